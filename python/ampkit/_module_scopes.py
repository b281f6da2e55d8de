"""Module scopes at run time: the hooks of ``policy.apply(model)`` enter nested regions.

The scopes themselves (``ModuleScope``, parsing, matching a model) are values of
ampkit._module_policy; entering a scope means entering a region (ampkit._region, what
``ampkit.autocast`` enters once it has checked its arguments), so the hooks live here,
above the engine and below the Policy type, whose ``apply`` builds them. In code that
torch.compile traces (a compiled model), a hook of a scope that leaves autocast on enters
the traced form of its region instead (ampkit._compiled_regions.enter_traced: a handler
over a table built at trace time, on top of the enclosing region's), so the scope costs
no graph break; the chain's policy is built when the scopes are applied, so the traced
hook only looks it up. A pin (autocast off) still enters a Region there: a graph break.

>>> import torch, ampkit
>>> model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))
>>> p = ampkit.load_policy("torch_default").with_module("1", pin="float32")
>>> with ModuleScopes(p, model), ampkit.autocast("cpu"):
...     y = model(torch.randn(3, 4))
>>> y.dtype
torch.float32
"""

from __future__ import annotations

import threading

import torch

from ampkit._compiled_regions import enter_traced
from ampkit._module_policy import resolve
from ampkit._region import Region, check_policy_args


class _ThreadState(threading.local):
    """This thread's scope chain and, per entered scope, the devices autocast was on for.
    Both exist from a thread's first look, so that the first forward and the next read the
    same attributes (a compiled model guards on what its hooks read: no recompile)."""

    def __init__(self):
        self.chain = []
        self.devs = []


_tls = _ThreadState()
_is_compiling = torch.compiler.is_compiling


def _chain() -> list:
    return _tls.chain


def deciding_scope(op) -> str:
    """The pattern of the scope that decides ``op`` at this point of this thread's forward,
    "" when none does (the policy's own tables decide)."""
    chain = _tls.chain
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


def _nested_chains(targets) -> list:
    """The chain of scopes each target runs under when modules nest as the model's names
    say: the scopes of its scoped ancestors, outermost first, then its own."""
    by_name = {n: scope for n, _, scope in targets}
    chains = []
    for name, _, scope in targets:
        outer = sorted((n for n in by_name if name.startswith(n + ".")), key=len)
        chains.append([by_name[n] for n in outer] + [scope])
    return chains


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
        for chain in _nested_chains(self.targets):  # built here, so that traced hooks find them
            self._policy_for(chain)
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
        def pre(module, args, kwargs):
            # the devices autocast is on for, with their dtype; inside a pinned scope the
            # enclosing scope's devices (autocast is off there, but an inner scope may turn it on)
            devs = {d: torch.get_autocast_dtype(d) for d in ("cpu", "cuda") if torch.is_autocast_enabled(d)}
            outer = _tls.devs
            outer_pinned = False
            if outer:
                outer_pinned = any(d not in devs for d in outer[-1])
                devs = {**outer[-1], **devs}
            chain = _chain()
            chain.append(scope)
            # traced (no graph break): the chain's policy built before the trace (its id() keys
            # the traced table) and torch's autocast state unchanged (enabled, the enclosing
            # dtype); else the eager Region (a graph break in traced code): a chain the model's
            # nesting did not predict, a pin, or a scope inside a pin
            traced = _is_compiling() and scope.pin is None and not outer_pinned \
                and tuple(s.pattern for s in chain) in self._cache
            regions = []
            try:
                if devs:
                    pol = self._policy_for(chain)
                    enabled = scope.pin is None
                    for d, dt in devs.items():
                        dt = check_policy_args(d, dt, enabled, None, pol)[0]
                        if traced:  # the eager Region compiles tables: code dynamo cannot trace
                            regions.extend(enter_traced(d, dt, enabled, pol))
                        else:
                            r = Region(d, dt, enabled, None, pol)
                            r.__enter__()
                            regions.append(r)
            except BaseException:
                for r in reversed(regions):
                    r.__exit__(None, None, None)
                chain.pop()
                raise
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
