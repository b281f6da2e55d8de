"""The engine of one thread: its stack of regions, the handler mode, compiled tables, cast cache.

A region entered with (device_type, enabled, dtype, policy, cache_enabled) becomes a
:class:`Level` on this thread's :class:`Engine`: the frame of the per-device state it
builds (shared between regions entered with the same arguments from the same parent), the
kind of table it uses, its checkpoint tokens, the kernels it holds and whether it pushed
the handler mode. A Region (ampkit._region) drives it; torch's own autocast state is
set there, not here.
"""

from __future__ import annotations

import torch
from torch.overrides import TorchFunctionMode

from ampkit import _kernel_bridge, _kernels, _ops
from ampkit._bounded import BoundedCache
from ampkit._cast_tables import DELTA, KERNELS, REFERENCE, TRACE, Table, compile_table
from ampkit._checkpoint_guard import checkpoint_token
from ampkit._per_thread import per_thread

_is_compiling = torch.compiler.is_compiling
# The frozen table of the region last entered or left eagerly in any thread: what traced
# code reads (written by Engine._use, read by Mode.__torch_function__ while compiling)
_COMPILE_TABLE = [{}]
_CACHE_LIMIT = 64  # entries of each cache keyed by a policy (e.g. a fresh policy built every step)


class Frame:
    """The per-device ampkit state of one nesting level (immutable once built).

    Frames are shared: the child of a frame for one region's arguments is built once
    and kept, with its compiled table per kind, so entering a region again is a few
    dict lookups."""

    __slots__ = ("devs", "children", "tables", "plain")

    def __init__(self, devs):
        # devs: {device_type: (enabled, dtype, policy, cache_enabled)}
        self.devs = devs
        # (device_type, enabled, dtype, id(policy), cache, registry version) -> Frame: keyed
        # by id() (a Policy hashes in Python); the child holds its policy, so the id is not
        # reused while the entry lives
        self.children = BoundedCache(_CACHE_LIMIT)
        self.tables = {}  # kind -> Table
        # The children whose region is torch's autocast alone (a table that changes nothing
        # and holds no kernel), by the region's own arguments: (device_type, enabled, dtype,
        # id(policy argument), cache) -> PlainEntry. Entering one of them again is
        # Engine.push's fast path.
        self.plain = BoundedCache(_CACHE_LIMIT)

    def child(self, key, policy):
        frame = self.children.get(key)
        if frame is None:
            devs = dict(self.devs)
            devs[key[0]] = (key[1], key[2], policy, key[4])
            frame = self.children.put(key, Frame(devs))
        return frame


class PlainEntry:
    """A child region that leaves everything to torch's autocast, as entered from its parent."""

    __slots__ = ("policy", "version", "frame", "kind", "table")

    def __init__(self, policy, version, frame, kind, table):
        self.policy = policy  # the policy argument (its id() is the key: held so it is not reused)
        self.version = version  # _ops.VERSION when it was built
        self.frame = frame
        self.kind = kind
        self.table = table


class Level:
    """One entered region on a thread's stack (a class with slots, not a NamedTuple: it is
    built on every region entry, and builds in about half a NamedTuple's time)."""

    __slots__ = ("frame", "kind", "tokens", "held", "owns")

    def __init__(self, frame, kind, tokens, held, owns):
        self.frame = frame  # the Frame of the per-device state
        self.kind = kind  # its table kind: REFERENCE inside reference(), else KERNELS or DELTA
        # per device, the torch checkpoint the region setting that device was entered in
        # (see ampkit._checkpoint_guard)
        self.tokens = tokens
        self.held = held  # the kernels its region holds (_kernels.acquire's records)
        self.owns = owns  # whether its region pushed the handler mode


_CANONICAL = BoundedCache(_CACHE_LIMIT)  # Policy -> the first Policy seen equal to it
_CANONICAL_BY_ID = BoundedCache(_CACHE_LIMIT)  # id(Policy) -> (Policy, its canonical Policy)


