"""Policies per module: rules scoped to a model's qualified module names (the data).

A policy may carry module scopes, globs on the names of ``model.named_modules()``
(``head``, ``blocks.*.attn``; ``*`` matches within one dotted part, ``**`` any number
of parts). A scope moves ops between categories inside the modules it matches, or
pins them to float32 (autocast off, floating inputs cast to float32)::

    modules:
      head: {pin: float32}
      "blocks.*.attn": {fp32: [softmax, matmul]}

How it runs (``policy.apply(model)``, a handle that is also a context manager):

    apply          -> every scope must match a module (else PolicyError with close
                      matches); a module matched by two scopes with different rules is a
                      conflict (PolicyError); only then are hooks installed, on the matched
                      modules only (a policy without scopes installs nothing)
    module enters  -> chain = the scopes of the enclosing scoped modules + this one
                      for each device whose autocast is on: enter a nested
                      ampkit.autocast(device, dtype=<the enclosing dtype>,
                      policy=base.with_ops(<the chain's moves, outermost first>),
                      enabled=not <innermost scope pins>)
                      (pinned: floating inputs on that device are cast to float32)
    module exits   -> exit those regions (also when forward raises)

So the innermost scope wins: its moves are applied last, and its pin (or lack of one)
decides whether autocast is on. Outside every autocast region the hooks do nothing.
This module holds the scopes as values and matches them to a model; the hooks that
enter the regions are ampkit._module_scopes, above the autocast engine.
``ampkit.trace()`` records, per cast, the scope that decided it (``CastRecord.scope``).

>>> import torch, ampkit
>>> model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))
>>> p = ampkit.load_policy("torch_default").with_module("1", pin="float32")
>>> with p.apply(model), ampkit.autocast("cpu"):
...     y = model(torch.randn(3, 4))
>>> y.dtype
torch.float32
"""

from __future__ import annotations

import dataclasses
import difflib
import fnmatch

import torch

from ampkit import _ops
from ampkit._errors import PolicyError

PINS = ("float32",)
SCOPE_CATEGORIES = ("lower_precision_fp", "fp32", "fp32_output", "promote", "fp8")
_SCOPE_KEYS = ("pin",) + SCOPE_CATEGORIES


@dataclasses.dataclass(frozen=True)
class ModuleScope:
    """The rules of one module scope: a glob, an optional pin, and op moves.

    ``ops``: sorted ``((op, category), ...)``; ``pin``: ``"float32"`` or None."""

    pattern: str
    pin: str | None = None
    ops: tuple = ()

    def category(self, op):
        """The category this scope moves ``op`` into, or None."""
        for n, c in self.ops:
            if n == op:
                return c
        return None

    def moves(self) -> dict:
        """``{category: [ops]}`` for ``Policy.with_ops``."""
        out = {}
        for n, c in self.ops:
            out.setdefault(c, []).append(n)
        return out

    def to_dict(self) -> dict:
        d = {"pin": self.pin} if self.pin else {}
        d.update(self.moves())
        return d

    def rules(self):
        return (self.pin, self.ops)


def check_pattern(pattern, where):
    if not isinstance(pattern, str) or not pattern or pattern != pattern.strip() \
            or any(not part for part in pattern.split(".")):
        raise PolicyError(
            f"{where}: a module scope must be a dotted module name or glob such as 'head' or "
            f"'blocks.*.attn' (names of model.named_modules()), got {pattern!r}")
    return pattern


