"""The numerics doctor: the first non-finite op of a run, forward or backward, and its module.

``doc = ampkit.doctor(model, every=N)`` arms it (also ``with ampkit.doctor(...) as doc:``);
``doc.close()`` disarms it. Armed, it installs a forward pre-hook and a forward hook on the
model itself; every step is checked on the device for an inf or a NaN that reaches the
gradients or the outputs, and the first bad step's inputs and output gradient are kept
(``_doctor_step``). Disarmed (or never armed) nothing is installed: no cost.

The op is named by the **op-level watch**, which runs only in sampled steps (every
``every``-th, eager) and in the replay of the first bad step that ``first_nonfinite()``
runs on demand. It installs a forward pre/post hook on each module and inserts one
``TorchDispatchMode`` where the mode stack ended at arming; the mode sees every aten op of
the forward and of the backward (the autocast casts included: aten ``_to_copy``)::

    forward op   : module = innermost module whose forward is running (the hooks' stack)
    backward op  : module = the module whose forward created the running autograd node
                   (each module's post-hook tags the nodes its forward created)
    op outside the model's forward and outside backward (optimizer, scaler): not watched
    uninitialized outputs (empty_like ...) and views: not watched (a view keeps its base's slot)
    per watched op: slot k = next slot of the step
        buf[k]   = max |output|   (one reduction kernel; NaN and inf propagate)
        sites[k] = site, an int naming (op, module, phase, dtype), interned in Python
        ins[k]   = the slots of its inputs (a leaf input, parameter or data, gets a slot of
                   its own, reduced once per step, site -1)
    at the step's end (and on read): fold the slots into the record
        bad    = not isfinite(buf) and sites >= 0;   j = first bad slot
        record = where(any(bad) and not record.found,
                       [1, sites[j], step, max(buf[ins[j]]), buf[j]], record)

No value is read back to the host per step: ``first_nonfinite()`` reads the records on
demand, and replays the first bad step if no sampled step named it. Under
``make_train_step``'s CUDA graph the per-step check and keeping are kernels of the graph,
and a device step counter names the replayed step.

In sampled steps the doctor also accumulates per module: the absmax of its forward outputs
and gradients, the fraction of values cast to the low dtype that underflow (nonzero in
float32, zero after the cast) and the fraction of low-precision values beyond the dtype's
range (inf).

>>> import torch, ampkit
>>> model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 1))
>>> with torch.no_grad():
...     _ = model[1].weight.fill_(3e4)     # fits float16; the product does not
>>> with ampkit.doctor(model) as doc, ampkit.autocast("cpu", dtype=torch.float16):
...     out = model(torch.full((2, 4), 100.0))
>>> f = doc.first_nonfinite()
>>> (f.op, f.module, f.phase, f.dtype, f.step)
('addmm', '1', 'forward', 'float16', 0)
"""

from __future__ import annotations

import array
import collections
import dataclasses
import math
import threading
import warnings
import weakref

import torch
from ampkit import _doctor_step as _step_watch
from torch.utils._python_dispatch import (TorchDispatchMode, _get_current_dispatch_mode_stack, _pop_mode,
                                          _push_mode)
from torch.utils._pytree import tree_leaves

_LOW = (torch.float16, torch.bfloat16)
_OUTSIDE = "<outside model>"
_TAG = "ampkit_doctor_module"
# Weak references to the armed doctors: a plain list, which the scaler reads every step; a
# doctor collected with its model, never closed, leaves it by its reference's callback.
_DOCTORS: list = []
_CAST_OPS = ("_to_copy",)
_current_node = torch._C._current_autograd_node
_aten = torch.ops.aten
# ops whose output is uninitialized memory: what they return is not a value any op made
_UNINITIALIZED = frozenset(getattr(_aten, n) for n in (
    "empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided", "empty_permuted")
    if hasattr(_aten, n))


@dataclasses.dataclass(frozen=True)
class Finding:
    """The first non-finite value the doctor saw: which op made it, where and when."""

    op: str  # the aten op (``addmm``, ``mm``, ``_to_copy``, ``mul`` ...)
    module: str  # qualified module name ("" is the model itself)
    phase: str  # "forward" or "backward"
    dtype: str  # the dtype of the op's output
    step: int  # 0-based index of the model's forward calls since arming
    input_absmax: float  # max |x| over the op's floating inputs
    output_absmax: float  # inf or nan
    weights: str = "step"  # the weights the op ran with: "step" (that step's), or "current"
    # (a replay with the weights at the time of reading, see ampkit.doctor's keep_weights)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def _check_every(every):
    if isinstance(every, bool) or not isinstance(every, int) or every < 1:
        raise ValueError(f"ampkit.doctor: every must be a positive integer (sample statistics every "
                         f"N steps, 1 = every step), got {every!r}")
    return every


_REPLAYING = [None]  # the step a doctor is replaying now (see replaying())


