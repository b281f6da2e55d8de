"""fp8 ``auto``: a short calibration that puts in fp8 only the modules where it pays.

``calibrate_fp8(model, example_inputs)`` returns an ordinary policy, the base policy with a
module scope ``fp8: [linear]`` for each module that got fp8, and a report that says why each
candidate got its precision:

    capture    run model(*example_inputs) once in the base policy's region (its scopes
               applied), with hooks on the candidates: every ``torch.nn.Linear`` (``linear``
               is the op the fp8 category takes); each call's input is kept (shapes seen)
    skip       a candidate inside a module that a scope of the base policy matches (the
               policy already decides there), or one never called
    for each   on a copy of the module (the model and its delayed-scaling histories are
    candidate  left alone), at each captured input, in ampkit.autocast(device, dtype):
                 ref  = module(x) with ``linear`` in lower_precision_fp   (the region dtype)
                 fp8  = module(x) with ``linear`` in fp8 (the policy's recipe)
                 error = max over calls of  ||fp8 - ref||_2 / ||ref||_2   (float32, whole
                         tensor; a delayed recipe is measured at its second call, once its
                         history holds this input's amax)
                 ms    = timer(name, precision, run): the sum over calls of one call's median
                         time (forward and, with backward=True, backward), after warm-up,
                         synchronized on CUDA
               fp8 when  ref_ms / fp8_ms > min_speedup  and  error <= max_error
    policy     base + with_module(name, fp8=["linear"]) for each fp8 module; where the base
               already has ``linear`` in fp8, with_module(name, lower_precision_fp=["linear"])
               for each module kept in the region dtype, unless the form below has fewer
               scopes and decides every call the same:
    fewer      where the base has ``linear`` in fp8 on each of its devices, each of its scopes
    scopes     decides ``linear`` itself (a pin, or ``linear`` among its ops), and every call
               of the fp8 category in the capture ran inside an unscoped candidate (ampkit.trace
               records), ``linear`` moves to lower_precision_fp on every device and a scope
               ``fp8: [linear]`` goes on each fp8 module and each unscoped candidate the capture
               never called (it keeps the base's fp8); the base's scopes stay. Each scope costs
               a compiled model guards on every call (GPT-2-small, 48 scopes: ~1 ms a step on a
               2-core CPU, host-bound on an H100); a call outside the candidates (a functional
               linear) would leave fp8 with the move, so there the form above stays.
               The result's device tables may then differ from the base's: run its region with
               ``policy.without_modules()``, the tables its scopes start from

The emulation (the CPU, CUDA below capability 8.9) dequantizes before a matmul in the
region dtype, so it is never faster: there, ``auto`` keeps every module in the region dtype.

>>> import torch, ampkit
>>> model = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
>>> def timer(name, precision, run):  # fp8 twice as fast in module "2" (a GPU might say so)
...     return 1.0 if (name, precision) == ("2", "fp8") else 2.0
>>> result = ampkit.calibrate_fp8(model, torch.randn(8, 16), device_type="cpu", timer=timer)
>>> [(r.module, r.precision) for r in result.report]
[('0', 'bfloat16'), ('2', 'fp8')]
>>> result.report[0].reason
'fp8 not fast enough (1.00x, needs > 1)'
>>> [(m.pattern, m.ops) for m in result.policy.modules]
[('2', (('linear', 'fp8'),))]
"""

from __future__ import annotations

import copy
import dataclasses
import math
import statistics
import time

import torch

from ampkit._autocast import autocast
from ampkit._module_policy import matches
from ampkit._policy import Policy, load_policy
from ampkit._rules import DTYPE_NAMES
from ampkit._trace import trace

OP = "linear"  # the op a candidate (torch.nn.Linear) calls; the fp8 category takes it
CANDIDATE_TYPES = (torch.nn.Linear,)


@dataclasses.dataclass(frozen=True)
class Fp8Decision:
    """The calibration of one candidate module: what was measured and what was decided.

    ``precision`` is ``"fp8"`` or the region dtype's name; ``reason`` says why in words.
    ``fp8_ms``, ``ref_ms``, ``speedup`` (``ref_ms / fp8_ms``) and ``error`` are None for a
    module that was skipped."""

    module: str
    shapes: tuple  # the input shapes of its calls, as tuples
    fp8_ms: float | None
    ref_ms: float | None
    speedup: float | None
    error: float | None
    precision: str
    reason: str

    def to_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d["shapes"] = ", ".join("x".join(str(n) for n in s) for s in self.shapes)
        return d


