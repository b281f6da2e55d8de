"""The cast of one listed op on one device, for each policy category (ATen's casts in Python).

Each category is a function ``(func, args, kwargs, dtype) -> result`` run with torch's
autocast off for the device (the op runs as a leaf on the inputs cast here):

    lower_precision_fp : cast floating non-float64 tensors on the device to the region
                         dtype (fp32 leaf params requiring grad: cached per region)
    fp32               : cast them to float32 (nll_loss on a large input: only the
                         elements it reads, ampkit._narrow_casts)
    fp32_output        : call with dtype=float32 unless a dtype is given
    promote            : cast them to the widest floating input dtype
    fp8                : input and weight cast to fp8 with a scale, as the device's recipe
                         says (ampkit._fp8); the output in the region dtype
    banned             : raise RuntimeError(message)
    (None)             : an op torch lists but the policy removed: run as is

>>> import torch
>>> act = rule({}, "mm", "fp32", "cpu", False, None)
>>> act(torch.mm, (torch.ones(2, 2, dtype=torch.bfloat16),) * 2, {}, torch.bfloat16).dtype
torch.float32
"""

from __future__ import annotations

import torch

from ampkit import _fp8, _narrow_casts, _ops
from ampkit._errors import PolicyError

Tensor = torch.Tensor
F32 = torch.float32
F16 = torch.float16
CASTABLE = frozenset(
    d for d in vars(torch).values() if isinstance(d, torch.dtype) and d.is_floating_point and d is not torch.float64
)
SEQ = (list, tuple)
_is_compiling = torch.compiler.is_compiling


def on_device(device_type):
    """A fast predicate 'tensor is on device_type' (attribute read, no device object)."""
    if device_type == "cpu":
        return lambda t: t.is_cpu or t.is_mkldnn
    if device_type == "cuda":
        return lambda t: t.is_cuda
    return lambda t: t.device.type == device_type


def first_tensor(args, kwargs):
    """The first tensor of a call (also the first of a list argument), or None."""
    for a in args:
        if isinstance(a, Tensor):
            return a
        if type(a) in SEQ and a and isinstance(a[0], Tensor):
            return a[0]
    if kwargs:
        for a in kwargs.values():
            if isinstance(a, Tensor):
                return a
            if type(a) in SEQ and a and isinstance(a[0], Tensor):
                return a[0]
    return None


def is_inplace(func) -> bool:
    """Whether ``func`` is an in-place op (``add_``, ``__iadd__``): never cast."""
    name = getattr(func, "__name__", "") or ""
    if name.startswith("__"):
        return name.startswith("__i") and name.endswith("__") and name not in ("__init__", "__index__", "__int__", "__invert__", "__iter__")
    return name.endswith("_") and not name.endswith("__")


def caster(cache, device_type, cache_enabled, cached):
    """Return cast_all(values, to) -> list: eligible tensors (also in lists) cast to ``to``.

    Mirrors ATen's cached_cast: only floating, non-float64 tensors on the device;
    fp32 leaves that require grad and are not views are cast once per outermost
    region (when ``cached`` says so: casts to the region dtype, cache enabled), kept in
    ``cache`` (the thread engine's, emptied when the outermost region exits).
    """
    on = on_device(device_type)

    def cast_t(a, to):  # a: an eligible tensor whose dtype differs from ``to``
        if (cached and cache_enabled and a.requires_grad and a.dtype is F32 and a.is_leaf
                and not torch.compiler.is_compiling() and not a._is_view()):
            key = (id(a), to)
            hit = cache.get(key)
            if hit is not None and hit[0] is a:
                return hit[1]
            out = a.to(dtype=to)
            cache[key] = (a, out)
            return out
        return a.to(dtype=to)

    def cast_all(values, to):
        out = []
        for x in values:
            if isinstance(x, Tensor):
                dt = x.dtype
                if dt is not to and dt in CASTABLE and on(x):
                    x = cast_t(x, to)
            elif type(x) in SEQ and x and isinstance(x[0], Tensor):
                x = type(x)(
                    cast_t(t, to) if isinstance(t, Tensor) and t.dtype is not to and t.dtype in CASTABLE and on(t) else t
                    for t in x
                )
            out.append(x)
        return out

    return cast_all


