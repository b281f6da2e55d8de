"""Benchmark results: one JSON schema for both languages (shared_specs/benchmarks/schema.json).

A results document is {"context": {...}, "records": [...]}: the context says where and
with what it ran (host, CPU, card, library versions, commit, profile); each record is
one case x variant x language with structured fields (never a packed name). Derived
comparisons (speedup against fp32, time against each rival of RIVALS: torch_amp and the
torch.compile variants, R against Python, loss against fp32) are filled in by `derive`,
the same code for records of either language.
"""

from __future__ import annotations

import datetime
import json
import math
import os
import platform
import statistics
import subprocess
from pathlib import Path

from ampkit._specs import specs_root

SCHEMA_VERSION = 1
NOISE = 0.05  # a ratio whose [low, high] lies wholly past 1 +/- NOISE is flagged as a change
# The rivals every record is timed against (same case and language), and the field each
# ratio goes in: torch's eager AMP, and torch.compile under torch's AMP in its three modes.
RIVALS = {"torch_amp": "time_vs_torch_amp",
          "torch_compile_amp": "time_vs_torch_compile_amp",
          "torch_compile_ro": "time_vs_torch_compile_ro",
          "torch_compile_mat": "time_vs_torch_compile_mat"}
# torch's compiled loops: the compiled captured step's rivals, the fastest of them on each case
COMPILED_RIVALS = ("torch_compile_amp", "torch_compile_ro", "torch_compile_mat")
ERROR_CHARS = 600  # a failed record keeps the error's first characters, on one line


def schema_path() -> Path:
    """The results schema, shipped with the cases (``shared_specs/benchmarks/schema.json``)."""
    return specs_root() / "benchmarks" / "schema.json"


def load_schema() -> dict:
    with open(schema_path()) as f:
        return json.load(f)


# --- a small JSON-schema validator (jsonschema is not a dependency) -------------------------

_TYPES = {"object": dict, "array": list, "string": str, "boolean": bool, "null": type(None)}


def _is_type(x, t: str) -> bool:
    if t == "number":
        return isinstance(x, (int, float)) and not isinstance(x, bool)
    if t == "integer":
        return isinstance(x, int) and not isinstance(x, bool)
    return isinstance(x, _TYPES[t])


def validate(doc, schema=None, _root=None, _path="$") -> list:
    """Errors (a list of 'path: message' strings, empty when valid) of doc against a JSON schema.

    Supports the subset schema.json uses: type, enum, const, required, properties,
    additionalProperties (false), items, minimum, minItems and $ref to #/$defs.
    >>> validate({"a": 1}, {"type": "object", "properties": {"a": {"type": "string"}}})
    ['$.a: expected string, got int 1']
    """
    schema = load_schema() if schema is None else schema
    root = schema if _root is None else _root
    if "$ref" in schema:
        ref = schema["$ref"]
        if not ref.startswith("#/$defs/"):
            raise ValueError("unsupported $ref %r" % ref)
        return validate(doc, root["$defs"][ref[len("#/$defs/"):]], root, _path)
    errs = []
    t = schema.get("type")
    if t is not None:
        types = [t] if isinstance(t, str) else t
        if not any(_is_type(doc, x) for x in types):
            return ["%s: expected %s, got %s %r" % (_path, " or ".join(types), type(doc).__name__, doc)]
    if "enum" in schema and doc not in schema["enum"]:
        errs.append("%s: %r is not one of %s" % (_path, doc, schema["enum"]))
    if "const" in schema and doc != schema["const"]:
        errs.append("%s: %r is not %r" % (_path, doc, schema["const"]))
    if "minimum" in schema and _is_type(doc, "number") and doc < schema["minimum"]:
        errs.append("%s: %r is below the minimum %r" % (_path, doc, schema["minimum"]))
    if isinstance(doc, dict):
        for k in schema.get("required", []):
            if k not in doc:
                errs.append("%s: missing required field %r" % (_path, k))
        props = schema.get("properties", {})
        for k, v in doc.items():
            if k in props:
                errs += validate(v, props[k], root, "%s.%s" % (_path, k))
            elif schema.get("additionalProperties", True) is False:
                errs.append("%s: unexpected field %r (allowed: %s)" % (_path, k, ", ".join(props)))
    if isinstance(doc, list):
        if len(doc) < schema.get("minItems", 0):
            errs.append("%s: needs at least %d items" % (_path, schema["minItems"]))
        if "items" in schema:
            for i, v in enumerate(doc):
                errs += validate(v, schema["items"], root, "%s[%d]" % (_path, i))
    return errs