@dataclasses.dataclass(frozen=True)
class Fp8Calibration:
    """What :func:`calibrate_fp8` returns: ``policy`` (keep its ``to_yaml()``) and ``report``
    (one :class:`Fp8Decision` per candidate, in model order)."""

    policy: Policy
    report: tuple

    def as_rows(self) -> list:
        """The report as a list of plain dicts (``shapes`` joined as ``"8x16, 4x16"``)."""
        return [r.to_dict() for r in self.report]

    def table(self) -> str:
        """The report as an aligned text table."""
        cols = ("module", "shapes", "fp8_ms", "ref_ms", "speedup", "error", "precision", "reason")
        head = dict(zip(cols, ("module", "shapes", "fp8 ms", "ref ms", "speedup", "error", "precision", "reason")))

        def cell(v):
            return "-" if v is None else f"{v:.4g}" if isinstance(v, float) else str(v)

        rows = [{c: cell(r[c]) for c in cols} for r in self.as_rows()]
        width = {c: max([len(head[c])] + [len(r[c]) for r in rows]) for c in cols}
        lines = ["  ".join(head[c].ljust(width[c]) for c in cols).rstrip()]
        lines += ["  ".join(r[c].ljust(width[c]) for c in cols).rstrip() for r in rows]
        return "\n".join(lines)

    def __str__(self):
        return self.table()


# -- arguments ------------------------------------------------------------------------
def _positive(name, value, fix):
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
        raise ValueError(f"calibrate_fp8: {name} must be a finite number > 0, got {value!r}; {fix}")
    return float(value)


def _whole(name, value, least):
    if isinstance(value, bool) or not isinstance(value, int) or value < least:
        raise ValueError(f"calibrate_fp8: {name} must be a whole number >= {least}, got {value!r}")
    return value


def _device_of(model, device_type):
    if device_type is None:
        p = next(iter(model.parameters()), None)
        return p.device.type if p is not None else "cpu"
    if device_type not in ("cpu", "cuda"):
        raise ValueError(f"calibrate_fp8: device_type must be 'cpu' or 'cuda' (or None: the device of "
                         f"the model's parameters), got {device_type!r}")
    return device_type


def _region_policies(base, device, recipe):
    """(base with the recipe, the region without scopes with linear in the region dtype, the
    same with linear in fp8)."""
    if recipe is not None:
        if not isinstance(recipe, dict):
            raise ValueError(f"calibrate_fp8: recipe must be a dict of fp8_recipe keys such as "
                             f"{{'scaling': 'rowwise'}} or None (the policy's), got {recipe!r}")
        base = base.with_fp8_recipe(device, **recipe)
    plain = base.without_modules()
    return base, plain.with_ops(device, lower_precision_fp=[OP]), plain.with_ops(device, fp8=[OP])


# -- measuring --------------------------------------------------------------------------
def wall_clock(device_type, warmup, repeats):
    """The default timer: ``timer(name, precision, run)`` -> the median milliseconds of
    ``repeats`` calls of ``run`` after ``warmup`` calls, synchronized on CUDA."""
    sync = torch.cuda.synchronize if device_type == "cuda" else (lambda: None)

    def timer(name, precision, run):
        for _ in range(warmup):
            run()
        times = []
        for _ in range(repeats):
            sync()
            t0 = time.perf_counter()
            run()
            sync()
            times.append((time.perf_counter() - t0) * 1e3)
        return statistics.median(times)

    return timer


def relative_error(got, want) -> float:
    """``||got - want||_2 / ||want||_2`` over the whole tensor, in float32 (0 when both are 0)."""
    got, want = got.detach().float(), want.detach().float()
    den = torch.linalg.vector_norm(want)
    num = torch.linalg.vector_norm(got - want)
    if den == 0:
        return 0.0 if num == 0 else math.inf
    return float(num / den)


def _scopes_over(base, name) -> list:
    """The patterns of the base policy's scopes that match module ``name`` or one around it."""
    prefixes = [".".join(name.split(".")[:i + 1]) for i in range(name.count(".") + 1)]
    return [s.pattern for s in base.modules if any(matches(s.pattern, p) for p in prefixes)]


