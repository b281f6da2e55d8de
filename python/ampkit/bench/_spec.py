"""Benchmark cases and variants as data: load and check the YAML in shared_specs/benchmarks.

A case file names builders (model, data, loss, optimizer) and, per profile, the sizes
that the builders take plus how long to run. A variant says which autocast (none,
torch, ampkit), which scaler (none, torch, ampkit), which dtype, whether the model goes
through torch.compile (and in which mode), and on which devices and from which
languages it runs. Both runners (Python and R) read the same files
through these functions, so a case runs identically from either language.

>>> cases = load_cases()
>>> sorted(cases)[:2]
['convnet', 'gpt2_small']
>>> cases["seed_mlp"].profile("full")["sizes"]["in_size"]
4096
"""

from __future__ import annotations

import dataclasses
import inspect
from pathlib import Path
from typing import Any, Mapping

import yaml

from ampkit._specs import SpecsNotFoundError, bench_dir

SPEC_SCHEMA_VERSION = 1
PROFILES = ("tiny", "cpu", "full")
RUN_KEYS = ("num_batches", "repeats", "warmup_steps")
AUTOCASTS = ("none", "torch", "ampkit")
SCALERS = ("none", "torch", "ampkit")
DTYPES = ("none", "auto", "float16", "bfloat16")
DEVICES = ("cpu", "cuda")
LANGUAGES = ("python", "r")
RUNNERS = ("loop", "train_step")
# torch.compile's mode ("default": no mode given)
COMPILES = ("none", "default", "reduce-overhead", "max-autotune-no-cudagraphs")
# torchao's float8 training recipe for the model's nn.Linear layers ("none": not converted)
FLOAT8S = ("none", "tensorwise", "rowwise")
# ampkit's fp8 tier: the shipped fp8 policy, or the one ampkit.calibrate_fp8 returns ("none": no fp8)
FP8S = ("none", "policy", "auto")


class BenchSpecError(ValueError):
    """A benchmark case, variant or profile that does not exist or does not parse."""


def spec_dir() -> Path:
    """The folder of case files: $AMPKIT_BENCH_SPECS, else shared_specs/benchmarks (of the
    installed package or the checkout; ``ampkit._specs`` says where it looks)."""
    try:
        return bench_dir()
    except SpecsNotFoundError as e:
        raise BenchSpecError("%s; or set AMPKIT_BENCH_SPECS to a folder of case files" % e) from e


def _fail(path: Path, key: str, msg: str) -> BenchSpecError:
    return BenchSpecError("%s: key '%s': %s" % (path, key, msg))


def _read_yaml(path: Path) -> dict:
    try:
        with open(path) as f:
            doc = yaml.safe_load(f)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = " (line %d)" % (mark.line + 1) if mark is not None else ""
        raise BenchSpecError("%s%s: not valid YAML: %s" % (path, where, e)) from e
    if not isinstance(doc, dict):
        raise BenchSpecError("%s: expected a mapping at the top level, got %s" % (path, type(doc).__name__))
    return doc


def _check_keys(path: Path, where: str, got: Mapping, required: tuple, optional: tuple = ()) -> None:
    valid = tuple(required) + tuple(optional)
    for k in got:
        if k not in valid:
            raise _fail(path, where + str(k), "unknown key; valid keys are %s" % ", ".join(valid))
    for k in required:
        if k not in got:
            raise _fail(path, where + k, "missing (required: %s)" % ", ".join(required))


def _builder_params(fn) -> tuple[set, set]:
    """(all parameter names, required parameter names) of a builder, minus the fixed ones."""
    fixed = {"device", "generator", "num_batches"}
    params = inspect.signature(fn).parameters
    names = {n for n in params if n not in fixed}
    required = {n for n, p in params.items() if n not in fixed and p.default is inspect.Parameter.empty}
    return names, required


def _int_params(fn) -> set:
    """The parameters a builder annotates as int (sizes that must be positive integers)."""
    return {n for n, p in inspect.signature(fn).parameters.items() if p.annotation in (int, "int")}


@dataclasses.dataclass(frozen=True)
class Case:
    """One benchmark case, as read from its YAML file (a value: frozen, comparable)."""

    name: str
    description: str
    model: str
    data: str
    loss: str
    optimizer: Mapping[str, Any]
    profiles: Mapping[str, Mapping[str, Any]]
    path: str = ""

    def profile(self, name: str) -> dict:
        """The sizes and run lengths of one profile ('tiny', 'cpu' or 'full')."""
        if name not in self.profiles:
            raise BenchSpecError("unknown profile %r for case %r; valid profiles: %s"
                                 % (name, self.name, ", ".join(self.profiles)))
        p = self.profiles[name]
        return {"sizes": dict(p["sizes"]), **{k: p[k] for k in RUN_KEYS}}


