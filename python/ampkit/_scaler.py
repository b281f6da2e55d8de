"""Dynamic loss scaling: ``GradScaler`` with torch's numerics, hysteresis, clamps and stats.

One class, one stage machine, one update rule. The update rule is torch's own ATen
kernel (``torch._amp_update_scale_``), so with ``hysteresis=1`` and no clamps the
scale, the growth tracker, the parameters and the optimizer state follow
``torch.amp.GradScaler`` bit for bit. Everything added on top (hysteresis, clamps,
statistics) adds no host-device sync: device-tensor arithmetic where the inf flag lives
only on the device (fused optimizers, CUDA graphs), Python integers where the plain path
has read the flag on the host already (then an update runs no more kernels than torch's).

This module holds the class and its stage machine; beside it, each on its own floor of
the import graph (none imports anything of ampkit above the scaler): ``_scaler_checks``
(limits, argument checks, misuse errors), ``_grad_check`` (the gradients grouped for the
check), ``_scale_update`` (the scale's device state and update rule, a base of the class),
``_scaler_state_dict`` (the state dict's keys and checks), ``_distributed`` (the inf flags
over ranks). The scaler knows no diagnostic: it notifies ``_listeners.gradients_checked``
after each gradient check, which costs one truth test when nothing subscribed.
"""

from __future__ import annotations

import dataclasses
import enum
import math
import warnings
from collections.abc import Mapping
from typing import Any

import torch

from ._distributed import InfFlagSync, local_shards, reduce_over
from ._grad_check import any_flag, collect_grads, finite_probes, grads_of, same_tensors
from ._listeners import gradients_checked
from ._scale_update import HostCounts, ScaleUpdate, to_device_counters
from ._scaler_checks import (F32_MAX, HISTORY_SIZE, INT32_MAX, ORDER, NoChecksError, NoGradsError, check_clamps,
                             check_optimizer, check_outputs, device_type_of, int_in, optional_scale, real_in)
from ._scaler_state_dict import ScaleHistory, parse_state_dict

__all__ = ["GradScaler", "OptState", "ScalerStats", "cuda_amp_grad_scaler", "HISTORY_SIZE"]

_is_grad_enabled, _set_grad_enabled = torch.is_grad_enabled, torch._C._set_grad_enabled


class OptState(enum.Enum):
    """Where one optimizer is in the current iteration."""

    READY = "ready"  # nothing done since the last update()
    UNSCALED = "unscaled"  # unscale_() ran: grads are unscaled and checked
    STEPPED = "stepped"  # step() ran (or was skipped); wait for update()


@dataclasses.dataclass
class _OptRecord:
    stage: OptState
    found_inf_per_device: dict[torch.device, torch.Tensor]
    host_found: bool | None = None  # known on the host (plain step synced), else None
    # UNSCALED: the gradient tensors that were unscaled. A step() that finds others (a new
    # backward after zero_grad, because the iteration that unscaled failed) refuses them.
    grads: tuple = ()


@dataclasses.dataclass(frozen=True)
class ScalerStats:
    """What ``GradScaler.stats()`` returns: host values read with a single sync.

    ``steps`` counts the ``update()`` calls that checked gradients (``update(new_scale=...)``
    is not counted); ``skipped`` those whose gradients held an inf/NaN (so the optimizer
    step was skipped); ``last_skipped`` is the 0-based index of the latest skipped one.
    ``history_steps[i]`` is the index of an ``update()`` and ``history_scales[i]`` the scale
    it left; only the last ``HISTORY_SIZE`` updates are kept.
    """

    steps: int
    skipped: int
    last_skipped: int | None
    scale: float
    growth_tracker: int
    hysteresis_left: int
    history_steps: tuple[int, ...]
    history_scales: tuple[float, ...]

    @property
    def taken(self) -> int:
        """Updates whose optimizer steps ran (``steps - skipped``)."""
        return self.steps - self.skipped


# --------------------------------------------------------------------------- validation


# --------------------------------------------------------------------------- the scaler