def check(doc, what="results document") -> dict:
    """Raise ValueError listing every schema error of a results document; return it unchanged."""
    errs = validate(doc)
    if errs:
        raise ValueError("%s does not match %s:\n  %s" % (what, schema_path(), "\n  ".join(errs[:20])))
    return doc


# --- context ---------------------------------------------------------------------------------

def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _git_commit():
    if os.environ.get("AMPKIT_GIT_COMMIT"):  # where the checkout has no .git (the device machine)
        return os.environ["AMPKIT_GIT_COMMIT"]
    repo = specs_root().parent  # the checkout (an installed package has no commit: None)
    try:
        sha = subprocess.run(["git", "rev-parse", "HEAD"], cwd=repo, capture_output=True, text=True,
                             timeout=10).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=repo,
                               capture_output=True, text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None
    return (sha + ("-dirty" if dirty else "")) or None


def context(profile: str, device: str, language: str = "python", r_version=None, reticulate_version=None,
            seed: int = 0) -> dict:
    """The context block: where, with what, and how the run was made."""
    import torch
    try:
        import ampkit
        ampkit_version = getattr(ampkit, "__version__", None)
    except Exception:  # the engine may be mid-change; the benchmark still records what it can
        ampkit_version = None
    card = torch.cuda.get_device_name(0) if device == "cuda" else None
    return {
        "schema_version": SCHEMA_VERSION,
        "profile": profile,
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "host": platform.node(),
        "os": platform.platform(),
        "cpu": _cpu_model(),
        "cpu_count": os.cpu_count(),
        "load_average": [round(x, 2) for x in os.getloadavg()] if hasattr(os, "getloadavg") else None,
        "device": device,
        "card": card,
        "cuda_version": torch.version.cuda if device == "cuda" else None,
        "torch_version": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        "python_version": platform.python_version(),
        "r_version": r_version,
        "reticulate_version": reticulate_version,
        "ampkit_version": ampkit_version,
        "git_commit": _git_commit(),
        "languages": [language],
        "seed": int(seed),
    }


# --- records ---------------------------------------------------------------------------------

def _num(x):
    if x is None:
        return None
    x = float(x)
    return x if math.isfinite(x) else None


