"""The scaler's limits and argument checks, and the errors that name the order its calls broke."""

from __future__ import annotations

import math
import numbers
from typing import Any

import torch

#: Number of recent ``update()`` calls whose scale is kept on the device.
HISTORY_SIZE = 1024
# The stats counters (int64 on the device) count modulo this; a loaded _steps must be below.
COUNT_LIMIT = 2**62
INT32_MAX = 2**31 - 1
F32_MAX = float(torch.finfo(torch.float32).max)
ORDER = "scale(loss).backward() -> [unscale_(opt)] -> step(opt) -> update()"


def real_in(name: str, value: Any, lo: float, hi: float, lo_open: bool, hi_open: bool) -> float:
    """A finite real number in the given interval, as a float; else TypeError/ValueError."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name} must be a real number, got {value!r} ({type(value).__name__})")
    v = float(value)
    valid = f"{'(' if lo_open else '['}{lo:g}, {hi:g}{')' if hi_open else ']'}"
    inside = (v > lo if lo_open else v >= lo) and (v < hi if hi_open else v <= hi)
    if not (math.isfinite(v) and inside):
        raise ValueError(f"{name}={value!r} is invalid; it must be finite and in {valid}")
    return v

def int_in(name: str, value: Any, lo: int, hi: int) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name} must be an int, got {value!r} ({type(value).__name__})")
    if not lo <= int(value) <= hi:
        raise ValueError(f"{name}={value!r} is invalid; it must be an int in [{lo}, {hi}]")
    return int(value)

def optional_scale(name: str, value: Any) -> float | None:
    return None if value is None else real_in(name, value, 0.0, F32_MAX, True, False)

def check_clamps(min_scale: float | None, max_scale: float | None, prefix: str = "") -> None:
    if min_scale is not None and max_scale is not None and min_scale > max_scale:
        raise ValueError(
            f"{prefix}min_scale={min_scale!r} is larger than {prefix}max_scale={max_scale!r}; "
            "min_scale must be <= max_scale"
        )

def device_type_of(device: Any) -> str:
    if not isinstance(device, (str, torch.device)):
        raise TypeError(f"device must be a str such as 'cuda' or 'cpu', got {device!r}")
    try:
        return torch.device(device).type
    except RuntimeError as e:
        raise ValueError(f"device={device!r} is not a torch device type; use 'cuda' or 'cpu'") from e

def check_outputs(value: Any, where: str = "outputs") -> torch.Tensor | None:
    """Validate ``scale()``'s input before touching state; return its first tensor."""
    if isinstance(value, torch.Tensor):
        return value
    if isinstance(value, (list, tuple)):
        first = None
        for i, v in enumerate(value):
            t = check_outputs(v, f"{where}[{i}]")
            first = first if first is not None else t
        return first
    raise TypeError(
        f"scale() takes a tensor or (nested) lists/tuples of tensors, but {where} is "
        f"{type(value).__name__} ({value!r:.60}); pass the loss tensor(s) themselves"
    )

def check_optimizer(optimizer, method: str) -> None:
    if getattr(optimizer, "param_groups", None) is None:
        raise TypeError(f"{method}() expected a torch.optim.Optimizer (something with "
                        f"param_groups), got {optimizer!r:.60}")

class NoGradsError(RuntimeError):
    def __init__(self):
        super().__init__(
            "step(): this optimizer has no gradients (every .grad is None), so there is "
            "nothing to check or apply. Call scaler.scale(loss).backward() on a loss that "
            "depends on its parameters first."
        )

class NoChecksError(RuntimeError):
    def __init__(self):
        super().__init__(
            "update() found no inf/NaN checks: no optimizer was stepped (or unscaled) "
            f"since the last update(); the order is {ORDER}. Call "
            "scaler.step(optimizer) first, or update(new_scale=...) to set the scale."
        )
