"""The scale's state on the device, its update rule, and the host's counting beside it.

``GradScaler`` keeps on the device: the scale (float32), the growth tracker and the run of
consecutive overflows (int32), the stats counters (int64: steps, skipped, the gap since the
last skip, the history slot) and a ring of the last ``HISTORY_SIZE`` scales. An update::

    if the host knows the inf flag and has counted every update so far (the plain path):
        count in Python; run torch's kernel only where the scale changes (a backoff, a growth),
        writing the ring's unwritten entries (all equal to the old scale) first
    else (a fused optimizer's flag, known only on the device; from then on, always):
        torch._amp_update_scale_ (+ hysteresis: an absorbed overflow keeps the old scale)
        clamp; ring[slot] = scale; counters = (counters + delta) % modulus, picked by the flag

Nothing here syncs with the device, except ``_host_state`` (one copy of every field) and a
``new_scale`` tensor's validation. ``ScaleUpdate`` is a base of ``GradScaler``: its methods
read and write the scaler's own fields.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import torch

from ._scaler_checks import COUNT_LIMIT, F32_MAX, HISTORY_SIZE, real_in


@dataclasses.dataclass(eq=False)
class HostCounts:
    """What update() counts in Python while the host knows every inf flag (see GradScaler).

    ``tracker`` is the growth tracker (the device's copy lags), so the host knows which
    update changes the scale; the history entries of the updates from ``unwritten`` on all equal the
    current scale and are written to the device ring only when it changes or is read."""

    steps: int
    skipped: int
    last: int  # -1: none
    run: int  # consecutive overflows (read where hysteresis > 1)
    tracker: int
    unwritten: int

    @classmethod
    def of(cls, counters: list[int], run: int, tracker: int) -> HostCounts:
        steps, skipped, last = counters
        return cls(steps, skipped, last, run, tracker, steps)

def to_device_counters(counters: list[int]) -> list[int]:
    """(steps, skipped, last_skipped) -> the device form (steps, skipped, gap, slot)."""
    steps, skipped, last = counters
    gap = steps - 1 - last if last >= 0 else steps
    return [steps, skipped, gap, steps % HISTORY_SIZE]

def from_device_counters(values: list[int]) -> list[int]:
    steps, skipped, gap, _ = values
    return [steps, skipped, steps - 1 - gap if skipped else -1]

def capturing(device: torch.device) -> bool:
    return device.type == "cuda" and torch.cuda.is_current_stream_capturing()


class ScaleUpdate:
    """The scale's device state and update rule (a base of ``GradScaler``, see the module)."""

    def _lazy_init(self, device: torch.device) -> None:
        p = self._pending
        self._scale = torch.full((), p["scale"], dtype=torch.float32, device=device)
        self._growth_tracker = torch.full((), p["growth_tracker"], dtype=torch.int32, device=device)
        self._overflow_run = torch.full(
            (), self._hysteresis - p["hysteresis_left"], dtype=torch.int32, device=device
        )
        self._counters = torch.tensor(to_device_counters(p["counters"]), dtype=torch.int64, device=device)
        self._history = torch.tensor(p["history"], dtype=torch.float32, device=device)
        # Stats step on the device: counters = (counters + delta) % modulus, elementwise,
        # with (delta, modulus) picked by the inf flag: steps+1, skipped+flag, gap+1 (mod 1
        # -> 0 on a skip), slot+1 (mod HISTORY_SIZE). No sync.
        big = COUNT_LIMIT
        clean, skip = ([1, 0, 1, 1], [big, big, big, HISTORY_SIZE]), ([1, 1, 1, 1], [big, big, 1, HISTORY_SIZE])
        table = torch.tensor([clean, skip], dtype=torch.int64, device=device)
        # (delta if clean, delta if skipped, modulus if clean, modulus if skipped)
        self._stat_steps = (table[0, 0], table[1, 0], table[0, 1], table[1, 1])
        # Made once: a view costs an op per step (the slot counter, the scale as a
        # 1-element tensor); every write to these tensors is in place.
        self._views = (self._counters[3:], self._scale.view(1))
        self._host_counts = HostCounts.of(
            p["counters"], self._hysteresis - p["hysteresis_left"], p["growth_tracker"])
        self._device_behind = False

    def _set_scale(self, scale: torch.Tensor, new_scale) -> None:
        if isinstance(new_scale, torch.Tensor):
            if (
                new_scale.device.type != scale.device.type
                or new_scale.numel() != 1
                or new_scale.requires_grad
                or not new_scale.is_floating_point()
            ):
                raise ValueError(
                    f"update(new_scale=tensor) needs a one-element floating tensor on "
                    f"{scale.device.type} without requires_grad; got shape "
                    f"{tuple(new_scale.shape)}, dtype {new_scale.dtype}, device "
                    f"{new_scale.device}, requires_grad={new_scale.requires_grad}"
                )
            if not capturing(new_scale.device):  # the one read (a capture cannot read)
                value = float(new_scale.item())
                if not (math.isfinite(value) and 0.0 < value <= F32_MAX):
                    raise ValueError(
                        f"update(new_scale=tensor({value!r})) is invalid; the scale must be "
                        "finite and > 0 (within the clamps, if any, it is clamped)"
                    )
            if self._host_counts is not None:  # the updates since the last change keep the old scale
                self._write_history()
            scale.copy_(new_scale.reshape(()))
            if self._min_scale is not None or self._max_scale is not None:
                scale.clamp_(min=self._min_scale, max=self._max_scale)
            return
        lo = self._min_scale if self._min_scale is not None else 0.0
        hi = self._max_scale if self._max_scale is not None else F32_MAX
        value = real_in("new_scale", new_scale, lo, hi, self._min_scale is None, False)
        if self._host_counts is not None:
            self._write_history()
        scale.fill_(value)

    def _update_scale(self, found: torch.Tensor, host_found: bool | None) -> None:
        if host_found is not None and self._host_counts is not None:
            self._update_on_host(found, host_found)
            return
        if self._host_counts is not None:  # from now on the device counts
            self._catch_up_device()
            self._host_counts = None
        if host_found is None:
            self._device_counted = True
        scale, tracker = self._scale, self._growth_tracker
        args = (self._growth_factor, self._backoff_factor, self._growth_interval)
        found_b = None
        if self._hysteresis > 1:
            # An overflow is absorbed while fewer than hysteresis-1 overflows precede it in a
            # row. The kernel backs off as usual (tracker -> 0, as DeepSpeed restarts its growth
            # window); an absorbed step then gets its old scale back.
            found_b = found > 0
            run = self._overflow_run
            absorb = found_b & (run < self._hysteresis - 1)
            old = scale.clone()
            torch._amp_update_scale_(scale, tracker, found, *args)
            torch.where(absorb, old, scale, out=scale)
            run.add_(1).mul_(found_b)  # consecutive overflows; a clean step resets it to 0
        else:
            torch._amp_update_scale_(scale, tracker, found, *args)
        if self._min_scale is not None or self._max_scale is not None:
            scale.clamp_(min=self._min_scale, max=self._max_scale)
        # Stats, on the device: the scale into the ring buffer at `slot`, then the counters.
        slot, scale_row = self._views
        self._history.scatter_(0, slot, scale_row)
        clean, skip, clean_mod, skip_mod = self._stat_steps
        if host_found is None:
            if found_b is None:
                found_b = found > 0
            delta, modulus = torch.where(found_b, skip, clean), torch.where(found_b, skip_mod, clean_mod)
        else:  # the plain path already read the flag on the host
            delta, modulus = (skip, skip_mod) if host_found else (clean, clean_mod)
        self._counters.add_(delta).remainder_(modulus)

    def _update_on_host(self, found: torch.Tensor, host_found: bool) -> None:
        """_update_scale when the host knows the flag and the counters: torch's kernel where
        the scale changes (a backoff, a growth), nothing on the device otherwise (the host
        counts, the growth tracker included); the history is written before a change."""
        c = self._host_counts
        absorbed = host_found and c.run < self._hysteresis - 1
        grows = not host_found and c.tracker + 1 == self._growth_interval
        if grows or (host_found and not absorbed):  # the scale changes (or may: growth)
            self._write_history()
            c.unwritten = c.steps  # from this update on: the new scale
            if grows:  # the kernel decides by the tracker, which the device has not kept
                self._growth_tracker.fill_(c.tracker)
            torch._amp_update_scale_(self._scale, self._growth_tracker, found, self._growth_factor,
                                     self._backoff_factor, self._growth_interval)
            if self._min_scale is not None or self._max_scale is not None:
                self._scale.clamp_(min=self._min_scale, max=self._max_scale)
        if host_found:  # backed off or absorbed: the growth window restarts
            c.skipped = (c.skipped + 1) % COUNT_LIMIT
            c.last = c.steps
            c.tracker = 0
            if self._hysteresis > 1:  # (kept only where it is read)
                c.run += 1
        else:
            c.tracker = 0 if grows else c.tracker + 1
            if self._hysteresis > 1:
                c.run = 0
        c.steps = (c.steps + 1) % COUNT_LIMIT
        self._device_behind = True

    def _write_history(self) -> None:
        """Write the current scale into the ring for the updates the host has not written."""
        c = self._host_counts
        n = c.steps - c.unwritten
        if n <= 0:
            return
        history = self._history
        if n >= HISTORY_SIZE:
            history.copy_(self._scale)
        else:
            i = c.unwritten % HISTORY_SIZE
            history[i:i + n].copy_(self._scale)  # (broadcast: no host read)
            if i + n > HISTORY_SIZE:
                history[:i + n - HISTORY_SIZE].copy_(self._scale)
        c.unwritten = c.steps

    def _catch_up_device(self) -> None:
        """Write the host's counters, overflow run and history into the device tensors."""
        if not self._device_behind:
            return
        device = self._counters.device
        if capturing(device):
            raise RuntimeError(
                "update() inside a CUDA graph capture, but the scaler's counters were last "
                "kept on the host (its earlier steps used an optimizer that is not sync-free); "
                "run one eager iteration with the sync-free optimizer before capturing")
        c = self._host_counts
        self._write_history()
        self._counters.copy_(
            torch.tensor(to_device_counters([c.steps, c.skipped, c.last]), dtype=torch.int64).to(device))
        self._overflow_run.fill_(c.run)
        self._growth_tracker.fill_(c.tracker)
        self._device_behind = False

    def _host_state(self) -> dict[str, Any]:
        """Every device field as host values, with a single device-to-host copy."""
        if self._scale is None:
            p = self._pending
            return {
                "scale": float(p["scale"]),
                "growth_tracker": int(p["growth_tracker"]),
                "hysteresis_left": int(p["hysteresis_left"]),
                "counters": [int(c) for c in p["counters"]],
                "history": [float(h) for h in p["history"]],
            }
        c = self._host_counts
        if c is not None:
            self._write_history()
        # One int64 buffer: the counters (up to 2**62) stay exact, which float64 would not
        # keep past 2**53; the float fields travel as the bits of their float64 values.
        packed = torch.cat(
            (
                self._growth_tracker.long().reshape(1),
                self._overflow_run.long().reshape(1),
                self._counters,
                self._scale.double().reshape(1).view(torch.int64),
                self._history.double().view(torch.int64),
            )
        ).cpu()
        ints, floats = packed[:6].tolist(), packed[6:].view(torch.float64).tolist()
        run, counters = ints[1], from_device_counters(ints[2:6])
        tracker = ints[0]
        if c is not None:  # the device copies may lag
            counters, run, tracker = [c.steps, c.skipped, c.last], c.run, c.tracker
        return {
            "scale": floats[0],
            "growth_tracker": tracker,
            "hysteresis_left": max(self._hysteresis - run, 1),
            "counters": counters,
            "history": floats[1:],
        }
