"""The doctor's watch over every step: is anything non-finite, and what replays the first bad step.

Naming the op that made an inf needs a look at every op; doing that every step costs a
reduction per op (measured on an H100: 1.4x the step time inside a CUDA graph, 3-6x
eagerly). So the doctor splits the work:

* **every step** (this module), no host sync: after the backward (an autograd callback
  queued by a hook on the model's output), one check of the
  parameters' gradients and of the gradient that arrived at the model's output
  (``_foreach_norm(inf)``, a few kernels), or an ``ampkit.GradScaler``'s own check of
  the gradients of this model's optimizer when one runs. A step without a backward is
  checked at its outputs, when the next step starts or when the record is read. The
  step's *replay data* is held, not copied: its tensor inputs, the output gradient, the
  CPU generator's state (and with ``keep_weights`` the weights' bytes). Two ways on:
  - *the host's verdict* (eager steps whose inputs are new tensors, the usual loop): the
    check's flag is held (no op), and every 32 steps (sooner once the steps not sent hold
    256 MiB) the held flags are stacked and copied, asynchronously, to pinned host memory
    over a sentinel; the steps wait in a queue holding their tensors. A later step (or a
    reader) sees the flags there once the device got that far: a clean step lets go, the
    first bad one has its tensors copied into the frozen bytes then. The host waits only
    if it runs 64 steps ahead of the device.
  - *the device's copy* (inside a CUDA graph capture, inputs that are the last step's
    buffers refilled in place, ``keep_weights``, a model over several devices): after
    the verdict one conditional copy per held tensor puts them into the frozen bytes only
    if the step is the first bad one: on CUDA a Triton kernel whose blocks return at once
    otherwise (no pass over the bytes), elsewhere ``torch.where``.
* **on demand** (``doctor.first_nonfinite``, ``_replay``): the frozen step is replayed
  under the op-level watch (``_op_watch``): the same inputs, autocast regions and random state
  (and with ``keep_weights`` the step's own weights), the forward, then the backward from
  the frozen output gradient; then everything is put back.

The host also notes every later bad step whose verdict it read, and keeps what the first
``_LATER`` of them hold (their tensors, no copy, as the pending queue held them): a later bad
step may be the first harmful one (``_verdict``); a step the device records (a capture, a
refilled buffer, ``keep_weights``) is known only when it is the first bad one.

Memory: the frozen inputs and output gradients (one step's), and with ``keep_weights``
one copy of the weights; a step's inputs and output gradient are held until its verdict
(up to about 34 steps later; at most 64), or, for a step the device copies, until the next
step begins (each of the step's checks may be the bad one).
"""

from __future__ import annotations

import array
import collections
import contextlib
import ctypes
import dataclasses
import time

import torch
from torch.utils._pytree import tree_flatten, tree_leaves, tree_unflatten

_U8 = torch.uint8
_INF = float("inf")


_CUDA = torch.cuda.is_available()


_IS_CAPTURING = getattr(torch._C, "_cuda_isCurrentStreamCapturing", None) if _CUDA else None


def capturing() -> bool:
    """Whether the current CUDA stream is capturing a graph (torch's own test, called
    without its Python wrapper: it runs every step)."""
    if _IS_CAPTURING is not None:
        return _IS_CAPTURING()
    return _CUDA and torch.cuda.is_current_stream_capturing()


@dataclasses.dataclass(eq=False)
class _Layout:
    """Where a step's tensor inputs sit in the frozen input bytes (one object per distinct
    layout: steps alike share it)."""

    spec: object  # the pytree spec of (args, kwargs)
    leaves: list  # the non-tensor leaves (tensor leaves are None)
    tensors: list  # (index into leaves, or -1 for the CPU generator's state; offset, shape, dtype)
    dst: list = None  # per tensor, its typed view of the frozen bytes
    size: int = 0  # bytes


_RECORD = []  # the Triton kernel, once built (CUDA)
_SLOTS = 4  # tensors one launch of the kernel copies