class GradScaler(ScaleUpdate):
    """Dynamic loss scaling with torch's numerics, plus hysteresis, clamps and stats.

    The state machine (one ``update()`` per iteration; ``found`` is "some gradient of
    some optimizer stepped this iteration held an inf or NaN")::

        scale, tracker, left = init_scale, 0, hysteresis
        every iteration:
            loss * scale -> backward              # scale(loss).backward()
            per optimizer: grads *= 1/scale; found |= any(!isfinite(grads))   # unscale_
                           if not found: optimizer.step()                     # step
            if found and left > 1:                # update(): hysteresis absorbs it
                left -= 1; tracker = 0            #   (the optimizer step was still skipped)
            elif found:                           # back off
                scale *= backoff_factor; tracker = 0
            else:
                left = hysteresis                 # a clean step refills the hysteresis
                tracker += 1
                if tracker == growth_interval:
                    tracker = 0
                    if isfinite(scale * growth_factor): scale *= growth_factor
            scale = clamp(scale, min_scale, max_scale)
            steps += 1; skipped += found; last_skipped = step if found; history.append(scale)

    With ``hysteresis=1`` and no clamps this is exactly ``torch.amp.GradScaler`` (the same
    ATen kernels run). Hysteresis follows DeepSpeed's ``DynamicLossScaler`` with
    ``delayed_shift=hysteresis`` and ``consecutive_hysteresis=True``: up to
    ``hysteresis - 1`` *consecutive* overflows keep the scale (their steps are still
    skipped); any clean step refills the budget. Once the budget is spent, every further
    consecutive overflow backs off, as in DeepSpeed. (DeepSpeed's default,
    ``consecutive_hysteresis=False``, refills only when the scale grows.)

    Each optimizer goes through the stages ``OptState.READY -> UNSCALED -> STEPPED`` between
    two ``update()`` calls; calls out of order raise ``RuntimeError`` naming the order.

    After a failed iteration (an exception anywhere between ``scale`` and ``update``), call
    ``reset_iteration()`` before the next one: every optimizer goes back to ``READY``; the
    scale, growth tracker, hysteresis and stats are kept (they change only in ``update()``,
    which changes nothing when it raises). Every method either completes or raises before
    changing anything, except ``step()`` when ``optimizer.step`` itself raises: the
    gradients were unscaled in place by then, so the optimizer stays ``UNSCALED`` (a retry
    of ``step()`` does not unscale twice). ``scale()`` does not reset the stages by itself:
    a second loss scaled after ``step(opt_a)``, for ``opt_b``, is a valid iteration (GAN
    training). Forgetting the reset is caught where it would corrupt the step: ``step()`` on
    an ``UNSCALED`` optimizer whose gradients are other tensors than the ones unscaled
    raises, naming ``reset_iteration()``, and so do a second ``unscale_()``/``step()``.
    (``torch.amp.GradScaler`` has no reset: its records persist until ``update()``, so
    after a failure its next ``unscale_()`` raises and its ``step()`` applies the new,
    still scaled gradients with the old inf flag; the way out there is a new scaler.)

    Host-device syncs: none in ``scale``, ``unscale_``, ``update`` (hysteresis, clamps and
    stats included) and in ``step`` for optimizers that take ``grad_scale``/``found_inf``
    themselves (fused SGD/Adam/AdamW/Adagrad: ``is_sync_free(optimizer)`` is True); for
    those, ``step`` only *reads* the gradients to check them, and the optimizer unscales
    them inside its kernel. ``step`` with any other optimizer reads ``found_inf`` on the
    host (one ``.item()`` per device) to decide whether to call ``optimizer.step()``.
    ``get_scale``, ``state_dict`` and ``stats`` sync once each.

    Args:
        device: device type of the scaler state, ``"cuda"`` (default) or ``"cpu"``.
            ``"cuda"`` without CUDA warns and disables the scaler, like torch.
        init_scale: initial scale, finite and > 0 (and within the clamps).
        growth_factor: finite, > 1. backoff_factor: in (0, 1).
        growth_interval: clean steps before growing, int >= 1.
        enabled: ``False`` makes every method a pass-through.
        hysteresis: int >= 1, consecutive overflows tolerated + 1 (see above).
        min_scale, max_scale: optional clamps of the scale, finite and > 0.
        process_group: the ranks whose inf flags are combined (one all-reduce of one
            float a device, no host sync). ``None`` (default) detects it: FSDP1's sharded
            gradients are reduced over the default group; DDP's (already all-reduced) and
            FSDP2's (DTensor: reduced over the mesh by the check) need nothing. See
            docs/distributed.md.

    Example (runs on CPU; a fused optimizer on CUDA makes it sync-free)::

        >>> import torch, ampkit
        >>> _ = torch.manual_seed(0)
        >>> model = torch.nn.Linear(4, 1)
        >>> opt = torch.optim.SGD(model.parameters(), lr=0.1)
        >>> scaler = ampkit.GradScaler("cpu", init_scale=2.0**16, growth_interval=2)
        >>> for x in [torch.randn(8, 4), torch.full((8, 4), float("inf")), torch.randn(8, 4)]:
        ...     opt.zero_grad()
        ...     with ampkit.autocast("cpu", dtype=torch.bfloat16):
        ...         loss = model(x).float().pow(2).mean()
        ...     scaler.scale(loss).backward()
        ...     scaler.step(opt)      # skipped when a gradient is inf/NaN
        ...     scaler.update()
        >>> scaler.get_scale()        # backed off once at the inf batch
        32768.0
        >>> s = scaler.stats(); (s.steps, s.skipped, s.last_skipped)
        (3, 1, 1)
    """

    def __init__(
        self,
        device: str = "cuda",
        init_scale: float = 2.0**16,
        growth_factor: float = 2.0,
        backoff_factor: float = 0.5,
        growth_interval: int = 2000,
        enabled: bool = True,
        *,
        hysteresis: int = 1,
        min_scale: float | None = None,
        max_scale: float | None = None,
        process_group: Any = None,
    ) -> None:
        device_type = device_type_of(device)
        if not isinstance(enabled, bool):
            raise TypeError(f"enabled must be True or False, got {enabled!r}")
        init_scale = real_in("init_scale", init_scale, 0.0, F32_MAX, True, False)
        growth_factor = real_in("growth_factor", growth_factor, 1.0, math.inf, True, True)
        backoff_factor = real_in("backoff_factor", backoff_factor, 0.0, 1.0, True, True)
        growth_interval = int_in("growth_interval", growth_interval, 1, INT32_MAX)
        hysteresis = int_in("hysteresis", hysteresis, 1, INT32_MAX)
        min_scale = optional_scale("min_scale", min_scale)
        max_scale = optional_scale("max_scale", max_scale)
        check_clamps(min_scale, max_scale)
        if (min_scale is not None and init_scale < min_scale) or (
            max_scale is not None and init_scale > max_scale
        ):
            raise ValueError(
                f"init_scale={init_scale!r} lies outside [min_scale, max_scale] = "
                f"[{min_scale}, {max_scale}]; choose an init_scale between the clamps"
            )
        if device_type == "cuda" and enabled and not torch.cuda.is_available():
            warnings.warn(
                "ampkit.GradScaler(device='cuda') is enabled but CUDA is not available; "
                "disabling it. Use GradScaler('cpu') for CPU training.",
                stacklevel=2,
            )
            enabled = False
        sync = InfFlagSync(process_group)  # validates the group

        self._device = device_type
        self._sync = sync
        self._enabled = enabled
        self._growth_factor = growth_factor
        self._backoff_factor = backoff_factor
        self._growth_interval = growth_interval
        self._hysteresis = hysteresis
        self._min_scale = min_scale
        self._max_scale = max_scale
        # Host values the device state is built from on the first scale() (lazily, on the
        # loss's device, like torch); load_state_dict() before that call edits them.
        self._pending: dict[str, Any] = {
            "scale": init_scale,
            "growth_tracker": 0,
            "hysteresis_left": hysteresis,
            "counters": [0, 0, -1],
            "history": [0.0] * HISTORY_SIZE,
        }
        self._scale: torch.Tensor | None = None  # float32, ()
        self._growth_tracker: torch.Tensor | None = None  # int32, ()
        self._overflow_run: torch.Tensor | None = None  # int32, (): consecutive overflows
        self._counters: torch.Tensor | None = None  # int64, (steps, skipped, gap, slot)
        self._history: torch.Tensor | None = None  # float32 ring buffer, (HISTORY_SIZE,)
        # The same counters (steps, skipped, last_skipped), the overflow run and a mirror of
        # the growth tracker, kept on the host while every update() since the start (or a
        # load) knew its inf flag on the host: the plain path, which read it in step().
        # Then update() counts in Python and runs torch's kernel only where the scale
        # changes; the history is written there (or where it is read); the device's
        # counters, overflow run and growth tracker lag (_device_behind) until a
        # device-side update needs them. None from the first
        # update() counted on the device (a fused optimizer's): a CUDA graph may replay that
        # one, unseen by the host, so the host never takes the counting back
        # (_device_counted).
        self._host_counts: HostCounts | None = None
        self._device_behind = False
        self._device_counted = False
        self._per_optimizer: dict[int, _OptRecord] = {}
        self._ones: dict[torch.device, torch.Tensor] = {}  # the fused path's dummy inv scale
        self._stat_steps: tuple | None = None  # device tables for the stats update
        self._views: tuple | None = None  # views of the device state the update writes

    # ------------------------------------------------------------------ small accessors

    def __repr__(self) -> str:
        return (
            f"GradScaler(device={self._device!r}, scale={self._pending['scale'] if self._scale is None else '<device>'}, "
            f"growth_factor={self._growth_factor}, backoff_factor={self._backoff_factor}, "
            f"growth_interval={self._growth_interval}, enabled={self._enabled}, "
            f"hysteresis={self._hysteresis}, min_scale={self._min_scale}, max_scale={self._max_scale})"
        )

    def is_enabled(self) -> bool:
        """Whether scaling is on (``False`` also when ``"cuda"`` was asked without CUDA)."""
        return self._enabled

    def get_scale(self) -> float:
        """The current scale as a float (1.0 when disabled). Syncs once."""
        if not self._enabled:
            return 1.0
        if self._scale is None:
            return float(self._pending["scale"])
        return float(self._scale.item())

    def get_growth_factor(self) -> float:
        return self._growth_factor

    def set_growth_factor(self, new_factor: float) -> None:
        self._growth_factor = real_in("growth_factor", new_factor, 1.0, math.inf, True, True)

    def get_backoff_factor(self) -> float:
        return self._backoff_factor

    def set_backoff_factor(self, new_factor: float) -> None:
        self._backoff_factor = real_in("backoff_factor", new_factor, 0.0, 1.0, True, True)

    def get_growth_interval(self) -> int:
        return self._growth_interval

    def set_growth_interval(self, new_interval: int) -> None:
        self._growth_interval = int_in("growth_interval", new_interval, 1, INT32_MAX)

    @property
    def scale_tensor(self) -> torch.Tensor | None:
        """The scale as the float32 0-dim tensor on the device that ``scale()`` multiplies by
        (None before the first ``scale()`` or ``unscale_()``); read it, never write it:
        ``update()`` may replace the tensor, and a captured train step checks by identity
        that no call created it during a capture."""
        return self._scale

    @property
    def device(self) -> str:
        """The device type the scaler was made for: ``"cuda"`` or ``"cpu"`` (read-only)."""
        return self._device

    @property
    def hysteresis(self) -> int:
        return self._hysteresis

    @property
    def min_scale(self) -> float | None:
        return self._min_scale

    @property
    def max_scale(self) -> float | None:
        return self._max_scale

    def stage(self, optimizer: torch.optim.Optimizer) -> OptState:
        """The stage of ``optimizer`` in the current iteration."""
        check_optimizer(optimizer, "stage")
        record = self._per_optimizer.get(id(optimizer))
        return OptState.READY if record is None else record.stage

    def is_sync_free(self, optimizer: torch.optim.Optimizer) -> bool:
        """Whether ``step(optimizer)`` and ``update()`` run without a host-device sync.

        True when the optimizer takes ``grad_scale`` and ``found_inf`` itself
        (``_step_supports_amp_scaling``: fused SGD, Adam, AdamW), so that its kernel skips
        the step on the device, and when the scaler is disabled (a pass-through). False for
        every other optimizer: the host reads the inf flag to decide whether to call
        ``optimizer.step()``. ``make_train_step`` captures a CUDA graph only when True.

        >>> import torch, ampkit
        >>> params = [torch.nn.Parameter(torch.zeros(2))]
        >>> scaler = ampkit.GradScaler("cpu")
        >>> scaler.is_sync_free(torch.optim.SGD(params, lr=0.1, fused=True))
        True
        >>> scaler.is_sync_free(torch.optim.SGD(params, lr=0.1))
        False
        """
        check_optimizer(optimizer, "is_sync_free")
        return not self._enabled or bool(getattr(optimizer, "_step_supports_amp_scaling", False))

    def _settings(self) -> tuple:
        """What every rank of a distributed run must agree on (checked at the first step)."""
        return (
            self._enabled, self._pending["scale"], self._growth_factor, self._backoff_factor,
            self._growth_interval, self._hysteresis, self._min_scale, self._max_scale,
        )

    def reset_iteration(self) -> None:
        """Forget this iteration's per-optimizer stages (all back to ``READY``).

        For an iteration abandoned half-way (an exception, an aborted CUDA-graph capture):
        the scale, the growth tracker, the hysteresis and the stats are untouched, and
        gradients already unscaled stay unscaled (zero them before the next iteration).
        No sync.

        >>> import torch, ampkit
        >>> w = torch.nn.Parameter(torch.ones(2))
        >>> opt = torch.optim.SGD([w], lr=0.1)
        >>> scaler = ampkit.GradScaler("cpu", init_scale=4.0)
        >>> scaler.scale(w.sum()).backward()
        >>> scaler.unscale_(opt)  # ... then the iteration fails before step()
        >>> scaler.reset_iteration()
        >>> opt.zero_grad()
        >>> scaler.scale(w.sum()).backward(); scaler.step(opt); scaler.update()
        >>> w.tolist()
        [0.8999999761581421, 0.8999999761581421]
        """
        self._per_optimizer = {}

    # ------------------------------------------------------------------ device state


    def _require_scale(self, method: str) -> torch.Tensor:
        if self._scale is None:
            raise RuntimeError(
                f"{method}() was called before any scale(); the order is {ORDER}. "
                "Call scaler.scale(loss).backward() first in each iteration."
            )
        return self._scale

    # ------------------------------------------------------------------ scale

    def scale(self, outputs):
        """Multiply a tensor, or nested lists/tuples of tensors, by the scale.

        Containers are rebuilt with the same types (named tuples included). Disabled:
        returns ``outputs`` unchanged. No sync.
        """
        if not self._enabled:
            return outputs
        first = check_outputs(outputs)
        if first is None:
            return outputs
        if self._scale is None:
            self._lazy_init(first.device)
        scale = self._scale
        if isinstance(outputs, torch.Tensor):
            if outputs.device == scale.device:
                return outputs * scale
            return outputs * scale.to(device=outputs.device, non_blocking=True)
        per_device: dict[torch.device, torch.Tensor] = {}

        def apply(v):
            if isinstance(v, torch.Tensor):
                s = per_device.get(v.device)
                if s is None:
                    s = per_device[v.device] = scale.to(device=v.device, non_blocking=True)
                return v * s
            items = [apply(x) for x in v]
            return type(v)(*items) if hasattr(v, "_fields") else type(v)(items)

        return apply(outputs)

    # ------------------------------------------------------------------ unscale_


    def found_inf(self, grouped: dict, unscale: bool) -> dict:
        """One float32 flag per device: 1.0 when some gradient holds an inf or NaN, else 0.0.

        ``unscale``: the gradients are also multiplied by 1/scale in place (torch's own
        kernel, as ``torch.amp.GradScaler`` does). Otherwise they are only read (the fused
        path, whose optimizer unscales inside its kernel): each gradient is reduced to
        scalars that are non-finite exactly when it holds an inf or NaN, and torch's kernel
        checks those scalars. No sync either way; capturable in a CUDA graph.

        ``grouped`` maps (device, dtype) to a list of gradients. This is the scaler's one
        gradient check: a subclass may override it to check differently or to inject
        infs (benchmarks and tests do), as long as it returns a flag per device.
        """
        if type(grouped) is not dict and not isinstance(grouped, Mapping):
            raise TypeError(
                f"found_inf() takes a dict {{(device, dtype): [gradients]}}, got "
                f"{type(grouped).__name__}; group the gradients by device and dtype first"
            )
        found_per_device: dict[torch.device, torch.Tensor] = {}
        # torch computes 1/scale as float(1/double(scale)): three ops. One float32 reciprocal
        # gives the same bits: double rounding through float64 is innocuous for a float32
        # quotient (53 >= 2*24 + 2 bits), and both CPU and CUDA divide correctly rounded
        # (tests check every float32 on CPU and on CUDA).
        inv_scale = torch.reciprocal(self._scale) if unscale else None
        mesh_groups: list = []
        # torch.no_grad() without its context-manager objects (a few us a step)
        grad_mode = _is_grad_enabled()
        if grad_mode:
            _set_grad_enabled(False)
        try:
            for (device, _), grads in grouped.items():
                found = found_per_device.get(device)
                if found is None:
                    found = found_per_device[device] = torch.zeros((), device=device)
                if inv_scale is None:
                    # DTensor gradients (FSDP2) are read on their local shards, where an
                    # empty shard is dropped (its inf-norm would raise on this rank alone),
                    # and the flag is reduced over their meshes below, on every rank.
                    grads, groups = local_shards(grads)
                    mesh_groups += [g for g in groups if not any(g is h for h in mesh_groups)]
                    grads, inv = finite_probes(grads), self._one(device)
                else:  # torch's check on DTensors reduces the flag over the mesh itself
                    inv = inv_scale if inv_scale.device == device else inv_scale.to(device)
                if grads:
                    torch._amp_foreach_non_finite_check_and_unscale_(grads, found, inv)
        finally:
            if grad_mode:
                _set_grad_enabled(True)
        if mesh_groups:
            reduce_over(list(found_per_device.values()), mesh_groups)
        return found_per_device

    def _one(self, device: torch.device) -> torch.Tensor:
        one = self._ones.get(device)
        if one is None:
            one = self._ones[device] = torch.ones((), device=device)
        return one

    def _check_ready_for_unscale(self, optimizer) -> None:
        stage = self.stage(optimizer)
        if stage is OptState.UNSCALED:
            raise RuntimeError(
                "unscale_() was already called for this optimizer since the last update(); "
                f"call it at most once per optimizer per iteration ({ORDER}), after all "
                "backward passes of the iteration. If the iteration that called it failed, "
                "call scaler.reset_iteration() before starting a new one."
            )
        if stage is OptState.STEPPED:
            raise RuntimeError(
                "unscale_() was called after step() for this optimizer; the order is "
                f"{ORDER}. Move unscale_() before step(), or call update() to start a new "
                "iteration."
            )

    def unscale_(self, optimizer: torch.optim.Optimizer) -> None:
        """Divide the optimizer's gradients by the scale in place and check them for inf/NaN.

        Optional: call it to clip or inspect gradients before ``step``. At most once per
        optimizer per iteration. No sync.
        """
        if not self._enabled:
            return
        check_optimizer(optimizer, "unscale_")
        scale = self._require_scale("unscale_")
        self._check_ready_for_unscale(optimizer)
        grouped, grads = collect_grads(optimizer, allow_fp16=False)
        found = self.found_inf(grouped, unscale=True)
        combine = self._sync.needed(optimizer)
        if gradients_checked.listeners:  # (an armed doctor takes the flags as its step's check)
            gradients_checked.notify(found, optimizer, combine)
        if combine:
            self._sync.combine(found, scale.device)
        self._per_optimizer[id(optimizer)] = _OptRecord(OptState.UNSCALED, found, grads=grads)

    # ------------------------------------------------------------------ step

    def step(self, optimizer: torch.optim.Optimizer, *args: Any, **kwargs: Any):
        """Unscale (unless ``unscale_`` ran) and step, skipping the step on inf/NaN gradients.

        ``args``/``kwargs`` go to ``optimizer.step``; its return value is returned (``None``
        when skipped). Sync-free optimizers (``is_sync_free``: fused SGD/Adam/AdamW) get
        ``grad_scale`` and ``found_inf`` tensors, unscale and skip on the device; the check
        before them reads the gradients without writing them. Other optimizers: gradients
        unscaled in place, then one host read of the inf flag.
        """
        if not self._sync.checked:  # once, at the first step (no per-step cost after it)
            self._sync.check_settings(self._settings(), self._device)
        if not self._enabled:
            return optimizer.step(*args, **kwargs)
        if "closure" in kwargs:
            raise RuntimeError(
                "step(optimizer, closure=...) is not supported while scaling is enabled: the "
                "closure would recompute gradients after they were checked. Run the forward "
                "and scaler.scale(loss).backward() yourself, then call scaler.step(optimizer)."
            )
        check_optimizer(optimizer, "step")
        scale = self._require_scale("step")
        record = self._per_optimizer.get(id(optimizer))
        stage = OptState.READY if record is None else record.stage
        if stage is OptState.STEPPED:
            raise RuntimeError(
                "step() was already called for this optimizer since the last update(); the "
                f"order is {ORDER}. Call scaler.update() once per iteration after stepping "
                "every optimizer, before the next step() (or scaler.reset_iteration() if "
                "the iteration failed and must not count)."
            )
        fused = bool(getattr(optimizer, "_step_supports_amp_scaling", False))  # is_sync_free
        if stage is OptState.READY:
            grouped, grads = collect_grads(optimizer, allow_fp16=fused)
            combine = self._sync.needed(optimizer)
            if not grouped and not combine:  # combined, this rank's share may be nothing
                raise NoGradsError()
            # Fused: only read the gradients; the optimizer unscales them in its kernel.
            found = self.found_inf(grouped, unscale=not fused)
            if gradients_checked.listeners:  # (this rank's flags, before they are combined)
                gradients_checked.notify(found, optimizer, combine)
            if combine:
                self._sync.combine(found, scale.device)
            if not fused:  # as unscale_() records it: a failing step() won't unscale twice
                record = self._per_optimizer[id(optimizer)] = _OptRecord(
                    OptState.UNSCALED, found, grads=grads)
        else:
            found = record.found_inf_per_device
            if not found:
                raise NoGradsError()
            if not same_tensors(record.grads, grads_of(optimizer)):
                raise RuntimeError(
                    "step(): this optimizer's gradients are not the ones unscale_() unscaled "
                    "(a new backward after zero_grad(): the iteration that unscaled them "
                    "failed before step()); stepping would apply still-scaled gradients with "
                    "a stale inf check. Call scaler.reset_iteration() when an iteration "
                    "fails, then run the new one from scale(loss).backward()."
                )
        if fused:
            return self._fused_step(optimizer, stage, scale, found, args, kwargs)
        # The one sync of the plain path: the host must know whether to call step().
        if len(found) == 1:
            found_any = bool(next(iter(found.values())).item())
        else:
            found_any = bool(sum(v.item() for v in found.values()))
        retval = None if found_any else optimizer.step(*args, **kwargs)
        # host_found lets update() skip the device-side pick of the stats step.
        record.stage, record.host_found = OptState.STEPPED, found_any
        return retval

    def _fused_step(self, optimizer, stage, scale, found, args, kwargs):
        found_inf = any_flag(found.values(), scale.device)
        state = optimizer.state
        fresh = [
            p for g in optimizer.param_groups for p in g["params"]
            if p.grad is not None and not state.get(p)
        ]
        had_grad_scale = hasattr(optimizer, "grad_scale")
        previous = getattr(optimizer, "grad_scale", None)
        if stage is OptState.UNSCALED:
            optimizer.grad_scale = previous
        else:  # the kernel only reads grad_scale: pass our scale itself when nothing to combine
            optimizer.grad_scale = scale if previous is None else scale * previous
        optimizer.found_inf = found_inf
        try:
            retval = optimizer.step(*args, **kwargs)
        finally:
            del optimizer.found_inf
            if had_grad_scale:
                optimizer.grad_scale = previous
            else:
                del optimizer.grad_scale
        # Fused kernels allocate state before they look at found_inf; fused SGD allocates its
        # momentum buffer with empty_like, so a skipped first step would leave garbage that
        # the next step reads (torch's scaler does). Zero state born in a skipped step: for
        # SGD (dampening=0) the next step then starts from buf = grad, as a first step does.
        # The kernels skip on every device when any device overflowed (they get the combined
        # found_inf), so the mask is the combined flag too, moved to each state's device.
        skipped = {}
        for p in fresh:
            for v in state.get(p, {}).values():
                if isinstance(v, torch.Tensor):
                    mask = skipped.get(v.device)
                    if mask is None:
                        mask = skipped[v.device] = found_inf.to(v.device) > 0
                    v.masked_fill_(mask, 0)
        self._per_optimizer[id(optimizer)] = _OptRecord(OptState.STEPPED, found)
        return retval

    # ------------------------------------------------------------------ update

    def update(self, new_scale: float | torch.Tensor | None = None) -> None:
        """End the iteration: back off on inf/NaN, grow after ``growth_interval`` clean steps.

        ``new_scale`` (a float, or a one-element float tensor on the scaler's device) sets
        the scale instead; it is not counted in ``stats()``. It must be finite and > 0
        (``ValueError`` naming it otherwise): a float must also lie within the clamps, a
        tensor is clamped into them. No sync, except one read of a ``new_scale`` tensor to
        validate it (skipped while a CUDA graph is being captured).
        """
        if not self._enabled:
            return
        scale = self._require_scale("update")
        records = self._per_optimizer
        if new_scale is not None:
            self._set_scale(scale, new_scale)
        elif len(records) == 1:  # the common case, without the lists
            (record,) = records.values()
            flags = record.found_inf_per_device
            if not flags:
                raise NoChecksError()
            found = next(iter(flags.values())) if len(flags) == 1 else None
            if found is None or found.device != scale.device:
                found = any_flag(flags.values(), scale.device)
            self._update_scale(found, record.host_found)
        else:
            flags = [t for record in records.values() for t in record.found_inf_per_device.values()]
            if not flags:
                raise NoChecksError()
            found = any_flag(flags, scale.device)
            host = [r.host_found for r in records.values()]
            self._update_scale(found, None if None in host else any(host))
        self._per_optimizer = {}


    # ------------------------------------------------------------------ stats


    def stats(self) -> ScalerStats:
        """Steps, skipped steps, the last skip and the recent scale history. Syncs once.

        >>> import ampkit
        >>> ampkit.GradScaler("cpu").stats().steps
        0
        """
        h = self._host_state() if self._enabled else None
        if h is None:
            return ScalerStats(0, 0, None, 1.0, 0, self._hysteresis, (), ())
        steps, skipped, last = h["counters"]
        kept = range(max(0, steps - HISTORY_SIZE), steps)
        return ScalerStats(
            steps=steps,
            skipped=skipped,
            last_skipped=None if last < 0 else last,
            scale=h["scale"],
            growth_tracker=h["growth_tracker"],
            hysteresis_left=h["hysteresis_left"],
            history_steps=tuple(kept),
            history_scales=tuple(h["history"][i % HISTORY_SIZE] for i in kept),
        )

    # ------------------------------------------------------------------ state_dict

    def state_dict(self) -> dict[str, Any]:
        """Torch's five entries plus ours (hysteresis, clamps, stats). ``{}`` when disabled.

        A ``torch.amp.GradScaler`` loads it (it reads its own five keys). Syncs once.
        """
        if not self._enabled:
            return {}
        h = self._host_state()
        steps, skipped, last = h["counters"]
        return {
            "scale": h["scale"],
            "growth_factor": self._growth_factor,
            "backoff_factor": self._backoff_factor,
            "growth_interval": self._growth_interval,
            "_growth_tracker": h["growth_tracker"],
            "hysteresis": self._hysteresis,
            "min_scale": self._min_scale,
            "max_scale": self._max_scale,
            "_hysteresis_left": h["hysteresis_left"],
            "_steps": steps,
            "_skipped": skipped,
            "_last_skipped": last,
            "_scale_history": ScaleHistory(h["history"]),
        }

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Load ours or a ``torch.amp.GradScaler`` state dict; on any error nothing changes.

        A torch dict sets torch's five fields, refills the hysteresis budget and clamps the
        scale into ``[min_scale, max_scale]``; stats are kept. No-op when disabled.
        """
        if not isinstance(state_dict, Mapping):
            raise TypeError(f"load_state_dict() takes a dict, got {type(state_dict).__name__}")
        if not self._enabled:
            return
        if len(state_dict) == 0:
            raise ValueError(
                "load_state_dict() got an empty dict, probably saved from a disabled scaler "
                "(enabled=False); load a state dict saved from an enabled scaler"
            )
        new = parse_state_dict(state_dict, self._kept_by_torch_state)
        # Everything is valid: mutate.
        for key in ("growth_factor", "backoff_factor", "growth_interval", "hysteresis"):
            setattr(self, "_" + key, new[key])
        self._min_scale, self._max_scale = new["min_scale"], new["max_scale"]
        if self._scale is None:
            self._pending.update(
                {k: new[k] for k in ("scale", "growth_tracker", "hysteresis_left")},
                counters=new["counters"],
                history=new["history"],
            )
            return
        self._scale.fill_(new["scale"])
        self._growth_tracker.fill_(new["growth_tracker"])
        self._overflow_run.fill_(new["hysteresis"] - new["hysteresis_left"])
        device = self._scale.device
        self._counters.copy_(
            torch.tensor(to_device_counters(new["counters"]), dtype=torch.int64).to(device)
        )
        self._history.copy_(torch.tensor(new["history"], dtype=torch.float32).to(device))
        self._device_behind = False
        if not self._device_counted:  # (else a captured graph may count on the device)
            self._host_counts = HostCounts.of(
                new["counters"], new["hysteresis"] - new["hysteresis_left"], new["growth_tracker"])

    def _kept_by_torch_state(self) -> dict[str, Any]:
        """What a torch state dict leaves as it is: our configuration and stats."""
        h = self._host_state()
        return {"hysteresis": self._hysteresis, "min_scale": self._min_scale, "max_scale": self._max_scale,
                "counters": h["counters"], "history": h["history"]}


def cuda_amp_grad_scaler(**kwargs: Any) -> GradScaler:
    """``GradScaler("cuda", **kwargs)``: the drop-in for ``torch.cuda.amp.GradScaler``."""
    if "device" in kwargs:
        raise TypeError(
            f"cuda_amp_grad_scaler() always uses 'cuda'; got device={kwargs['device']!r}. "
            "Use ampkit.GradScaler(device=...) for another device."
        )
    return GradScaler("cuda", **kwargs)
