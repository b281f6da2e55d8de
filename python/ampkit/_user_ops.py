"""``ampkit.op``: a user function made an op that policies can list by name.

The registry of names lives in ``ampkit._ops`` (``USER_OPS``: name -> wrapper, what a
policy's name resolves to); :data:`ORIGINALS` maps each wrapper back to the function it
wraps, which a region runs in its body when the policy does not list the op.
"""

from __future__ import annotations

import functools

from torch.overrides import handle_torch_function, has_torch_function

from ampkit import _native, _ops

ORIGINALS: dict = {}  # wrapper -> the user's function


def op(fn=None, *, name=None, replace=False):
    """Make a user function an op that policies can list under ``name``.

    Inside an ampkit region the function takes part in torch's function dispatch,
    so a policy can put it in a category (its inputs are then cast and its body
    runs as one leaf op, with autocast off, like a native op). Unlisted, its body
    runs in the region. Outside regions it behaves exactly as before; torch is never
    patched. Register before building a policy that names it.

    A name is registered once: registering another function under a taken name raises
    ``ValueError`` (the first registration stays and keeps working) unless
    ``replace=True`` (re-running a notebook cell, say); the replaced wrapper is then an
    unlisted op. Registering the same function again returns its wrapper.

    >>> import torch, ampkit
    >>> @ampkit.op
    ... def toy_attention(q, k, v):
    ...     return torch.softmax(q @ k.transpose(-2, -1), -1) @ v
    >>> policy = ampkit.load_policy("torch_default").with_ops(lower_precision_fp=["toy_attention"])
    >>> q = torch.randn(2, 3, 4)
    >>> with ampkit.autocast("cpu", policy=policy):
    ...     toy_attention(q, q, q).dtype
    torch.bfloat16
    """
    if not isinstance(replace, bool):
        raise TypeError(f"ampkit.op: replace must be True or False, got {replace!r}")
    if isinstance(fn, str) and name is None:
        return functools.partial(op, name=fn, replace=replace)
    if fn is None:
        return functools.partial(op, name=name, replace=replace)
    if not callable(fn):
        raise TypeError(f"ampkit.op: expected a function to register, got {fn!r}")
    if name is None:
        name = getattr(fn, "__name__", None)
    if not isinstance(name, str) or not name.isidentifier():
        raise ValueError(f"ampkit.op: op name must be an identifier, got {name!r}")
    if name not in _ops.USER_OPS and _ops.resolve(name):
        raise ValueError(f"ampkit.op: {name!r} already names a torch op; register your function under another name")
    taken = _ops.USER_OPS.get(name)
    if taken is not None and ORIGINALS.get(taken) is fn:
        return taken  # the same function again: nothing to change
    if taken is not None and not replace:
        first = ORIGINALS.get(taken)
        raise ValueError(
            f"ampkit.op: the name {name!r} is already registered for "
            f"{getattr(first, '__module__', '?')}.{getattr(first, '__qualname__', first)!r}; "
            "pass replace=True to register this function in its place (the first one then "
            "runs as an unlisted op), or register it under another name")

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        if kwargs:
            rel = args + tuple(kwargs.values())
        else:
            rel = args
        if has_torch_function(rel):
            return handle_torch_function(wrapper, rel, *args, **kwargs)
        return fn(*args, **kwargs)

    old = _ops.USER_OPS.get(name)
    if old is not None:
        ORIGINALS.pop(old, None)
    _ops.USER_OPS[name] = wrapper
    ORIGINALS[wrapper] = fn
    _ops.VERSION[0] += 1  # compiled tables are keyed by it: rebuilt on next region entry
    _native.forget()
    wrapper.ampkit_op_name = name
    return wrapper
