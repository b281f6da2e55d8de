"""Fault injection: put an inf or a NaN in the output of a chosen aten op of a chosen module,
forward or backward, at a chosen step. The oracle side of the doctor's tests.

Where an op runs is decided here by means independent of ``ampkit.doctor``: the target
module's own forward hooks for the forward, and its ``register_full_backward_pre_hook``
for the backward (the first matching op after the gradient of the module's output is
ready). ``ops_of(...)`` lists what can be targeted, from one recording step.

A test helper, not part of the package: it builds its models with ``ampkit.bench`` and
follows the doctor's replays through ``ampkit._doctor.replaying()``. The Python tests
import it as ``faults`` (tests/python is on their path); the R tests load it from
``$AMPKIT_REPO/tests/python``.

>>> import torch
>>> import faults
>>> model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 1))
>>> with faults.inject(model, "1", "addmm", "forward", "nan") as f:
...     out = model(torch.randn(2, 4))
>>> bool(out.isnan().any()), f.fired_at_step
(True, 0)
"""

from __future__ import annotations

import warnings

import torch
from ampkit._doctor import replaying
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

PHASES = ("forward", "backward")
KINDS = ("inf", "nan")


def _floating_out(out):
    return [t for t in tree_leaves(out) if isinstance(t, torch.Tensor) and t.is_floating_point() and t.numel()]


def _injectable(func) -> bool:
    """Ops whose output can be replaced by a corrupted copy: no views, no in-place/out ops."""
    s = func._schema
    if func.overloadpacket.__name__.startswith(("empty", "new_empty")):
        return False  # uninitialized memory
    return not func.is_view and not s.is_mutable and not any(
        a.alias_info is not None for a in s.returns)


class inject(TorchDispatchMode):
    """A context manager that corrupts the ``occurrence``-th (0-based) call of aten op ``op``
    (its overload packet name: ``addmm``, ``mm``, ``native_layer_norm`` ...) run by module
    ``module`` (a qualified name of ``model.named_modules()``, a leaf) in ``phase`` of the
    ``step``-th forward of ``model`` (and the backward that follows it). The op's first
    floating output becomes ``inf`` or ``nan``: all of it (``elements="all"``, an overflow
    that reaches the step's gradients), or its first element only (``elements="first"``,
    which a ReLU after it may mask before any gradient sees it). ``fired_at_step`` is the step
    it fired at (None if it never did). With ``record=True`` nothing is corrupted: ``seen``
    lists ``(phase, op)`` of the module's injectable ops at ``step``: all of its forward, and
    the first of its backward (the later ones may belong to another module's backward,
    which autograd may run in between)."""

    def __init__(self, model, module, op=None, phase="forward", kind="inf", step=0, occurrence=0,
                 record=False, elements="all"):
        super().__init__()
        if elements not in ("all", "first"):
            raise ValueError(f"faults.inject: elements must be 'all' or 'first', got {elements!r}")
        self.elements = elements
        if phase not in PHASES:
            raise ValueError(f"faults.inject: phase must be one of {PHASES}, got {phase!r}")
        if kind not in KINDS:
            raise ValueError(f"faults.inject: kind must be one of {KINDS}, got {kind!r}")
        mods = dict(model.named_modules())
        if module not in mods:
            raise ValueError(f"faults.inject: model has no module {module!r}")
        if list(mods[module].children()):
            raise ValueError(f"faults.inject: module {module!r} has submodules; target a leaf module")
        self.target = mods[module]
        self.op, self.phase, self.kind, self.step, self.occurrence = op, phase, kind, step, occurrence
        self.record = record
        self.seen: list = []
        self.fired_at_step = None
        self._step = -1
        self._fwd = 0
        self._bw_window = False
        self._count = 0
        self._handles = [
            model.register_forward_pre_hook(self._root_pre),
            self.target.register_forward_pre_hook(self._pre),
            self.target.register_forward_hook(self._post, always_call=True),
            self.target.register_full_backward_pre_hook(self._bw_pre),
        ]

    def _now(self):
        """The step running now: a doctor's replay of step k runs step k again (and this
        fault, modelling an overflow of that step's values, fires there again)."""
        k = replaying()
        return self._step if k is None else k

    def _root_pre(self, m, args):
        if replaying() is None:
            self._step += 1
        self._count = 0

    def _pre(self, m, args):
        self._fwd += 1

    def _post(self, m, args, out):
        self._fwd -= 1

    def _bw_pre(self, m, grad_out):
        if self._now() == self.step:
            self._bw_window = True
        return None

    def __exit__(self, *exc):
        try:
            return super().__exit__(*exc)
        finally:
            for h in self._handles:
                h.remove()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if self._now() != self.step or self.fired_at_step is not None and replaying() is None:
            return out
        backward = torch._C._current_autograd_node() is not None
        if backward:
            if not self._bw_window or self.phase == "forward" and not self.record:
                return out
            phase = "backward"
        else:
            if not self._fwd:
                return out
            phase = "forward"
        outs = _floating_out(out)
        if not outs or not _injectable(func):
            return out
        name = func.overloadpacket.__name__
        if self.record:
            self.seen.append((phase, name))
            if backward:  # only the first op after the output's gradient is surely the module's
                self._bw_window = False
            return out
        if phase != self.phase or name != self.op:
            return out
        if self._count < self.occurrence:
            self._count += 1
            return out
        self.fired_at_step = self._now()
        self._bw_window = False
        bad = outs[0].clone()
        value = float("inf") if self.kind == "inf" else float("nan")
        if self.elements == "all":
            bad.fill_(value)
        else:
            bad.view(-1)[0] = value
        if isinstance(out, torch.Tensor):
            return bad
        leaves = list(out)
        leaves[[i for i, t in enumerate(leaves) if t is outs[0]][0]] = bad
        return type(out)(leaves)


