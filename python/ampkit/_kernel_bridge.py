"""The kernels ampkit registers at torch's Autocast key (ampkit._kernels), and what they run.

A kernel holds no region: each call asks this thread's innermost region, through the
per-thread :class:`InnermostKernels` that the engine keeps up to date, for the op's action,
and without one does what torch's own autocast does for the op. The engine imports this
module; this module knows no engine.
"""

from __future__ import annotations

import torch

from ampkit import _cast_rules, _kernels, _narrow_casts, _native
from ampkit._per_thread import per_thread

Tensor = torch.Tensor
NO_KERNELS: dict = {}  # the acts of a region that runs no kernel


class InnermostKernels:
    """This thread's innermost region's kernel actions: {(id(overload), device_type): action}
    (keyed by id(): an OpOverload hashes in Python; overloads live as long as torch.ops)."""

    __slots__ = ("acts",)

    def __init__(self):
        self.acts = NO_KERNELS


innermost = per_thread(
    InnermostKernels, "This thread's :class:`InnermostKernels` (the engine sets its ``acts``; kernels read it).")


def kernel_ops(name, category, device_type) -> tuple:
    """The ATen overloads that run op ``name``'s changed handling as kernels, or ()."""
    if category not in _kernels.CATEGORIES or device_type not in _kernels.KEYS:
        return ()
    if category == "fp32" and name in _narrow_casts.NARROWED:
        return ()
    return _kernels.overloads(name)


def kernel_for(op, device_type, name):
    """The kernel at torch's Autocast key of ``device_type`` for ``op`` (policy op ``name``):
    the innermost ampkit region's action for it, else native autocast's handling of it."""
    key = (id(op), device_type)
    native = _native_handling(op, device_type, name)
    note = _kernels.note_if_traced
    call = getattr(op, "_op", op)  # the C function OpOverload.__call__ calls: one Python frame less

    def kernel(*args, **kwargs):
        act = innermost().acts.get(key)
        if act is None:
            return native(args, kwargs)
        for a in args:
            if type(a) is not Tensor and isinstance(a, Tensor):  # a fake tensor: a compile traces
                note(args)
                break
        return act(call, args, kwargs)

    return kernel


def _native_handling(op, device_type, name):
    """(args, kwargs) -> result: what torch's own autocast does for ``op``: the shipped
    torch_default's rule for ``name`` where torch registers a kernel for the op (the drift
    check proves the two equal), else a fall-through to the kernels below autocast."""
    rules = _native.NATIVE_RULES[device_type]  # the shipped table: what native autocast does
    cat = rules.category(name)
    if cat is not None and _kernels.native_has_kernel(op, device_type):
        msg = rules.ban_message(name) if cat == "banned" else None
        rule = _cast_rules.rule({}, name, cat, device_type, False, msg)  # (no cache: native's)
        get_dtype = torch.get_autocast_dtype
        call = getattr(op, "_op", op)  # the C function OpOverload.__call__ calls
        return lambda args, kwargs: rule(call, args, kwargs, get_dtype(device_type))
    after = torch._C._dispatch_keyset_full_after(getattr(torch._C.DispatchKey, _kernels.KEYS[device_type]))
    keys_of = torch._C._dispatch_keys
    seq = _cast_rules.SEQ

    def fall_through(args, kwargs):
        ks = None
        for a in (*args, *kwargs.values()):
            for t in (a if type(a) in seq else (a,)):
                if isinstance(t, Tensor):
                    ks = keys_of(t) if ks is None else ks | keys_of(t)
        return op.redispatch(after if ks is None else after & ks, *args, **kwargs)

    return fall_through
