"""The replay of the first bad step: its forward and backward run again under the op-level watch.

A step's regions (``region_config``: ampkit's autocast regions, and torch's where no ampkit
region is) are noted every step; its inputs, output gradient and random state are frozen by
the step watch (``_step_watch``). ``first_nonfinite()`` replays the first bad step once::

    put the frozen inputs (and, with keep_weights, the step's weights) in place
    with the step's random state, its regions, grad enabled, replaying(k) == k:
        out = model(*args, **kwargs)                      # the op-level watch on
        finding = the first non-finite op, else:
            a non-finite output gradient -> "<output gradient>" (made outside the model)
            else backward(out, frozen output gradients)  -> the first non-finite op
    put back the parameters, buffers, gradients, random state and the watch's step state
"""

from __future__ import annotations

import array
import contextlib
import dataclasses
import warnings

import torch
from torch.utils._pytree import tree_leaves

from ampkit._autocast import autocast
from ampkit._engine import thread_engine
from ampkit._doctor._finding import OUTSIDE, Finding
from ampkit._doctor._op_watch import absmax
from ampkit._doctor._replaying import set_replaying

_NO_REGIONS: dict = {}


def region_config(types):
    """The autocast regions in force, to enter again in a replay: ampkit's (all), and
    torch's own for the device types ``types`` (the model's: another type's region casts
    none of its ops) where no ampkit region is."""
    devs = thread_engine().devs()  # {device_type: (enabled, dtype, policy, cache)}: one object per region, never changed
    plain = _NO_REGIONS
    for dt in types:
        if dt not in devs and torch.is_autocast_enabled(dt):
            if plain is _NO_REGIONS:
                plain = {}
            plain[dt] = torch.get_autocast_dtype(dt)
    return devs, plain


@contextlib.contextmanager
def enter_region(config):
    """Enter the regions ``region_config()`` described."""
    devs, plain = config
    with contextlib.ExitStack() as stack:
        for dt, (enabled, dtype, policy, cache) in devs.items():
            stack.enter_context(autocast(dt, dtype=dtype, enabled=enabled, cache_enabled=cache, policy=policy))
        for dt, dtype in plain.items():
            stack.enter_context(torch.autocast(dt, dtype=dtype))
        yield


def cuda_generator(dev):
    """The CUDA generator of ``dev`` (its default one), whose state a replay needs."""
    return torch.cuda.default_generators[dev.index if dev.index is not None else torch.cuda.current_device()]


@contextlib.contextmanager
def replay_rng(state):
    """Run with the random state ``state`` (("cuda", generator, seed, offset), or ("cpu",
    the CPU generator's bytes)); put the current one back."""
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
    old = torch.get_rng_state()
    torch.set_rng_state(state[1])
    try:
        yield
    finally:
        torch.set_rng_state(old)


def leaves_requiring_grad(out):
    return [t for t in tree_leaves(out) if isinstance(t, torch.Tensor) and t.requires_grad
            and t.is_floating_point()]


class Replay:
    """The doctor's replay (a base of ``ampkit.doctor``): what it notes each step for a
    replay, and the replay itself."""

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
            set_replaying(k)
            self._ops_on()
            try:
                with replay_rng(rng), enter_region(cfg), torch.enable_grad():
                    out = self.model(*args, **kwargs)
                f = self._replay_finding()
                if f is None and grads:
                    bad = [g for g in grads if not bool(torch.isfinite(g).all())]
                    if bad:  # the gradient arrived non-finite: made outside the model (the loss)
                        g = bad[0]
                        f = Finding("<output gradient>", OUTSIDE, "backward", str(g.dtype).replace("torch.", ""),
                                    k, nan, float(absmax(g)))
                    else:
                        outs = leaves_requiring_grad(out)
                        if len(outs) == len(grads):
                            torch.autograd.backward(outs, grads)
                        f = self._replay_finding()
            finally:
                set_replaying(None)
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
