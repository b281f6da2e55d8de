"""Narrow casts: an fp32 op that reads a few elements of a large input casts only those.

``nll_loss`` is in the fp32 category: natively, autocast copies its whole
(batch, classes) input to float32 before the kernel reads one element per row,
and autograd then builds a float32 gradient of the same size and casts it back.
For a language-model head (8192 tokens x 32768 classes) that is 1 GiB written
forward and 1.5 GiB more backward, for 8192 numbers.

The engine instead gathers the elements ``nll_loss`` reads (one per row, in the
input's dtype), casts those to float32, and runs ``nll_loss`` on the (batch, 1)
result. The value of each element is the same (a cast is elementwise), and the
CPU and CUDA kernels visit the rows in the same order whatever the number of
classes, so the loss is the native one bit for bit, and so is the gradient:
each row's -1/N (or -weight) is computed by the same kernel, cast to the
input's dtype, and scattered into zeros. The one difference: where the upstream
gradient is exactly zero, a target element gets +0.0 where native gets -0.0.

Used where it pays and is exact: a 2-D input of a dtype the fp32 rule would
cast, at least ``MIN_ELEMENTS`` elements, int64 targets, no class weights (the
kernel reads ``weight[target]``, which a (batch, 1) input cannot express).
Everything else takes the ordinary fp32 rule. A target out of range still
fails as natively: on the CPU the call falls back to the full cast, so the
error is nll_loss's own; on CUDA the gather's device-side assert fires where
nll_loss's would (checking first would cost a host sync every step).

>>> import torch
>>> logp = torch.randn(256, 300).log_softmax(1).to(torch.bfloat16)
>>> t = torch.randint(0, 300, (256,))
>>> torch.equal(nll_loss(torch.nn.functional.nll_loss, (logp, t), {}),
...             torch.nn.functional.nll_loss(logp.float(), t))
True
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.nn import _reduction

from ampkit._decompositions import REDUCTIONS

MIN_ELEMENTS = 1 << 16  # below this the gather's extra small kernels cost more than they save
_INNER_IGNORE = -1  # the (batch, 1) call's ignore_index: targets there are 0 or this
NOT_NARROWED = object()


def _nll_args(func, args, kwargs):
    """(input, target, weight, reduction enum, ignore_index) of a call, or None."""
    if func is F.nll_loss:
        names = ("input", "target", "weight", "size_average", "ignore_index", "reduce", "reduction")
        defaults = (None, None, None, None, -100, None, "mean")
    elif func is torch._C._nn.nll_loss:
        names = ("input", "target", "weight", "reduction", "ignore_index")
        defaults = (None, None, None, 1, -100)
    else:
        return None
    if len(args) > len(names) or any(k not in names for k in kwargs):
        return None  # let the op raise its own error
    a = dict(zip(names, defaults))
    a.update(zip(names, args))
    a.update(kwargs)
    red = a["reduction"]
    if func is F.nll_loss:
        if a["size_average"] is not None or a["reduce"] is not None:
            red = _reduction.legacy_get_string(a["size_average"], a["reduce"], emit_warning=False)
        red = REDUCTIONS.index(red) if red in REDUCTIONS else None
    if red not in (0, 1, 2) or type(a["ignore_index"]) is not int:
        return None
    return a["input"], a["target"], a["weight"], red, a["ignore_index"]


def nll_loss(func, args, kwargs):
    """``nll_loss`` on float32 copies of the elements it reads, or NOT_NARROWED.

    ``func``: the callable (``F.nll_loss`` or ``torch._C._nn.nll_loss``); the
    caller has decided that the op's inputs are to be cast to float32, and that
    the input is large enough to pay (``NARROWED["nll_loss"].pays``).
    """
    parsed = _nll_args(func, args, kwargs)
    if parsed is None:
        return NOT_NARROWED
    inp, target, weight, red, ignore_index = parsed
    if (
        weight is not None or not isinstance(inp, torch.Tensor) or not isinstance(target, torch.Tensor)
        or inp.dim() != 2 or target.dim() != 1 or target.dtype != torch.int64
        or inp.dtype == torch.float32 or not inp.is_floating_point() or inp.dtype == torch.float64
        or target.shape[0] != inp.shape[0] or target.device != inp.device
    ):
        return NOT_NARROWED
    kept = target != ignore_index
    if not inp.is_cuda:  # (a CPU check costs no sync) out-of-range targets: the native error
        n_classes = inp.shape[1]
        if bool((kept & ((target < 0) | (target >= n_classes))).any()):
            return NOT_NARROWED
    picked = inp.gather(1, torch.where(kept, target, 0).unsqueeze(1)).to(torch.float32)
    inner_target = torch.where(kept, 0, _INNER_IGNORE)
    return torch._C._nn.nll_loss(picked, inner_target, None, red, _INNER_IGNORE)


class Narrowing:
    """One op's narrow cast: ``pays(input)`` (cheap, checked first), then ``run(func, args, kwargs)``."""

    __slots__ = ("pays", "run")

    def __init__(self, pays, run):
        self.pays, self.run = pays, run


def _large(t) -> bool:
    return t.numel() >= MIN_ELEMENTS


NARROWED = {"nll_loss": Narrowing(_large, nll_loss)}