def load_case(path) -> Case:
    """Load and check one case file; errors name the file and the key."""
    from ampkit.bench import _models

    path = Path(path)
    doc = _read_yaml(path)
    _check_keys(path, "", doc, ("schema_version", "name", "description", "model", "data", "loss",
                                "optimizer", "profiles"))
    if doc["schema_version"] != SPEC_SCHEMA_VERSION:
        raise _fail(path, "schema_version", "is %r; this ampkit reads %d" % (doc["schema_version"], SPEC_SCHEMA_VERSION))
    if not isinstance(doc["name"], str) or doc["name"] != path.stem:
        raise _fail(path, "name", "is %r; it must equal the file's name %r" % (doc["name"], path.stem))
    for key, table in (("model", _models.MODELS), ("data", _models.DATA), ("loss", _models.LOSSES)):
        if doc[key] not in table:
            raise _fail(path, key, "unknown %s %r; valid: %s" % (key, doc[key], ", ".join(sorted(table))))
    opt = doc["optimizer"]
    if not isinstance(opt, dict) or opt.get("name") not in _models.OPTIMIZERS:
        raise _fail(path, "optimizer.name", "got %r; valid: %s" % (
            opt.get("name") if isinstance(opt, dict) else opt, ", ".join(sorted(_models.OPTIMIZERS))))
    opt_names, _ = _builder_params(_models.OPTIMIZERS[opt["name"]])
    opt_names.discard("params")
    for k, v in opt.items():
        if k != "name" and k not in opt_names:
            raise _fail(path, "optimizer." + k, "unknown option for %s; valid: %s" % (opt["name"], ", ".join(sorted(opt_names))))
        if k != "name" and (not isinstance(v, (int, float, list)) or v is True or v is False):
            raise _fail(path, "optimizer." + k, "must be a number, got %r" % (v,))
    profiles = doc["profiles"]
    if not isinstance(profiles, dict):
        raise _fail(path, "profiles", "must be a mapping of %s" % ", ".join(PROFILES))
    _check_keys(path, "profiles.", profiles, PROFILES)
    m_names, m_req = _builder_params(_models.MODELS[doc["model"]])
    d_names, d_req = _builder_params(_models.DATA[doc["data"]])
    int_sizes = _int_params(_models.MODELS[doc["model"]]) | _int_params(_models.DATA[doc["data"]])
    for pname, prof in profiles.items():
        where = "profiles.%s." % pname
        if not isinstance(prof, dict):
            raise _fail(path, where[:-1], "must be a mapping")
        _check_keys(path, where, prof, ("sizes",) + RUN_KEYS)
        sizes = prof["sizes"]
        if not isinstance(sizes, dict):
            raise _fail(path, where + "sizes", "must be a mapping")
        for k, v in sizes.items():
            if k not in m_names | d_names:
                raise _fail(path, where + "sizes." + k, "not a size of model %r or data %r; valid: %s"
                            % (doc["model"], doc["data"], ", ".join(sorted(m_names | d_names))))
            if not isinstance(v, (int, float)) or isinstance(v, bool) or v < 0:
                raise _fail(path, where + "sizes." + k, "must be a non-negative number, got %r" % (v,))
            if k in int_sizes and (not isinstance(v, int) or v < 1):
                raise _fail(path, where + "sizes." + k, "case %r: must be a positive integer (a "
                            "count or a dimension), got %r" % (doc["name"], v))
        for k in sorted((m_req | d_req) - set(sizes)):
            raise _fail(path, where + "sizes." + k, "missing (model %r and data %r need %s)"
                        % (doc["model"], doc["data"], ", ".join(sorted(m_req | d_req))))
        for k in RUN_KEYS:
            v = prof[k]
            lo = 0 if k == "warmup_steps" else 1
            if not isinstance(v, int) or isinstance(v, bool) or v < lo:
                raise _fail(path, where + k, "must be an integer >= %d, got %r" % (lo, v))
    return Case(name=doc["name"], description=str(doc["description"]).strip(), model=doc["model"],
                data=doc["data"], loss=doc["loss"], optimizer=dict(opt),
                profiles={k: dict(v) for k, v in profiles.items()}, path=str(path))