def widest(values, on, lower):
    """ATen's prioritize(): float32 wins, float64 is ignored, else the region dtype."""
    for a in values:
        if isinstance(a, Tensor):
            ts = (a,)
        elif type(a) in SEQ:
            ts = a
        else:
            continue
        for t in ts:
            if isinstance(t, Tensor):
                d = t.dtype
                if d is lower or d not in CASTABLE or not on(t):
                    continue
                if d is F32:
                    return F32
                raise RuntimeError(
                    f"ampkit autocast: promote op got a {d} input in a {lower} region "
                    "(native autocast raises 'Unexpected floating ScalarType in prioritize' here)"
                )
    return lower


def native_off(device_type):
    """call(func, args, kwargs) with torch's autocast off for ``device_type``: the op runs
    as a leaf on the inputs ampkit cast (native would otherwise cast them again)."""
    set_enabled = torch.set_autocast_enabled
    is_enabled = torch.is_autocast_enabled

    def call(func, args, kwargs):
        if _is_compiling():  # dynamo traces the context manager
            with torch.autocast(device_type, enabled=False):
                return func(*args, **kwargs)
        prev = is_enabled(device_type)
        if not prev:
            return func(*args, **kwargs)
        set_enabled(device_type, False)
        try:
            return func(*args, **kwargs)
        finally:
            set_enabled(device_type, True)

    return call


def rule(cache, name, category, device_type, cache_enabled, message, recipe=None, tracer=None):
    """The cast of one listed op on one device: (func, args, kwargs, dtype) -> result,
    run with native autocast off. Calls without tensors on ``device_type`` run as is.
    ``cache``: where casts of fp32 leaves are kept (see :func:`caster`). For ``fp8``:
    ``recipe``, the device's fp8 recipe, and ``tracer()``, the active trace or None."""
    on = on_device(device_type)
    call = native_off(device_type)
    if category == "lower_precision_fp" or category == "fp32":
        cast_all = caster(cache, device_type, cache_enabled, cached=category == "lower_precision_fp")
        low = category == "lower_precision_fp"

        def act(func, args, kwargs, dtype):
            to = dtype if low else F32
            if not kwargs:
                return call(func, cast_all(args, to), {})
            if kwargs.get("out") is not None:
                return func(*args, **kwargs)
            return call(func, cast_all(args, to), dict(zip(kwargs, cast_all(kwargs.values(), to))))

        if category == "fp32" and name in _narrow_casts.NARROWED:
            cast_everything = act
            narrowed = _narrow_casts.NARROWED

            def act(func, args, kwargs, dtype):
                t = first_tensor(args, kwargs)
                n = narrowed[name]  # (looked up per call: tests swap it)
                if t is not None and on(t) and n.pays(t):
                    out = call(n.run, (func, args, kwargs), {})
                    if out is not _narrow_casts.NOT_NARROWED:
                        return out
                return cast_everything(func, args, kwargs, dtype)

    elif category == "fp32_output":

        def act(func, args, kwargs, dtype):
            t = first_tensor(args, kwargs)  # torch.sum(input=x) names its tensor
            if (
                t is None or kwargs.get("dtype") is not None or kwargs.get("out") is not None or t.dtype not in CASTABLE or not on(t)
                or any(isinstance(a, torch.dtype) for a in args)
            ):
                return call(func, args, kwargs)
            kwargs = dict(kwargs)
            kwargs["dtype"] = F32
            try:
                return call(func, args, kwargs)
            except TypeError as e:
                if "dtype" not in str(e):
                    raise
                raise TypeError(
                    f"ampkit autocast: op {name!r} is in the fp32_output category, but "
                    f"{_ops.op_name(func)} takes no dtype= argument; list it under fp32 instead"
                ) from e

    elif category == "promote":
        cast_all = caster(cache, device_type, cache_enabled, cached=True)

        def act(func, args, kwargs, dtype):
            if not kwargs:
                return call(func, cast_all(args, widest(args, on, dtype)), {})
            if kwargs.get("out") is not None:
                return func(*args, **kwargs)
            to = widest((*args, *kwargs.values()), on, dtype)
            return call(func, cast_all(args, to), dict(zip(kwargs, cast_all(kwargs.values(), to))))

    elif category == "fp8":
        run = _fp8.runner(name, recipe, device_type, on)

        def act(func, args, kwargs, dtype):
            if kwargs.get("out") is not None:
                return func(*args, **kwargs)
            return call(run, (func, args, kwargs, dtype, tracer() if tracer is not None else None), {})

    elif category == "banned":

        def act(func, args, kwargs, dtype):
            raise RuntimeError(message)

    elif category is None:  # listed natively, removed by the policy: runs untouched

        def act(func, args, kwargs, dtype):
            return call(func, args, kwargs)

    else:  # pragma: no cover - categories are validated by Policy
        raise PolicyError(f"unknown category {category!r}")
    return act