def _record_kernel():
    if not _RECORD:
        try:
            import triton
            import triton.language as tl

            @triton.jit
            def _copy_chunk(src, dst, n, CHUNK: tl.constexpr, BLOCK: tl.constexpr):
                base = tl.program_id(0).to(tl.int64) * CHUNK
                for i in range(0, CHUNK, BLOCK):
                    offs = base + i + tl.arange(0, BLOCK)
                    m = offs < n
                    tl.store(dst + offs, tl.load(src + offs, mask=m), mask=m)

            @triton.jit(do_not_specialize=["host_step", "n0", "n1", "n2", "n3"])
            def record(bad, step_ptr, bad_step, host_step, s0, d0, n0, s1, d1, n1, s2, d2, n2, s3, d3, n3,
                       USE_HOST: tl.constexpr, CHUNK: tl.constexpr, BLOCK: tl.constexpr):
                # every program decides alike whatever the order they run in: the step is new
                # when it is bad and no other step is recorded (bad_step < 0, or already this one)
                if USE_HOST:
                    step = host_step.to(tl.float64)
                else:
                    step = tl.load(step_ptr)
                cur = tl.load(bad_step)
                new = (tl.load(bad) != 0) & ((cur < 0) | (cur == step))
                first = (tl.program_id(0) == 0) & (tl.program_id(1) == 0)
                if first:
                    if USE_HOST:
                        tl.store(step_ptr, step)
                    if new:
                        tl.store(bad_step, step)
                if new:
                    slot = tl.program_id(1)
                    if slot == 0:
                        _copy_chunk(s0, d0, n0, CHUNK, BLOCK)
                    if slot == 1:
                        _copy_chunk(s1, d1, n1, CHUNK, BLOCK)
                    if slot == 2:
                        _copy_chunk(s2, d2, n2, CHUNK, BLOCK)
                    if slot == 3:
                        _copy_chunk(s3, d3, n3, CHUNK, BLOCK)

            _RECORD.append(record)
        except Exception:  # no Triton: torch ops, whose where reads and writes every byte
            _RECORD.append(None)
    return _RECORD[0]


_CHUNK = 1 << 16
_BIG = 32 << 20  # bytes: a held tensor this large is copied by the Triton kernel
_BATCH = 32  # steps whose flags go to the host in one copy (two launches)
_BATCH_BYTES = 256 << 20  # ... or fewer, once the steps not sent hold this much
_RING = 2048  # host slots for the flags on their way (pinned on CUDA)
_FLAGS = 8  # flags a step sends at most (more checks in a step are folded into its last)
_LATER = 32  # bad steps after the first whose held tensors are kept for a replay (no copy)
_PENDING = 64  # eager steps whose verdicts the host may wait for, holding their tensors


