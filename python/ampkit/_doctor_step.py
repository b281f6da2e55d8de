"""The doctor's watch over every step: is anything non-finite, and what replays the first bad step.

Naming the op that made an inf needs a look at every op; doing that every step costs a
reduction per op (measured on an H100: 1.4x the step time inside a CUDA graph, 3-6x
eagerly). So the doctor splits the work:

* **every step** (this module), on the device, no host read: after the backward (an
  autograd callback queued by a hook on the model's output gradient), one check of the
  parameters' gradients and of the gradient that arrived at the model's output
  (``_foreach_norm(inf)``, a few kernels). The first step whose check fails is recorded.
  A step without a backward is checked at its outputs, when the next step starts or when
  the record is read. Beside the check, the step's *replay data* is kept: the bytes of
  the parameters and buffers as the step began, of the model's tensor inputs and of the
  output gradient. They are copied into ``cur`` each step and frozen into ``frozen`` by
  one ``where`` when the step is the first bad one (a byte copy: NaN-proof). On CUDA the
  copies run on a side stream, beside the forward and the optimizer.
* **on demand** (``_doctor.doctor.first_nonfinite``): the frozen step is replayed with the
  op-level watch (``_doctor_ops``): the parameters and buffers set to the frozen bytes,
  the same inputs, the same autocast regions, the same random state, the forward, then
  the backward from the frozen output gradient; then everything is put back.

Arming costs two copies of the parameters' bytes in memory (``cur`` and ``frozen``).
"""

from __future__ import annotations

import contextlib
import dataclasses

import torch
from torch.utils._pytree import tree_flatten, tree_leaves, tree_unflatten

_U8 = torch.uint8
_INF = float("inf")


def _bytes(t: torch.Tensor) -> torch.Tensor:
    """The bytes of ``t`` as a flat uint8 view (``t`` contiguous)."""
    t = t.detach()
    if t.dim() == 0:
        t = t.reshape(1)
    return t.reshape(-1).view(_U8)


def _capturing() -> bool:
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


@dataclasses.dataclass
class _Layout:
    """Where a step's tensor inputs and output gradients sit in the ``io`` bytes."""

    spec: object  # the pytree spec of (args, kwargs)
    leaves: list  # the non-tensor leaves (tensor leaves are None)
    tensors: list  # (index into leaves, offset, shape, dtype) of the tensor inputs
    grads: list  # (offset, shape, dtype) of the output gradients (filled at the forward's end)
    size: int  # bytes used