def ops_of(model, module, run_step, step=0):
    """``[(phase, op)]``: the injectable ops module ``module`` runs at ``step`` when
    ``run_step(i)`` runs step ``i`` of training (forward and backward)."""
    with inject(model, module, step=step, record=True) as rec:
        for i in range(step + 1):
            run_step(i)
    return rec.seen


# -- the fault suite over the benchmark cases ---------------------------------------------
CASES = ("seed_mlp", "transformer", "text_classifier", "convnet")
DTYPES = (torch.float16, torch.bfloat16)
MODES = ("eager", "train_step")


def _trainer(built, model, dtype, mode, device):
    """``run(i)``: one training step of ``model`` on batch ``i`` (a hand-written eager loop,
    or ``ampkit.make_train_step``, which captures a CUDA graph on cuda and runs eagerly on cpu)."""
    import ampkit

    opt = built.new_optimizer(model, fused=device == "cuda")  # fused: capturable on cuda
    scaler = ampkit.GradScaler(device, init_scale=1.0)  # no overflow of its own: only the fault
    region = dict(device_type=device, dtype=dtype)
    if mode == "train_step":
        step = ampkit.make_train_step(model, built.loss_fn, opt, scaler=scaler, autocast=region)

        def run(i):
            x, y = built.batches[i % len(built.batches)]
            return step(x, y)
        return run

    from ampkit.bench import loop_step

    step = loop_step(model, built.loss_fn, opt, lambda: ampkit.autocast(**region), scaler)

    def run(i):
        x, y = built.batches[i % len(built.batches)]
        return step(x, y).detach()
    return run