def _capture(model, inputs, device, dtype, base):
    """{name: [input tensors of its calls]} for the candidates, from one forward in the base
    policy's region (scopes applied), plus their modules in model order, and whether every
    call of the fp8 category in that forward ran inside an unscoped candidate (its ampkit.trace
    record falls between the candidate's pre- and post-hook)."""
    named = [(n, m) for n, m in model.named_modules() if n and isinstance(m, CANDIDATE_TYPES)]
    seen = {n: [] for n, _ in named}
    records = []  # the trace's records, once it is entered
    inside, starts = set(), []  # indices of the records made inside unscoped candidates
    handles, scopes = [], None
    try:
        scopes = base.apply(model) if base.modules else None
        for n, m in named:
            def pre(module, args, n=n):
                if args and isinstance(args[0], torch.Tensor):
                    seen[n].append(args[0].detach().clone())
                starts.append(len(records))
            handles.append(m.register_forward_pre_hook(pre))
            if not _scopes_over(base, n):
                def post(module, args, out):
                    inside.update(range(starts.pop(), len(records)))
            else:
                def post(module, args, out):
                    starts.pop()
            handles.append(m.register_forward_hook(post, always_call=True))
        with torch.no_grad(), autocast(device, dtype=dtype, policy=base.without_modules()), trace() as tr:
            records = tr.records
            model(*inputs)
    finally:
        for h in handles:
            h.remove()
        if scopes is not None:
            scopes.remove()
    fp8_inside = all(i in inside for i, r in enumerate(records) if r.rule == "fp8")
    return named, seen, fp8_inside


def _runner(module, xs, device, dtype, policy, backward):
    """A function that runs ``module`` on each captured input in the region (and its backward),
    and the outputs of one run."""
    def run():
        outs = []
        for x in xs:
            x = x.requires_grad_(backward) if x.is_floating_point() else x
            with torch.set_grad_enabled(backward), autocast(device, dtype=dtype, policy=policy):
                y = module(x)
            if backward:
                x.grad = None
                for p in module.parameters():
                    p.grad = None
                y.backward(torch.ones_like(y))
            outs.append(y.detach())
        return outs
    return run


def _decide(speedup, error, min_speedup, max_error, ref):
    faster = speedup > min_speedup
    accurate = error <= max_error
    if faster and accurate:
        return "fp8", f"fp8 {speedup:.2f}x as fast as {ref} (> {min_speedup:g}), error {error:.3g} <= {max_error:g}"
    why = []
    if not faster:
        why.append(f"fp8 slower than {ref} ({speedup:.2f}x)" if speedup < 1 else
                   f"fp8 not fast enough ({speedup:.2f}x, needs > {min_speedup:g})")
    if not accurate:
        why.append(f"error {error:.3g} > max_error {max_error:g}")
    return ref, "; ".join(why)