class StepWatch:
    """The per-step check and replay data of one device's parameters and buffers."""

    def __init__(self, dev, state, keep_weights=False):
        self.dev = dev
        self.state = state  # parameters and buffers on this device (contiguous)
        self.keep_weights = keep_weights
        self.src = [_bytes(t) for t in state] if keep_weights else []
        n = sum(s.numel() for s in self.src)
        self.cur = torch.empty(n, dtype=_U8, device=dev)
        self.frozen = torch.zeros(n, dtype=_U8, device=dev)
        self.frozen_at = None
        self.views = list(torch.split(self.cur, [s.numel() for s in self.src])) if self.src else []
        self.io_cur = torch.empty(0, dtype=_U8, device=dev)
        self.io_frozen = torch.empty(0, dtype=_U8, device=dev)
        self.step = torch.full((), -1.0, dtype=torch.float64, device=dev)  # the device's step count
        self.looking = torch.ones((), dtype=torch.bool, device=dev)  # no bad step recorded yet
        self.bad_step = torch.full((), -1.0, dtype=torch.float64, device=dev)
        self.layout = None  # this step's _Layout
        self.pending = None  # outputs of a forward whose backward has not been checked
        self.side = torch.cuda.Stream(dev) if dev.type == "cuda" else None
        self.keep = ()  # tensors the side stream still reads

    # -- every step ------------------------------------------------------------------
    def _stream(self):
        if self.side is None or _capturing():
            return contextlib.nullcontext()
        self.side.wait_stream(torch.cuda.current_stream(self.dev))
        return torch.cuda.stream(self.side)

    def _join(self):
        if self.side is not None and not _capturing():
            torch.cuda.current_stream(self.dev).wait_stream(self.side)

    def begin(self, args, kwargs):
        """The step starts: count it, keep its parameters' and inputs' bytes."""
        self.step.add_(1)
        flat, spec = tree_flatten((args, kwargs))
        leaves, tensors, off = [], [], 0
        ins = []
        for i, a in enumerate(flat):
            if isinstance(a, torch.Tensor) and a.device == self.dev:
                a = a.detach()
                if not a.is_contiguous():
                    a = a.contiguous()
                b = _bytes(a)
                tensors.append((i, off, a.shape, a.dtype))
                ins.append(b)
                off += b.numel()
                leaves.append(None)
            else:  # (a tensor on another device is not kept: the replay runs without it)
                leaves.append(None if isinstance(a, torch.Tensor) else a)
        if self.dev.type == "cpu":  # the CPU generator's state: bytes beside the inputs
            rng = torch.get_rng_state()
            ins.append(rng)
            tensors.append((-1, off, rng.shape, rng.dtype))
            off += rng.numel()
        self.layout = _Layout(spec, leaves, tensors, [], off)
        self._reserve(off)
        with self._stream():
            if self.views:
                torch._foreach_copy_(self.views, self.src)
            if ins:
                dst = [self.io_cur[o: o + b.numel()] for (_, o, _, _), b in zip(tensors, ins)]
                torch._foreach_copy_(dst, ins)
                if self.side is not None and not _capturing():
                    for b in ins:
                        b.record_stream(self.side)

    def _reserve(self, size):
        if size <= self.io_cur.numel():
            return
        cap = max(size, 2 * self.io_cur.numel())
        self._join()  # the side stream may still read the old buffers
        cur = torch.empty(cap, dtype=_U8, device=self.dev)
        frozen = torch.zeros(cap, dtype=_U8, device=self.dev)
        frozen[: self.io_frozen.numel()].copy_(self.io_frozen)
        cur[: self.io_cur.numel()].copy_(self.io_cur)
        self.io_cur, self.io_frozen = cur, frozen

    def output_grad_slot(self, t):
        """A place in ``io`` for the gradient of output ``t``: (offset, shape, dtype)."""
        lay = self.layout
        nbytes = t.numel() * t.element_size()
        slot = (lay.size, t.shape, t.dtype)
        lay.grads.append(slot)
        lay.size += nbytes
        self._reserve(lay.size)
        return slot

    def keep_grad(self, slot, grad):
        off, shape, dtype = slot
        if grad.dtype != dtype or grad.shape != shape:
            return
        self._join()  # the side stream's freeze of the last step reads io_cur
        self.io_cur[off: off + grad.numel() * grad.element_size()].copy_(_bytes(grad.contiguous()))

    def check(self, tensors):
        """After the step's backward (or for a forward without one): record the step if any
        of ``tensors`` holds a non-finite value and no bad step is recorded yet, and freeze
        its replay data. A few kernels, no host read."""
        ts = [t.detach() for t in tensors if t is not None and t.is_floating_point() and t.numel()]
        if ts:
            norms = torch._foreach_norm(ts, _INF)
            fine = (torch.stack([n.float() for n in norms]) if len(norms) > 1 else norms[0].float()).amax().isfinite()
        else:
            fine = torch.ones((), dtype=torch.bool, device=self.dev)
        self.record(fine)

    def record(self, fine):
        """Record this step as the first bad one if ``fine`` (a device bool) is False and no
        bad step is recorded yet, freezing its replay data (idempotent within a step)."""
        self._join()
        new = self.looking > fine  # looking and not fine
        torch.where(new, self.step, self.bad_step, out=self.bad_step)
        torch.logical_and(self.looking, fine, out=self.looking)
        n = self.layout.size if self.layout is not None else 0
        with self._stream():
            if self.src:
                torch.where(new, self.cur, self.frozen, out=self.frozen)
            if n:
                torch.where(new, self.io_cur[:n], self.io_frozen[:n], out=self.io_frozen[:n])
        if self.side is not None and not _capturing():
            new.record_stream(self.side)
        self.keep = (new,)

    def check_pending(self):
        """A forward whose outputs got no backward: check them now (if they are alive)."""
        p, self.pending = self.pending, None
        if p is not None:
            outs = [r() for r in p]
            if all(o is not None for o in outs):
                self.check(outs)

    def reset(self):
        self._join()
        self.looking.fill_(True)
        self.bad_step.fill_(-1.0)

    # -- reading -------------------------------------------------------------------
    def bad(self):
        """The first bad step's index, or None (one host read)."""
        self._join()
        s = int(self.bad_step.item())
        return None if s < 0 else s

    def frozen_state(self):
        """The frozen parameters and buffers, as tensors shaped like ``state``."""
        out, off = [], 0
        for t in self.state:
            n = t.numel() * t.element_size()
            out.append(self.frozen[off: off + n].view(t.dtype).view(t.shape))
            off += n
        return out

    def frozen_io(self, layout):
        """The frozen step's args, kwargs, output gradients and (CPU) random state."""
        leaves = list(layout.leaves)
        rng = None
        for i, off, shape, dtype in layout.tensors:
            n = shape.numel() * torch.empty((), dtype=dtype).element_size()
            t = self.io_frozen[off: off + n].view(dtype).view(shape).clone()
            if i < 0:
                rng = t
            else:
                leaves[i] = t
        args, kwargs = tree_unflatten(leaves, layout.spec)
        grads = []
        for off, shape, dtype in layout.grads:
            n = shape.numel() * torch.empty((), dtype=dtype).element_size()
            grads.append(self.io_frozen[off: off + n].view(dtype).view(shape).clone())
        return args, kwargs, grads, rng


