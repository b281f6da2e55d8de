"""Python functions of torch whose body can reach an op a region changes: seen through.

``F.multi_head_attention_forward`` or ``torch.functional.einsum`` call listed ops from
Python. Their ``has_torch_function`` guards would hand the whole call to the handler as
one unlisted op; a region instead runs a clone of such a function whose guards return
False, with the handler mode re-pushed, so each call in its body is cast by its own rule.
"""

from __future__ import annotations

import dis
import functools
import types

from ampkit import _ops

_GUARDS = ("has_torch_function", "has_torch_function_unary", "has_torch_function_variadic")


def _never(*args, **kwargs):
    return False


def _code_names(code, acc):
    acc.update(code.co_names)
    for c in code.co_consts:
        if isinstance(c, types.CodeType):
            _code_names(c, acc)
    return acc


@functools.lru_cache(maxsize=None)
def _uses_matmul_operator(code) -> bool:
    for ins in dis.get_instructions(code):
        if ins.opname == "BINARY_MATRIX_MULTIPLY" or (ins.opname == "BINARY_OP" and ins.argrepr in ("@", "@=")):
            return True
    return any(_uses_matmul_operator(c) for c in code.co_consts if isinstance(c, types.CodeType))


def reaches(func, names, memo) -> bool:
    """Can the body of Python function ``func`` call an op named in ``names``?

    Static and conservative: the names its code (and nested code) mentions, the
    ``@`` operator, and recursively the torch Python functions it refers to.
    """
    hit = memo.get(func)
    if hit is not None:
        return hit
    memo[func] = False  # cycles
    code = func.__code__
    seen = _code_names(code, set())
    found = bool(seen & names) or ("matmul" in names and _uses_matmul_operator(code))
    if not found:
        g = func.__globals__
        refs = [g.get(n) for n in seen] + [c.cell_contents for c in (func.__closure__ or ()) if _cell_ok(c)]
        for r in refs:
            if isinstance(r, types.FunctionType) and (r.__module__ or "").startswith("torch") and reaches(r, names, memo):
                found = True
                break
    memo[func] = found
    return found


def _cell_ok(cell):
    try:
        cell.cell_contents
        return True
    except ValueError:
        return False


class _GuardFreeGlobals(dict):
    """A module's globals seen through: the has_torch_function* guards return False,
    every other name is read from the module at call time (never a stale copy)."""

    __slots__ = ("module_globals",)

    def __init__(self, module_globals):
        super().__init__({n: _never for n in _GUARDS if n in module_globals})
        self["__builtins__"] = module_globals.get("__builtins__", __builtins__)
        self.module_globals = module_globals

    def __missing__(self, name):
        return self.module_globals[name]


_guardfree_globals: dict = {}  # id(module globals) -> _GuardFreeGlobals: one per torch module


def guardfree(func):
    """A clone of ``func`` whose has_torch_function* guards return False."""
    key = id(func.__globals__)
    g = _guardfree_globals.get(key)
    if g is None or g.module_globals is not func.__globals__:
        g = _guardfree_globals[key] = _GuardFreeGlobals(func.__globals__)
    clone = types.FunctionType(func.__code__, g, func.__name__, func.__defaults__, func.__closure__)
    clone.__kwdefaults__ = func.__kwdefaults__
    return clone


def run_inside(mode, active, target, func):
    """Action: run ``target`` with ``mode`` re-pushed so its inner torch calls are seen
    (``active``: the funcs running this way now in this thread, a set)."""

    def act(f, args, kwargs):
        if func in active:  # re-entered through a guard we could not remove: run natively
            return f(*args, **kwargs)
        active.add(func)
        mode.__enter__()
        try:
            return target(*args, **kwargs)
        finally:
            mode.__exit__(None, None, None)
            active.discard(func)

    act.rule = "composite"
    act.op = _ops.op_name(func)
    return act
