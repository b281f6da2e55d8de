"""An ampkit region made inside code that torch.compile traces.

Traced code cannot enter an ampkit region the eager way (the engine's per-thread state is
Python that dynamo would guard on). A region made there is a torch.autocast plus, for a
policy that changes native's handling, a handler over a table built once at trace time:

    trace time -> table_index(...): the region's DELTA table, compiled once per
                  (registry version, arguments, policy) and kept; -1 when it changes nothing
    run time   -> torch.autocast(...) and, for index >= 0, CompiledMode(index)

``ampkit.autocast`` made in traced code enters them as one ``with`` (compiled_region); a
module scope's hooks (ampkit._module_scopes) enter them in the forward pre-hook and exit
them in the forward hook (enter_traced). This module sits below the Policy type: it takes
a policy object and asks it only for its rules.
"""

from __future__ import annotations

import contextlib
import ctypes

import torch
from torch.overrides import TorchFunctionMode

from ampkit import _ops
from ampkit._cast_tables import DELTA, TRACE, compile_table
from ampkit._engine import thread_engine



class _Tables:
    """The frozen tables of regions entered inside compiled code, table ``i`` the attribute
    ``t<i>`` (never dropped: compiled graphs hold their index).

    Attributes, not a container: table_index runs at trace time and may add a table in the
    middle of a trace (a model whose module scopes hold several policies adds one per scope
    it reaches). Dynamo reads a dict or a list once per trace and keeps that snapshot, so a
    table added after the trace's first lookup is missing from it (KeyError: dynamo gives up
    the whole frame, and the model's shared forward code runs eagerly from then on for every
    model that uses it); it also guards on a list's length, recompiling every graph traced
    before a new table. An attribute is read when the trace reaches it and guarded alone."""

    def add(self, table) -> int:
        index = len(vars(self))
        setattr(self, table_name(index), table)
        return index


def table_name(index: int) -> str:
    return f"t{index}"


_TABLES = _Tables()
_INDEX: dict = {}  # (version, arguments, policy, kind) -> index


def _policy_with_id(policy_id: int):
    """The Policy whose id() is ``policy_id``. Called at trace time only, with the id of the
    policy the traced region holds: dynamo holds that object while it traces, so the id
    names a live object (CPython's id() is its address)."""
    policy = ctypes.cast(policy_id, ctypes.py_object).value
    if type(policy).__name__ != "Policy" or not callable(getattr(policy, "rules", None)):  # pragma: no cover
        raise TypeError(f"ampkit: id {policy_id} does not name a Policy (got {type(policy).__name__})")
    return policy


@torch._dynamo.assume_constant_result
def table_index(device_type, enabled, dtype, policy_id, cache_enabled, kind=DELTA) -> int:
    """Index in the compiled tables of a region's table of ``kind`` (its delta over native,
    or TRACE: every op the policy lists), -1 when it has none (run at trace time). The
    policy comes as its id(): torch 2.11's dynamo cannot rebuild a frozen dataclass argument
    of a trace-time function."""
    policy = _policy_with_id(policy_id)
    key = (_ops.VERSION[0], device_type, enabled, dtype, policy, cache_enabled, kind)
    index = _INDEX.get(key)
    if index is None:
        table = compile_table(thread_engine(), {device_type: (enabled, dtype, policy, cache_enabled)}, kind)
        index = -1
        if table.changes:
            index = _TABLES.add(table.frozen)
        _INDEX[key] = index
    return index


class CompiledMode(TorchFunctionMode):
    """The handler of a region inside compiled code: its table is fixed at trace time."""

    def __init__(self, index):
        super().__init__()
        self.index = index
        self.table_name = table_name(index)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        act = getattr(_TABLES, self.table_name).get(func)
        if act is None:
            return func(*args, **(kwargs or {}))
        return act(func, args, kwargs or {})


@contextlib.contextmanager
def compiled_region(device_type, dtype, enabled, cache_enabled, index):
    """A region inside traced code: torch's autocast, plus the delta's handler if any
    (index >= 0). A generator context, not a torch.autocast: some dynamo releases (2.11)
    cannot ask isinstance() of the torch.autocast that ampkit.autocast() would return."""
    with torch.amp.autocast(device_type, dtype=dtype, enabled=enabled, cache_enabled=cache_enabled):
        if index < 0:
            yield
        else:
            with CompiledMode(index):
                yield


def enter_traced(device_type, dtype, enabled, policy) -> list:
    """Enter, in traced code, the handler of a region nested in an enclosing one that has
    the same torch autocast state (``enabled``, ``dtype``: the caller checks), as a module
    scope's hooks do. Only the handler: torch's state does not change (and dynamo cannot
    trace a torch.autocast entered without a ``with``). Its table holds every op the policy
    lists (TRACE), not only its delta over native: the enclosing region's handler stays
    below it on the stack, so an op this policy gives back to native's category (a head's
    ``linear`` moved out of fp8) must be cast here, where it runs with native autocast off
    and so passes through the enclosing handler. Returns what was entered; the caller
    exits it in reverse (``__exit__(None, None, None)``)."""
    index = table_index(device_type, enabled, dtype, id(policy), torch.is_autocast_cache_enabled(), TRACE)
    if index < 0:
        return []
    mode = CompiledMode(index)
    mode.__enter__()
    return [mode]
