"""An optimizer's gradients, grouped for the scaler's inf check, and the reads of the check.

No function here syncs with the device, and each runs inside a CUDA graph capture.
"""

from __future__ import annotations

import math

import torch

# torch's C++ grouping of tensor lists by (device, dtype), used by its foreach optimizers.
_GROUP = getattr(torch._C, "_group_tensors_by_device_and_dtype", None)


def collect_grads(optimizer, allow_fp16: bool) -> tuple[dict, tuple]:
    """Group the optimizer's gradients by (device, dtype); validate before mutating.

    Returns the groups and the parameters' gradient tensors (``grads_of``)."""
    groups = getattr(optimizer, "param_groups", None)
    if groups is None:
        raise TypeError(
            f"expected a torch.optim.Optimizer (something with param_groups), "
            f"got {type(optimizer).__name__}"
        )
    grads = [g for group in groups for p in group["params"] if (g := p.grad) is not None]
    if not grads:
        return {}, ()
    if _GROUP is None or any(g.is_sparse for g in grads):
        return collect_grads_slowly(groups, allow_fp16)
    grouped = {key: lists[0] for key, (lists, _) in _GROUP([grads], False).items()}
    if not allow_fp16 and any(dtype == torch.float16 for _, dtype in grouped):
        collect_grads_slowly(groups, allow_fp16)  # raises, naming the parameter
    return grouped, tuple(grads)

def collect_grads_slowly(groups, allow_fp16: bool) -> tuple[dict, tuple]:
    """_collect_grads for sparse gradients (and a torch without its grouping), and the
    float16 refusal with the parameter's shape."""
    params = [p for group in groups for p in group["params"] if p.grad is not None]
    grads = [p.grad for p in params]
    if not allow_fp16:
        for p, grad in zip(params, grads):
            if grad.dtype == torch.float16:
                raise ValueError(
                    f"unscale_() got a float16 gradient (parameter of shape "
                    f"{tuple(p.shape)}); unscaling in float16 loses the small "
                    "gradients that loss scaling exists to keep. Keep parameters in "
                    "float32 and run the forward pass under ampkit.autocast, or use a "
                    "fused optimizer that unscales internally."
                )
    if any(g.is_sparse for g in grads):
        with torch.no_grad():
            for i, p in enumerate(params):
                if grads[i].is_sparse:
                    if grads[i].dtype is torch.float16:  # duplicates could overflow
                        p.grad = grads[i] = grads[i].coalesce()
                    grads[i] = grads[i]._values()
    kept = tuple(p.grad for p in params)
    if _GROUP is not None:
        return {key: lists[0] for key, (lists, _) in _GROUP([grads], False).items()}, kept
    grouped: dict[tuple, list[torch.Tensor]] = {}
    for grad in grads:
        grouped.setdefault((grad.device, grad.dtype), []).append(grad)
    return grouped, kept


def grads_of(optimizer) -> tuple:
    """The gradient tensors of the optimizer's parameters that have one."""
    return tuple(g for group in optimizer.param_groups for p in group["params"] if (g := p.grad) is not None)

def same_tensors(a: tuple, b: tuple) -> bool:
    return len(a) == len(b) and all(x is y for x, y in zip(a, b))

def any_flag(flags, device: torch.device) -> torch.Tensor:
    """One inf flag on ``device`` from several 1.0/0.0 flags (per device, per optimizer).

    Their max, not their sum: it stays 1.0 or 0.0, and fused optimizers skip a step only
    when ``found_inf == 1.0`` (two overflowing devices would sum to 2.0 and step). A lone
    flag already on ``device`` is returned as is (no kernel); each further one costs one
    ``maximum`` (plus a copy if it lives elsewhere). No sync.
    """
    total = None
    for flag in flags:
        if flag.device != device:
            flag = flag.to(device, non_blocking=True)
        total = flag if total is None else torch.maximum(total, flag)
    return total

def finite_probes(grads: list[torch.Tensor]) -> list[torch.Tensor]:
    """Scalars, read from ``grads`` without writing them, non-finite iff a grad holds inf/NaN.

    max |g| (the inf-norm, NaN-propagating) of every non-empty gradient: one multi-tensor
    kernel on CUDA. The CPU's ``_foreach_norm`` is a scalar loop (about 20x slower than
    torch's check), so there it is (min, max) per gradient, vectorized and NaN-propagating.
    ``grads`` are plain tensors (DTensors' local shards: see ``found_inf``).
    """
    grads = [g for g in grads if g.numel()]  # an empty gradient holds nothing to check
    if not grads:
        return []
    if grads[0].device.type != "cpu":
        return inf_norms(grads)
    return [m for g in grads for m in torch.aminmax(g)]

def inf_norms(grads: list[torch.Tensor]) -> list[torch.Tensor]:
    """max |g| of every gradient of one (device, dtype) group: one multi-tensor kernel.

    torch's check kernel has no bfloat16 on CUDA, so bfloat16 norms come out of the same
    kernel as float32 (``dtype=``; it reduces in float32 anyway): the max of bfloat16
    values is exact in float32, and inf and NaN stay inf and NaN. No extra kernel per
    gradient (a ``.float()`` each), no sync.
    """
    if grads[0].dtype == torch.bfloat16:
        return list(torch._foreach_norm(grads, math.inf, dtype=torch.float32))
    return list(torch._foreach_norm(grads, math.inf))