def canonical(policy):
    """The first policy seen equal to ``policy``: equal policies share frames and their
    compiled tables (a policy rebuilt every step compiles nothing again), and frames key
    it by id() (a Policy hashes in Python; the entry holds it, so the id is not reused)."""
    hit = _CANONICAL_BY_ID.get(id(policy))
    if hit is not None and hit[0] is policy:
        return hit[1]
    canon = _CANONICAL.get(policy)
    if canon is None:
        canon = _CANONICAL.put(policy, policy)
    _CANONICAL_BY_ID.put(id(policy), (policy, canon))
    return canon


class Engine:
    """The state of one thread: its :class:`Level` stack (the root first), the mode,
    compiled tables, the cast cache. A region is entered and left with one append and one
    pop of ``levels``."""

    def __init__(self):
        self.levels = [Level(Frame({}), DELTA, {}, (), False)]
        self.tokens = {}  # the innermost level's checkpoint tokens (read by every delta action)
        self.cache = {}  # (id(fp32 leaf), dtype) -> (leaf, cast)
        self.trace = None
        self.reference = 0  # > 0 inside reference(): regions entered there use REFERENCE
        self.active_clones = set()
        self.mode = Mode(self)
        self.mode_pushed = False
        self.kernels = _kernel_bridge.innermost()  # the innermost frame's kernel actions

    @property
    def depth(self):
        return len(self.levels) - 1

    def push(self, device_type, enabled, dtype, policy, cache_enabled):
        levels = self.levels
        top = levels[-1]
        parent = top.frame
        plain = parent.plain.get((device_type, enabled, dtype, id(policy), cache_enabled))
        if (plain is not None and plain.policy is policy and plain.version == _ops.VERSION[0]
                and self.trace is None and not self.reference and not self.mode_pushed
                and device_type not in top.tokens):
            # A region that leaves everything to torch's autocast, entered before from this
            # parent: what the slow path below would do, without its lookups (no kernels, no
            # checkpoint token, the mode stays off; the tokens stay the parent's).
            levels.append(Level(plain.frame, plain.kind, top.tokens, (), False))
            self._show(plain.table)
            return
        caller_policy = policy
        hit = _CANONICAL_BY_ID.get(id(policy))  # canonical(policy), its common case inline
        policy = hit[1] if hit is not None and hit[0] is policy else canonical(policy)
        key = (device_type, enabled, dtype, id(policy), cache_enabled, _ops.VERSION[0])
        frame = parent.children.get(key) or parent.child(key, policy)
        if self.reference:
            kind = REFERENCE
        else:
            known = frame.tables.get(KERNELS)
            if known is not None and not known.kernels:  # nothing runs as a kernel: the two kinds agree
                kind = KERNELS
            else:
                kind = KERNELS if _kernels.ENABLED[0] and not _kernels.dynamo_used() else DELTA
        table = self._use(frame, kind)  # (compiling a table may raise: nothing is changed then)
        try:
            held = _kernels.acquire(table.kernels, _kernel_bridge.kernel_for) if table.kernels else ()
        except BaseException:
            self._use(parent, top.kind)
            raise
        changes = table.changes or table.kernels
        tokens = top.tokens
        if changes or device_type in tokens:
            tokens = dict(tokens)
            tokens[device_type] = checkpoint_token() if changes else None
        owns = not self.mode_pushed and bool(self.mode.real_size or self.trace is not None)
        levels.append(Level(frame, kind, tokens, held, owns))
        self.tokens = tokens
        if owns:
            self.mode.__enter__()
            self.mode_pushed = True
        elif not changes and self.trace is None and not self.reference and kind != REFERENCE:
            parent.plain.put((device_type, enabled, dtype, id(caller_policy), cache_enabled),
                             PlainEntry(caller_policy, key[5], frame, kind, table))

    def pop(self):
        levels = self.levels
        left = levels.pop()
        if left.owns:
            self.mode_pushed = False
            self.mode.__exit__(None, None, None)
        top = levels[-1]
        self.tokens = top.tokens
        outermost = len(levels) == 1
        if outermost:
            self.cache.clear()
        table = top.frame.tables.get(top.kind) if self.trace is None else None
        if table is not None:  # compiled already, no trace: _use without its lookups
            self._show(table)
        else:
            self._use(top.frame, top.kind)
        if left.held:
            _kernels.release(left.held)
        if outermost:
            _kernels.forget_compiled_if_traced()

    def _use(self, frame, kind):
        """Make ``frame``'s table of ``kind`` (compiled on first use) the one calls see, or,
        while a trace records, its TRACE table behind the recorder; returns it."""
        tables = frame.tables
        table = tables.get(kind)
        if table is None:
            table = tables[kind] = compile_table(self, frame.devs, DELTA if kind == KERNELS else kind,
                                                 kernels=kind == KERNELS)
        if self.trace is None or kind == REFERENCE:
            self._show(table)
            return table
        self.kernels.acts = table.kernel_acts  # (NO_KERNELS but for a KERNELS table)
        table = tables.get(TRACE)  # every listed op goes to the recorder
        if table is None:
            table = tables[TRACE] = compile_table(self, frame.devs, TRACE)
        mode = self.mode
        mode.table = mode.recording
        mode.real = table
        mode.real_size = table.changes
        _COMPILE_TABLE[0] = table.frozen
        return table

    def _show(self, table):
        """Make a compiled ``table`` the one calls and kernels see (no trace recording).
        Region entry and exit call it directly where they hold the table already (the plain
        fast path, a parent's compiled table): _use's lookups are measurable there."""
        self.kernels.acts = table.kernel_acts  # (NO_KERNELS but for a KERNELS table)
        mode = self.mode
        mode.real = mode.table = table
        mode.real_size = table.changes
        _COMPILE_TABLE[0] = table.frozen

    def set_trace(self, tr):
        """Start or stop recording; returns whether the mode was pushed for it."""
        prev, self.trace = self.trace, tr
        top = self.levels[-1]
        try:
            self._use(top.frame, top.kind)
        except BaseException:
            self.trace = prev
            raise
        if tr is not None and not self.mode_pushed and len(self.levels) > 1:
            self.mode.__enter__()
            self.mode_pushed = True
            return True
        return False

    def drop_trace_push(self):
        self.mode_pushed = False
        self.mode.__exit__(None, None, None)

    def state(self, device_type):
        return self.devs().get(device_type)

    def devs(self) -> dict:
        """{device_type: (enabled, dtype, policy, cache_enabled)} of the innermost region."""
        return self.levels[-1].frame.devs


thread_engine = per_thread(
    Engine, "This thread's engine: its stack of regions, its trace and its cast cache.")


class Mode(TorchFunctionMode):
    """The one handler. Kept minimal: it runs for every torch call while pushed."""

    def __init__(self, engine):
        super().__init__()
        self.engine = engine
        self.table = Table(engine)  # what calls look up: ``real``, or the recorder while tracing
        self.real = self.table
        self.real_size = 0
        self.recording = _Recording(engine)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if _is_compiling():
            act = _COMPILE_TABLE[0].get(func)
        else:
            try:
                act = self.table[func]  # a first-seen func is classified once (Table.__missing__)
            except TypeError:  # an unhashable callable: never listed, run as is
                act = None
        if act is None:
            return func(*args, **kwargs) if kwargs else func(*args)
        return act(func, args, kwargs or {})


class _Recording(dict):
    """The table while a trace is active: every call goes to the recorder."""

    def __init__(self, engine):
        super().__init__()

        def record(func, args, kwargs):
            try:
                act = engine.mode.real[func]
            except TypeError:
                act = None
            return engine.trace.record_call(func, act, args, kwargs)

        self.record = record

    def __missing__(self, func):
        return self.record
