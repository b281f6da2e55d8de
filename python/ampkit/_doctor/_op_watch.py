"""The op-level watch: every aten op of a sampled step or a replay, its module and phase.

It installs a forward pre/post hook on each module and inserts one ``TorchDispatchMode``
where the mode stack ended at arming; the mode sees every aten op of the forward and of the
backward (the autocast casts included: aten ``_to_copy``)::

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

In sampled steps it also accumulates per module: the absmax of its forward outputs and
gradients, the fraction of values cast to the low dtype that underflow (nonzero in float32,
zero after the cast) and the fraction of low-precision values beyond the dtype's range (inf).
"""

from __future__ import annotations

import contextlib
import weakref

import torch
from torch.utils._python_dispatch import (TorchDispatchMode, _get_current_dispatch_mode_stack, _pop_mode,
                                          _push_mode)
from torch.utils._pytree import tree_leaves

from ampkit._doctor._finding import OUTSIDE
from ampkit._doctor._replaying import replaying
from ampkit._doctor._step_watch import capturing

_LOW = (torch.float16, torch.bfloat16)
_FP8 = tuple(getattr(torch, n) for n in ("float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz")
             if hasattr(torch, n))
_TAG = "ampkit_doctor_module"
_CAST_OPS = ("_to_copy",)
_current_node = torch._C._current_autograd_node
_aten = torch.ops.aten
# ops whose output is uninitialized memory: what they return is not a value any op made
_UNINITIALIZED = frozenset(getattr(_aten, n) for n in (
    "empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided", "empty_permuted")
    if hasattr(_aten, n))
_INF = float("inf")


class OpWatch:
    """The op-level watch (a base of ``ampkit.doctor``): on for sampled steps and replays."""

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
        self._fp8.off()
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
        k = replaying()
        return torch.full((), float(self._step if k is None else k), dtype=torch.float64, device=dev)

    # -- the slots: one absmax per watched op and leaf this step, on the device ----------
    def _slots(self, dev):
        sl = self._slot_state.get(dev)
        if sl is None:
            sl = self._slot_state[dev] = _Slots(dev, self._step_on(dev))
        return sl

    def _where(self):
        """(phase, module) of the op running now, or None when it is not watched: a backward
        op's module is the one whose forward created the running autograd node, a forward op's
        the innermost module whose forward is running."""
        node = _current_node()
        if node is not None:
            return "backward", node.metadata.get(_TAG, OUTSIDE)
        if self._stack:
            return "forward", self._stack[-1][0]
        return None

    @contextlib.contextmanager
    def _unwatched(self):
        """The doctor's own reductions inside a watched op (the fp8 watch's) are not ops of
        the model: the mode lets them through unwatched."""
        mode = self._mode
        if mode is None:
            yield
            return
        mode.quiet = True
        try:
            yield
        finally:
            mode.quiet = False

    def _watch(self, func, args, out):
        if func.overloadpacket in _UNINITIALIZED:  # garbage, which may hold an inf, until written
            return
        where = self._where()
        if where is None:
            return
        phase, module = where
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


def absmax(t):
    """max |t| as a float32 scalar, NaN-propagating (one reduction, no |x| temporary)."""
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
            if capturing():
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
            if t.dtype in _FP8:  # (no reduction kernel takes 8-bit floats: the fp8 category's casts)
                t = t.to(torch.float32)
            if self._cuda and t.dtype != torch.float64:  # one kernel, no |x| temporary; NaN propagates
                v = torch.linalg.vector_norm(t, _INF, dtype=torch.float32)
            else:  # on the CPU vector_norm(inf) is slow: aminmax is one fast pass
                v = absmax(t)
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


class _Mode(TorchDispatchMode):
    def __init__(self, doc):
        super().__init__()
        self.doc = doc
        self.quiet = False  # (the doctor's own ops, OpWatch._unwatched)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if not self.quiet:
            self.doc._watch(func, args, out)
        return out
