"""ATen decompositions written in Python, for a policy's ``decompose`` list.

Some ops are C++ composites: ATen runs them as a few other ops, and native
autocast casts each of those parts by its own rule. A Python-level engine only
sees the outer call. An op listed under ``decompose`` for a device is therefore
run through the decomposition below, with the region active, so that its parts
reach ampkit's handler and are cast by their own rules, as natively.

Each decomposition repeats ATen's code op for op (the same kernels, the same
order), so outside any region it gives the op's own values bit for bit, and in
a region the values native autocast gives:

=====================  ==========================================  ===========
op                     ATen source (torch 2.11 .. 2.13)             devices
=====================  ==========================================  ===========
``cross_entropy``      ``native/LossNLL.cpp`` cross_entropy_loss   cpu, cuda
``pairwise_distance``  ``native/Distance.cpp`` pairwise_distance    cpu, cuda
``trace``              ``native/cuda/TriangularOps.cu`` trace_cuda  cuda
=====================  ==========================================  ===========

(``trace`` on cpu is a kernel of its own, so it has no decomposition there.)

>>> import torch
>>> x, t = torch.randn(4, 5), torch.tensor([0, 3, 1, 4])
>>> torch.equal(cross_entropy(x, t, label_smoothing=0.1),
...             torch.nn.functional.cross_entropy(x, t, label_smoothing=0.1))
True
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.nn import _reduction

REDUCTIONS = ("none", "mean", "sum")  # ATen's at::Reduction enum: None=0, Mean=1, Sum=2


# --------------------------------------------------------------------------- cross_entropy
def cross_entropy(input, target, weight=None, reduction="mean", ignore_index=-100, label_smoothing=0.0):
    """ATen's ``cross_entropy_loss``: log_softmax (in the input's dtype) + nll_loss.

    With the region active, ``log_softmax`` runs with its dtype given (the
    input's), ``nll_loss`` casts the log-probabilities to float32, and the sums
    of the label-smoothing and probability-target forms get a float32 output.
    """
    _reduction.get_enum(reduction)  # ValueError naming the bad value, as F.cross_entropy
    class_dim = 0 if input.dim() == 1 else 1
    if input.shape == target.shape:  # ATen: soft targets when the shapes are the same
        if not target.is_floating_point():
            raise RuntimeError(f"Expected floating point type for target with class probabilities, got {_aten_name(target.dtype)}")
        if ignore_index >= 0:
            raise RuntimeError("ignore_index is not supported for floating point target")
        return _cross_entropy_prob_target(input, target, weight, reduction, label_smoothing, class_dim)
    if label_smoothing > 0.0:
        _check_smoothing(label_smoothing)
        return _cross_entropy_label_smoothing(input, target, weight, reduction, ignore_index, label_smoothing, class_dim)
    logp = torch.log_softmax(input, class_dim, dtype=input.dtype)
    return F.nll_loss(logp, target, weight, ignore_index=ignore_index, reduction=reduction)


def _check_smoothing(label_smoothing):
    if label_smoothing > 1.0:
        raise RuntimeError(f"label_smoothing must be between 0.0 and 1.0. Got: {label_smoothing}")


def _aten_name(dtype):
    return {torch.int64: "Long", torch.int32: "Int", torch.int16: "Short", torch.int8: "Char",
            torch.uint8: "Byte", torch.bool: "Bool"}.get(dtype, str(dtype).replace("torch.", ""))


def _cross_entropy_prob_target(input_, target, weight, reduction, label_smoothing, class_dim):
    n_classes = input_.size(class_dim)
    if weight is not None and (weight.dim() != 1 or weight.numel() != n_classes):
        raise RuntimeError(
            f"cross_entropy: weight tensor should be defined either for all {n_classes} classes or no classes "
            f"but got weight tensor of shape: {list(weight.shape)}"
        )
    logp = torch.log_softmax(input_, class_dim, dtype=input_.dtype)
    if label_smoothing > 0.0:
        _check_smoothing(label_smoothing)
        target = target * (1 - label_smoothing) + label_smoothing / n_classes
    prod = logp * target
    if weight is not None:
        w = weight
        if logp.dim() > 1:
            shape = [1] * logp.dim()
            shape[1] = weight.size(0)
            w = weight.view(shape)
        prod = prod * w
    if reduction == "mean":
        if logp.numel() == 0:
            return -prod.sum().fill_(float("nan"))
        return -prod.sum() / (logp.numel() // n_classes)
    if reduction == "sum":
        return -prod.sum()
    return -prod.sum(class_dim)


def _cross_entropy_label_smoothing(input_, target, weight, reduction, ignore_index, label_smoothing, class_dim):
    logp = torch.log_softmax(input_, class_dim, dtype=input_.dtype)
    nll = F.nll_loss(logp, target, weight, ignore_index=ignore_index, reduction=reduction)
    n_classes = logp.size(class_dim)
    if weight is not None:
        shape = [1] * logp.dim()
        shape[class_dim] = weight.size(0)
        smooth = -(logp * weight.view(shape)).sum(class_dim)
    else:
        smooth = -logp.sum(class_dim)
    ignore_mask = target == ignore_index
    smooth.masked_fill_(ignore_mask, 0.0)
    if reduction == "mean":
        if weight is not None:
            ret = smooth.sum() / weight.gather(0, target.masked_select(~ignore_mask).flatten()).sum()
        else:
            ret = smooth.sum() / (~ignore_mask).sum()
    elif reduction == "sum":
        ret = smooth.sum()
    else:
        ret = smooth
    return nll * (1 - label_smoothing) + ret * (label_smoothing / n_classes)


def _cross_entropy_functional(input, target, weight=None, size_average=None, ignore_index=-100, reduce=None,
                              reduction="mean", label_smoothing=0.0):
    """``torch.nn.functional.cross_entropy``'s signature."""
    if size_average is not None or reduce is not None:
        reduction = _reduction.legacy_get_string(size_average, reduce)
    return cross_entropy(input, target, weight, reduction, ignore_index, label_smoothing)


def _cross_entropy_aten(self, target, weight=None, reduction=1, ignore_index=-100, label_smoothing=0.0):
    """``torch._C._nn.cross_entropy_loss``'s signature (reduction as ATen's enum)."""
    if reduction not in (0, 1, 2):
        raise RuntimeError(f"Invalid reduction type encountered in cross_entropy: {reduction}")
    return cross_entropy(self, target, weight, REDUCTIONS[reduction], ignore_index, label_smoothing)


# --------------------------------------------------------------------------- pairwise_distance, trace
def pairwise_distance(x1, x2, p=2.0, eps=1e-6, keepdim=False):
    """ATen's ``pairwise_distance``: ``norm(x1 - x2 + eps, p, last dim, keepdim)``.

    The difference is taken in the inputs' dtype; only ``norm`` (fp32_output on
    cuda) computes in float32.
    """
    dim = max(x1.dim(), x2.dim()) - 1
    return torch._C._VariableFunctions.norm(x1 - x2 + eps, p, [dim], keepdim)


def trace(input):
    """ATen's ``trace_cuda``: ``input.diagonal().sum()`` (sum gets a float32 output on cuda)."""
    if input.dim() != 2:
        raise RuntimeError("expected a matrix")
    return input.diagonal().sum()


# --------------------------------------------------------------------------- registry
class Decomposition:
    """The decomposition of one op: per callable signature, and where it is ATen's."""

    __slots__ = ("op", "devices", "default", "by_callable", "source")

    def __init__(self, op, devices, default, by_callable=None, source=""):
        self.op, self.devices, self.default, self.source = op, tuple(devices), default, source
        self.by_callable = by_callable or {}

    def for_callable(self, func):
        """The Python decomposition with the signature of ``func`` (a callable of the op)."""
        return self.by_callable.get(func, self.default)


DECOMPOSITIONS = {
    "cross_entropy": Decomposition(
        "cross_entropy", ("cpu", "cuda"), _cross_entropy_functional,
        {torch._C._nn.cross_entropy_loss: _cross_entropy_aten}, "aten/src/ATen/native/LossNLL.cpp",
    ),
    "pairwise_distance": Decomposition(
        "pairwise_distance", ("cpu", "cuda"), pairwise_distance, None, "aten/src/ATen/native/Distance.cpp",
    ),
    "trace": Decomposition("trace", ("cuda",), trace, None, "aten/src/ATen/native/cuda/TriangularOps.cu"),
}


def known(device_type: str) -> tuple:
    """Op names with a decomposition that is ATen's on ``device_type``."""
    return tuple(sorted(n for n, d in DECOMPOSITIONS.items() if device_type in d.devices))
