"""Which step the doctor is replaying right now (read by the watch, by the doctor's hooks and
by fault injectors, which fire in the replay of the step they model)."""

from __future__ import annotations

_REPLAYING = [None]  # the step a doctor is replaying now


def replaying():
    """The index of the step a doctor is replaying right now, else None. A replay runs a
    recorded step's forward and backward again under the op-level watch; a fault injector
    (``faults.inject`` in tests/python/faults.py) that models a fault of that step fires in the replay too."""
    return _REPLAYING[0]


def set_replaying(step) -> None:
    """Mark step ``step`` as the one being replayed (None: no replay runs)."""
    _REPLAYING[0] = step
