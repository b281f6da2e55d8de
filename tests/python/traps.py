"""Traps that make one call of a train step raise, for the "a call that raises changes
nothing" tests, and batches poisoned with infs and NaNs (tests/python/test_train_step*.py)."""

import math

import torch

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


def poisoned_batches(n, batch, d_in, d_out, inf_steps=(), nan_steps=(), seed=1):
    """``n`` seeded CPU (inputs, targets) batches; the targets of the steps in ``inf_steps``
    hold an inf, those in ``nan_steps`` a NaN, which overflow the loss there."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        x, y = torch.randn(batch, d_in, generator=g), torch.randn(batch, d_out, generator=g)
        if i in inf_steps:
            y[0, 0] = math.inf
        if i in nan_steps:
            y[1, 1] = math.nan
        out.append((x, y))
    return out
