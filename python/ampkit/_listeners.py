"""The core's listener points: where a diagnostic subscribes to the scaler and the train step.

The scaler and the train step import this module and nothing of the diagnostics; a
diagnostic (``ampkit.doctor``) subscribes when it is armed and unsubscribes when it is
closed. A point with no listener costs one truth test of an empty tuple at its call site::

    point.subscribe(fn)          # fn is called on every notify(), in subscription order
    if point.listeners:          # (the call site's test: a tuple, empty when none subscribed)
        point.notify(*args)      # for fn in point.listeners: fn(*args)
    point.unsubscribe(fn)        # (a listener that is not subscribed is ignored)

The points:

* ``gradients_checked(found_per_device, optimizer, combined_later)``: an ``ampkit.GradScaler``
  checked the gradients of ``optimizer``'s parameters in ``unscale_()`` or ``step()``;
  ``found_per_device`` is ``{device: float32 flag}`` (1.0 = an inf or a NaN), this rank's
  own; with ``combined_later`` the scaler then combines the flags over ranks in place (a
  listener that keeps them copies them).
* ``about_to_capture()``: ``make_train_step`` is about to capture a CUDA graph of a step
  (the listeners run eagerly, before the capture begins).
* ``fp8_quantized(op, operand, source, quantized, scale)``: an op of the ``fp8`` category
  (``ampkit._fp8``) cast one operand (``"input"``, ``"weight"``, ``"grad_output"``):
  ``source`` is the tensor before the cast (2-D), ``quantized`` its fp8 value, ``scale``
  the float32 scale used (0-dim, or one per row). Called inside the op's forward or
  backward, so a listener's own tensor ops run under whatever dispatch modes are active.

>>> from ampkit._listeners import Listeners
>>> seen = []
>>> point = Listeners("example")
>>> point.subscribe(seen.append)
>>> point.notify(1); point.unsubscribe(seen.append); point.notify(2)
>>> seen, point.listeners
([1], ())
"""

from __future__ import annotations

from collections.abc import Callable


class Listeners:
    """One listener point: the functions subscribed to it, called in order by ``notify``.

    ``listeners`` is a tuple that each (un)subscription replaces (never changed in place),
    so a listener may unsubscribe (or subscribe another) while ``notify`` runs: that call
    goes on with the listeners it began with.
    """

    __slots__ = ("name", "listeners")

    def __init__(self, name: str) -> None:
        self.name = name
        self.listeners: tuple[Callable[..., None], ...] = ()

    def subscribe(self, fn: Callable[..., None]) -> None:
        if not callable(fn):
            raise TypeError(f"Listeners({self.name!r}).subscribe() takes a callable, got {fn!r:.60}")
        self.listeners += (fn,)

    def unsubscribe(self, fn: Callable[..., None]) -> None:
        self.listeners = tuple(f for f in self.listeners if f is not fn and f != fn)

    def notify(self, *args) -> None:
        for fn in self.listeners:
            fn(*args)

    def __repr__(self) -> str:
        return f"<Listeners {self.name!r}: {len(self.listeners)} subscribed>"


#: An ``ampkit.GradScaler`` checked an optimizer's gradients (see the module's doc).
gradients_checked = Listeners("gradients_checked")
#: ``make_train_step`` is about to capture a CUDA graph of a step (see the module's doc).
about_to_capture = Listeners("about_to_capture")
#: An fp8 op cast an operand to fp8 (see the module's doc).
fp8_quantized = Listeners("fp8_quantized")