def make_record(run, *, status: str = "ok", samples_ms=None, final_loss=None, peak_memory_bytes=None,
                final_scale=None, skipped_steps=None, reason=None, error=None, torch_threads=None,
                wall_s=None, graph_captured=None, compile_s=None, interleaved=None, paired=None,
                fp8_modules=None) -> dict:
    """One record, the same fields from either language: ``run`` (a ResolvedRun, see
    ``resolve_run``) says what ran; the keywords what it measured. samples_ms holds one
    ms/step value per timed repeat; compile_s the first warm-up step of a compiled variant
    (torch.compile's compilation); ``interleaved`` ({"group": [variants], "rounds": R,
    "positions": [this variant's place in each round]}, see ``run_interleaved``) says the
    samples were taken in rounds in turn with the group's other variants (absent: alone);
    ``paired`` (``pair_summary``'s dict, see ``ampkit.bench._pairing``) that this variant was
    timed against its control in turns, and the per-pair ratios (kept when ok);
    ``fp8_modules`` (an fp8 variant's ``Fp8Setup.modules``: nn.Linear layers in fp8, nn.Linear
    layers of the model) what its policy put in fp8."""
    import torch
    if status not in ("ok", "skipped", "failed"):
        raise ValueError("status must be 'ok', 'skipped' or 'failed', got %r" % (status,))
    samples = [float(s) for s in (samples_ms or [])]
    if status == "ok" and not samples:
        raise ValueError("an 'ok' record needs its timed samples")
    loss = _num(final_loss)
    if status == "ok" and loss is None:
        status, error = "failed", "final loss is not finite (%r): training diverged" % (final_loss,)
    if status != "ok":  # a failed or skipped run has no timings (a diverged run's are dropped)
        samples = []
    if error is not None:  # compiler errors run to pages: one line, the head of it
        error = " ".join(str(error).split())[:ERROR_CHARS]
    q = statistics.quantiles(samples, n=4, method="inclusive") if len(samples) >= 2 else [None, None, None]
    rec = {
        "case": run.case,
        "variant": run.variant.name,
        "language": run.language,
        "profile": run.profile,
        "device": run.device,
        "status": status,
        "reason": reason,
        "error": error,
        "autocast": run.variant.autocast,
        "scaler": run.variant.scaler,
        "dtype": run.dtype,
        "tf32": bool(run.variant.tf32),
        "runner": run.variant.runner,
        "compile": run.variant.compile,
        "graph_captured": None if graph_captured is None else bool(graph_captured),
        "compile_s": _num(compile_s) if status == "ok" else None,
        "sizes": dict(run.sizes),
        "num_batches": run.num_batches,
        "warmup_steps": run.warmup_steps,
        "repeats": run.repeats,
        "unit": "ms/step",
        "samples": samples,
        "median": statistics.median(samples) if samples else None,
        "min": min(samples) if samples else None,
        "max": max(samples) if samples else None,
        "iqr": (q[2] - q[0]) if q[0] is not None else (0.0 if samples else None),
        "final_loss": loss if status == "ok" else None,
        "skipped_steps": None if skipped_steps is None else int(skipped_steps),
        "final_scale": _num(final_scale),
        "peak_memory_bytes": None if peak_memory_bytes is None else int(peak_memory_bytes),
        "torch_threads": int(torch_threads if torch_threads is not None else torch.get_num_threads()),
        "wall_s": _num(wall_s),
        "load_average": round(os.getloadavg()[0], 2) if hasattr(os, "getloadavg") else None,
        "speedup_vs_fp32": None,
        **{field: None for field in RIVALS.values()},
        "time_vs_python": None,
        "loss_rel_diff_vs_fp32": None,
    }
    if run.variant.float8 != "none":  # torchao's float8 recipe (optional: absent for other variants)
        rec["float8"] = run.variant.float8
    if run.variant.fp8 != "none":  # ampkit's fp8 tier: "policy" or "auto" (optional: absent for other variants)
        rec["fp8"] = run.variant.fp8
        if fp8_modules is not None:
            rec["fp8_modules"] = {"fp8": int(fp8_modules[0]), "linear": int(fp8_modules[1])}
    if interleaved is not None:
        rec["interleaved"] = {"group": [str(v) for v in interleaved["group"]], "rounds": int(interleaved["rounds"]),
                              "positions": [int(p) for p in interleaved.get("positions", [])]}
    if paired is not None and status == "ok":
        rec["paired"] = {"with": str(paired["with"]), "unit": str(paired["unit"]), "n": int(paired["n"]),
                         "ratio": float(paired["ratio"]), "q1": float(paired["q1"]), "q3": float(paired["q3"]),
                         "this_ms": [float(t) for t in paired["this_ms"]],
                         "control_ms": [float(t) for t in paired["control_ms"]]}
    if run.world_size is not None:  # across processes: where, and the throughput of all ranks
        batch = run.sizes.get("batch_size")
        rec.update(world_size=int(run.world_size), engine=run.engine, engine_options=dict(run.engine_options or {}),
                   samples_per_s=(run.world_size * batch * 1000.0 / rec["median"]) if batch and rec["median"] else None,
                   scaling_efficiency=None)
    return rec


def interleaved_together(a: dict, b: dict) -> bool:
    """Whether records ``a`` and ``b`` were timed in the same interleaved group (the same
    case, language and placement, each in the other's group): their samples then come from
    the same rounds, in the same minutes."""
    ia, ib = a.get("interleaved"), b.get("interleaved")
    return bool(ia and ib and ia["group"] == ib["group"] and a["variant"] in ia["group"]
                and b["variant"] in ia["group"] and a["variant"] != b["variant"]
                and (a["case"], a["language"], a.get("profile"), a.get("device")) ==
                (b["case"], b["language"], b.get("profile"), b.get("device"))
                and placement_key(a) == placement_key(b))


def time_ratio(num: dict, den: dict, speedup: bool = False):
    """num.median / den.median with a conservative [low, high] from the extremes of the samples.

    A time ratio (speedup=False) below 1 is faster; a speedup (fp32 time / this time) above 1 is.
    When both were timed in the same interleaved group the ratio says so ("interleaved": true).
    """
    if num is None or den is None or num is den or num.get("status") != "ok" or den.get("status") != "ok":
        return None
    value = num["median"] / den["median"]
    low, high = num["min"] / den["max"], num["max"] / den["min"]
    below, above = high < 1 - NOISE, low > 1 + NOISE
    change = ("faster" if above else "slower" if below else "same") if speedup else \
             ("faster" if below else "slower" if above else "same")
    out = {"value": value, "low": low, "high": high, "change": change}
    if interleaved_together(num, den):
        out["interleaved"] = True
    return out


def placement_key(rec: dict) -> tuple:
    """Where a record ran: () for a single process, else (engine, its options, world size).
    Records compare only with records of the same placement."""
    if rec.get("world_size") is None:
        return ()
    return (rec["engine"], json.dumps(rec.get("engine_options") or {}, sort_keys=True), rec["world_size"])


