"""The doctor itself: arming on a model, the per-step hooks, and reading what it found.

Armed, it installs a forward pre-hook and a forward hook on the model and subscribes to the
core's listener points (``ampkit._listeners``: a scaler's gradient check, a coming CUDA
graph capture); ``close()`` (or the doctor's collection with its model) undoes both. The
per-step check and the frozen first bad step are the step watch's (``_step_watch``); the
op-level watch (``_op_watch``) and the replay (``_replay``) are the bases of the class.
"""

from __future__ import annotations

import array
import collections
import threading
import weakref

import torch
from torch.utils._python_dispatch import _get_current_dispatch_mode_stack
from torch.utils._pytree import tree_leaves

from ampkit import _ops
from ampkit._listeners import about_to_capture, gradients_checked
from ampkit._policy import load_policy
from ampkit._scaler import GradScaler
from ampkit._doctor._finding import OUTSIDE, Finding
from ampkit._doctor._fp8_watch import Fp8Watch, table
from ampkit._doctor._op_watch import OpWatch
from ampkit._doctor._plot import heatmap
from ampkit._doctor._replay import Replay, cuda_generator, region_config
from ampkit._doctor._replaying import replaying
from ampkit._doctor._step_watch import StepWatch, capturing, state_of
from ampkit._doctor._verdict import HANDLED, HARMFUL, classify

# The armed doctors (at most one a model), held weakly: a doctor collected with its model,
# never closed, leaves by itself.
_ARMED: weakref.WeakSet = weakref.WeakSet()


def _check_every(every):
    if isinstance(every, bool) or not isinstance(every, int) or every < 1:
        raise ValueError(f"ampkit.doctor: every must be a positive integer (sample statistics every "
                         f"N steps, 1 = every step), got {every!r}")
    return every


def _subscribe(doc):
    """Subscribe ``doc`` to the core's listener points, holding it weakly (a doctor collected
    with its model, never closed, unsubscribes by its reference's callback); returns the
    function that unsubscribes it."""
    def checked(found_per_device, optimizer, combined_later):
        d = ref()
        if d is not None:
            d._gradients_checked(found_per_device, optimizer, combined_later)

    def capture():
        d = ref()
        if d is not None:
            d._before_capture()

    def unsubscribe(_collected=None):
        gradients_checked.unsubscribe(checked)
        about_to_capture.unsubscribe(capture)

    ref = weakref.ref(doc, unsubscribe)
    gradients_checked.subscribe(checked)
    about_to_capture.subscribe(capture)
    return unsubscribe


