"""A region's compiled table: {torch callable: action} for the ops its policy lists.

Table kinds: the policy's delta over native (``DELTA``, what an eager region uses), the
delta with the ops that run as kernels at torch's Autocast key set apart (``KERNELS``,
ampkit._kernel_bridge), the whole policy with native on underneath (``TRACE``: every
listed op is cast in Python so that the trace can record it), the whole policy with
native off (``REFERENCE``: the YAML alone decides). An action is
``(func, args, kwargs) -> result``; each carries ``rule`` and ``op`` for the trace.

A table is built for an engine (ampkit._engine), an object giving ``mode`` (the handler
to re-push for decompositions and composites), ``active_clones``, ``cache`` (casts of
fp32 leaves) and ``tokens`` (the checkpoint each device's region was entered in).
"""

from __future__ import annotations

import types

import torch

from ampkit import _decompositions, _kernel_bridge, _narrow_casts, _native, _ops, _user_ops
from ampkit._cast_rules import first_tensor, is_inplace, on_device, rule
from ampkit._checkpoint_guard import refuse_plain_checkpoint
from ampkit._composites import guardfree, reaches, run_inside
from ampkit._rules import CATEGORIES

DELTA, TRACE, REFERENCE = "delta", "trace", "reference"
KERNELS = "delta+kernels"


class Table(dict):
    """{func: action or None}; a func seen for the first time is classified and kept."""

    names = frozenset()  # the op names of the entries (see composites.reaches)
    frozen: dict = {}  # the compiled entries alone, for traced code
    reach = None  # reaches' memo
    changes = 0  # entries that change native's result (0: no mode needed)
    kernels: dict = {}  # {(overload, device_type): action} that run as kernels instead
    kernel_acts: dict = _kernel_bridge.NO_KERNELS  # the same keyed by (id(overload), device_type)

    def __init__(self, engine):
        super().__init__()
        self.engine = engine

    def __missing__(self, func):
        act = self[func] = _classify(self.engine, func, self)
        return act


def _action(engine, name, category, device_type, cache_enabled, message, kind, recipe=None):
    """The table entry of one op on one device: (func, args, kwargs) -> result."""
    on = on_device(device_type)
    if category == "decompose":
        act = _decomposer(engine, name, on)
    else:
        cast = rule(engine.cache, name, category, device_type, cache_enabled, message,
                    recipe, lambda: engine.trace)
        get_dtype = torch.get_autocast_dtype
        is_enabled = torch.is_autocast_enabled
        live = kind != REFERENCE  # native's switch is the region's (a nested torch.autocast counts)
        guard = kind == DELTA  # a change from native that a plain checkpoint would not replay

        def act(func, args, kwargs):
            t = first_tensor(args, kwargs)
            if t is None or not on(t):
                return func(*args, **kwargs)
            if live and not is_enabled(device_type):
                return func(*args, **kwargs)
            if guard:
                refuse_plain_checkpoint(name, engine.tokens.get(device_type))
            return cast(func, args, kwargs, get_dtype(device_type))

    act.rule = category or "none"
    act.op = name
    act.on = on
    return act


def _decomposer(engine, name, on):
    """Action of an op under ``decompose``: its ATen decomposition, parts seen by the handler."""
    mode = engine.mode
    dec = _decompositions.DECOMPOSITIONS[name]

    def act(func, args, kwargs):
        t = first_tensor(args, kwargs)
        if t is None or not on(t) or kwargs.get("out") is not None:
            return func(*args, **kwargs)
        mode.__enter__()  # torch popped the mode for this handler: push it for the parts
        try:
            return dec.for_callable(func)(*args, **kwargs)
        finally:
            mode.__exit__(None, None, None)

    return act


def _dispatch(rules):
    """The action of a func listed on several enabled devices: pick by the first tensor."""
    if len(rules) == 1:  # each rule only touches tensors on its own device
        return rules[0]

    def act(func, args, kwargs):
        t = first_tensor(args, kwargs)
        if t is not None:
            for r in rules:
                if r.on(t):
                    return r(func, args, kwargs)
        return func(*args, **kwargs)

    act.rule, act.op = "/".join(r.rule for r in rules), rules[0].op
    act.on = lambda t: any(r.on(t) for r in rules)
    return act