def replaying():
    """The index of the step a doctor is replaying right now, else None. A replay runs a
    recorded step's forward and backward again under the op-level watch; a fault injector
    (``ampkit.faults.inject``) that models a fault of that step fires in the replay too."""
    return _REPLAYING[0]


def _disarmed(ref):
    if ref in _DOCTORS:
        _DOCTORS.remove(ref)


def before_capture():
    """A CUDA graph capture of a step is about to begin (``make_train_step``): a forward
    whose outputs got no backward (an evaluation between training steps) is checked now,
    eagerly (inside the capture its check would be recorded into the graph, and its flag
    sent from there would never reach the host); then each armed doctor's device step count
    catches up with its host count (a captured step counts itself on the device; eager
    steps read by the host do not write it)."""
    for r in list(_DOCTORS):
        doc = r()
        if doc is not None:
            for w in doc._watches.values():
                w.check_pending(False)
                w.sync_step()


def scaler_checked(found_per_device, optimizer, combined_later=False):
    """An ``ampkit.GradScaler`` checked the gradients of ``optimizer``'s parameters
    (``{device: flag}``, 1.0 = an inf or a NaN): the doctor armed on the model they belong
    to takes it as its step's check, with no pass of its own (it holds the flags: with
    ``combined_later`` the scaler then combines them over ranks in place, so it copies
    them, this rank's own)."""
    for r in _DOCTORS:
        doc = r()
        if doc is not None and doc._steps(optimizer):
            if combined_later:
                found_per_device = {d: f.clone() for d, f in found_per_device.items()}
            doc._scaler_report(found_per_device)


