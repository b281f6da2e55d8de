"""Which findings the loss scaler handled and which did harm: the rule, in one place.

A float16 run's first backward steps often overflow by design: the scaler starts high,
skips the step and backs off. Such a finding is *handled*; the others are *harmful*::

    harmful if  phase == "forward"                     # no scale makes a forward finite
             or the scaler did not skip the step       # the bad value went on, or no scaler
             or scale before the step <= min_scale     # a backoff cannot lower it (clamped)
             or run > (hysteresis - 1) + max_backoffs  # it recurs after every backoff it gets
    else handled

``run`` counts the consecutive skipped steps ending with this one; the scaler's hysteresis
absorbs ``hysteresis - 1`` of them and then backs off on each. ``max_backoffs`` is the number
of backoffs that divide the scale by 2**16 (``ceil(16 / log2(1 / backoff_factor))``: 16 at
the default 0.5): float16's range above 1 is 2**16 wide, so a backward overflow that recurs
after the scale dropped that much is no longer one a loss scale can bring into range.

The scaler's side is read from its own record (``GradScaler.stats()``: the scale each update
left, its settings): update ``u`` is this doctor's step ``u - offset``, the latest update
being the latest step's. A step older than the scaler's history (or its first update) has
no recorded scale before it: the ``min_scale`` test reads it as above the floor.

>>> rule = Rule(min_scale=None, hysteresis=1, backoff_factor=0.5)
>>> rule.verdict("backward", skipped=True, run=1, scale_before=65536.0)
'handled'
>>> rule.verdict("forward", skipped=True, run=1, scale_before=65536.0)
'harmful'
>>> rule.verdict("backward", skipped=True, run=17, scale_before=1.0)
'harmful'
"""

from __future__ import annotations

import dataclasses
import math

HANDLED = "handled"
HARMFUL = "harmful"
#: float16's range above 1 (its max is 65504 < 2**16): the most a loss scale can shift a value
RANGE_BITS = 16


@dataclasses.dataclass(frozen=True)
class Rule:
    """The scaler's settings the rule needs (``min_scale``, ``hysteresis``, ``backoff_factor``)."""

    min_scale: float | None
    hysteresis: int
    backoff_factor: float

    @classmethod
    def of(cls, scaler) -> Rule:
        return cls(scaler.min_scale, scaler.hysteresis, scaler.get_backoff_factor())

    @property
    def max_backoffs(self) -> int:
        return math.ceil(RANGE_BITS / math.log2(1.0 / self.backoff_factor))

    @property
    def max_run(self) -> int:
        """The longest run of consecutive skipped steps the scaler still handles."""
        return self.hysteresis - 1 + self.max_backoffs

    def verdict(self, phase: str, *, skipped: bool, run: int, scale_before: float | None) -> str:
        if phase != "backward" or not skipped:
            return HARMFUL
        if self.min_scale is not None and scale_before is not None and scale_before <= self.min_scale:
            return HARMFUL
        return HARMFUL if run > self.max_run else HANDLED


def classify(findings, bad_steps, scaler_checked, scaler, last_step):
    """``findings`` (a list of ``Finding``, by step) with their ``verdict`` set, from the
    scaler's record (one read: ``scaler.stats()``). ``bad_steps``: the steps whose check was
    bad; ``scaler_checked``: whether that check was the scaler's own (then each of them was
    skipped by it); ``last_step``: the doctor's latest step (the scaler's latest update)."""
    rule = Rule.of(scaler)
    stats = scaler.stats()
    scales = dict(zip(stats.history_steps, stats.history_scales))
    offset = stats.steps - 1 - last_step
    bad = set(bad_steps) if scaler_checked else set()
    out = []
    for f in findings:
        run = 0
        while f.step - run in bad:
            run += 1
        out.append(dataclasses.replace(f, verdict=rule.verdict(
            f.phase, skipped=f.step in bad, run=run, scale_before=scales.get(f.step + offset - 1))))
    return out
