"""Traps that make one call of a train step raise, for the "a call that raises changes
nothing" tests (tests/python/test_train_step*.py)."""

import ampkit


class Boom(Exception):
    """The injected error."""


class Once:
    """Raise Boom the first time ``fire()`` is reached after ``armed`` was set."""

    def __init__(self):
        self.armed = False

    def fire(self):
        if self.armed:
            self.armed = False
            raise Boom("injected")


class UpdateFailsOnce(ampkit.GradScaler):
    """A scaler whose ``update()`` fires its ``trap`` (a Once) before updating."""

    trap = None

    def update(self, new_scale=None):
        self.trap.fire()
        return super().update(new_scale)
