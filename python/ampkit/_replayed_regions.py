"""Regions replayed later: a checkpoint's recomputation and a custom function's backward.

torch replays its own autocast state when it recomputes a checkpointed forward or runs a
``custom_bwd`` backward, but not an ampkit policy. These wrappers carry the policies of the
regions active at forward time and enter them again around the replay.
"""

from __future__ import annotations

import functools

import torch

from ampkit._autocast import DEFAULT_POLICY, autocast
from ampkit._engine import thread_engine


def checkpoint(function, *args, use_reentrant=None, **kwargs):
    """``torch.utils.checkpoint.checkpoint`` that recomputes under the same ampkit policy.

    torch's checkpoint restores torch's own autocast state when it recomputes the
    forward (during backward, outside any ``with`` block), but not a policy's changes
    to it. This function takes the same arguments and wraps ``function`` so that the
    policies of the ampkit regions active now are applied again in the recomputation
    (torch's state itself is left to torch): gradients equal those of the same code
    without checkpointing. With the default policy it is torch's checkpoint; with a
    changed policy plain torch checkpointing raises a RuntimeError that names this
    function.

    >>> import torch, ampkit
    >>> lin = torch.nn.Linear(4, 4)
    >>> policy = ampkit.load_policy("torch_default").with_ops("cpu", fp32=["linear"])
    >>> with ampkit.autocast("cpu", policy=policy):
    ...     y = ampkit.checkpoint(lin, torch.randn(2, 4), use_reentrant=False)
    >>> y.dtype
    torch.float32
    >>> y.sum().backward()
    """
    if not callable(function):
        raise TypeError(f"ampkit.checkpoint: function must be callable, got {function!r}")
    if use_reentrant is not None and not isinstance(use_reentrant, bool):
        raise TypeError(f"ampkit.checkpoint: use_reentrant must be True, False or None, got {use_reentrant!r}")
    saved = list(thread_engine().devs().items())

    def under_policy(*a, **k):
        # ampkit's frames only: torch's autocast state is the one torch's checkpoint restores
        eng = thread_engine()
        pushed = 0
        try:
            for d, (enabled, dtype, policy, cache) in saved:
                eng.push(d, enabled, dtype, policy, cache)
                pushed += 1
            return function(*a, **k)
        finally:
            for _ in range(pushed):
                eng.pop()

    return torch.utils.checkpoint.checkpoint(under_policy, *args, use_reentrant=use_reentrant, **kwargs)


def _current_policy(device_type):
    s = thread_engine().state(device_type)
    return s[2] if s is not None else DEFAULT_POLICY


def custom_fwd(fwd=None, *, device_type: str, cast_inputs=None):
    """``torch.amp.custom_fwd`` that also carries the ampkit policy to :func:`custom_bwd`.

    With ``cast_inputs=None`` forward runs in the region it is called in and
    backward (with :func:`custom_bwd`) replays that region, policy included. With a
    dtype, the floating inputs are cast to it and forward runs with autocast off.
    ``torch.amp.custom_fwd`` itself works in ampkit regions as in torch's.
    """
    if not isinstance(device_type, str):
        raise ValueError(f"custom_fwd: device_type must be a string such as 'cuda', got {device_type!r}")
    if cast_inputs is not None and not (isinstance(cast_inputs, torch.dtype) and cast_inputs.is_floating_point):
        raise ValueError(f"custom_fwd: cast_inputs must be a floating torch.dtype or None, got {cast_inputs!r}")
    if fwd is None:
        return functools.partial(custom_fwd, device_type=device_type, cast_inputs=cast_inputs)
    inner = torch.amp.custom_fwd(fwd, device_type=device_type, cast_inputs=cast_inputs)

    @functools.wraps(fwd)
    def decorate_fwd(*args, **kwargs):
        args[0]._ampkit_policy = _current_policy(device_type)
        return inner(*args, **kwargs)

    return decorate_fwd


def custom_bwd(bwd=None, *, device_type: str):
    """``torch.amp.custom_bwd`` for ampkit: backward runs in the region forward ran in."""
    if not isinstance(device_type, str):
        raise ValueError(f"custom_bwd: device_type must be a string such as 'cuda', got {device_type!r}")
    if bwd is None:
        return functools.partial(custom_bwd, device_type=device_type)

    @functools.wraps(bwd)
    def decorate_bwd(*args, **kwargs):
        ctx = args[0]
        with autocast(
            device_type, dtype=ctx._dtype, enabled=ctx._fwd_used_autocast,
            policy=getattr(ctx, "_ampkit_policy", None),
        ):
            return bwd(*args, **kwargs)

    return decorate_bwd