class StepWatch:
    """The per-step check and replay data of one device's parameters and buffers.

    Per step: ``begin`` holds the step's inputs; the output gradients are held as they
    arrive; ``record`` takes the check's verdict (a device flag). A step held as it is (new
    input tensors, nothing over 32 MiB, eager) queues with its flag until the host reads the
    verdict (``poll``; flags are sent in batches, ``_send``), and only the first bad one is
    copied into the frozen bytes then (``_freeze``). Any other step is copied by the device
    at once, only if it is the first bad one: inside a CUDA graph capture or for a tensor
    over 32 MiB (on CUDA with Triton) one kernel launch whose blocks return at once
    otherwise (no pass over the bytes); else a few torch ops (``where``)."""

    def __init__(self, dev, state, keep_weights=False):
        self.dev = dev
        self.state = state  # parameters and buffers on this device (contiguous)
        self.keep_weights = keep_weights
        n = sum(t.numel() * t.element_size() for t in state) if keep_weights else 0
        self.frozen = torch.zeros(n, dtype=_U8, device=dev)
        self.weights = [(t.detach(), v) for t, v in zip(state, _typed_views(self.frozen, state))] \
            if keep_weights else []
        self.io_frozen = torch.zeros(0, dtype=_U8, device=dev)  # the inputs (and CPU generator)
        self.g_frozen = torch.zeros(0, dtype=_U8, device=dev)  # the output gradients
        # the step count: in eager steps the host's, written by record(); a captured step
        # counts itself (the graph's replays run no Python)
        self.step = torch.full((), -1.0, dtype=torch.float64, device=dev)
        self.host_step = -1
        self._cpu = dev.type == "cpu"
        self.bad_step = torch.full((), -1.0, dtype=torch.float64, device=dev)
        self.layout = None  # this step's _Layout
        self.grad_layout = ()  # this step's output gradients: ((offset, shape, dtype), ...)
        self._grad_dst = ()
        self.pending = None  # outputs of a forward whose backward has not been checked
        self.held = []  # (tensor, frozen view) this step holds until its verdict
        self._key = None
        self.cap = False  # this step runs inside a CUDA graph capture
        # Verdicts read by the host (eager steps whose inputs are new tensors): each step's
        # check flag is held (no op); every _BATCH steps their stack is copied to pinned host
        # memory over a sentinel, asynchronously; a later step (or a reader) sees the verdicts
        # there once the device got that far. The step's tensors are held until then and
        # copied only if it is the first bad one.
        self._unsent = self._unsent_bytes = 0
        self.step_bytes = 0  # what this step holds (inputs, output gradients)
        self._ring = torch.full((_RING,), -1.0, dtype=torch.float32, pin_memory=not self._cpu)  # -1 free, -2 on its way
        # the ring's host memory as a Python buffer (a slot read and written in ns; without
        # numpy, which ampkit does not require): the tensor outlives it
        self._ring_mv = memoryview((ctypes.c_float * self._ring.numel()).from_address(self._ring.data_ptr())).cast("B").cast("f")
        # Flags are numbered in the order they are made; flag f sits in ring slot f % _RING.
        self._flags = []  # the flags not sent yet: numbers _sent .. _made - 1
        self._made = self._sent = 0
        self._pending = collections.deque()  # [host step, its first flag's number, its flag count, held]
        self._first = None  # the first bad step the host has seen the verdict of
        # the later bad steps the host saw the verdict of, and (for the first _LATER of them)
        # what they hold, as it is (no copy): a later bad step may be the first harmful one
        self.bad_steps: list = []
        self._device_records = False  # a step the device records came since the last bad verdict
        self.later: dict = {}  # step -> its held data, as _freeze takes it
        # a step's bytes placed by the host after its verdict (off: by the device at once,
        # as with keep_weights, whose weights change before a verdict arrives)
        self.host_verdicts = not keep_weights
        self._last_in = ()  # the last step's inputs, held so that a buffer reused is recognised
        self._last_ptrs = None  # their data pointers (None before the first step)
        self.host_mode = False  # this step is held as it is (see begin)
        self.args = self.ins = self.grads = self.rng = self.cfg = None  # such a step's inputs, gradients, state
        self.frozen_meta = None  # (step, _Layout, gradient slots, regions) of a step placed by the host
        self.stale = None  # a first bad step whose held inputs were changed in place before the copy
        self.host_steps = 0  # eager steps whose verdict the host read (the others: device records)
        self._counted = -1
        self._kernel = _record_kernel() if dev.type == "cuda" else None
        if self._kernel is not None:  # built now (both kinds), not inside a graph capture later
            no = torch.zeros((), dtype=torch.bool, device=dev)
            self._launch(no, [], use_host=True)
            self._launch(no, [], use_host=False)

    # -- every step ------------------------------------------------------------------
    def begin(self, args, kwargs, host_step, cap):
        """The step starts (``cap``: inside a CUDA graph capture): count it, hold its inputs
        (no copy). New input tensors (none is the last step's) are held as they are, their
        bytes placed only if the step turns out the first bad one (the host's verdict,
        ``poll``); a buffer refilled in place, a capture, or ``keep_weights`` holds them
        with their places in the frozen bytes, for the device's conditional copy."""
        if not cap and not kwargs and len(args) == 1 and self.begin_new(args[0], host_step):
            return  # model(x): the usual call
        self.host_step = host_step
        self.cap = cap
        if cap:
            self.step.add_(1)
        elif self._pending:
            self.poll()
        plain = not kwargs and all(type(a) is torch.Tensor for a in args)
        if plain and any(a.requires_grad for a in args):  # (held without the graph that made it)
            args = tuple(a.detach() for a in args)
        ins = args if plain else [a for a in tree_leaves((args, kwargs)) if isinstance(a, torch.Tensor)]
        ptrs = {a.data_ptr() for a in ins}
        sizes = [a.nbytes for a in ins]
        last = self._last_ptrs
        host = self.host_verdicts and not cap and all(n <= _BIG for n in sizes) and last is not None \
            and not (last & ptrs)
        self._hold(args, kwargs, ins, ptrs, sum(sizes), host)

    def begin_new(self, a, host_step):
        """``begin`` for the usual step, ``model(x)`` eager (not inside a capture: the
        caller knows) with ``x`` a new tensor (not the last step's buffer) of at most _BIG
        bytes: held as it is until the host reads the verdict. Returns False, having changed
        nothing, for any other step (``begin``'s general path takes it)."""
        last = self._last_ptrs
        if type(a) is not torch.Tensor or last is None or not self.host_verdicts:
            return False
        ptr = a.data_ptr()
        nbytes = a.nbytes
        if ptr in last or nbytes > _BIG:
            return False
        p = self._pending
        if p and p[0][1] < self._sent:  # the oldest step's flag was sent: its verdict may be back
            self.poll()
        if a.requires_grad:  # (held without the graph that made it)
            a = a.detach()
        self.host_step = host_step
        self.cap = False
        self._last_in = self.ins = (a,)
        self._last_ptrs = {ptr}
        self.host_mode = True
        if self.held:  # (the last step's, if the device placed it)
            self.held = []
        self.step_bytes = nbytes
        self.args = ((a,), {})
        self.grads = []
        self.rng = torch.get_rng_state() if self._cpu else None
        return True

    def _hold(self, args, kwargs, ins, ptrs, nbytes, host):
        """Hold this step's inputs ``ins`` (data pointers ``ptrs``): as they are until the
        host reads the verdict (``host``), else with their places in the frozen bytes."""
        self._last_in = ins  # (held: a pointer seen again is the same buffer, not new memory)
        self._last_ptrs = ptrs
        self.host_mode = host
        if host:
            self.held = []  # (the last step's, if the device placed it)
            self.step_bytes = nbytes
            self.args = (args, kwargs)
            self.ins = ins
            self.grads = []
            self.rng = torch.get_rng_state() if self._cpu else None
            return
        self.args = None
        self._place_inputs(args, kwargs)

    def _place_inputs(self, args, kwargs, rng=None):
        """Hold the inputs with their places in the frozen bytes (the device's copy)."""
        if not kwargs and self.dev.type != "cpu":
            key = tuple((a.dtype, a.shape, a.device, a.is_contiguous()) if type(a) is torch.Tensor else None
                        for a in args)
            if key == self._key:  # the usual call: the layout of the last step
                self.held = [(a, v) for a, v in zip(args, self.layout.dst)]
                return
            self._key = key if None not in key and all(k[2] == self.dev for k in key) else None
        if rng is None and self._cpu:
            rng = torch.get_rng_state()
        lay, ins = self._plan(args, kwargs, rng)
        grown = _grown(self.io_frozen, lay.size)
        if grown is not self.io_frozen or not same_layout(lay, self.layout):
            self.io_frozen = grown
            lay.dst = [_typed_view(grown, o, shape, dtype) for _, o, shape, dtype in lay.tensors]
            self.layout = lay
        self.held = list(zip(ins, self.layout.dst))

    def _plan(self, args, kwargs, rng):
        """Where the tensor inputs on this device (and the CPU generator's bytes ``rng``) sit
        in the frozen input bytes: (the _Layout, the tensors in its order)."""
        flat, spec = tree_flatten((args, kwargs))
        leaves, tensors, off, ins = [], [], 0, []
        for i, a in enumerate(flat):
            if isinstance(a, torch.Tensor) and a.device == self.dev:
                a = a.detach()
                tensors.append((i, off, a.shape, a.dtype))
                ins.append(a if a.is_contiguous() else a.contiguous())
                off += a.numel() * a.element_size()
                leaves.append(None)
            else:  # (a tensor on another device is not kept: the replay runs without it)
                leaves.append(None if isinstance(a, torch.Tensor) else a)
        if rng is not None:
            ins.append(rng)
            tensors.append((-1, off, rng.shape, rng.dtype))
            off += rng.numel()
        return _Layout(spec, leaves, tensors, size=off), ins

    def hold_output_grads(self, outs):
        """The forward ended: where each output's gradient will go in the frozen bytes (None
        for a step held as it is: its gradients are placed only if it is the first bad one)."""
        if self.host_mode:
            sizes = [t.nbytes for t in outs]
            if not any(n > _BIG for n in sizes):
                self.step_bytes += sum(sizes)
                return None
            # a gradient this large is not held for steps: the device copies this step
            self.host_mode = False
            self._place_inputs(*self.args, rng=self.rng)
            self.args = None
        slots, off = _grad_slots(outs)
        grown = _grown(self.g_frozen, off)
        if slots != self.grad_layout or grown is not self.g_frozen:
            self.g_frozen = grown
            self.grad_layout = slots
            self._grad_dst = tuple(_typed_view(grown, o, shape, dtype) for o, shape, dtype in slots)
        return self._grad_dst

    def keep_grad(self, dst, grad):
        if self.host_mode:
            self.grads.append(grad)
        elif grad.dtype == dst.dtype and grad.shape == dst.shape:
            self.held.append((grad if grad.is_contiguous() else grad.contiguous(), dst))

    def check(self, tensors):
        """After the step's backward (or for a forward without one): record the step if any
        of ``tensors`` holds a non-finite value. A few kernels, no host read."""
        ts = [t.detach() for t in tensors if t is not None and t.is_floating_point() and t.numel()]
        if ts:
            norms = torch._foreach_norm(ts, _INF)
            bad = (torch.stack([n.float() for n in norms]) if len(norms) > 1 else norms[0].float()).amax()
            bad = bad.isfinite().logical_not_().float()
        else:
            bad = torch.zeros((), device=self.dev)
        self.record(bad)

    def record(self, bad):
        """Record this step as the first bad one if ``bad`` (a device flag: a bool, or the
        scaler's float 1.0/0.0) is set and no other step is recorded. A step held as it is:
        the flag goes to the host ring and the step waits there for its verdict (``poll``);
        otherwise the device copies what the step holds into the frozen bytes only if it is
        the first bad one (what such a step holds is let go of when the next step begins:
        each check of the step may be the bad one). Idempotent within a step."""
        if not self.host_mode:
            self._device_records = True
            # what the step holds stays held until the next step begins: a second check in
            # this step (a second optimizer's) may be the bad one and copies it then
            with torch.no_grad():  # (a held input may require grad; where's out= refuses those)
                self._record(bad, self.held + self.weights)
            return
        if bad.dtype != torch.float32:
            bad = bad.float()
        p = self._pending
        if p and p[-1][0] == self.host_step:  # a second check in this step: one more flag
            e = p[-1]
            if e[2] >= _FLAGS and e[1] + e[2] > self._sent:  # (many checks: folded on the device)
                self._flags[-1] = torch.maximum(self._flags[-1], bad)
            else:
                self._flags.append(bad)
                e[2] += 1
                self._made += 1
        else:
            if len(p) >= _PENDING:
                self._wait_oldest()
            vers = [t._version for t in self.ins] + [g._version for g in self.grads]
            p.append([self.host_step, self._made, 1, (self.args, self.ins, self.grads, self.rng, self.cfg, vers)])
            self._flags.append(bad)  # (after the wait: a send makes a new list)
            self._made += 1
            if self._counted != self.host_step:
                self._counted = self.host_step
                self.host_steps += 1
        self._unsent += 1
        self._unsent_bytes += self.step_bytes
        if self._unsent >= _BATCH or self._unsent_bytes > _BATCH_BYTES:
            self._send()

    def _send(self):
        """Send the flags made so far to the host in one asynchronous copy (of their stack,
        into their ring slots, over the sentinel -2): two launches for _BATCH steps, no
        allocation of host memory. Not while a CUDA graph is being captured (the copy would
        be recorded into the graph, not run): the flags wait for the next send then."""
        if not self._cpu and capturing():
            return
        self._unsent = self._unsent_bytes = 0
        flags = self._flags
        n = len(flags)
        if not n:
            return
        if n > _RING:
            raise RuntimeError(f"ampkit.doctor: {n} flags wait to be sent, more than the ring's {_RING}")
        first = self._sent
        runs = [(first % _RING, 0, min(n, _RING - first % _RING))]  # (slot, flag, count): one run, or two
        if runs[0][2] < n:
            runs.append((0, runs[0][2], n - runs[0][2]))
        mv = self._ring_mv
        if not all(_all_free(mv, i, k) for i, _, k in runs):  # (never with _PENDING x _FLAGS < _RING / 2)
            if self.dev.type == "cuda":
                torch.cuda.synchronize(self.dev)
            self.poll()
            if not all(_all_free(mv, i, k) for i, _, k in runs):
                raise RuntimeError("ampkit.doctor: the verdict ring is full (a bug: please report it)")
        self._flags = []
        self._sent = first + n
        src = torch.stack(flags) if n > 1 else flags[0].reshape(1)
        for i, j, k in runs:
            mv[i: i + k] = array.array("f", (-2.0,)) * k
            self._ring[i: i + k].copy_(src[j: j + k] if len(runs) > 1 else src, non_blocking=True)

    def _wait_oldest(self):
        """The host is _PENDING steps ahead of the device: wait for the oldest verdict (the
        device is the bottleneck then; the wait is a read of host memory, no CUDA call)."""
        _, first, k, _ = self._pending[0]
        if first + k > self._sent:
            self._send()
        mv = self._ring_mv
        while any(mv[(first + j) % _RING] == -2.0 for j in range(k)):
            time.sleep(20e-6)
        self.poll()

    def poll(self, wait=False):
        """Read the verdicts that have arrived, oldest first; place the first bad step's
        held tensors in the frozen bytes (once) and let go of the rest. ``wait``: send the
        flags not sent yet and wait for all (a reader's one sync)."""
        p = self._pending
        if wait and p:
            self._send()
            if self.dev.type == "cuda":
                torch.cuda.synchronize(self.dev)
        mv = self._ring_mv
        while p:
            step, first, k, data = p[0]
            if first + k > self._sent:
                return
            slots = [(first + j) % _RING for j in range(k)] if k > 1 else (first % _RING,)
            vals = [mv[i] for i in slots]
            if -2.0 in vals:
                return
            p.popleft()
            for i in slots:
                mv[i] = -1.0
            if max(vals) > 0:
                self.bad_steps.append(step)
                if self._first is None and self._device_records:
                    # a step the device recorded may come first: read its record (one host
                    # read, at a bad verdict only) rather than overwrite it
                    self._device_records = False
                    s = int(self.bad_step.item())
                    self._first = s if 0 <= s < step else None  # (a later one: this step's bytes go first)
                if self._first is None:
                    self._first = step
                    self._freeze(step, *data)
                elif len(self.later) < _LATER:
                    self.later[step] = data

    def _freeze(self, step, args, ins, grads, rng, cfg, vers):
        """Place step ``step``'s inputs (and CPU generator bytes) and output gradients in the
        frozen bytes: it is the first bad step (the device recorded none before it)."""
        if any(t._version != v for t, v in zip(list(ins) + grads, vers)):
            self.stale = step
        lay, src = self._plan(*args, rng)
        gslots, goff = _grad_slots(grads)
        self.io_frozen = _grown(self.io_frozen, lay.size)
        self.g_frozen = _grown(self.g_frozen, goff)
        self._key = self.layout = None  # (the device path places its next step afresh)
        self.grad_layout, self._grad_dst = (), ()
        cur = torch.cuda.current_stream(self.dev) if self.dev.type == "cuda" else None
        pairs = [(t, _typed_view(self.io_frozen, o, shape, dtype)) for t, (_, o, shape, dtype) in zip(src, lay.tensors)]
        pairs += [(g.detach(), _typed_view(self.g_frozen, o, shape, dtype)) for g, (o, shape, dtype) in zip(grads, gslots)]
        with torch.no_grad():
            for t, dst in pairs:
                dst.copy_(t)
                if cur is not None:  # t may be another stream's memory: not reused before the copy
                    t.record_stream(cur)
            self.bad_step.fill_(float(step))
        self.frozen_meta = (step, lay, gslots, cfg)

    def _record(self, bad, held):
        if self._kernel is not None and (self.cap or any(s.numel() * s.element_size() > _BIG for s, _ in held)):
            self._launch(bad, held)  # one launch (one node of a graph), no pass over the held bytes
            return
        # eager, small tensors: torch ops (a Triton launch costs more host time than a few)
        step = self.step if self.cap else self.step.fill_(float(self.host_step))
        new = torch.logical_and(bad, self.bad_step < 0)  # (a second record in a step: no-op)
        torch.where(new, step, self.bad_step, out=self.bad_step)
        for src, dst in held:
            torch.where(new, src, dst, out=dst)

    def _launch(self, bad, held, use_host=None):
        if use_host is None:
            use_host = not self.cap
        for i in range(0, max(len(held), 1), _SLOTS):
            part = held[i: i + _SLOTS]
            args = []
            chunks = 1
            for src, dst in part:
                args += [src, dst, src.numel()]
                chunks = max(chunks, -(-src.numel() // _CHUNK))
            args += [self.bad_step, self.bad_step, 0] * (_SLOTS - len(part))
            self._kernel[(chunks, _SLOTS)](bad, self.step, self.bad_step, self.host_step, *args,
                                           USE_HOST=use_host, CHUNK=_CHUNK, BLOCK=4096)

    def check_pending(self, cap):
        """A forward whose outputs got no backward: check them now (if they are alive)."""
        self.cap = cap
        p, self.pending = self.pending, None
        if p is not None:
            outs = [r() for r in p]
            if all(o is not None for o in outs):
                self.check(outs)

    def reset(self):
        self.poll(wait=True)
        self.bad_step.fill_(-1.0)
        self._first = None
        self.bad_steps, self.later = [], {}
        self._device_records = False
        self.stale = self.frozen_meta = None

    def release(self):
        """Let go of everything a step holds (the doctor is closed): read the verdicts still
        waited for first (one wait for the device)."""
        self.poll(wait=True)
        self._last_in, self._last_ptrs = (), None
        self.args = self.ins = self.grads = self.rng = None
        self.held, self.pending = [], None

    def sync_step(self):
        """Before a CUDA graph capture: the device's step count catches up with the host's
        (eager steps whose verdict the host reads do not write it)."""
        self.step.fill_(float(self.host_step))

    # -- reading -------------------------------------------------------------------
    def bad(self):
        """The first bad step's index, or None (one host read)."""
        self.poll(wait=True)
        s = int(self.bad_step.item())
        return None if s < 0 else s

    def known_bad_steps(self):
        """Every bad step whose verdict the host read (the usual eager loop), with the first
        one the device recorded; sorted. One host read."""
        first = self.bad()
        return sorted(set(self.bad_steps) | ({first} if first is not None else set()))

    @contextlib.contextmanager
    def later_frozen(self, step):
        """Place later bad step ``step``'s held tensors in frozen bytes of their own for a
        replay, and put the first bad step's frozen bytes and record back afterwards."""
        saved = (self.io_frozen, self.g_frozen, self.frozen_meta, self.stale, self._key, self.layout,
                 self.grad_layout, self._grad_dst, self.bad_step.clone())
        self.io_frozen = torch.zeros(0, dtype=_U8, device=self.dev)
        self.g_frozen = torch.zeros(0, dtype=_U8, device=self.dev)
        try:
            self._freeze(step, *self.later[step])
            yield
        finally:
            (self.io_frozen, self.g_frozen, self.frozen_meta, self.stale, self._key, self.layout,
             self.grad_layout, self._grad_dst, bad_step) = saved
            self.bad_step.copy_(bad_step)

    def frozen_state(self):
        """The frozen parameters and buffers, as tensors shaped like ``state``."""
        return [v for _, v in self.weights]

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


def _all_free(mv, i, k):
    """Whether ring slots i .. i + k - 1 are free (-1)."""
    return all(v == -1.0 for v in mv[i: i + k].tolist())


def _grad_slots(outs):
    """Where each output gradient sits in the frozen gradient bytes: (slots, size)."""
    slots, off = [], 0
    for t in outs:
        slots.append((off, t.shape, t.dtype))
        off += t.numel() * t.element_size()
    return tuple(slots), off


def _typed_view(buf, off, shape, dtype):
    n = shape.numel() * torch.empty((), dtype=dtype).element_size()
    return buf[off: off + n].view(dtype).view(shape)


def _typed_views(buf, ts):
    out, off = [], 0
    for t in ts:
        out.append(_typed_view(buf, off, t.shape, t.dtype))
        off += t.numel() * t.element_size()
    return out


def _typed(buf, off, shape, dtype):
    return _typed_view(buf, off, shape, dtype).clone()


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


def state_of(model, keep_weights=False):
    """The model's parameters and buffers, each once, grouped by device (with
    ``keep_weights`` each must be contiguous: their bytes are kept)."""
    seen, by_dev = set(), {}
    for t in list(model.parameters()) + list(model.buffers()):
        if id(t) in seen:
            continue
        seen.add(id(t))
        if keep_weights and not t.is_contiguous():
            raise ValueError(
                "ampkit.doctor: keep_weights=True, and the model has a non-contiguous parameter or "
                f"buffer (shape {tuple(t.shape)}, strides {t.stride()}), whose bytes the doctor would "
                "keep for its replay. Make it contiguous (`p.data = p.data.contiguous()`) before "
                "arming, or arm without keep_weights")
        by_dev.setdefault(t.device, []).append(t)
    return by_dev