def load_cases(folder=None) -> dict:
    """Every case file (*.yaml) of the folder, by name, in name order."""
    folder = Path(folder) if folder is not None else spec_dir()
    files = sorted(folder.glob("*.yaml"))
    if not files:
        raise BenchSpecError("no case files (*.yaml) in %s" % folder)
    return {c.name: c for c in map(load_case, files)}


@dataclasses.dataclass(frozen=True)
class Variant:
    """How one run trains: which autocast, scaler and dtype, where and from which language."""

    name: str
    description: str
    autocast: str = "none"
    scaler: str = "none"
    dtype: str = "none"
    tf32: bool = False
    devices: tuple = DEVICES
    languages: tuple = LANGUAGES
    runner: str = "loop"
    fused_optimizer: bool = False
    compile: str = "none"
    capture: Any = "auto"  # the train_step runner's make_train_step(capture=...): "auto" or False
    float8: str = "none"  # torchao's convert_to_float8_training recipe (an optional rival)
    fp8: str = "none"  # ampkit's fp8 tier: "policy" (the shipped fp8 policy) or "auto" (calibrated)
    # the control this variant is timed against step by step when both run in a group
    # (ampkit.bench.run_interleaved; ampkit.bench._pairing): another variant's name, or None
    paired_with: Any = None

    def warmup_steps(self, profile_warmup: int) -> int:
        """The untimed steps this variant runs first: the profile's, and at least one for a
        compiled variant, whose first step compiles (its time is recorded apart, as compile_s).

        >>> Variant("x", "d", compile="default").warmup_steps(0), Variant("y", "d").warmup_steps(0)
        (1, 0)
        """
        return max(int(profile_warmup), 1) if self.compile != "none" else int(profile_warmup)

    def resolved_dtype(self, device: str):
        """'float16' / 'bfloat16' / None for this device ('auto': fp16 on CUDA, bf16 on CPU)."""
        if self.dtype == "none":
            return None
        if self.dtype == "auto":
            return "float16" if device == "cuda" else "bfloat16"
        return self.dtype

    def skip_reason(self, device: str, numerics: bool = False):
        """Why this variant cannot run on the device (None when it can). ``numerics``: for a
        run whose losses count and not its time (the fidelity harness), where an fp8 variant
        whose time needs fp8 matmuls may run through ampkit's emulation where it stands in
        for them (``ampkit.bench._fp8_tier``: ``numerics_stand_in``).

        >>> v = load_variants()["ampkit_fp8"]
        >>> v.skip_reason("cpu")
        'ampkit_fp8 runs only on cuda; this run is on cpu'
        >>> v.skip_reason("cpu", numerics=True) is None or "compile" in v.skip_reason("cpu", numerics=True)
        True
        """
        if self.fp8 != "none":
            from ampkit.bench._fp8_tier import fp8_reason, numerics_stand_in
            if numerics:
                reason = numerics_stand_in(self.fp8, device)
                if reason:
                    return reason
            elif device in self.devices:
                reason = fp8_reason(device)
                if reason:
                    return reason
        if device not in self.devices and not (numerics and self.fp8 != "none"):
            return "%s runs only on %s; this run is on %s" % (self.name, " or ".join(self.devices), device)
        if self.compile != "none" and device == "cpu":
            from ampkit.bench._machine import compile_reason
            reason = compile_reason()
            if reason:
                return reason
        if self.float8 != "none":
            from ampkit.bench._float8 import float8_reason
            return float8_reason()
        return None


