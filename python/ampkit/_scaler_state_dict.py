"""The scaler's state dict: torch's five keys plus ours, checked key by key on load.

The scale history travels as a ``ScaleHistory``: a list of ``HISTORY_SIZE`` floats (the raw
ring buffer) that prints as a one-line summary, so that ``print(scaler.state_dict())``
stays readable. It pickles as itself, and this module registers it with
``torch.serialization.add_safe_globals``, so ``torch.save``/``torch.load`` (``weights_only``
included, once ampkit is imported) give it back with the same values.

>>> from ampkit._scaler_state_dict import ScaleHistory
>>> h = ScaleHistory([65536.0] * 1020 + [32768.0] * 4)
>>> h
ScaleHistory(1024 scales, min 32768.0, max 65536.0, last 32768.0)
>>> h == [65536.0] * 1020 + [32768.0] * 4
True
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from typing import Any

import torch

from ._scaler_checks import (COUNT_LIMIT, F32_MAX, HISTORY_SIZE, INT32_MAX, check_clamps, int_in, optional_scale,
                             real_in)

TORCH_KEYS = ("scale", "growth_factor", "backoff_factor", "growth_interval", "_growth_tracker")
OUR_KEYS = (
    "hysteresis",
    "min_scale",
    "max_scale",
    "_hysteresis_left",
    "_steps",
    "_skipped",
    "_last_skipped",
    "_scale_history",
)


class ScaleHistory(list):
    """The scales a state dict keeps (a plain list of floats in every use) that prints as a
    summary of its length and range rather than every value."""

    __slots__ = ()

    def __repr__(self) -> str:
        if len(self) <= 8:
            return f"ScaleHistory({list.__repr__(self)})"
        return f"ScaleHistory({len(self)} scales, min {min(self)!r}, max {max(self)!r}, last {self[-1]!r})"

    def __reduce__(self):
        # as itself, from a plain list (what torch.load's weights_only unpickler rebuilds)
        return (ScaleHistory, (list(self),))


torch.serialization.add_safe_globals([ScaleHistory])


def parse_state_dict(sd: Mapping[str, Any], kept: Callable[[], dict[str, Any]]) -> dict[str, Any]:
    """The values of a state dict, each checked, as ``load_state_dict`` applies them; raises
    naming the key otherwise. ``kept()`` gives what a torch state dict leaves as it is (the
    scaler's hysteresis, clamps, counters and history), asked only for a torch dict."""
    missing = [k for k in TORCH_KEYS if k not in sd]
    ours = [k for k in OUR_KEYS if k in sd]
    if ours:
        missing += [k for k in OUR_KEYS if k not in sd]
    if missing:
        raise ValueError(
            f"load_state_dict(): missing key(s) {missing}; pass a dict from "
            "ampkit.GradScaler.state_dict() or torch.amp.GradScaler.state_dict()"
        )

    def q(k):
        return f"state_dict[{k!r}]"

    new: dict[str, Any] = {
        "scale": real_in(q("scale"), sd["scale"], 0.0, F32_MAX, True, False),
        "growth_factor": real_in(q("growth_factor"), sd["growth_factor"], 1, math.inf, True, True),
        "backoff_factor": real_in(q("backoff_factor"), sd["backoff_factor"], 0, 1, True, True),
        "growth_interval": int_in(q("growth_interval"), sd["growth_interval"], 1, INT32_MAX),
    }
    # torch's kernel grows when the tracker *reaches* the interval: one at or past it
    # would never grow again.
    new["growth_tracker"] = int_in(q("_growth_tracker"), sd["_growth_tracker"], 0,
                                 new["growth_interval"] - 1)
    if not ours:  # a torch state dict: keep our config and stats
        k = kept()
        new.update(k, hysteresis_left=k["hysteresis"])
        lo, hi = k["min_scale"], k["max_scale"]
        new["scale"] = min(max(new["scale"], lo or 0.0), hi or F32_MAX)
        return new
    hyst = int_in(q("hysteresis"), sd["hysteresis"], 1, INT32_MAX)
    lo, hi = optional_scale(q("min_scale"), sd["min_scale"]), optional_scale(q("max_scale"), sd["max_scale"])
    check_clamps(lo, hi, prefix="state_dict ")
    if (lo is not None and new["scale"] < lo) or (hi is not None and new["scale"] > hi):
        raise ValueError(
            f"{q('scale')}={new['scale']!r} lies outside its own clamps [{lo}, {hi}]"
        )
    steps = int_in(q("_steps"), sd["_steps"], 0, COUNT_LIMIT - 1)
    skipped = int_in(q("_skipped"), sd["_skipped"], 0, steps)
    last = int_in(q("_last_skipped"), sd["_last_skipped"], -1 if skipped == 0 else 0,
                -1 if skipped == 0 else steps - 1)
    history = sd["_scale_history"]
    if not isinstance(history, (list, tuple)) or len(history) != HISTORY_SIZE:
        raise ValueError(
            f"{q('_scale_history')} must be a list of {HISTORY_SIZE} floats, got "
            f"{type(history).__name__} of length {len(history) if hasattr(history, '__len__') else '?'}"
        )
    history = [
        real_in(f"{q('_scale_history')}[{i}]", v, 0.0, F32_MAX, False, False)
        for i, v in enumerate(history)
    ]
    new.update(
        hysteresis=hyst,
        min_scale=lo,
        max_scale=hi,
        hysteresis_left=int_in(q("_hysteresis_left"), sd["_hysteresis_left"], 1, hyst),
        counters=[steps, skipped, last],
        history=history,
    )
    return new