def _entries(policy, device_type, kind):
    """[(op name, category or "decompose" or None, changes native)] that a table of ``kind`` holds.

    A DELTA table holds the ops whose handling differs from native; while its mode
    runs anyway, it also narrows casts that native makes in full (``_narrow_casts``:
    the same values, less memory), which do not change native's result.
    """
    rules = policy.rules(device_type)
    listed = [(n, cat) for cat in CATEGORIES for n in rules.ops(cat)] + [(n, "decompose") for n in rules.decompose]
    if kind == REFERENCE:
        return [(n, c, True) for n, c in listed]
    delta = _native.delta(policy, device_type)
    if kind == DELTA:
        out = [(n, c, True) for n, c in listed if n in delta]
        out += [(n, c, False) for n, c in listed if n not in delta and (
            c == "decompose" or (c == "fp32" and n in _narrow_casts.NARROWED))]
    else:
        out = [(n, c, True) for n, c in listed]
    # ops torch lists that the policy does not: run with native off
    return out + [(n, None, True) for n in sorted(delta) if not rules.category(n) and not rules.decomposes(n)]


def compile_table(engine, devs, kind, kernels=False) -> Table:
    """{func: action} for the ops of ``kind`` of every enabled device of a frame
    (``devs``: {device_type: (enabled, dtype, policy, cache_enabled)}).

    ``kernels`` (a DELTA table only): the changes that can run as kernels at torch's
    Autocast key go to ``table.kernels`` {(overload, device_type): action} instead."""
    per_func = {}
    names = set()
    changes = 0
    by_kernel = {}
    for device_type, (enabled, dtype, policy, cache_enabled) in devs.items():
        if not enabled:
            continue
        rules = policy.rules(device_type)
        for name, cat, changing in _entries(policy, device_type, kind):
            msg = rules.ban_message(name) if cat == "banned" else None
            # an entry that keeps native's result (a narrow cast) needs no checkpoint guard: as in a trace
            act = _action(engine, name, cat, device_type, cache_enabled, msg, kind if changing else TRACE,
                          rules.fp8_recipe)
            ops = _kernel_bridge.kernel_ops(name, cat, device_type) if kernels and changing else ()
            if ops:
                by_kernel.update(((op, device_type), act) for op in ops)
                continue
            changes += changing
            for func in _ops.resolve(name):
                if is_inplace(func):
                    continue
                per_func.setdefault(func, []).append(act)
                if not isinstance(func, types.FunctionType):  # builtins: ATen-style names
                    names.add(getattr(func, "__name__", name))
            names.add(name.rsplit(".", 1)[-1])
    table = Table(engine)
    table.update((f, _dispatch(acts)) for f, acts in per_func.items())
    table.names = frozenset(names)  # for reaches: the op names a composite may call
    table.reach = {}  # its memo
    table.changes = changes  # entries that change native's result (0: no mode needed)
    table.frozen = dict(table)  # what traced code reads: never grows (dynamo guards on its size)
    table.kernels = by_kernel
    # what a kernel looks up on every call: keyed by id() (an OpOverload hashes in Python;
    # overloads live as long as torch.ops)
    table.kernel_acts = {(id(op), d): act for (op, d), act in by_kernel.items()} if by_kernel else _kernel_bridge.NO_KERNELS
    return table


def _classify(engine, func, table):
    """Action for a func not in the compiled ``table`` (kept there by the caller)."""
    if is_inplace(func):
        return None
    user = _user_ops.ORIGINALS.get(func)  # (func is hashable: the table lookup that led here hashed it)
    if user is not None:  # a registered user op that the policy does not list
        return run_inside(engine.mode, engine.active_clones, user, func)
    if isinstance(func, types.FunctionType) and (getattr(func, "__module__", "") or "").startswith("torch"):
        if table.names and reaches(func, table.names, table.reach):
            return run_inside(engine.mode, engine.active_clones, guardfree(func), func)
    return None