class doctor(OpWatch, Replay):
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
        if not isinstance(model, torch.nn.Module):
            raise TypeError(f"ampkit.doctor: model must be a torch.nn.Module, got {type(model).__name__}")
        self.every = _check_every(every)
        if not isinstance(keep_weights, bool):
            raise ValueError(f"ampkit.doctor: keep_weights must be True or False, got {keep_weights!r}")
        self.keep_weights = keep_weights
        self.policy = load_policy("torch_default" if policy is None else policy)
        if any(d.model is model for d in _ARMED):
            raise RuntimeError(
                f"ampkit.doctor: a doctor is already armed on this {type(model).__name__}; "
                "call .close() on it (or leave its `with` block) before arming another")
        state = state_of(model, keep_weights)  # (may raise: nothing is armed then)
        self.model = model
        self.names = {m: n for n, m in model.named_modules()}
        self._sites: dict = {}  # (op, module, phase, dtype) -> int
        self._site_list: list = []
        self._records: dict = {}  # device -> float32 [found, site, step, in_absmax, out_absmax] (sampled steps)
        self._step = -1  # host count of steps (the device's count goes on in graph replays)
        self._sampling = False
        self._acc: dict = {}  # module -> float32 tensor [absmax, grad_absmax, under, over, n_cast, n_low]
        self._rows: list = []  # (step, module, tensor) of sampled steps
        self._fp8 = Fp8Watch(self._where, self._unwatched)  # the fp8 casts of sampled steps
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
        self._split = None  # (handled, harmful) counts of the last findings() read
        # the op-level watch's mode goes where the stack ends now: above the modes entered
        # before arming (a fault injector), below those entered later
        self._depth = len(_get_current_dispatch_mode_stack())
        if not state:
            state = {torch.device("cpu"): []}
        # the record, step counters and replay buffers exist before any step, so that a CUDA
        # graph captured later writes into them rather than allocating its own
        self._watches = {dev: StepWatch(dev, ts, keep_weights) for dev, ts in state.items()}
        self._rng_dev = next((d for d in self._watches if d.type == "cuda"), None)  # whose generator is logged
        self._rng_gen = cuda_generator(self._rng_dev) if self._rng_dev is not None else None
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
        _ARMED.add(self)
        self._unsubscribe = _subscribe(self)
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
        self._unsubscribe()
        _ARMED.discard(self)
        self.armed = False

    # -- hooks ----------------------------------------------------------------------
    def _root_pre(self, module, args, kwargs):
        if replaying() is None and not self._stack:
            self._new_step(args, kwargs)
        if self._mode is not None:
            self._enter_forward("", args)
        return None

    def _root_post(self, module, args, output):
        if self._mode is not None:
            self._leave_forward("", output)
        if replaying() is not None or self._stack:
            return None
        every = [output] if type(output) is torch.Tensor else \
            [o for o in tree_leaves(output) if isinstance(o, torch.Tensor)]
        grad = torch.is_grad_enabled()
        self._bw_queued = False
        if self._out_grads:
            self._out_grads = []
        cfg = region_config(self._types)
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

    # -- the core's listener points (subscribed while armed) ------------------------------
    def _gradients_checked(self, found_per_device, optimizer, combined_later):
        """An ``ampkit.GradScaler`` checked the gradients of ``optimizer``'s parameters
        (``{device: flag}``, 1.0 = an inf or a NaN): if they are this model's, the flags are
        this step's check, with no pass of its own (it holds the flags: with
        ``combined_later`` the scaler then combines them over ranks in place, so it copies
        them, this rank's own)."""
        if self._steps(optimizer):
            if combined_later:
                found_per_device = {d: f.clone() for d, f in found_per_device.items()}
            self._scaler_report(found_per_device)

    def _before_capture(self):
        """A CUDA graph capture of a step is about to begin (``make_train_step``): a forward
        whose outputs got no backward (an evaluation between training steps) is checked now,
        eagerly (inside the capture its check would be recorded into the graph, and its flag
        sent from there would never reach the host); then the device step count catches up
        with the host count (a captured step counts itself on the device; eager steps read
        by the host do not write it)."""
        for w in self._watches.values():
            w.check_pending(False)
            w.sync_step()

    def _new_step(self, args, kwargs):
        if self._mode is not None or self._inner:  # the last sampled step ends here
            self._fold_sampled()
            self._ops_off()
        self._step += 1
        cap = capturing()
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
            self._fp8.on(self._step)

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
        if replaying() is not None:
            return None
        self._fold_sampled(restart=False)  # this step's slots so far (folding is idempotent)
        bads = []
        for dev, w in self._watches.items():
            w.check_pending(capturing())
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

    def findings(self, scaler):
        """Every bad step's finding, by step, each with its ``verdict``: ``"handled"`` (a
        backward overflow that ``scaler`` skipped and could still back off from) or
        ``"harmful"`` (a forward one, one the scaler did not skip, one that recurs where the
        scaler cannot lower the scale); the rule is ``ampkit._doctor._verdict``'s.

        ``scaler`` is the ``ampkit.GradScaler`` that steps the model's optimizer (its record
        of scales is read once; its latest update is taken as this doctor's latest step).
        The first finding is ``first_nonfinite()``'s; each later bad step whose verdict the
        host read (the usual eager loop: not a step the device records, as inside a CUDA
        graph) is replayed once, with the weights of the time of reading (up to 32 of them)."""
        if not isinstance(scaler, GradScaler):
            raise TypeError(f"ampkit.doctor.findings: scaler must be the ampkit.GradScaler that steps "
                            f"the model's optimizer, got {type(scaler).__name__}")
        first = self.first_nonfinite()
        if first is None:
            return []
        bad, found = set(), [first]
        for dev, w in self._watches.items():
            steps = w.known_bad_steps()
            bad.update(steps)
            k = w.bad()  # the frozen first bad step: later than a sampled step's finding
            if k is not None and k > first.step:
                if k not in self._replayed:
                    self._replayed[k] = self._replay(k, dev)
                found.append(self._replayed[k])
            for k in sorted(w.later):
                if k > first.step and k not in self._replayed:
                    with w.later_frozen(k):
                        self._replayed[k] = self._replay(k, dev)
                if k > first.step:
                    found.append(self._replayed[k])
        found = sorted({f.step: f for f in reversed(found)}.values(), key=lambda f: f.step)
        judged = classify(found, bad, self._scaler_seen, scaler, self._step)
        self._split = (sum(f.verdict == HANDLED for f in judged), sum(f.verdict == HARMFUL for f in judged))
        return judged

    def first_harmful(self, scaler):
        """The first finding ``scaler`` did not handle (see :meth:`findings`), or None."""
        return next((f for f in self.findings(scaler) if f.verdict == HARMFUL), None)

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

    def fp8_stats(self) -> list:
        """One dict per sampled step, module and operand that an op of the policy's ``fp8``
        category cast (``[]`` when none did): step, module, operand (``input``, ``weight``,
        ``grad_output``), dtype (the fp8 dtype), ops (the fp8 ops that cast it), amax (max
        |x|), overflow (fraction of elements saturated: ``|x * scale|`` beyond the largest
        value that rounds to the fp8 max), underflow (fraction of elements nonzero in ``x``
        and zero in fp8), scale (the smallest scale used), elements and casts (the counts
        they come from); see ``ampkit._doctor._fp8_watch``. Reads the device once."""
        return self._fp8.rows()

    def reset(self):
        """Forget the record and the statistics (the step count goes on)."""
        for sl in self._slot_state.values():
            sl.restart()
        for rec in self._records.values():
            rec.zero_()
        for w in self._watches.values():
            w.reset()
        self._replayed = {}
        self._split = None
        self._rows = []
        self._fp8.reset()

    def suggest(self, *, underflow: float = 0.01, fp8_overflow: float = 0.001,
                fp8_underflow: float = 0.01, policy=None, scaler=None):
        """The smallest change to the policy that stops what the doctor saw: each module where
        a forward value overflowed (the first non-finite value, or a sampled step's inf), or
        where more than ``underflow`` of the cast values underflowed, is pinned to float32
        (``policy.with_module(name, pin="float32")``). A forward finding outside every module
        moves its op to ``fp32`` instead. With ``scaler`` (the ``ampkit.GradScaler`` of the
        run) it acts on the first *harmful* finding (:meth:`findings`), a backward one the
        scaler could not handle included (its module pinned); without, on the first finding
        if it is a forward one (backward overflows are left to the loss scaler).

        fp8 hurts a module when, in a sampled step, more than ``fp8_overflow`` of the elements
        of one of its fp8 operands saturated or more than ``fp8_underflow`` flushed to zero
        (:meth:`fp8_stats`): its fp8 ops move back to the region dtype
        (``policy.with_module(name, lower_precision_fp=[ops])``; for the model itself,
        ``policy.with_ops(lower_precision_fp=[ops])``), unless it is pinned above. Returns an
        ``ampkit.Policy`` (``.to_yaml()`` writes it) whose description says why."""
        from ampkit import _ops
        base = self.policy if policy is None else load_policy(policy)
        for k, v in (("fp8_overflow", fp8_overflow), ("fp8_underflow", fp8_underflow)):
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 <= v < 1:
                raise ValueError(f"ampkit.doctor.suggest: {k} must be a fraction in [0, 1) (a module "
                                 f"above it is changed), got {v!r}")
        bad = []
        if scaler is None:
            f = self.first_nonfinite()
            f = f if f is not None and f.phase == "forward" else None
        else:
            f = self.first_harmful(scaler)
        global_ops = []
        if f is not None:
            if f.module in ("", OUTSIDE):
                try:
                    _ops.check_name(f.op, "suggest")
                    global_ops.append(f.op)
                except Exception:
                    pass
            else:
                bad.append(f.module)
        for r in self.stats():
            if r["module"] in ("", OUTSIDE):
                continue
            if r["overflow"] > 0 or r["underflow"] > underflow:
                bad.append(r["module"])
        bad = list(dict.fromkeys(bad))
        hurt = fp8_hurt(self.fp8_stats(), fp8_overflow, fp8_underflow, skip=set(bad))
        out = base
        have = {m.pattern: m for m in base.modules}
        for mod in bad:
            if mod in have:
                out = out.without_module(mod)
            out = out.with_module(mod, pin="float32")
        for mod, (ops, _) in hurt.items():
            if mod == "":
                out = out.with_ops(lower_precision_fp=sorted(ops))
                continue
            moves = {}
            if mod in have:
                if have[mod].pin is not None:
                    continue
                out = out.without_module(mod)
                moves = {c: [n for n in names if n not in ops] for c, names in have[mod].moves().items()}
            moves["lower_precision_fp"] = sorted(set(moves.get("lower_precision_fp", [])) | ops)
            out = out.with_module(mod, **{c: names for c, names in moves.items() if names})
        if global_ops:
            out = out.with_ops(fp32=global_ops)
        if out is not base:
            out = out.with_name(f"{base.name}+doctor",
                                "Suggested by ampkit.doctor: " + ", ".join(
                                    [f"{m} pinned to float32" for m in bad]
                                    + [f"{o} in fp32" for o in global_ops]
                                    + [why for _, why in hurt.values()]))
        return out

    def heatmap(self, path, *, title=None):
        """Write a PNG: per-module underflow and overflow fractions over sampled steps."""
        return heatmap(self.stats(), path, title=title or f"ampkit.doctor: {type(self.model).__name__}")

    def __str__(self):
        """The one-line ``repr``, then, when ops ran in fp8, a table of the latest sampled
        step's fp8 statistics per module and operand (:meth:`fp8_stats`; one device read)."""
        rows = self.fp8_stats()
        if not rows:
            return repr(self)
        return f"{self!r}\nfp8 casts (latest sampled step of each module and operand):\n{table(rows)}"

    def __repr__(self):
        state = "armed" if self.armed else "closed"
        split = "" if self._split is None else f", findings: {self._split[0]} handled, {self._split[1]} harmful"
        return f"<ampkit.doctor on {type(self.model).__name__}, every={self.every}, {state}{split}>"


def fp8_hurt(rows, max_overflow, max_underflow, skip=()):
    """``{module: (fp8 ops, why in words)}`` for each module (not in ``skip``, not outside the
    model) where an fp8 operand's overflow or underflow fraction passed its threshold in a
    sampled step; the words name the first such row."""
    out = {}
    for r in rows:
        mod = r["module"]
        if mod == OUTSIDE or mod in skip:
            continue
        why = None
        if r["overflow"] > max_overflow:
            why = f"{r['operand']} overflow {r['overflow']:.3g} > fp8_overflow {max_overflow:g}"
        elif r["underflow"] > max_underflow:
            why = f"{r['operand']} underflow {r['underflow']:.3g} > fp8_underflow {max_underflow:g}"
        if why is None:
            continue
        ops = {o for o in r["ops"].split(", ") if o}
        if mod in out:
            out[mod] = (out[mod][0] | ops, out[mod][1])
        else:
            name = mod or "the model"
            out[mod] = (ops, f"{name} back from fp8 to the region dtype ({why} at step {r['step']})")
    return out