def derive(records: list) -> list:
    """Fill the comparison fields of every record from the others of the same case (and language).

    speedup_vs_fp32 = fp32 time / this time (>1: faster), time_vs_<rival> = this time /
    the rival's for each of RIVALS (<1: faster), time_vs_python = this R time / the Python
    time of the same case and variant; loss_rel_diff_vs_fp32 = |loss - fp32 loss| / |fp32 loss|.
    Each only against records of the same placement (``placement_key``). Across processes
    also scaling_efficiency = the 1-process time / this time (same case, variant, engine and
    options): N-process throughput / (N x 1-process throughput), 1 when it scales perfectly.
    """
    idx = {(r["case"], r["variant"], r["language"], placement_key(r)): r for r in records}
    for r in records:
        where = placement_key(r)
        fp32 = idx.get((r["case"], "fp32", r["language"], where))
        r["speedup_vs_fp32"] = time_ratio(fp32, r, speedup=True)
        for rival, field in RIVALS.items():
            r[field] = time_ratio(r, idx.get((r["case"], rival, r["language"], where)))
        r["time_vs_python"] = time_ratio(r, idx.get((r["case"], r["variant"], "python", where)))
        if where and r["world_size"] > 1:
            one = idx.get((r["case"], r["variant"], r["language"], where[:2] + (1,)))
            r["scaling_efficiency"] = time_ratio(one, r, speedup=True)
        if fp32 and r["status"] == "ok" and fp32["status"] == "ok" and fp32["final_loss"]:
            r["loss_rel_diff_vs_fp32"] = abs(r["final_loss"] - fp32["final_loss"]) / abs(fp32["final_loss"])
        else:
            r["loss_rel_diff_vs_fp32"] = None
    return records


def merge_fidelity(sections: list):
    """One ``fidelity`` block from several documents' (None where none has one): the records
    of all, when the settings agree; a case x variant x language twice is an error."""
    sections = [s for s in sections if s]
    if not sections:
        return None
    keys = ("reference", "profile", "device", "seeds", "steps", "window", "threshold_std", "checkpoints", "data")

    def setting(section, key):  # only "data" may be absent: an older document's data were the case's
        return section.get(key, "case")

    first = sections[0]
    for s in sections[1:]:
        diff = [k for k in keys if setting(s, k) != setting(first, k)]
        if diff:
            raise ValueError("cannot merge fidelity runs made with different %s: %s" % (
                ", ".join(diff), "; ".join("%r and %r" % (setting(first, k), setting(s, k)) for k in diff)))
    records = [r for s in sections for r in s["records"]]
    seen = set()
    for r in records:
        key = (r["case"], r["variant"], r["language"])
        if key in seen:
            raise ValueError("fidelity record %s / %s / %s is in two of the merged documents" % key)
        seen.add(key)
    return dict(first, records=records)


def merge(documents: list) -> dict:
    """One document from several (one per language): the first context, with the others'
    R/reticulate versions and languages added, and all records, compared with `derive`;
    their ``fidelity`` blocks merged (``merge_fidelity``)."""
    if not documents:
        raise ValueError("nothing to merge")
    ctx = dict(documents[0]["context"])
    langs = list(ctx.get("languages", []))
    for d in documents[1:]:
        for k, v in d["context"].items():
            if ctx.get(k) is None and v is not None:
                ctx[k] = v
        langs += [x for x in d["context"].get("languages", []) if x not in langs]
        for k in ("profile", "device"):
            if d["context"].get(k) != ctx.get(k):
                raise ValueError("cannot merge runs of different %s: %r and %r" % (k, ctx.get(k), d["context"].get(k)))
    ctx["languages"] = langs
    records = [dict(r) for d in documents for r in d["records"]]
    cases = list(dict.fromkeys(r["case"] for r in records))
    records.sort(key=lambda r: (cases.index(r["case"]), r["language"] != "python"))  # stable: variants keep their order
    doc = {"context": ctx, "records": derive(records)}
    fidelity = merge_fidelity([d.get("fidelity") for d in documents])
    if fidelity is not None:
        doc["fidelity"] = fidelity
    return check(doc)


def finalize_json(text: str) -> str:
    """For the R runner: a results document as JSON text in, derived and checked JSON text out."""
    doc = json.loads(text)
    doc["records"] = derive(doc["records"])
    return json.dumps(check(doc), indent=1)


def write_document(path, ctx: dict, records: list, fidelity=None) -> dict:
    """Derive, check and write a results document (with its ``fidelity`` block when given); returns it."""
    doc = {"context": dict(ctx), "records": derive([dict(r) for r in records])}
    if fidelity is not None:
        doc["fidelity"] = fidelity
    doc = check(doc)
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as f:
        json.dump(doc, f, indent=1)
    return doc


def read_document(path) -> dict:
    with open(path) as f:
        return check(json.load(f), what=str(path))