class doctor:
    """Arm the numerics doctor on ``model``.

    Args:
      model: the ``torch.nn.Module`` to watch (its forward, and the backward of the graph
        its forward builds).
      every: sample per-module statistics every ``every`` steps (a positive int, default
        100: a sampled step watches every op, at a few reductions per op); the step 0 is
        sampled. Every step is checked for non-finite values; the op is named by a replay.
      policy: the cast policy the run uses (an ``ampkit.Policy``, a shipped name or a
        path); :meth:`suggest` changes it. Default ``"torch_default"``.
      keep_weights: keep the weights each step began with, so that the replay of the
        first bad step runs that step's weights even when later steps changed them (one
        copy of them in memory; each step copies them there only if it is the first bad
        one, with a Triton kernel on CUDA, else a ``where`` over them per step). Off (the
        default), the replay runs the weights of the time of reading: the same weights
        when nothing stepped since (the scaler skipped the bad step and you read then, as
        ``on_skip`` does); the finding's ``weights`` says which.

    A model has at most one armed doctor: arming a second raises ``RuntimeError`` (close the
    first). Nothing is installed when an argument is bad.
    """

    def __init__(self, model, every: int = 100, *, policy=None, keep_weights: bool = False):
        from ampkit._policy import load_policy

        if not isinstance(model, torch.nn.Module):
            raise TypeError(f"ampkit.doctor: model must be a torch.nn.Module, got {type(model).__name__}")
        self.every = _check_every(every)
        if not isinstance(keep_weights, bool):
            raise ValueError(f"ampkit.doctor: keep_weights must be True or False, got {keep_weights!r}")
        self.keep_weights = keep_weights
        self.policy = load_policy("torch_default" if policy is None else policy)
        if any(getattr(r(), "model", None) is model for r in _DOCTORS):
            raise RuntimeError(
                f"ampkit.doctor: a doctor is already armed on this {type(model).__name__}; "
                "call .close() on it (or leave its `with` block) before arming another")
        state = _step_watch.state_of(model, keep_weights)  # (may raise: nothing is armed then)
        self.model = model
        self.names = {m: n for n, m in model.named_modules()}
        self._sites: dict = {}  # (op, module, phase, dtype) -> int
        self._site_list: list = []
        self._records: dict = {}  # device -> float32 [found, site, step, in_absmax, out_absmax] (sampled steps)
        self._step = -1  # host count of steps (the device's count goes on in graph replays)
        self._sampling = False
        self._acc: dict = {}  # module -> float32 tensor [absmax, grad_absmax, under, over, n_cast, n_low]
        self._rows: list = []  # (step, module, tensor) of sampled steps
        self._stack: list = []  # (module name, stop nodes) of the running forwards
        self._abs: dict = {}  # id(tensor) -> (weakref, absmax) of this step's values
        self._slot_state: dict = {}  # device -> _Slots
        self._thread = threading.get_ident()
        self._handles = []
        self._inner: list = []  # the op-level watch's module hooks while it is on
        self._mode = None  # the op-level watch's mode while it is on
        self._bw_queued = False
        self._out_grads: list = []
        self._history: list = []  # (host step, layouts, region config) where they change
        self._rng_offsets = array.array("q")  # the CUDA generator's offset at each eager step's start
        self._rng_start = None  # the host step of _rng_offsets[0]
        self._rng_seeds: dict = {}  # host step -> the generator's seed, where it changes
        self._rng_seed = None  # the last seed logged
        self._replayed: dict = {}  # step -> Finding
        # the op-level watch's mode goes where the stack ends now: above the modes entered
        # before arming (a fault injector), below those entered later
        self._depth = len(_get_current_dispatch_mode_stack())
        if not state:
            state = {torch.device("cpu"): []}
        # the record, step counters and replay buffers exist before any step, so that a CUDA
        # graph captured later writes into them rather than allocating its own
        self._watches = {dev: _step_watch.StepWatch(dev, ts, keep_weights) for dev, ts in state.items()}
        self._rng_dev = next((d for d in self._watches if d.type == "cuda"), None)  # whose generator is logged
        self._rng_gen = _step_watch.cuda_generator(self._rng_dev) if self._rng_dev is not None else None
        self._one = len(self._watches) == 1
        self._types = tuple({d.type for d in self._watches})
        for w in self._watches.values():
            w.take = self._taker(w, None)
        if not self._one:  # a model over devices: each step's bytes placed by the device
            for w in self._watches.values():
                w.host_verdicts = False
        self._scaler_seen = False  # an ampkit.GradScaler checks the gradients: its flag is used
        self._optimizers: dict = {}  # id(optimizer) -> (weak reference, whether it steps the model)
        for dev in self._watches:
            self._records[dev] = torch.zeros(5, device=dev)
        self._handles.append(model.register_forward_pre_hook(self._root_pre, with_kwargs=True))
        self._handles.append(model.register_forward_hook(self._root_post, always_call=True))
        self._ref = weakref.ref(self, _disarmed)
        _DOCTORS.append(self._ref)
        self.armed = True

    @property
    def host_verdict_steps(self) -> int:
        """How many eager steps held their inputs as they were until the host read their
        verdict (the usual loop, new tensors each step); the others were copied by the device
        at once (a CUDA graph, a refilled input buffer, ``keep_weights``)."""
        return sum(w.host_steps for w in self._watches.values())

    # -- arming ---------------------------------------------------------------------
    def __enter__(self):
        if not self.armed:
            raise RuntimeError("ampkit.doctor: this doctor was closed; arm a new ampkit.doctor(model)")
        return self

    def __exit__(self, *exc):
        self.close()
        return False

    def close(self):
        """Disarm: remove the hooks (and the op-level watch's mode; records stay readable).
        The steps still waiting for their verdict get it now (one wait for the device), so
        that nothing they held stays alive with the closed doctor."""
        if not self.armed:
            return
        if threading.get_ident() != self._thread:
            raise RuntimeError("ampkit.doctor.close(): close the doctor in the thread that armed it")
        for w in self._watches.values():
            w.release()
        self._fold_sampled()
        self._ops_off()
        for h in self._handles:
            h.remove()
        self._handles = []
        _disarmed(self._ref)
        self.armed = False

    # -- the op-level watch: on for sampled steps and replays ----------------------------
    def _ops_on(self):
        for m, n in self.names.items():
            if m is not self.model:
                self._inner.append(m.register_forward_pre_hook(self._pre(n)))
                self._inner.append(m.register_forward_hook(self._post(n), always_call=True))
        self._mode = _Mode(self)
        _insert_mode(self._mode, self._depth)

    def _ops_off(self):
        """Turn the op-level watch off (its mode leaves the stack wherever it sits in it)."""
        if self._mode is not None:
            _remove_mode(self._mode)
            self._mode = None
        for h in self._inner:
            h.remove()
        self._inner = []
        self._stack = []

    def _fold_sampled(self, restart=True):
        for sl in self._slot_state.values():
            sl.fold(self._record(sl.dev))
            if restart:
                sl.restart()

    # -- hooks ----------------------------------------------------------------------
    def _root_pre(self, module, args, kwargs):
        if _REPLAYING[0] is None and not self._stack:
            self._new_step(args, kwargs)
        if self._mode is not None:
            self._enter_forward("", args)
        return None

    def _root_post(self, module, args, output):
        if self._mode is not None:
            self._leave_forward("", output)
        if _REPLAYING[0] is not None or self._stack:
            return None
        every = [output] if type(output) is torch.Tensor else \
            [o for o in tree_leaves(output) if isinstance(o, torch.Tensor)]
        grad = torch.is_grad_enabled()
        self._bw_queued = False
        if self._out_grads:
            self._out_grads = []
        cfg = _step_watch.region_config(self._types)
        placed = False
        one = self._one
        for dev, w in self._watches.items():
            mine = every if one else [o for o in every if o.device == dev]
            w.pending = [weakref.ref(o) for o in mine] or None
            mine = [o for o in mine if grad and o.requires_grad and o.is_floating_point()]
            dsts = w.hold_output_grads(mine)
            for i, o in enumerate(mine):
                self._hook_grad(o, w, None if dsts is None else dsts[i])
            w.cfg = cfg
            placed = placed or not w.host_mode
        if placed:
            self._remember(cfg)
        return None

    def _taker(self, w, dst):
        """The hook that takes an output's gradient for watch ``w`` (into ``dst``, or held
        when ``dst`` is None)."""
        def take(grad):
            w.keep_grad(dst, grad)
            w.pending = None  # (the backward came: no forward-only check)
            if not self._scaler_seen:  # else the scaler's own check records the step
                self._out_grads.append(grad)
                if not self._bw_queued:
                    self._bw_queued = True
                    torch.autograd.Variable._execution_engine.queue_callback(self._backward_end)

        return take

    def _hook_grad(self, out, w, dst):
        """Take ``out``'s gradient when the backward reaches it: a tensor hook, put in the
        tensor's hook table as ``Tensor.register_hook`` does, without the removable handle
        it makes (nothing removes it: the tensor is the step's; a third of the cost). A held
        gradient's hook is made once per watch."""
        take = w.take if dst is None else self._taker(w, dst)
        hooks = out._backward_hooks
        if hooks is None:
            node = out.grad_fn
            if node is None:  # (a leaf)
                out.register_hook(take)
                return
            hooks = out._backward_hooks = collections.OrderedDict()
            node._register_hook_dict(out)
        hooks[self] = take  # (the doctor as the key: one entry per doctor, beside any other)

    def _backward_end(self):
        grads = self._out_grads
        self._out_grads = []
        for w in self._watches.values():
            w.pending = None
            if self._scaler_seen:  # the scaler's own check of the gradients will record the step
                continue
            w.check([t.grad for t in w.state if isinstance(t, torch.nn.Parameter)]
                    + [g for g in grads if g.device == w.dev])

    def _steps(self, optimizer):
        """Whether ``optimizer`` steps this doctor's model (some parameter of it is the
        model's); answered once per optimizer."""
        seen = self._optimizers.get(id(optimizer))
        if seen is not None and seen[0]() is optimizer:
            return seen[1]
        ids = {id(t) for ts in self._watches.values() for t in ts.state}
        mine = any(id(p) in ids for g in getattr(optimizer, "param_groups", ()) for p in g["params"])
        self._optimizers[id(optimizer)] = (weakref.ref(optimizer), mine)
        return mine

    def _scaler_report(self, found_per_device):
        """An ``ampkit.GradScaler`` checked the gradients: its flags (1.0 = inf or NaN) are
        this step's check, with no pass of the doctor's own over the gradients."""
        self._scaler_seen = True
        for dev, found in found_per_device.items():
            w = self._watches.get(dev)
            if w is not None and w.host_step >= 0:
                w.record(found)

    def _remember(self, cfg):
        """What a replay of this step needs from the host, for a step whose bytes the device
        places: the layouts of its inputs and output gradients and the autocast regions
        ``cfg`` (kept where they change)."""
        layouts = tuple((w.layout, w.grad_layout) for w in self._watches.values())
        if self._history:
            _, l0, c0 = self._history[-1]
            if c0 == cfg and all(a[0] is b[0] and a[1] == b[1] for a, b in zip(l0, layouts)):
                return
        self._history.append((self._step, layouts, cfg))

    def _log_rng(self, cap):
        """The CUDA generator's state at this step's start (8 bytes a step; the seed where it
        changes), for the replay's random ops (the first CUDA device's generator; a captured
        step's replays advance it on the device: nothing to log)."""
        if cap:
            return
        g = self._rng_gen
        seed, offset = g.initial_seed(), g.get_offset()
        if self._rng_start is None or self._step - self._rng_start != len(self._rng_offsets):
            # the first, or after a gap: start over
            self._rng_start, self._rng_offsets, self._rng_seeds, self._rng_seed = self._step, array.array("q"), {}, None
        self._rng_offsets.append(offset)
        if seed != self._rng_seed:
            self._rng_seeds[self._step] = self._rng_seed = seed

    def _rng_at(self, k):
        if self._rng_start is None or not 0 <= k - self._rng_start < len(self._rng_offsets):
            return None
        seed = self._rng_seeds[max(s for s in self._rng_seeds if s <= k)]
        return ("cuda", self._rng_gen, seed, self._rng_offsets[k - self._rng_start])

    def _pre(self, name):
        def pre(module, args):
            self._enter_forward(name, args)

        return pre

    def _post(self, name):
        def post(module, args, output):
            self._leave_forward(name, output)

        return post

    def _enter_forward(self, name, args):
        stops = {t.grad_fn for t in tree_leaves(args) if isinstance(t, torch.Tensor) and t.grad_fn is not None}
        self._stack.append((name, stops))

    def _leave_forward(self, name, output):
        if not self._stack or self._stack[-1][0] != name:
            return
        _, stops = self._stack.pop()
        if torch.is_grad_enabled():
            self._tag(output, name, stops)

    def _tag(self, output, name, stops):
        """Tag the autograd nodes this module's forward created (those not tagged by an inner
        module already): the walk from its outputs stops at its inputs' nodes."""
        todo = [t.grad_fn for t in tree_leaves(output) if isinstance(t, torch.Tensor) and t.grad_fn is not None]
        seen = set()
        while todo:
            node = todo.pop()
            if node is None or node in seen or node in stops:
                continue
            seen.add(node)
            md = node.metadata
            if _TAG not in md:
                md[_TAG] = name
            todo.extend(nf for nf, _ in node.next_functions if nf is not None)

    def _new_step(self, args, kwargs):
        if self._mode is not None or self._inner:  # the last sampled step ends here
            self._fold_sampled()
            self._ops_off()
        self._step += 1
        cap = _capturing()
        for w in self._watches.values():
            w.check_pending(cap)
            w.begin(args, kwargs, self._step, cap)
        if self._rng_dev is not None:
            self._log_rng(cap)
        self._sampling = self._step % self.every == 0 and not cap
        if self._acc:
            self._acc = {}
        if self._abs:
            self._abs = {}
        if self._sampling:
            for sl in self._slot_state.values():  # the slots record this step's index
                sl.step = self._step_on(sl.dev)
            self._ops_on()

    # -- the per-op record (called by the mode) --------------------------------------
    def _site(self, key) -> int:
        s = self._sites.get(key)
        if s is None:
            s = self._sites[key] = len(self._site_list)
            self._site_list.append(key)
        return s

    def _step_on(self, dev):
        """The step index the op-level slots record: the replayed step in a replay, else this
        (sampled, eager) step's host count, as a device scalar."""
        k = _REPLAYING[0]
        return torch.full((), float(self._step if k is None else k), dtype=torch.float64, device=dev)

    # -- the slots: one absmax per watched op and leaf this step, on the device ----------
    def _slots(self, dev):
        sl = self._slot_state.get(dev)
        if sl is None:
            sl = self._slot_state[dev] = _Slots(dev, self._step_on(dev))
        return sl

    def _watch(self, func, args, out):
        if func.overloadpacket in _UNINITIALIZED:  # garbage, which may hold an inf, until written
            return
        node = _current_node()
        if node is not None:
            phase = "backward"
            module = node.metadata.get(_TAG, _OUTSIDE)
        elif self._stack:
            phase = "forward"
            module = self._stack[-1][0]
        else:
            return
        outs = [t for t in tree_leaves(out) if isinstance(t, torch.Tensor) and t.is_floating_point() and t.numel()]
        if not outs:
            return
        if phase == "forward" and len(outs) > 1:
            # a forward op's first output is its value; the others are saved statistics for
            # its backward (layer_norm's mean and rstd, attention's padded logsumexp), whose
            # padding may hold infs that no value carries
            outs = outs[:1]
        known = self._abs
        if func.is_view:  # a view makes no new value: it has its base's slot (a bound)
            src = args[0] if args and isinstance(args[0], torch.Tensor) else None
            e = known.get(id(src)) if src is not None else None
            if e is not None and e[0]() is src:
                for o in outs:
                    known[id(o)] = (weakref.ref(o), e[1])
            return
        dev = outs[0].device
        sl = self._slots(dev)
        with torch.no_grad():
            # the inputs: an earlier op's output has a slot; a leaf (a parameter, the data) is
            # reduced into a slot of its own once per step
            ins = []
            for t in tree_leaves(args):
                if isinstance(t, torch.Tensor) and t.is_floating_point() and t.numel() and t.device == dev:
                    e = known.get(id(t))
                    if e is None or e[0]() is not t:
                        k = sl.take(-1, ())
                        if k is None:
                            return
                        sl.absmax_into([t], k)
                        e = known[id(t)] = (weakref.ref(t), k)
                    ins.append(e[1])
            name = func.overloadpacket.__name__
            key = (name, module, phase, str(outs[0].dtype).replace("torch.", ""))
            k = sl.take(self._site(key), tuple(dict.fromkeys(ins)))
            if k is None:
                return
            sl.absmax_into(outs, k)
            for o in outs:  # (in-place ops: the new value of the mutated input)
                known[id(o)] = (weakref.ref(o), k)
            if self._sampling:
                self._sample(func, name, module, phase, args, outs, sl.buf[k])

    # views and in-place ops make no new values: not counted in the fractions
    @staticmethod
    def _new_values(func):
        return not func.is_view and not func._schema.is_mutable

    def _sample(self, func, name, module, phase, args, outs, oabs):
        dev = oabs.device
        acc = self._acc.get(module)
        if acc is None:  # the row holds the tensor: the step's backward still adds to it
            acc = self._acc[module] = torch.zeros(6, device=dev)
            self._rows.append((self._step, module, acc))
        if phase == "backward":
            acc[1] = torch.maximum(acc[1], oabs)
            return
        acc[0] = torch.maximum(acc[0], oabs)
        low = [t for t in outs if t.dtype in _LOW]
        if not low or not self._new_values(func):
            return
        src = args[0] if args and isinstance(args[0], torch.Tensor) else None
        if name in _CAST_OPS and src is not None and src.dtype == torch.float32 and len(outs) == 1:
            y = outs[0]
            acc[2] += ((src != 0) & (y == 0)).sum()
            acc[4] += y.numel()
        for y in low:  # inf, not NaN: a NaN comes from an inf upstream (or 0/0), not from range
            acc[3] += torch.isinf(y).sum()
            acc[5] += y.numel()

    # -- reading ----------------------------------------------------------------------
    def _record(self, dev):
        rec = self._records.get(dev)
        if rec is None:
            rec = self._records[dev] = torch.zeros(5, device=dev)
        return rec

    def first_nonfinite(self):
        """The first non-finite value since arming, as a :class:`Finding`, or None.

        Reads the device's record (one read per device). A sampled step's finding is read
        as it is; the first bad step otherwise is replayed once (see the module's doc)."""
        if _REPLAYING[0] is not None:
            return None
        self._fold_sampled(restart=False)  # this step's slots so far (folding is idempotent)
        bads = []
        for dev, w in self._watches.items():
            w.check_pending(_capturing())
            k = w.bad()
            if k is not None:
                bads.append((k, dev))
        sampled = self._sampled_finding()
        if not bads:
            return sampled
        k, dev = min(bads, key=lambda b: b[0])
        if sampled is not None and sampled.step <= k:
            return sampled
        if k not in self._replayed:
            self._replayed[k] = self._replay(k, dev)
        return self._replayed[k]

    def _sampled_finding(self):
        return self._earliest(self._records.values())

    def _earliest(self, records):
        """The finding of the earliest step among records [found, site, step, in, out] (one
        per device; one read each), or None."""
        hits = [r for r in (rec.tolist() for rec in records) if r[0] == 1.0]
        if not hits:
            return None
        r = min(hits, key=lambda r: r[2])
        op, module, phase, dtype = self._site_list[int(r[1])]
        return Finding(op=op, module=module, phase=phase, dtype=dtype, step=int(r[2]),
                       input_absmax=float(r[3]), output_absmax=float(r[4]))

    def _history_at(self, k):
        entry = self._history[0] if self._history else None
        for h in self._history:
            if h[0] <= k:
                entry = h
        return entry

    def _replay(self, k, dev):
        """Run step ``k`` again from its frozen bytes under the op-level watch; put back the
        parameters, buffers, gradients and the random state afterwards."""
        nan = float("nan")
        w = self._watches[dev]
        if w.stale == k:
            warnings.warn(
                f"ampkit.doctor: the inputs (or output gradient) of step {k} were changed in place "
                "after the step, before the doctor kept them; the replay runs the changed values. "
                "Pass each step a new tensor, or refill the same buffer every step (the doctor then "
                "keeps the bytes on the device)", RuntimeWarning, stacklevel=3)
        meta = w.frozen_meta
        if meta is not None and meta[0] == k:  # placed by the host after its verdict
            _, lay, gslots, cfg = meta
        else:
            entry = self._history_at(k)
            if entry is None:
                return Finding("<not reproduced>", "<unknown>", "forward", "", k, nan, nan)
            _, layouts, cfg = entry
            lay, gslots = layouts[list(self._watches).index(dev)]
        self._ops_off()  # (a sampled step still running is not watched further)
        args, kwargs, grads, cpu_rng = w.frozen_io(lay, gslots)
        rng = ("cpu", cpu_rng) if cpu_rng is not None else self._rng_at(k)
        params = [t for t in w.state if isinstance(t, torch.nn.Parameter)]
        # what the replay may change: the buffers (a forward updates running statistics),
        # and the parameters too when it loads the kept ones
        changed = w.state if self.keep_weights else [t for t in w.state if not isinstance(t, torch.nn.Parameter)]
        saved = [t.detach().clone() for t in changed]
        saved_grads = [p.grad for p in params]
        kept = (self._slot_state, self._stack, self._abs, self._sampling, self._acc)
        self._slot_state, self._stack, self._abs, self._sampling, self._acc = {}, [], {}, False, {}
        f = None
        try:
            if self.keep_weights:
                with torch.no_grad():
                    for t, v in zip(w.state, w.frozen_state()):
                        t.copy_(v)
            for p in params:
                p.grad = None
            _REPLAYING[0] = k
            self._ops_on()
            try:
                with _step_watch.replay_rng(rng), _step_watch.enter_region(cfg), torch.enable_grad():
                    out = self.model(*args, **kwargs)
                f = self._replay_finding()
                if f is None and grads:
                    bad = [g for g in grads if not bool(torch.isfinite(g).all())]
                    if bad:  # the gradient arrived non-finite: made outside the model (the loss)
                        g = bad[0]
                        f = Finding("<output gradient>", _OUTSIDE, "backward", str(g.dtype).replace("torch.", ""),
                                    k, nan, float(_amax1(g)))
                    else:
                        outs = _step_watch.leaves_requiring_grad(out)
                        if len(outs) == len(grads):
                            torch.autograd.backward(outs, grads)
                        f = self._replay_finding()
            finally:
                _REPLAYING[0] = None
                self._ops_off()
        finally:
            with torch.no_grad():
                for t, v in zip(changed, saved):
                    t.copy_(v)
            for p, g in zip(params, saved_grads):
                p.grad = g
            self._slot_state, self._stack, self._abs, self._sampling, self._acc = kept
        if f is None:
            f = Finding("<not reproduced>", "<unknown>", "backward" if grads else "forward", "", k, nan, nan)
        return f if self.keep_weights else dataclasses.replace(f, weights="current")

    def _replay_finding(self):
        recs = {}
        for sl in self._slot_state.values():
            sl.fold(recs.setdefault(sl.dev, torch.zeros(5, device=sl.dev)))
        return self._earliest(recs.values())

    def on_skip(self, scaler):
        """The finding when ``scaler`` (an ``ampkit.GradScaler``) skipped a step, else None."""
        stats = scaler.stats()
        return self.first_nonfinite() if stats.skipped else None

    def stats(self) -> list:
        """One dict per module and sampled step: step, module, absmax (forward outputs),
        grad_absmax (backward outputs), underflow (fraction of values cast to the low dtype
        that became 0), overflow (fraction of low-precision values beyond range), and the
        counts they come from. Reads the device once."""
        if not self._rows:
            return []
        vals = torch.stack([a.to("cpu") if a.device.type != "cpu" else a for _, _, a in self._rows]).tolist()
        rows = []
        for (step, mod, _), v in zip(self._rows, vals):
            absmax, gabs, under, over, ncast, nlow = v
            rows.append({"step": step, "module": mod, "absmax": absmax, "grad_absmax": gabs,
                         "underflow": under / ncast if ncast else 0.0,
                         "overflow": over / nlow if nlow else 0.0,
                         "cast_elements": int(ncast), "low_elements": int(nlow)})
        return rows

    def reset(self):
        """Forget the record and the statistics (the step count goes on)."""
        for sl in self._slot_state.values():
            sl.restart()
        for rec in self._records.values():
            rec.zero_()
        for w in self._watches.values():
            w.reset()
        self._replayed = {}
        self._rows = []

    def suggest(self, *, underflow: float = 0.01, policy=None):
        """The smallest change to the policy that stops what the doctor saw: each module where
        a forward value overflowed (the first non-finite value, or a sampled step's inf), or
        where more than ``underflow`` of the cast values underflowed, is pinned to float32
        (``policy.with_module(name, pin="float32")``). A forward finding outside every module
        moves its op to ``fp32`` instead. Backward overflows are left to the loss scaler
        (``ampkit.GradScaler`` backs off on them): no rule is suggested for them. Returns an
        ``ampkit.Policy`` (``.to_yaml()`` writes it)."""
        from ampkit import _ops
        from ampkit._policy import load_policy

        base = self.policy if policy is None else load_policy(policy)
        bad = []
        f = self.first_nonfinite()
        global_ops = []
        if f is not None and f.phase == "forward":
            if f.module in ("", _OUTSIDE):
                try:
                    _ops.check_name(f.op, "suggest")
                    global_ops.append(f.op)
                except Exception:
                    pass
            else:
                bad.append(f.module)
        for r in self.stats():
            if r["module"] in ("", _OUTSIDE):
                continue
            if r["overflow"] > 0 or r["underflow"] > underflow:
                bad.append(r["module"])
        out = base
        have = {m.pattern for m in base.modules}
        for mod in dict.fromkeys(bad):
            if mod in have:
                out = out.without_module(mod)
            out = out.with_module(mod, pin="float32")
        if global_ops:
            out = out.with_ops(fp32=global_ops)
        if out is not base:
            out = out.with_name(f"{base.name}+doctor",
                                "Suggested by ampkit.doctor: " + ", ".join(
                                    [f"{m} pinned to float32" for m in dict.fromkeys(bad)]
                                    + [f"{o} in fp32" for o in global_ops]))
        return out

    def heatmap(self, path, *, title=None):
        """Write a PNG: per-module underflow and overflow fractions over sampled steps."""
        from ampkit._doctor_plot import heatmap

        return heatmap(self.stats(), path, title=title or f"ampkit.doctor: {type(self.model).__name__}")

    def __repr__(self):
        state = "armed" if self.armed else "closed"
        return f"<ampkit.doctor on {type(self.model).__name__}, every={self.every}, {state}>"


