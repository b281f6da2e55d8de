"""Op names -> the Python callables a user reaches them by.

A spec names ops the way users call them (``linear``, ``matmul``,
``linalg.vector_norm``). The engine sees callables (``torch._C._nn.linear``,
``Tensor.matmul``, ``F.softmax`` ...), so each name is resolved once to every
public callable that reaches the same op:

- ``torch.<name>`` and ``torch._C._VariableFunctions.<name>``
- ``torch.nn.functional.<name>`` and ``torch._C._nn.<name>``
- ``torch.Tensor.<name>`` plus its operator dunders (``__matmul__`` ...)
- for dotted names ``linalg.x`` / ``fft.x`` / ``special.x``: ``torch.linalg.x``
  and ``torch._C._linalg.linalg_x`` (same for fft and special)
- functions registered with :func:`ampkit.op`.

>>> import torch
>>> torch.nn.functional.linear in resolve("linear")
True
"""

from __future__ import annotations

import difflib

import torch

from ampkit._errors import PolicyError

# Operator dunders that reach the same op as a named method.
_DUNDERS = {
    "matmul": ("__matmul__", "__rmatmul__"),
    "add": ("__add__", "__radd__"),
    "sub": ("__sub__", "__rsub__"),
    "mul": ("__mul__", "__rmul__"),
    "div": ("__truediv__", "__rtruediv__"),
    "pow": ("__pow__", "__rpow__"),
}
# Python names whose ATen op has another name (users call the left one).
_ALIASES = {
    "cross_entropy": ("cross_entropy_loss",),
    "grid_sample": (),
    "lu": ("_lu_with_info",),
}
_NAMESPACES = {"linalg": "_linalg", "fft": "_fft", "special": "_special"}

# name -> callable registered by ampkit.op (filled by ampkit._user_ops.op)
USER_OPS: dict = {}
VERSION = [0]  # bumped on each registration


def _is_op(obj) -> bool:
    return callable(obj) and not isinstance(obj, type)


def resolve(name: str) -> tuple:
    """Every callable that reaches op ``name``; empty if none."""
    found = []

    def add(obj):
        if obj is not None and _is_op(obj) and obj not in found:
            found.append(obj)

    if name in USER_OPS:
        add(USER_OPS[name])
        return tuple(found)
    if "." in name:
        ns, attr = name.split(".", 1)
        if ns in _NAMESPACES and "." not in attr:
            add(getattr(getattr(torch, ns), attr, None))
            cmod = getattr(torch._C, _NAMESPACES[ns], None)
            add(getattr(cmod, f"{ns}_{attr}", None))
        return tuple(found)
    if name.startswith("__"):
        return tuple(found)
    for n in (name,) + _ALIASES.get(name, ()):
        add(getattr(torch, n, None) if not _is_module(torch, n) else None)
        add(getattr(torch._C._VariableFunctions, n, None))
        add(getattr(torch.nn.functional, n, None) if not _is_module(torch.nn.functional, n) else None)
        add(getattr(torch._C._nn, n, None))
        add(getattr(torch.Tensor, n, None))
    for d in _DUNDERS.get(name, ()):
        add(getattr(torch.Tensor, d, None))
    return tuple(found)


def _is_module(mod, attr) -> bool:
    import types

    return isinstance(getattr(mod, attr, None), types.ModuleType)


def known_names() -> list:
    """Names usable for close-match suggestions (not exhaustive)."""
    names = set(USER_OPS)
    for mod in (torch, torch.nn.functional, torch._C._nn):
        names.update(n for n in dir(mod) if not n.startswith("__"))
    names.update(n for n in dir(torch.Tensor) if not n.startswith("_"))
    for ns in _NAMESPACES:
        names.update(f"{ns}.{n}" for n in dir(getattr(torch, ns)) if not n.startswith("_"))
    return sorted(names)


def check_name(name, where: str) -> tuple:
    """Resolve ``name`` or raise PolicyError with close matches."""
    if not isinstance(name, str) or not name:
        raise PolicyError(f"{where}: op name must be a non-empty string, got {name!r}")
    found = resolve(name)
    if not found:
        close = difflib.get_close_matches(name, known_names(), n=4, cutoff=0.75)
        hint = f"; did you mean {', '.join(repr(c) for c in close)}?" if close else ""
        raise PolicyError(
            f"{where}: unknown op {name!r} (not found as torch.{name}, torch.nn.functional.{name}, "
            f"Tensor.{name}, torch.linalg/fft/special.*, nor registered with ampkit.op){hint}"
        )
    return found


def op_name(func) -> str:
    """A readable name for an intercepted callable (for traces)."""
    name = getattr(func, "__name__", None) or type(func).__name__
    qual = getattr(func, "__qualname__", "")
    if qual.startswith(("TensorBase.", "Tensor.")) or type(func).__name__ in ("method_descriptor", "wrapper_descriptor"):
        return "Tensor." + name
    return name


def dunders(name: str) -> tuple:
    """The Tensor operator methods that reach op ``name`` (``__matmul__`` for matmul)."""
    return _DUNDERS.get(name, ())