def calibrate_fp8(model, example_inputs, *, policy="torch_default", device_type=None, dtype=None,
                  recipe=None, max_error=0.1, min_speedup=1.0, backward=True, warmup=3, repeats=10,
                  timer=None) -> Fp8Calibration:
    """Time fp8 against the region dtype for each ``torch.nn.Linear`` of ``model`` at its real
    input shapes, measure the error of its output, and return a policy that puts in fp8 only
    the modules where fp8 is faster and accurate enough (algorithm: this module's docstring;
    docs/autocast.md, "fp8 auto").

    Args:
      model: a ``torch.nn.Module``; it is run once (no gradients) and left unchanged.
      example_inputs: a tensor or a tuple of positional arguments: ``model(*example_inputs)``.
      policy: the base policy (a name, a path or a :class:`Policy`); the result is it plus
        module scopes. Its scopes are applied while capturing; the modules they match (and
        those inside them) are left to it.
      device_type: ``"cpu"`` or ``"cuda"``; None: the device of the model's parameters.
      dtype: the region dtype; None: the policy's for the device.
      recipe: a dict of ``fp8_recipe`` keys (``{"scaling": "rowwise"}``) written into the
        result; None: the policy's recipe.
      max_error: the largest relative output error (``||fp8 - ref|| / ||ref||``) fp8 may have.
      min_speedup: fp8 must be more than this many times as fast as the region dtype.
      backward: time forward and backward (training); False: the forward only.
      warmup, repeats: calls before timing, and timed calls (the median counts).
      timer: ``timer(module_name, precision, run) -> milliseconds``, where ``precision`` is
        ``"fp8"`` or the region dtype's name and ``run()`` runs the module's captured calls
        once; None: the wall clock (median of ``repeats`` after ``warmup``).

    Returns:
      An :class:`Fp8Calibration`: ``.policy`` and ``.report``.

    Raises:
      TypeError for a model that is not a module; ValueError for a bad threshold, count,
      device or recipe, and for a model with no ``torch.nn.Linear`` that its forward calls;
      ``PolicyError`` for a bad policy.
    """
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"calibrate_fp8: model must be a torch.nn.Module, got {type(model).__name__}; "
                        "pass the model itself, not its output or its state_dict")
    max_error = _positive("max_error", max_error, "the relative output error allowed, such as 0.1")
    min_speedup = _positive("min_speedup", min_speedup, "1.0 means fp8 must just be faster")
    warmup, repeats = _whole("warmup", warmup, 0), _whole("repeats", repeats, 1)
    if timer is not None and not callable(timer):
        raise TypeError(f"calibrate_fp8: timer must be a callable timer(module_name, precision, run) "
                        f"returning milliseconds, or None, got {timer!r}")
    if not isinstance(backward, bool):
        raise ValueError(f"calibrate_fp8: backward must be True or False, got {backward!r}")
    inputs = example_inputs if isinstance(example_inputs, tuple) else (example_inputs,)
    device = _device_of(model, device_type)
    base, ref_policy, fp8_policy = _region_policies(load_policy(policy), device, recipe)
    dtype = base.rules(device).lower_precision_dtype if dtype is None else dtype
    ref = DTYPE_NAMES.get(dtype, str(dtype))
    named, seen, fp8_inside = _capture(model, inputs, device, dtype, base)
    if not named:
        raise ValueError(f"calibrate_fp8: the {type(model).__name__} has no torch.nn.Linear, the "
                         "modules fp8 can take; nothing to calibrate (use the policy as it is)")
    if not any(seen.values()):
        raise ValueError(f"calibrate_fp8: model(*example_inputs) called none of the {type(model).__name__}'s "
                         f"torch.nn.Linear modules ({', '.join(n for n, _ in named[:6])}); give inputs that "
                         "run the forward you mean to train")
    timer = timer or wall_clock(device, warmup, repeats)
    delayed = base.rules(device).fp8_recipe.scaling == "delayed"
    report, moves = [], []
    for name, module in named:
        xs = seen[name]
        shapes = tuple(tuple(x.shape) for x in xs)
        scoped = _scopes_over(base, name)
        if scoped or not xs:
            why = (f"the policy's scope {scoped[0]!r} decides here" if scoped else
                   "not called by model(*example_inputs)")
            report.append(Fp8Decision(name, shapes, None, None, None, None, "(policy)", why))
            continue
        twin = copy.deepcopy(module)  # the model's parameters, grads and fp8 histories stay as they are
        run_ref = _runner(twin, xs, device, dtype, ref_policy, backward)
        run_fp8 = _runner(twin, xs, device, dtype, fp8_policy, backward)
        want = run_ref()
        if delayed:
            run_fp8()  # fills the fresh copy's history with these inputs' amaxes
        got = run_fp8()
        error = max(relative_error(g, w) for g, w in zip(got, want))
        ref_ms = float(timer(name, ref, run_ref))
        fp8_ms = float(timer(name, "fp8", run_fp8))
        speedup = ref_ms / fp8_ms if fp8_ms > 0 else math.inf
        precision, why = _decide(speedup, error, min_speedup, max_error, ref)
        report.append(Fp8Decision(name, shapes, fp8_ms, ref_ms, speedup, error, precision, why))
        moves.append((name, precision == "fp8"))
    result = base.with_name(f"{base.name}_fp8_auto", f"{base.name}, with fp8 where ampkit.calibrate_fp8 found "
                            f"it faster than {ref} and within max_error {max_error:g} on {device}")
    base_fp8 = base.category(device, OP) == "fp8"
    if base_fp8 and fp8_inside:
        fewer = _fewer_scopes(result, base, named, seen, moves)
        if fewer is not None:
            return Fp8Calibration(fewer, tuple(report))
    for name, chosen in moves:
        if chosen and not base_fp8:
            result = result.with_module(name, fp8=[OP])
        elif not chosen and base_fp8:
            result = result.with_module(name, lower_precision_fp=[OP])
    return Fp8Calibration(result, tuple(report))


def _fewer_scopes(result, base, named, seen, moves):
    """The result with ``linear`` in lower_precision_fp on every device and a scope ``fp8:
    [linear]`` on each fp8 module and each unscoped candidate never called, where that decides
    every call as base + one lower_precision_fp scope per kept module does and has fewer scopes
    (this module's docstring, "fewer scopes"); else None. The caller has checked that every
    call of the fp8 category in the capture ran inside an unscoped candidate."""
    if any(base.category(d, OP) != "fp8" for d in base.device_types()):
        return None  # a device where linear is not in fp8: a scope fp8: [linear] would change it
    if any(s.pin is None and s.category(OP) is None for s in base.modules):
        return None  # a scope that leaves linear to the device tables, which change here
    uncalled = [n for n, _ in named if not seen[n] and not _scopes_over(base, n)]
    fp8 = [n for n, chosen in moves if chosen] + uncalled
    kept = [n for n, chosen in moves if not chosen]
    if len(fp8) >= len(kept):
        return None
    result = result.with_ops(lower_precision_fp=[OP])
    for name in fp8:
        result = result.with_module(name, fp8=[OP])
    return result