_INF = float("inf")


def _amax1(t):
    mn, mx = torch.aminmax(t.detach())  # one reduction, no |x| temporary; NaN propagates
    return torch.maximum(mx.float(), mn.float().neg())




class _Slots:
    """One device's slots: ``buf[k]`` is the absmax of the k-th watched value of the step
    (slot 0 is a constant 0, the padding), ``sites[k]`` the op site that made it (-1: a leaf
    input), ``ins[k]`` the slots of its inputs. Per watched op one reduction kernel writes
    its slot; ``sites`` and ``ins`` are written only where the step's sequence of ops
    changes (the first step), by fill kernels, so that this also runs in a graph capture.
    ``fold`` turns the slots into the record once per step: a dozen kernels, no host read::

        bad  = not isfinite(buf[1:n]) and sites[1:n] >= 0
        j    = 1 + first index where bad            (argmax of the 0/1 vector)
        record = where(any(bad) and not record.found,
                       [1, sites[j], step, max(buf[ins[j]]), buf[j]], record)
    """

    MAX_INPUTS = 8

    def __init__(self, dev, step):
        self.dev = dev
        self.step = step
        self.cap = 0
        self.n = 1
        self.host_sites: list = [-1]
        self.host_ins: list = [()]
        self._grow(4096)
        self._one = torch.ones((), device=dev)
        self._cuda = dev.type == "cuda"

    def _grow(self, cap):
        buf = torch.zeros(cap, device=self.dev)
        sites = torch.full((cap,), -1, dtype=torch.int64, device=self.dev)
        ins = torch.zeros((cap, self.MAX_INPUTS), dtype=torch.int64, device=self.dev)
        if self.cap:
            buf[: self.cap].copy_(self.buf)
            sites[: self.cap].copy_(self.sites)
            ins[: self.cap].copy_(self.ins)
        self.buf, self.sites, self.ins, self.cap = buf, sites, ins, cap
        self.host_sites += [-1] * (cap - len(self.host_sites))
        self.host_ins += [()] * (cap - len(self.host_ins))

    def restart(self):
        self.n = 1

    def take(self, site, ins):
        """The next slot for a value made by ``site`` from the slots ``ins``; None when a graph
        capture has filled every slot (the value is not watched then)."""
        k = self.n
        if k >= self.cap:
            if _capturing():
                return None
            self._grow(2 * self.cap)
        self.n = k + 1
        if self.host_sites[k] != site:
            self.sites[k].fill_(site)
            self.host_sites[k] = site
        ins = ins[: self.MAX_INPUTS]
        if self.host_ins[k] != ins:
            row = list(ins) + [0] * (self.MAX_INPUTS - len(ins))
            for j, v in enumerate(row):
                self.ins[k, j].fill_(v)
            self.host_ins[k] = ins
        return k

    def absmax_into(self, ts, k):
        out = self.buf[k]
        for i, t in enumerate(ts):
            t = t.detach()
            if self._cuda and t.dtype != torch.float64:  # one kernel, no |x| temporary; NaN propagates
                v = torch.linalg.vector_norm(t, _INF, dtype=torch.float32)
            else:  # on the CPU vector_norm(inf) is slow: aminmax is one fast pass
                v = _amax1(t)
            if i == 0:
                out.copy_(v)
            else:
                torch.maximum(out, v, out=out)

    def fold(self, rec):
        n = self.n
        if n <= 1:
            return
        vals, sites = self.buf[1:n], self.sites[1:n]
        bad = ~torch.isfinite(vals) & (sites >= 0)
        # (index_select with a 1-element index tensor: indexing by a 0-dim tensor reads it
        # back to the host)
        j = (bad.to(torch.uint8).argmax() + 1).view(1)
        iabs = self.buf.index_select(0, self.ins.index_select(0, j).view(-1)).amax().view(1)
        row = torch.cat([self._one.view(1), self.sites.index_select(0, j).float(), self.step.view(1).float(),
                         iabs, self.buf.index_select(0, j)])
        new = bad.any() & (rec[0] == 0)
        rec.copy_(torch.where(new, row, rec))


def _insert_mode(mode, depth):
    """Push ``mode`` at ``depth`` of this thread's dispatch mode stack (or on top of a
    shallower stack): the modes above it are taken off and put back over it."""
    above = []
    while len(_get_current_dispatch_mode_stack()) > depth:
        above.append(_pop_mode())
    _push_mode(mode)
    for m in reversed(above):
        _push_mode(m)


def _remove_mode(mode):
    """Take ``mode`` out of this thread's dispatch mode stack, wherever it is."""
    if not any(m is mode for m in _get_current_dispatch_mode_stack()):
        return
    above = []
    while True:
        m = _pop_mode()
        if m is mode:
            break
        above.append(m)
    for m in reversed(above):
        _push_mode(m)


_capturing = _step_watch.capturing


class _Mode(TorchDispatchMode):
    def __init__(self, doc):
        super().__init__()
        self.doc = doc

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self.doc._watch(func, args, out)
        return out
