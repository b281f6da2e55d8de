"""The fp8 watch: in sampled steps, how each fp8 cast of each module fared.

An op of the ``fp8`` category (``ampkit._fp8``) casts its input and weight (forward) and its
output's gradient (backward) to an 8-bit float with a scale; it reports each cast through
the core's listener point ``ampkit._listeners.fp8_quantized``. The doctor subscribes only
while a sampled step's op-level watch is on, so an unsampled step (and a run with no fp8
op) pays nothing: one truth test of an empty tuple per cast. Per cast of operand ``x``
(2-D, as the op cast it), its scale ``s`` (0-dim or one per row) and its fp8 value ``q``::

    max      = the fp8 dtype's largest value (448 for float8_e4m3fn, 57344 for float8_e5m2)
    limit    = max + ulp(max) / 2      (464, 61440: up to it a value is within rounding of max)
    amax     = max |x|
    overflow = count(|x.float() * s| > limit)      # saturated: it lost more than rounding
    underflow= count(x != 0 and q == 0)            # a nonzero value flushed to zero
    elements = numel(x);  scale = min(s)

accumulated per (sampled step, module, operand) on the device (no host read): amax and
scale the max and min over the step's casts, the counts summed. The module is the doctor's
(``OpWatch._where``): the innermost module whose forward runs the op, or in the backward
the module whose forward created its autograd node. ``rows()`` reads them (one read).
"""

from __future__ import annotations

import math

import torch

from ampkit._listeners import fp8_quantized

OPERANDS = ("input", "weight", "grad_output")
_F64 = torch.float64


def saturation_limit(dtype) -> float:
    """``max + ulp(max) / 2`` of fp8 ``dtype`` (464.0 for float8_e4m3fn, 61440.0 for
    float8_e5m2): a scaled value up to it is within rounding of max (``> max`` alone would
    count a tensor's own amax, whose ``amax * (max / amax)`` may round above max); beyond
    it the clamp to max loses more than rounding (float8_e5m2 would be inf without it).

    >>> saturation_limit(torch.float8_e4m3fn), saturation_limit(torch.float8_e5m2)
    (464.0, 61440.0)
    """
    fi = torch.finfo(dtype)
    return fi.max + 2.0 ** math.floor(math.log2(fi.max)) * fi.eps / 2


class Fp8Watch:
    """One doctor's record of fp8 casts. ``where()`` names the (phase, module) of the op
    running now (None: not the model's); ``unwatched()`` is a context in which the doctor's
    own op-level watch lets the reductions through."""

    def __init__(self, where, unwatched):
        self._where = where
        self._unwatched = unwatched
        self._step = -1
        self._acc: dict = {}  # (module, operand) -> float64 [amax, overflow, underflow, elements, scale, casts]
        self._ops: dict = {}  # (step, module, operand) -> {op names}
        self._rows: list = []  # (step, module, operand, fp8 dtype name, accumulator)

    def on(self, step) -> None:
        """Watch the casts of sampled step ``step`` (until :meth:`off`)."""
        self._step = step
        self._acc = {}
        fp8_quantized.subscribe(self.quantized)

    def off(self) -> None:
        fp8_quantized.unsubscribe(self.quantized)

    def reset(self) -> None:
        self._acc, self._ops, self._rows = {}, {}, []

    def quantized(self, op, operand, source, quantized, scale) -> None:
        """The listener: one cast of ``source`` to ``quantized`` with ``scale``."""
        where = self._where()
        if where is None:
            return
        module = where[1]
        key = (module, operand)
        with torch.no_grad(), self._unwatched():
            acc = self._acc.get(key)
            if acc is None:
                acc = self._acc[key] = torch.zeros(6, dtype=_F64, device=source.device)
                acc[4] = math.inf  # (a fill: no copy from the host)
                self._rows.append((self._step, module, operand, str(quantized.dtype).replace("torch.", ""), acc))
            x = source.detach()
            s = scale.detach()
            mn, mx = torch.aminmax(x)  # (NaN propagates)
            amax = torch.maximum(mx.to(_F64), mn.to(_F64).neg())
            over = ((x.to(torch.float32) * s).abs() > saturation_limit(quantized.dtype)).sum()
            under = ((x != 0) & (quantized.to(torch.float32) == 0)).sum()
            acc[0] = torch.maximum(acc[0], amax)
            acc[1] += over
            acc[2] += under
            acc[3] += x.numel()
            acc[4] = torch.minimum(acc[4], s.amin().to(_F64))
            acc[5] += 1
        self._ops.setdefault((self._step, module, operand), set()).add(op)

    def rows(self) -> list:
        """One dict per sampled step, module and operand cast to fp8 (see the module's doc for
        each field), in the order of their first cast. Reads the device once."""
        if not self._rows:
            return []
        vals = torch.stack([a.to("cpu") for *_, a in self._rows]).tolist()
        out = []
        for (step, module, operand, dtype, _), v in zip(self._rows, vals):
            amax, over, under, n, scale, casts = v
            out.append({"step": step, "module": module, "operand": operand, "dtype": dtype,
                        "ops": ", ".join(sorted(self._ops[(step, module, operand)])),
                        "amax": amax, "overflow": over / n if n else 0.0,
                        "underflow": under / n if n else 0.0, "scale": scale,
                        "elements": int(n), "casts": int(casts)})
        return out


def table(rows) -> str:
    """The latest sampled step's row of each (module, operand) as aligned text."""
    latest = {}
    for r in rows:
        latest[(r["module"], r["operand"])] = r
    cols = ("step", "module", "operand", "dtype", "amax", "overflow", "underflow", "scale")
    shown = [{c: (f"{r[c]:.4g}" if isinstance(r[c], float) else str(r[c]) or '""') for c in cols}
             for r in latest.values()]
    width = {c: max([len(c)] + [len(r[c]) for r in shown]) for c in cols}
    lines = ["  ".join(c.ljust(width[c]) for c in cols).rstrip()]
    lines += ["  ".join(r[c].ljust(width[c]) for c in cols).rstrip() for r in shown]
    return "\n".join(lines)