def load_variants(path=None) -> dict:
    """The variants file (shared_specs/benchmarks/variants/variants.yaml), by name, in file order."""
    path = Path(path) if path is not None else spec_dir() / "variants" / "variants.yaml"
    doc = _read_yaml(path)
    _check_keys(path, "", doc, ("schema_version", "variants"))
    if doc["schema_version"] != SPEC_SCHEMA_VERSION:
        raise _fail(path, "schema_version", "is %r; this ampkit reads %d" % (doc["schema_version"], SPEC_SCHEMA_VERSION))
    out = {}
    for name, v in (doc["variants"] or {}).items():
        where = "variants.%s." % name
        if not isinstance(v, dict):
            raise _fail(path, where[:-1], "must be a mapping")
        _check_keys(path, where, v, ("description",), ("autocast", "scaler", "dtype", "tf32", "devices",
                                                         "languages", "runner", "fused_optimizer", "compile",
                                                         "capture", "float8", "fp8", "paired_with"))
        for key, valid in (("autocast", AUTOCASTS), ("scaler", SCALERS), ("dtype", DTYPES), ("runner", RUNNERS),
                           ("compile", COMPILES), ("float8", FLOAT8S), ("fp8", FP8S)):
            if key in v and v[key] not in valid:
                raise _fail(path, where + key, "got %r; valid: %s" % (v[key], ", ".join(valid)))
        for key, valid in (("devices", DEVICES), ("languages", LANGUAGES)):
            bad = [x for x in v.get(key, []) if x not in valid]
            if bad or (key in v and not v[key]):
                raise _fail(path, where + key, "got %r; valid: %s" % (v[key], ", ".join(valid)))
        if v.get("autocast", "none") != "none" and v.get("dtype", "none") == "none":
            raise _fail(path, where + "dtype", "an autocast variant needs a dtype (auto, float16 or bfloat16)")
        if "capture" in v and not (v["capture"] == "auto" or v["capture"] is False):
            raise _fail(path, where + "capture", "got %r; valid: auto, false" % (v["capture"],))
        if "capture" in v and v.get("runner", "loop") != "train_step":
            raise _fail(path, where + "capture", "applies to the train_step runner (make_train_step's "
                        "capture=); this variant's runner is %r" % v.get("runner", "loop"))
        if v.get("float8", "none") != "none" and (v.get("runner", "loop") != "loop" or v.get("languages") != ["python"]):
            raise _fail(path, where + "float8", "applies to the Python loop runner only (runner: loop, languages: "
                        "[python]): torchao converts the model's nn.Linear layers before the loop is built")
        if v.get("fp8", "none") != "none" and (v.get("runner", "loop") != "loop" or v.get("autocast") != "ampkit"
                                               or v.get("float8", "none") != "none"):
            raise _fail(path, where + "fp8", "applies to the loop runner under ampkit's autocast (runner: loop, "
                        "autocast: ampkit, no float8): the policy is installed on the model and named by the region")
        kw = {k: (tuple(x) if k in ("devices", "languages") else x) for k, x in v.items()}
        kw["description"] = str(kw["description"]).strip()
        out[name] = Variant(name=name, **kw)
    for name, v in out.items():  # once every name is known
        _check_pairing(path, v, out)
    return out


def _check_pairing(path: Path, v: Variant, variants: Mapping) -> None:
    """A variant's ``paired_with`` names another variant of the file (its control)."""
    if v.paired_with is None:
        return
    where = "variants.%s.paired_with" % v.name
    if v.paired_with == v.name:
        raise _fail(path, where, "a variant cannot be paired with itself (%r); name its control, one of: %s"
                    % (v.paired_with, ", ".join(n for n in variants if n != v.name)))
    if not isinstance(v.paired_with, str) or v.paired_with not in variants:
        raise _fail(path, where, "got %r, not a variant of this file; valid: %s"
                    % (v.paired_with, ", ".join(n for n in variants if n != v.name)))
    control = variants[v.paired_with]
    if control.paired_with is not None:
        raise _fail(path, where, "%r is itself paired (with %r): a pair is a variant and a control "
                    "that is paired with nothing" % (v.paired_with, control.paired_with))


def select(names, valid, what: str) -> list:
    """Check a comma-separated string or list of names against the valid ones, keeping their order.

    >>> select("fp32,torch_amp", ["fp32", "torch_amp", "ampkit_amp"], "variant")
    ['fp32', 'torch_amp']
    """
    valid = list(valid)
    if names is None or names == "" or names == []:
        return valid
    if isinstance(names, str):
        names = [n.strip() for n in names.split(",") if n.strip()]
    bad = [n for n in names if n not in valid]
    if bad:
        raise BenchSpecError("unknown %s %s; valid %ss: %s" % (
            what, ", ".join(repr(b) for b in bad), what, ", ".join(valid)))
    return list(dict.fromkeys(names))


def plan(profile: str, cases=None, variants=None):
    """Check a profile and case/variant names (comma-separated or lists; empty: all).

    Returns (cases, variants) as lists of Case and Variant, in file order. Errors list
    the valid names:
    >>> plan("gpu")
    Traceback (most recent call last):
    ...
    ampkit.bench._spec.BenchSpecError: unknown profile 'gpu'; valid profiles: tiny, cpu, full
    """
    if profile not in PROFILES:
        raise BenchSpecError("unknown profile %r; valid profiles: %s" % (profile, ", ".join(PROFILES)))
    all_cases, all_variants = load_cases(), load_variants()
    cs = [all_cases[n] for n in select(cases, all_cases, "case")]
    vs = [all_variants[n] for n in select(variants, all_variants, "variant")]
    return cs, vs