def plan(cases=CASES, dtypes=DTYPES, modes=MODES, device="cpu", per_combo=4, seed=0):
    """The fault list: per case, dtype and mode, ``per_combo`` faults cycling through
    (forward, inf), (forward, nan), (backward, inf), (backward, nan), each at a leaf module
    with parameters (cycled) and an op that module runs there (from a recording step).
    Each fault is a dict: case, dtype, mode, module, op, phase, kind, occurrence."""
    from ampkit.bench import build_case

    faults = []
    kinds = [("forward", "inf"), ("forward", "nan"), ("backward", "inf"), ("backward", "nan")]
    k = seed
    for case in cases:
        built = build_case(case, "tiny", device=device)
        for dtype in dtypes:
            model = built.new_model()
            run = _trainer(built, model, dtype, "eager", device)
            leaves = [n for n, m in model.named_modules()
                      if n and not list(m.children()) and list(m.parameters(recurse=False))]
            ops = {}

            def ops_at(name):  # recorded once per leaf the plan visits
                if name not in ops:
                    with warnings.catch_warnings():
                        warnings.filterwarnings("ignore", message="Full backward hook is firing")
                        ops[name] = ops_of(model, name, run, step=1)
                return ops[name]
            for mode in modes:
                for j in range(per_combo):
                    phase, kind = kinds[j % len(kinds)]
                    for _ in range(len(leaves)):  # next leaf that runs an op in this phase
                        name = leaves[k % len(leaves)]
                        k += 1
                        cands = [op for ph, op in ops_at(name) if ph == phase]
                        if cands:
                            break
                    op = cands[k % len(cands)]
                    occurrence = cands[: cands.index(op)].count(op)
                    faults.append(dict(case=case, dtype=str(dtype).replace("torch.", ""), mode=mode,
                                       module=name, op=op, phase=phase, kind=kind,
                                       occurrence=occurrence))
    return faults


def run_fault(fault, device="cpu", step=1, every=100, elements="all"):
    """Inject ``fault`` (a dict of :func:`plan`) at ``step`` of a fresh seeded run of its
    case, with a doctor armed; returns ``(finding, fired_at_step)``. With ``every`` > ``step``
    the faulty step is not a sampled one: the doctor finds it by its per-step check and
    names it by a replay; ``every=1`` samples every step (the op-level watch sees it)."""
    import ampkit
    from ampkit.bench import build_case

    built = build_case(fault["case"], "tiny", device=device)
    model = built.new_model()
    run = _trainer(built, model, getattr(torch, fault["dtype"]), fault["mode"], device)
    with warnings.catch_warnings():
        # the injector's backward pre-hook on a module whose inputs need no grad (the first layer)
        warnings.filterwarnings("ignore", message="Full backward hook is firing")
        return _run_fault(model, run, fault, step, every, elements)


def _run_fault(model, run, fault, step, every, elements="all"):
    import ampkit

    with inject(model, fault["module"], fault["op"], fault["phase"], fault["kind"], step=step,
                occurrence=fault["occurrence"], elements=elements) as inj:
        with ampkit.doctor(model, every=every) as doc:  # above the injector: it sees the fault
            for i in range(step + 1):
                run(i)
            finding = doc.first_nonfinite()
    return finding, inj.fired_at_step


def bad_batch(device="cuda", capture="auto", bad_step=6, steps=8, around_step=None):
    """The seed_mlp case (tiny profile) trained in float16 by ``make_train_step`` with the
    doctor armed; batch ``bad_step`` holds 1e6 (beyond float16: the cast of the input in
    layer ``0`` overflows). ``around_step(i)``, if given, returns a context manager for
    step ``i`` (a sync check, say). Returns (the doctor's first finding or None, whether
    each step replayed a captured graph)."""
    import contextlib

    import ampkit
    from ampkit.bench import build_case

    built = build_case("seed_mlp", "tiny", device=device)
    model = built.new_model()
    opt = built.new_optimizer(model, fused=device == "cuda")
    step = ampkit.make_train_step(model, built.loss_fn, opt, scaler=ampkit.GradScaler(device, init_scale=1.0),
                                  capture=capture if device == "cuda" else False,
                                  autocast=dict(device_type=device, dtype=torch.float16))
    captured = []
    with ampkit.doctor(model) as doc:
        for i in range(steps):
            x, y = built.batches[i % len(built.batches)]
            if i == bad_step:
                x = x.clone()
                x[0, 0] = 1e6
            with around_step(i) if around_step else contextlib.nullcontext():
                step(x, y)
            captured.append(bool(step.captured))
        if device == "cuda":
            torch.cuda.synchronize()
        return doc.first_nonfinite(), captured