def make_scope(pattern, pin=None, categories=None, where="with_module") -> ModuleScope:
    """A validated :class:`ModuleScope` (PolicyError naming the bad value)."""
    check_pattern(pattern, where)
    if pin is not None and pin not in PINS:
        raise PolicyError(f"{where}: scope {pattern!r}: pin must be one of {', '.join(PINS)} or "
                          f"absent, got {pin!r}")
    ops = {}
    for cat, names in (categories or {}).items():
        if cat not in SCOPE_CATEGORIES:
            raise PolicyError(f"{where}: scope {pattern!r}: unknown key {cat!r}; valid: "
                              f"{', '.join(_SCOPE_KEYS)}")
        if isinstance(names, str) or not isinstance(names, (list, tuple, set, frozenset)):
            raise PolicyError(f"{where}: scope {pattern!r}: {cat} must be a list of op names, "
                              f"got {names!r}")
        for n in names:
            _ops.check_name(n, f"{where}: scope {pattern!r}, {cat}")
            if n in ops and ops[n] != cat:
                raise PolicyError(f"{where}: scope {pattern!r} puts op {n!r} in both "
                                  f"{ops[n]!r} and {cat!r}; an op belongs to one category")
            ops[n] = cat
    if pin is not None and ops:
        raise PolicyError(
            f"{where}: scope {pattern!r} both pins the module to {pin} and moves ops "
            f"({', '.join(sorted(ops))}); a pinned module runs with autocast off, so the moves "
            "would do nothing: keep one of them, or scope the moves to a submodule")
    if pin is None and not ops:
        raise PolicyError(f"{where}: scope {pattern!r} has no rules; give pin='float32' or "
                          f"op lists for some of {', '.join(SCOPE_CATEGORIES)}")
    return ModuleScope(pattern=pattern, pin=pin, ops=tuple(sorted(ops.items())))


def parse_scopes(data, where_of) -> tuple:
    """The ``modules:`` section of a policy file -> sorted tuple of ModuleScope."""
    if data is None:
        return ()
    if not isinstance(data, dict):
        raise PolicyError(f"{where_of('modules')}: modules must be a mapping of module glob to "
                          f"rules ({{pin: float32}} or category: [ops]), got {data!r}")
    out = []
    for pattern, body in data.items():
        w = where_of("modules", pattern)
        if not isinstance(body, dict):
            raise PolicyError(f"{w}: the rules of scope {pattern!r} must be a mapping with keys "
                              f"among {', '.join(_SCOPE_KEYS)}, got {body!r}")
        body = dict(body)
        pin = body.pop("pin", None)
        out.append(make_scope(pattern, pin, body, w))
    return tuple(sorted(out, key=lambda s: s.pattern))


# -- matching -----------------------------------------------------------------
def _match_parts(pat, name):
    if not pat:
        return not name
    if pat[0] == "**":
        return any(_match_parts(pat[1:], name[i:]) for i in range(len(name) + 1))
    return bool(name) and fnmatch.fnmatchcase(name[0], pat[0]) and _match_parts(pat[1:], name[1:])


def matches(pattern: str, name: str) -> bool:
    """Whether module name ``name`` matches ``pattern`` (``*`` within a part, ``**`` across).

    >>> matches("blocks.*.attn", "blocks.3.attn"), matches("blocks.*.attn", "blocks.3.x.attn")
    (True, False)
    """
    return _match_parts(pattern.split("."), name.split("."))


def resolve(scopes, model) -> list:
    """``[(name, module, scope)]`` for every module some scope matches, in model order.
    Raises PolicyError (changing nothing) for a scope that matches no module and for a
    module matched by two scopes with different rules."""
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"apply(model): model must be a torch.nn.Module, got {type(model).__name__}")
    named = [(n, m) for n, m in model.named_modules() if n]
    names = [n for n, _ in named]
    for s in scopes:
        if not any(matches(s.pattern, n) for n in names):
            close = difflib.get_close_matches(s.pattern, names, n=4, cutoff=0.5)
            hint = f"; close matches: {', '.join(close)}" if close else \
                f"; the model's modules include: {', '.join(names[:8])}{' ...' if len(names) > 8 else ''}"
            raise PolicyError(f"module scope {s.pattern!r} matches no module of the "
                              f"{type(model).__name__}{hint}")
    out = []
    for n, m in named:
        hit = [s for s in scopes if matches(s.pattern, n)]
        if len({s.rules() for s in hit}) > 1:
            a, b = hit[0], next(s for s in hit if s.rules() != hit[0].rules())
            raise PolicyError(
                f"module {n!r} is matched by two scopes with different rules, {a.pattern!r} "
                f"({a.to_dict()}) and {b.pattern!r} ({b.to_dict()}); neither is inside the "
                "other, so neither wins: make the globs disjoint or give them the same rules")
        if hit:
            out.append((n, m, hit[0]))
    return out
