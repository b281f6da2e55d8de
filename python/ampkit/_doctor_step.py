"""The doctor's watch over every step: is anything non-finite, and what replays the first bad step.

Naming the op that made an inf needs a look at every op; doing that every step costs a
reduction per op (measured on an H100: 1.4x the step time inside a CUDA graph, 3-6x
eagerly). So the doctor splits the work:

* **every step** (this module), on the device, no host read: after the backward (an
  autograd callback queued by a hook on the model's output gradient), one check of the
  parameters' gradients and of the gradient that arrived at the model's output
  (``_foreach_norm(inf)``, a few kernels), or an ``ampkit.GradScaler``'s own check of
  the gradients when one runs. The first step whose check fails is recorded. A step
  without a backward is checked at its outputs, when the next step starts or when the
  record is read. The step's *replay data* is held, not copied: its tensor inputs, the
  output gradient, the CPU generator's state (and with ``keep_weights`` the weights'
  bytes). After the verdict one conditional copy per held tensor puts them into the
  frozen bytes only if the step is the first bad one: on CUDA a Triton kernel whose
  blocks return at once otherwise (no pass over the bytes), elsewhere ``torch.where``.
* **on demand** (``_doctor.doctor.first_nonfinite``): the frozen step is replayed under
  the op-level watch of ``_doctor``: the same inputs, autocast regions and random state
  (and with ``keep_weights`` the step's own weights), the forward, then the backward from
  the frozen output gradient; then everything is put back.

Memory: the frozen inputs and output gradients (one step's), and with ``keep_weights``
one copy of the weights; a step's output gradient is held until its verdict.
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


@dataclasses.dataclass(eq=False)
class _Layout:
    """Where a step's tensor inputs sit in the frozen input bytes (one object per distinct
    layout: steps alike share it)."""

    spec: object  # the pytree spec of (args, kwargs)
    leaves: list  # the non-tensor leaves (tensor leaves are None)
    tensors: list  # (index into leaves, or -1 for the CPU generator's state; offset, shape, dtype)
    size: int  # bytes


_COND_COPY = []  # the Triton kernel, once built (CUDA)


def _cond_copy_kernel():
    if not _COND_COPY:
        try:
            import triton
            import triton.language as tl

            @triton.jit
            def cond_copy(flag, src, dst, n, CHUNK: tl.constexpr, BLOCK: tl.constexpr):
                if tl.load(flag) != 0:  # the step is the first bad one: copy this chunk
                    base = tl.program_id(0).to(tl.int64) * CHUNK
                    for i in range(0, CHUNK, BLOCK):
                        offs = base + i + tl.arange(0, BLOCK)
                        m = offs < n
                        tl.store(dst + offs, tl.load(src + offs, mask=m), mask=m)

            _COND_COPY.append(cond_copy)
        except Exception:  # no Triton: torch.where, which reads and writes every byte
            _COND_COPY.append(None)
    return _COND_COPY[0]


def cond_copy(flag, src, dst):
    """``dst[:] = src`` where the device bool ``flag`` is True, else nothing; both flat uint8.
    On CUDA with Triton one kernel whose blocks return at once when ``flag`` is False (no
    pass over the bytes, no host read); elsewhere ``torch.where``."""
    n = src.numel()
    if n == 0:
        return
    k = _cond_copy_kernel() if src.device.type == "cuda" else None
    if k is None:
        torch.where(flag, src, dst, out=dst)
        return
    chunk = 1 << 16
    k[((n + chunk - 1) // chunk,)](flag, src, dst, n, CHUNK=chunk, BLOCK=4096)


class StepWatch:
    """The per-step check and replay data of one device's parameters and buffers.

    Per step: ``begin`` counts the step and holds its inputs; the output gradients are held
    as they arrive; ``record`` (after the backward, given the check's verdict) copies what
    it holds into the frozen bytes only if the step is the first bad one, and lets go."""

    def __init__(self, dev, state, keep_weights=False):
        self.dev = dev
        self.state = state  # parameters and buffers on this device (contiguous)
        self.keep_weights = keep_weights
        self.weights = [_bytes(t) for t in state] if keep_weights else []
        n = sum(b.numel() for b in self.weights)
        self.frozen = torch.zeros(n, dtype=_U8, device=dev)
        self.frozen_w = list(torch.split(self.frozen, [b.numel() for b in self.weights])) if self.weights else []
        self.io_frozen = torch.zeros(0, dtype=_U8, device=dev)  # the inputs (and CPU generator)
        self.g_frozen = torch.zeros(0, dtype=_U8, device=dev)  # the output gradients
        self.step = torch.full((), -1.0, dtype=torch.float64, device=dev)  # the device's step count
        self.looking = torch.ones((), dtype=torch.bool, device=dev)  # no bad step recorded yet
        self.bad_step = torch.full((), -1.0, dtype=torch.float64, device=dev)
        self.layout = None  # this step's _Layout
        self.grad_layout = ()  # this step's output gradients: ((offset, shape, dtype), ...)
        self.pending = None  # outputs of a forward whose backward has not been checked
        self.held = []  # (bytes, destination) this step holds until its verdict
        self._key = None
        if dev.type == "cuda":  # build the kernel now, not inside a graph capture later
            cond_copy(torch.zeros((), dtype=torch.bool, device=dev), self.looking.view(_U8).view(1),
                      torch.zeros(1, dtype=_U8, device=dev))

    # -- every step ------------------------------------------------------------------
    def begin(self, args, kwargs):
        """The step starts: count it, hold its inputs (no copy)."""
        self.step.add_(1)
        self.held = []
        if not kwargs and all(type(a) is torch.Tensor and a.device == self.dev for a in args):
            key = tuple((a.dtype, a.shape, a.is_contiguous()) for a in args)  # the usual call
            if key != self._key or self.dev.type == "cpu":
                self._key = key
                self._layout(args, kwargs)
            else:
                for (_, off, shape, dtype), a in zip(self.layout.tensors, args):
                    self._hold(a, self.io_frozen, off)
            return
        self._key = None
        self._layout(args, kwargs)

    def _hold(self, t, frozen, off):
        b = _bytes(t if t.is_contiguous() else t.contiguous())
        self.held.append((b, frozen[off: off + b.numel()]))

    def _layout(self, args, kwargs):
        flat, spec = tree_flatten((args, kwargs))
        leaves, tensors, off, ins = [], [], 0, []
        for i, a in enumerate(flat):
            if isinstance(a, torch.Tensor) and a.device == self.dev:
                a = a.detach()
                tensors.append((i, off, a.shape, a.dtype))
                ins.append(a)
                off += a.numel() * a.element_size()
                leaves.append(None)
            else:  # (a tensor on another device is not kept: the replay runs without it)
                leaves.append(None if isinstance(a, torch.Tensor) else a)
        if self.dev.type == "cpu":  # the CPU generator's state: bytes beside the inputs
            rng = torch.get_rng_state()
            ins.append(rng)
            tensors.append((-1, off, rng.shape, rng.dtype))
            off += rng.numel()
        lay = _Layout(spec, leaves, tensors, off)
        if not same_layout(lay, self.layout):
            self.layout = lay
        self.io_frozen = _grown(self.io_frozen, off)
        for (_, o, _, _), a in zip(self.layout.tensors, ins):
            self._hold(a, self.io_frozen, o)

    def hold_output_grads(self, outs):
        """The forward ended: where each output's gradient will go in the frozen bytes."""
        slots, off = [], 0
        for t in outs:
            slots.append((off, t.shape, t.dtype))
            off += t.numel() * t.element_size()
        slots = tuple(slots)
        if slots != self.grad_layout:
            self.grad_layout = slots
        self.g_frozen = _grown(self.g_frozen, off)
        return slots

    def keep_grad(self, slot, grad):
        off, shape, dtype = slot
        if grad.dtype == dtype and grad.shape == shape:
            self._hold(grad.detach(), self.g_frozen, off)

    def check(self, tensors):
        """After the step's backward (or for a forward without one): record the step if any
        of ``tensors`` holds a non-finite value. A few kernels, no host read."""
        ts = [t.detach() for t in tensors if t is not None and t.is_floating_point() and t.numel()]
        if ts:
            norms = torch._foreach_norm(ts, _INF)
            bad = (torch.stack([n.float() for n in norms]) if len(norms) > 1 else norms[0].float()).amax()
            bad = bad.isfinite().logical_not_()
        else:
            bad = torch.zeros((), dtype=torch.bool, device=self.dev)
        self.record(bad)

    def record(self, bad):
        """Record this step as the first bad one if ``bad`` (a device flag: a bool, or the
        scaler's float 1.0/0.0) is set and no bad step is recorded yet: its step index, and
        the bytes it holds, copied into the frozen ones on the device only then. Lets go of
        what it held. Three small kernels and one conditional copy per held tensor."""
        new = torch.logical_and(self.looking, bad)
        torch.where(new, self.step, self.bad_step, out=self.bad_step)
        torch.gt(self.looking, new, out=self.looking)  # looking and not new
        for src, dst in self.held:
            cond_copy(new, src, dst)
        for src, dst in zip(self.weights, self.frozen_w):
            cond_copy(new, src, dst)
        self.held = []

    def check_pending(self):
        """A forward whose outputs got no backward: check them now (if they are alive)."""
        p, self.pending = self.pending, None
        if p is not None:
            outs = [r() for r in p]
            if all(o is not None for o in outs):
                self.check(outs)

    def reset(self):
        self.looking.fill_(True)
        self.bad_step.fill_(-1.0)

    # -- reading -------------------------------------------------------------------
    def bad(self):
        """The first bad step's index, or None (one host read)."""
        s = int(self.bad_step.item())
        return None if s < 0 else s

    def frozen_state(self):
        """The frozen parameters and buffers, as tensors shaped like ``state``."""
        return [f.view(t.dtype).view(t.shape) for t, f in zip(self.state, self.frozen_w)]

    def frozen_io(self, layout, grad_layout):
        """The frozen step's args, kwargs, output gradients and (CPU) random state."""
        leaves = list(layout.leaves)
        rng = None
        for i, off, shape, dtype in layout.tensors:
            t = _typed(self.io_frozen, off, shape, dtype)
            if i < 0:
                rng = t
            else:
                leaves[i] = t
        args, kwargs = tree_unflatten(leaves, layout.spec)
        grads = [_typed(self.g_frozen, off, shape, dtype) for off, shape, dtype in grad_layout]
        return args, kwargs, grads, rng


def _typed(buf, off, shape, dtype):
    n = shape.numel() * torch.empty((), dtype=dtype).element_size()
    return buf[off: off + n].view(dtype).view(shape).clone()


def _grown(buf, size):
    """``buf``, or a larger copy of it when ``size`` bytes do not fit (the frozen bytes
    already there stay where they are)."""
    if size <= buf.numel():
        return buf
    new = torch.zeros(max(size, 2 * buf.numel()), dtype=_U8, device=buf.device)
    new[: buf.numel()].copy_(buf)
    return new


def same_layout(a, b) -> bool:
    """Whether two steps' inputs sit alike (then one record serves both)."""
    if a is None or b is None:
        return a is b
    if a.spec != b.spec or a.tensors != b.tensors or len(a.leaves) != len(b.leaves):
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

    devs = dict(thread_engine().devs())  # {device_type: (enabled, dtype, policy, cache)}
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
