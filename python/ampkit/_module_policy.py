"""Policies per module: rules scoped to a model's qualified module names.

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
import threading

import torch

from ampkit import _ops
from ampkit._errors import PolicyError

# ampkit.autocast, set by ampkit._autocast when it is imported (the package imports it
# first): the scopes' hooks enter regions, and an import of _autocast from here would run
# back up the house (_autocast -> _policy -> this module)
REGION = [None]

PINS = ("float32",)
SCOPE_CATEGORIES = ("lower_precision_fp", "fp32", "fp32_output", "promote")
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


# -- running --------------------------------------------------------------------
_tls = threading.local()


def _chain() -> list:
    try:
        return _tls.chain
    except AttributeError:
        _tls.chain = []
        return _tls.chain


def deciding_scope(op) -> str:
    """The pattern of the scope that decides ``op`` at this point of this thread's forward,
    "" when none does (the policy's own tables decide)."""
    chain = getattr(_tls, "chain", None)
    if not chain:
        return ""
    for s in reversed(chain):
        if s.pin or (op is not None and s.category(op) is not None):
            return s.pattern
    return ""


def _to_fp32(x, devs):
    if isinstance(x, torch.Tensor) and x.is_floating_point() and x.dtype in (torch.float16, torch.bfloat16) \
            and x.device.type in devs:
        return x.float()
    if isinstance(x, (list, tuple)) and type(x) in (list, tuple):
        return type(x)(_to_fp32(v, devs) for v in x)
    return x


class ModuleScopes:
    """The hooks of ``policy.apply(model)``; ``remove()`` (or leaving its ``with``) removes
    them. Entering it again after removal installs them again."""

    def __init__(self, policy, model):
        self.policy = policy
        self.model = model
        self.base = policy.without_modules()
        self.targets = resolve(policy.modules, model)  # raises before anything is installed
        self._handles = []
        self._cache = {}
        self.install()

    @property
    def installed(self) -> bool:
        return bool(self._handles)

    def install(self):
        if self._handles:
            return self
        for name, mod, scope in self.targets:
            stack = []
            self._handles.append(mod.register_forward_pre_hook(self._pre(scope, stack), with_kwargs=True))
            self._handles.append(mod.register_forward_hook(self._post(stack), always_call=True))
        return self

    def remove(self):
        for h in self._handles:
            h.remove()
        self._handles = []

    def __enter__(self):
        return self.install()

    def __exit__(self, *exc):
        self.remove()
        return False

    def _policy_for(self, chain):
        key = tuple(s.pattern for s in chain)
        pol = self._cache.get(key)
        if pol is None:
            pol = self.base
            for s in chain:
                if s.ops:
                    pol = pol.with_ops(**s.moves())
            if pol is not self.base:
                pol = pol.with_name(f"{self.base.name}[{chain[-1].pattern}]")
            self._cache[key] = pol
        return pol

    def _pre(self, scope, stack):
        autocast = REGION[0]

        def pre(module, args, kwargs):
            # the devices autocast is on for, with their dtype; inside a pinned scope the
            # enclosing scope's devices (autocast is off there, but an inner scope may turn it on)
            devs = {d: torch.get_autocast_dtype(d) for d in ("cpu", "cuda") if torch.is_autocast_enabled(d)}
            outer = getattr(_tls, "devs", None)
            if outer:
                devs = {**outer[-1], **devs}
            chain = _chain()
            chain.append(scope)
            regions = []
            try:
                if devs:
                    pol = self._policy_for(chain)
                    for d, dt in devs.items():
                        r = autocast(d, dtype=dt, enabled=scope.pin is None, policy=pol)
                        r.__enter__()
                        regions.append(r)
            except BaseException:
                for r in reversed(regions):
                    r.__exit__(None, None, None)
                chain.pop()
                raise
            if not hasattr(_tls, "devs"):
                _tls.devs = []
            _tls.devs.append(devs)
            stack.append(regions)
            if scope.pin and devs:
                return _to_fp32(tuple(args), devs), {k: _to_fp32(v, devs) for k, v in kwargs.items()}
            return None

        return pre

    def _post(self, stack):
        def post(module, args, output):
            if not stack:  # the pre-hook raised before it pushed
                return None
            for r in reversed(stack.pop()):
                r.__exit__(None, None, None)
            chain = _chain()
            chain.pop()
            devs = _tls.devs.pop()
            if chain and chain[-1].pin and devs:  # back into a pinned module: float32 again
                return _to_fp32(output, devs)
            return None

        return post

    def __repr__(self):
        state = "installed" if self._handles else "removed"
        return f"<ampkit module scopes of {self.policy.name!r} on {len(self.targets)} modules, {state}>"