def same_layout(a, b) -> bool:
    """Whether two steps' inputs sit alike (then one record serves both)."""
    if a is None or b is None:
        return a is b
    if a.spec != b.spec or a.tensors != b.tensors or a.grads != b.grads or len(a.leaves) != len(b.leaves):
        return False
    for x, y in zip(a.leaves, b.leaves):
        if x is y:
            continue
        try:
            if type(x) is not type(y) or not bool(x == y):
                return False
        except Exception:
            return False
    return True


def state_of(model):
    """The model's parameters and buffers, each once, grouped by device."""
    seen, by_dev = set(), {}
    for t in list(model.parameters()) + list(model.buffers()):
        if id(t) in seen:
            continue
        seen.add(id(t))
        if not t.is_contiguous():
            raise ValueError(
                "ampkit.doctor: the model has a non-contiguous parameter or buffer (shape "
                f"{tuple(t.shape)}, strides {t.stride()}); the doctor keeps their bytes for its "
                "replay. Make it contiguous (`p.data = p.data.contiguous()`) before arming")
        by_dev.setdefault(t.device, []).append(t)
    return by_dev


def region_config():
    """The autocast regions in force (ampkit's and torch's), to enter again in a replay."""
    from ampkit._autocast import thread_engine

    devs = dict(thread_engine().frames[-1].devs)  # {device_type: (enabled, dtype, policy, cache)}
    plain = {}
    for dt in ("cpu", "cuda"):
        if dt not in devs and torch.is_autocast_enabled(dt):
            plain[dt] = torch.get_autocast_dtype(dt)
    return devs, plain


@contextlib.contextmanager
def enter_region(config):
    """Enter the regions ``region_config()`` described."""
    import ampkit

    devs, plain = config
    with contextlib.ExitStack() as stack:
        for dt, (enabled, dtype, policy, cache) in devs.items():
            stack.enter_context(ampkit.autocast(dt, dtype=dtype, enabled=enabled, cache_enabled=cache,
                                                policy=policy))
        for dt, dtype in plain.items():
            stack.enter_context(torch.autocast(dt, dtype=dtype))
        yield


def cuda_rng_state(dev):
    """The CUDA generator's state a replay of a step on ``dev`` needs (host side, no device
    read; None under a graph capture, whose replays advance it on the device)."""
    if dev.type != "cuda" or _capturing():
        return None
    g = torch.cuda.default_generators[dev.index if dev.index is not None else torch.cuda.current_device()]
    return ("cuda", g, g.initial_seed(), g.get_offset())


@contextlib.contextmanager
def replay_rng(state):
    """Run with the random state ``state`` (of :func:`rng_state`); put the current one back."""
    if state is None:
        yield
        return
    if state[0] == "cuda":
        _, g, seed, offset = state
        old = (g.initial_seed(), g.get_offset())
        g.manual_seed(seed)
        g.set_offset(offset)
        try:
            yield
        finally:
            g.manual_seed(old[0])
            g.set_offset(old[1])
        return
    old = torch.get_rng_state()  # ("cpu", the frozen generator bytes)
    torch.set_rng_state(state[1])
    try:
        yield
    finally:
        torch.set_rng_state(old)


def leaves_requiring_grad(out):
    return [t for t in tree_leaves(out) if isinstance(t, torch.Tensor) and t.requires_grad
            and t.is_floating_point()]
