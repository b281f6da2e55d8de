"""The autocast engine: an ampkit region is a torch autocast region, plus the policy's delta.

How a region runs (this is the whole algorithm)::

    region enters  -> torch.autocast's own thread-local state is set (enabled, dtype,
                      cache, nesting): torch, checkpointing, custom_fwd and
                      torch.compile see an ordinary autocast region
                   -> delta = the ops whose handling in the region's policy differs
                      from torch's own table on the installed torch (_native.py; the
                      drift check proves the shipped torch_default equal to native)
    delta empty    -> nothing else: torch's C++ autocast executes every cast
    delta ops that are one ATen op (linear, mm, conv2d, cdist ...; _kernels.py)
                   -> run as kernels registered at torch's Autocast dispatch key for
                      the op while a region needs them: no other call pays anything
                      (not while torch.compile is in use in the process: see there)
    the rest of the delta (user ops, decompose, narrowed casts, fp32_output, Python
                      composites) -> push this thread's _Mode (a TorchFunctionMode)
                      whose table holds only those ops; every other call passes
                      through it to native autocast
    a delta op     -> if native autocast is off for the device (a nested
                      torch.autocast(enabled=False), custom_fwd(cast_inputs=...)),
                      run it as is; else apply the policy's category with native
                      autocast switched off for the call:
        lower_precision_fp : cast floating non-float64 tensors on the device to the
                             region dtype (fp32 leaf params requiring grad: cached)
        fp32               : cast them to float32 (nll_loss on a large input: only
                             the elements it reads, ampkit._narrow_casts)
        fp32_output        : call with dtype=float32 unless a dtype is given
        promote            : cast them to the widest floating input dtype
        banned             : raise RuntimeError(message)
        decompose          : run ampkit._decompositions' Python version of the C++
                             composite with the mode re-pushed, so each part is
                             cast by its own rule
        (unlisted)         : an op torch lists but the policy removed: run with
                             native autocast off
        Python function of torch that can reach a delta op (F.multi_head_attention_forward,
        torch.functional.einsum ...): run a clone of it whose has_torch_function guards
        return False, with the mode re-pushed, so the calls in its body are seen.
    region exits   -> pop the mode if this region pushed it, restore torch's state

Two other table kinds run the same actions over the *whole* policy instead of the
delta: the trace (``ampkit.trace()``: every listed op is cast by ampkit's Python code
so that each cast can be recorded; native stays on for the rest) and the reference
engine (:func:`reference`: native autocast off underneath, the tables alone decide;
the drift check and the table tests use it to prove the YAML equals torch).

In-place ops (``add_``, ``__iadd__``) and calls with ``out=`` are never cast.

>>> import torch, ampkit
>>> lin = torch.nn.Linear(4, 3)
>>> with ampkit.autocast("cpu"):
...     y = lin(torch.randn(2, 4))
...     with ampkit.autocast("cpu", enabled=False):
...         z = lin(torch.randn(2, 4))
>>> y.dtype, z.dtype, lin.weight.dtype
(torch.bfloat16, torch.float32, torch.float32)
"""

from __future__ import annotations

import contextlib
import dis
import functools
import inspect
import sys
import threading
import types

import torch
from torch.overrides import TorchFunctionMode, handle_torch_function, has_torch_function

from ampkit import _decompositions, _kernels, _module_policy, _narrow_casts, _native, _ops
from ampkit._policy import CATEGORIES, DEVICES, Policy, PolicyError, live_policy, load_policy

Tensor = torch.Tensor
_F32 = torch.float32
_F64 = torch.float64
_F16 = torch.float16
_CASTABLE = frozenset(
    d for d in vars(torch).values() if isinstance(d, torch.dtype) and d.is_floating_point and d is not torch.float64
)
_REGION_DTYPES = (torch.float16, torch.bfloat16)
_SEQ = (list, tuple)
_GUARDS = ("has_torch_function", "has_torch_function_unary", "has_torch_function_variadic")
# Table kinds: the policy's delta over native (the default), the whole policy with
# native on underneath (trace), the whole policy with native off (reference).
DELTA, TRACE, REFERENCE = "delta", "trace", "reference"
# The delta with the ops that can run as kernels at torch's Autocast key taken out of the
# mode's table (_kernels.py): what an eager region uses while torch.compile is not in play.
KERNELS = "delta+kernels"
_NO_KERNELS: dict = {}


def _never(*args, **kwargs):
    return False


def _on_device(device_type):
    """A fast predicate 'tensor is on device_type' (attribute read, no device object)."""
    if device_type == "cpu":
        return lambda t: t.is_cpu or t.is_mkldnn
    if device_type == "cuda":
        return lambda t: t.is_cuda
    return lambda t: t.device.type == device_type


def _first_tensor(args, kwargs):
    for a in args:
        if isinstance(a, Tensor):
            return a
        if type(a) in _SEQ and a and isinstance(a[0], Tensor):
            return a[0]
    if kwargs:
        for a in kwargs.values():
            if isinstance(a, Tensor):
                return a
            if type(a) in _SEQ and a and isinstance(a[0], Tensor):
                return a[0]
    return None


def _is_inplace(func) -> bool:
    name = getattr(func, "__name__", "") or ""
    if name.startswith("__"):
        return name.startswith("__i") and name.endswith("__") and name not in ("__init__", "__index__", "__int__", "__invert__", "__iter__")
    return name.endswith("_") and not name.endswith("__")


# --------------------------------------------------------------------------- state
class _Frame:
    """The per-device ampkit state of one nesting level (immutable once built).

    Frames are shared: the child of a frame for one region's arguments is built once
    and kept, with its compiled table per kind, so entering a region again is a few
    dict lookups."""

    __slots__ = ("devs", "children", "tables", "plain")

    def __init__(self, devs):
        # devs: {device_type: (enabled, dtype, policy, cache_enabled)}
        self.devs = devs
        # (device_type, enabled, dtype, id(policy), cache, registry version) -> _Frame: keyed
        # by id() (a Policy hashes in Python); the child holds its policy, so the id is not
        # reused while the entry lives
        self.children = {}
        self.tables = {}  # kind -> {func: action}
        # The children whose region is torch's autocast alone (a table that changes nothing
        # and holds no kernel), by the region's own arguments: (device_type, enabled, dtype,
        # id(policy argument), cache) -> (policy argument, registry version, child, kind,
        # table). Entering one of them again is Engine.push's fast path.
        self.plain = {}

    def child(self, key, policy):
        frame = self.children.get(key)
        if frame is None:
            if len(self.children) > 64:  # e.g. a fresh policy built every step
                self.children.clear()
            devs = dict(self.devs)
            devs[key[0]] = (key[1], key[2], policy, key[4])
            frame = self.children[key] = _Frame(devs)
        return frame


_CANONICAL: dict = {}  # Policy -> the first Policy seen equal to it
_CANONICAL_BY_ID: dict = {}  # id(Policy) -> (Policy, its canonical Policy)


def _canonical(policy):
    """The first policy seen equal to ``policy``: equal policies share frames and their
    compiled tables (a policy rebuilt every step compiles nothing again), and frames key
    it by id() (a Policy hashes in Python; the entry holds it, so the id is not reused)."""
    hit = _CANONICAL_BY_ID.get(id(policy))
    if hit is not None and hit[0] is policy:
        return hit[1]
    if len(_CANONICAL_BY_ID) > 64:  # e.g. a fresh policy built every step
        _CANONICAL_BY_ID.clear()
        _CANONICAL.clear()
    canon = _CANONICAL.setdefault(policy, policy)
    _CANONICAL_BY_ID[id(policy)] = (policy, canon)
    return canon


class _Engine:
    """The state of one thread: frames, the mode, compiled tables, the cast cache.

    Per nesting level (one tuple of ``levels``, the root first): its frame, its table kind
    (REFERENCE inside reference(), else KERNELS or DELTA; the trace overrides them while it
    records), per device the torch checkpoint the region setting that device was entered
    in (see _refuse_plain_checkpoint), the kernels its region holds (_kernels.acquire's
    records) and whether its region pushed the mode. One tuple, not parallel lists: a region
    is entered and left with one append and one pop."""

    def __init__(self):
        self.levels = [(_Frame({}), DELTA, {}, (), False)]
        self.tokens = {}  # the innermost level's checkpoint tokens (read by every delta action)
        self.cache = {}  # (id(fp32 leaf), dtype) -> (leaf, cast)
        self.trace = None
        self.reference = 0  # > 0 inside reference(): regions entered there use REFERENCE
        self.active_clones = set()
        self.mode = _Mode(self)
        self.mode_pushed = False
        self.kernel_acts = _NO_KERNELS  # {(id(overload), device_type): action} of the innermost frame

    @property
    def depth(self):
        return len(self.levels) - 1

    def push(self, device_type, enabled, dtype, policy, cache_enabled):
        levels = self.levels
        top = levels[-1]
        parent = top[0]
        plain = parent.plain.get((device_type, enabled, dtype, id(policy), cache_enabled))
        if (plain is not None and plain[0] is policy and plain[1] == _ops.VERSION[0]
                and self.trace is None and not self.reference and not self.mode_pushed
                and device_type not in top[2]):
            # A region that leaves everything to torch's autocast, entered before from this
            # parent: what the slow path below would do, without its lookups (no kernels, no
            # checkpoint token, the mode stays off; the tokens stay the parent's).
            frame, kind, table = plain[2:]
            levels.append((frame, kind, top[2], (), False))
            self.kernel_acts = _NO_KERNELS
            mode = self.mode
            mode.real = mode.table = table
            mode.real_size = 0
            _COMPILE_TABLE[0] = table.frozen
            return
        caller_policy = policy
        hit = _CANONICAL_BY_ID.get(id(policy))  # _canonical(policy), its common case inline
        policy = hit[1] if hit is not None and hit[0] is policy else _canonical(policy)
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
            held = _kernels.acquire(table.kernels, _kernel) if table.kernels else ()
        except BaseException:
            self._use(parent, top[1])
            raise
        changes = table.changes or table.kernels
        tokens = top[2]
        if changes or device_type in tokens:
            tokens = dict(tokens)
            tokens[device_type] = _checkpoint_token() if changes else None
        owns = not self.mode_pushed and bool(self.mode.real_size or self.trace is not None)
        levels.append((frame, kind, tokens, held, owns))
        self.tokens = tokens
        if owns:
            self.mode.__enter__()
            self.mode_pushed = True
        elif not changes and self.trace is None and not self.reference and kind != REFERENCE:
            if len(parent.plain) > 64:  # e.g. a fresh policy built every step
                parent.plain.clear()
            parent.plain[(device_type, enabled, dtype, id(caller_policy), cache_enabled)] = (
                caller_policy, key[5], frame, kind, table)

    def pop(self):
        levels = self.levels
        held, owns = levels.pop()[3:]
        if owns:
            self.mode_pushed = False
            self.mode.__exit__(None, None, None)
        top = levels[-1]
        self.tokens = top[2]
        outermost = len(levels) == 1
        if outermost:
            self.cache.clear()
        table = top[0].tables.get(top[1]) if self.trace is None else None
        if table is not None:  # _use, for a table compiled already and no trace
            self.kernel_acts = table.kernel_acts
            mode = self.mode
            mode.real = mode.table = table
            mode.real_size = table.changes
            _COMPILE_TABLE[0] = table.frozen
        else:
            self._use(top[0], top[1])
        if held:
            _kernels.release(held)
        if outermost:
            _kernels.forget_compiled_if_traced()

    def _use(self, frame, kind):
        tables = frame.tables
        table = tables.get(kind)
        if table is None:
            table = tables[kind] = _compile(self, frame.devs, DELTA if kind == KERNELS else kind, kernels=kind == KERNELS)
        self.kernel_acts = table.kernel_acts  # ({} but for a KERNELS table)
        if self.trace is not None and kind != REFERENCE:  # every listed op goes to the recorder
            table = tables.get(TRACE)
            if table is None:
                table = tables[TRACE] = _compile(self, frame.devs, TRACE)
        mode = self.mode
        mode.real = table
        mode.real_size = table.changes
        mode.table = table if self.trace is None else mode.recording
        _COMPILE_TABLE[0] = table.frozen
        return table

    def set_trace(self, tr):
        """Start or stop recording; returns whether the mode was pushed for it."""
        prev, self.trace = self.trace, tr
        top = self.levels[-1]
        try:
            self._use(top[0], top[1])
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
        return self.levels[-1][0].devs


_tls = threading.local()


def _engine() -> _Engine:
    try:
        return _tls.engine
    except AttributeError:
        e = _tls.engine = _Engine()
        return e


def thread_engine():
    """This thread's engine: its stack of regions, its trace and its cast cache (for the
    trace module, which records into it, and for tests of the engine's state)."""
    return _engine()


class _Mode(TorchFunctionMode):
    """The one handler. Kept minimal: it runs for every torch call while pushed."""

    def __init__(self, engine):
        super().__init__()
        self.engine = engine
        self.table = _Table(engine)  # what calls look up: ``real``, or the recorder while tracing
        self.real = self.table
        self.real_size = 0
        self.recording = _Recording(engine)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if _is_compiling():
            act = _COMPILE_TABLE[0].get(func)
        else:
            try:
                act = self.table[func]  # a first-seen func is classified once (_Table.__missing__)
            except TypeError:  # an unhashable callable: never listed, run as is
                act = None
        if act is None:
            return func(*args, **kwargs) if kwargs else func(*args)
        return act(func, args, kwargs or {})


class _Table(dict):
    """{func: action or None}; a func seen for the first time is classified and kept."""

    names = frozenset()  # the op names of the entries (see _reaches)
    frozen: dict = {}  # the compiled entries alone, for traced code
    reach = None  # _reaches' memo
    changes = 0  # entries that change native's result (0: no mode needed)

    def __init__(self, engine):
        super().__init__()
        self.engine = engine

    def __missing__(self, func):
        act = self[func] = _classify(self.engine, func, self)
        return act


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


_is_compiling = torch.compiler.is_compiling
# torch's autocast state, read and set by a region's entry and exit (C functions: looked up once)
_is_enabled, _set_enabled = torch.is_autocast_enabled, torch.set_autocast_enabled
_get_dtype, _set_dtype = torch.get_autocast_dtype, torch.set_autocast_dtype
_is_cache_enabled, _set_cache_enabled = torch.is_autocast_cache_enabled, torch.set_autocast_cache_enabled
_increment_nesting, _decrement_nesting = torch.autocast_increment_nesting, torch.autocast_decrement_nesting
_clear_cache = torch.clear_autocast_cache
_function_mode_on = torch._C._is_torch_function_mode_enabled
_backend_name = torch._C._get_privateuse1_backend_name
_thread_id = threading.get_ident
_CUDA_F16_CHECKED = [False]  # torch.autocast('cuda', dtype=float16) found CUDA available
_COMPILE_TABLE = [{}]  # the table of the last region entered eagerly (read by traced code)
_COMPILED_TABLES: list = []  # tables of regions entered inside torch.compile'd code
_COMPILED_INDEX: dict = {}


@torch._dynamo.assume_constant_result
def _compiled_table(device_type, enabled, dtype, policy_id, cache_enabled) -> int:
    """Index in _COMPILED_TABLES of a region's delta table, -1 when it has none (run at trace
    time). The policy comes as its id(): dynamo cannot rebuild a frozen dataclass argument."""
    policy = live_policy(policy_id)
    key = (_ops.VERSION[0], device_type, enabled, dtype, policy, cache_enabled)
    index = _COMPILED_INDEX.get(key)
    if index is None:
        table = _compile(_engine(), {device_type: (enabled, dtype, policy, cache_enabled)}, DELTA)
        index = -1
        if table.changes:
            index = len(_COMPILED_TABLES)
            _COMPILED_TABLES.append(table.frozen)
        _COMPILED_INDEX[key] = index
    return index


class _CompiledMode(TorchFunctionMode):
    """The handler of a region inside compiled code: its table is fixed at trace time."""

    def __init__(self, index):
        super().__init__()
        self.index = index

    def __torch_function__(self, func, types, args=(), kwargs=None):
        act = _COMPILED_TABLES[self.index].get(func)
        if act is None:
            return func(*args, **(kwargs or {}))
        return act(func, args, kwargs or {})


# --------------------------------------------------------------------------- casting
def _caster(engine, device_type, cache_enabled, cached):
    """Return cast_all(values, to) -> list: eligible tensors (also in lists) cast to ``to``.

    Mirrors ATen's cached_cast: only floating, non-float64 tensors on the device;
    fp32 leaves that require grad and are not views are cast once per outermost
    region (when ``cached`` says so: casts to the region dtype, cache enabled).
    """
    on = _on_device(device_type)
    cache = engine.cache

    def cast_t(a, to):  # a: an eligible tensor whose dtype differs from ``to``
        if (cached and cache_enabled and a.requires_grad and a.dtype is _F32 and a.is_leaf
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
                if dt is not to and dt in _CASTABLE and on(x):
                    x = cast_t(x, to)
            elif type(x) in _SEQ and x and isinstance(x[0], Tensor):
                x = type(x)(
                    cast_t(t, to) if isinstance(t, Tensor) and t.dtype is not to and t.dtype in _CASTABLE and on(t) else t
                    for t in x
                )
            out.append(x)
        return out

    return cast_all


def _widest(values, on, lower):
    """ATen's prioritize(): float32 wins, float64 is ignored, else the region dtype."""
    for a in values:
        if isinstance(a, Tensor):
            ts = (a,)
        elif type(a) in _SEQ:
            ts = a
        else:
            continue
        for t in ts:
            if isinstance(t, Tensor):
                d = t.dtype
                if d is lower or d not in _CASTABLE or not on(t):
                    continue
                if d is _F32:
                    return _F32
                raise RuntimeError(
                    f"ampkit autocast: promote op got a {d} input in a {lower} region "
                    "(native autocast raises 'Unexpected floating ScalarType in prioritize' here)"
                )
    return lower


def _native_off(device_type):
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


def _rule(engine, name, category, device_type, cache_enabled, message):
    """The cast of one listed op on one device: (func, args, kwargs, dtype) -> result,
    run with native autocast off. Calls without tensors on ``device_type`` run as is."""
    on = _on_device(device_type)
    call = _native_off(device_type)
    if category == "lower_precision_fp" or category == "fp32":
        cast_all = _caster(engine, device_type, cache_enabled, cached=category == "lower_precision_fp")
        low = category == "lower_precision_fp"

        def act(func, args, kwargs, dtype):
            to = dtype if low else _F32
            if not kwargs:
                return call(func, cast_all(args, to), {})
            if kwargs.get("out") is not None:
                return func(*args, **kwargs)
            return call(func, cast_all(args, to), dict(zip(kwargs, cast_all(kwargs.values(), to))))

        if category == "fp32" and name in _narrow_casts.NARROWED:
            cast_everything = act
            narrowed = _narrow_casts.NARROWED

            def act(func, args, kwargs, dtype):
                t = _first_tensor(args, kwargs)
                n = narrowed[name]  # (looked up per call: tests swap it)
                if t is not None and on(t) and n.pays(t):
                    out = call(n.run, (func, args, kwargs), {})
                    if out is not _narrow_casts.NOT_NARROWED:
                        return out
                return cast_everything(func, args, kwargs, dtype)

    elif category == "fp32_output":

        def act(func, args, kwargs, dtype):
            t = _first_tensor(args, kwargs)  # torch.sum(input=x) names its tensor
            if (
                t is None or kwargs.get("dtype") is not None or kwargs.get("out") is not None or t.dtype not in _CASTABLE or not on(t)
                or any(isinstance(a, torch.dtype) for a in args)
            ):
                return call(func, args, kwargs)
            kwargs = dict(kwargs)
            kwargs["dtype"] = _F32
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
        cast_all = _caster(engine, device_type, cache_enabled, cached=True)

        def act(func, args, kwargs, dtype):
            if not kwargs:
                return call(func, cast_all(args, _widest(args, on, dtype)), {})
            if kwargs.get("out") is not None:
                return func(*args, **kwargs)
            to = _widest((*args, *kwargs.values()), on, dtype)
            return call(func, cast_all(args, to), dict(zip(kwargs, cast_all(kwargs.values(), to))))

    elif category == "banned":

        def act(func, args, kwargs, dtype):
            raise RuntimeError(message)

    elif category is None:  # listed natively, removed by the policy: runs untouched

        def act(func, args, kwargs, dtype):
            return call(func, args, kwargs)

    else:  # pragma: no cover - categories are validated by Policy
        raise PolicyError(f"unknown category {category!r}")
    return act


def _action(engine, name, category, device_type, cache_enabled, message, kind):
    """The table entry of one op on one device: (func, args, kwargs) -> result."""
    on = _on_device(device_type)
    if category == "decompose":
        act = _decomposer(engine, name, on)
    else:
        rule = _rule(engine, name, category, device_type, cache_enabled, message)
        get_dtype = torch.get_autocast_dtype
        is_enabled = torch.is_autocast_enabled
        live = kind != REFERENCE  # native's switch is the region's (a nested torch.autocast counts)
        guard = kind == DELTA  # a change from native that a plain checkpoint would not replay

        def act(func, args, kwargs):
            t = _first_tensor(args, kwargs)
            if t is None or not on(t):
                return func(*args, **kwargs)
            if live and not is_enabled(device_type):
                return func(*args, **kwargs)
            if guard:
                _refuse_plain_checkpoint(name, engine.tokens.get(device_type))
            return rule(func, args, kwargs, get_dtype(device_type))

    act.rule = category or "none"
    act.op = name
    act.on = on
    return act


def _decomposer(engine, name, on):
    """Action of an op under ``decompose``: its ATen decomposition, parts seen by the handler."""
    mode = engine.mode
    dec = _decompositions.DECOMPOSITIONS[name]

    def act(func, args, kwargs):
        t = _first_tensor(args, kwargs)
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
        t = _first_tensor(args, kwargs)
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


def _compile(engine, devs, kind, kernels=False) -> dict:
    """{func: action} for the ops of ``kind`` of every enabled device of a frame.

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
            act = _action(engine, name, cat, device_type, cache_enabled, msg, kind if changing else TRACE)
            ops = _kernel_ops(name, cat, device_type) if kernels and changing else ()
            if ops:
                by_kernel.update(((op, device_type), act) for op in ops)
                continue
            changes += changing
            for func in _ops.resolve(name):
                if _is_inplace(func):
                    continue
                per_func.setdefault(func, []).append(act)
                if not isinstance(func, types.FunctionType):  # builtins: ATen-style names
                    names.add(getattr(func, "__name__", name))
            names.add(name.rsplit(".", 1)[-1])
    table = _Table(engine)
    table.update((f, _dispatch(acts)) for f, acts in per_func.items())
    table.names = frozenset(names)  # for _reaches: the op names a composite may call
    table.reach = {}  # its memo
    table.changes = changes  # entries that change native's result (0: no mode needed)
    table.frozen = dict(table)  # what traced code reads: never grows (dynamo guards on its size)
    table.kernels = by_kernel
    # what a kernel looks up on every call: keyed by id() (an OpOverload hashes in Python;
    # overloads live as long as torch.ops)
    table.kernel_acts = {(id(op), d): act for (op, d), act in by_kernel.items()} if by_kernel else _NO_KERNELS
    return table


def _kernel_ops(name, category, device_type) -> tuple:
    """The ATen overloads that run op ``name``'s changed handling as kernels, or ()."""
    if category not in _kernels.CATEGORIES or device_type not in _kernels.KEYS:
        return ()
    if category == "fp32" and name in _narrow_casts.NARROWED:
        return ()
    return _kernels.overloads(name)


def _kernel(op, device_type, name):
    """The kernel at torch's Autocast key of ``device_type`` for ``op`` (policy op ``name``):
    the innermost ampkit frame's action for it, else native autocast's handling of it."""
    key = (id(op), device_type)
    native = _native_handling(op, device_type, name)
    note = _kernels.note_if_traced
    call = getattr(op, "_op", op)  # the C function OpOverload.__call__ calls: one Python frame less

    def kernel(*args, **kwargs):
        act = _engine().kernel_acts.get(key)
        if act is None:
            return native(args, kwargs)
        for a in args:
            if type(a) is not Tensor and isinstance(a, Tensor):  # a fake tensor: a compile traces
                note(args)
                break
        return act(call, args, kwargs)

    return kernel


def _native_handling(op, device_type, name):
    """(args, kwargs) -> result: what torch's own autocast does for ``op``: the shipped
    torch_default's rule for ``name`` where torch registers a kernel for the op (the drift
    check proves the two equal), else a fall-through to the kernels below autocast."""
    rules = _DEFAULT.rules(device_type)
    cat = rules.category(name)
    if cat is not None and _kernels.native_has_kernel(op, device_type):
        msg = rules.ban_message(name) if cat == "banned" else None
        rule = _rule(_engine(), name, cat, device_type, False, msg)
        get_dtype = torch.get_autocast_dtype
        call = getattr(op, "_op", op)  # the C function OpOverload.__call__ calls
        return lambda args, kwargs: rule(call, args, kwargs, get_dtype(device_type))
    after = torch._C._dispatch_keyset_full_after(getattr(torch._C.DispatchKey, _kernels.KEYS[device_type]))
    keys_of = torch._C._dispatch_keys

    def fall_through(args, kwargs):
        ks = None
        for a in (*args, *kwargs.values()):
            for t in (a if type(a) in _SEQ else (a,)):
                if isinstance(t, Tensor):
                    ks = keys_of(t) if ks is None else ks | keys_of(t)
        return op.redispatch(after if ks is None else after & ks, *args, **kwargs)

    return fall_through




# --------------------------------------------------------------------------- checkpointing
_REENTRANT_FORWARD = getattr(getattr(torch.utils.checkpoint, "CheckpointFunction", None), "forward", None)
_REENTRANT_CODE = getattr(_REENTRANT_FORWARD, "__code__", None)
_CHECKPOINT_CODE = getattr(inspect.unwrap(torch.utils.checkpoint.checkpoint), "__code__", None)
_TOP_HOOKS = getattr(torch._C._autograd, "_top_saved_tensors_default_hooks", None)  # torch >= 2.5


def _checkpoint_token():
    """An identity of the innermost torch.utils.checkpoint forward running now, or None.

    Non-reentrant: its saved-tensor pack hook (a new function per checkpoint call);
    reentrant (forward without grad): the frame of CheckpointFunction.forward; torch 2.4
    (no hooks query): the frame of checkpoint() itself."""
    if _is_compiling():
        return None
    if _TOP_HOOKS is None:
        return _frame_on_stack((_CHECKPOINT_CODE, _REENTRANT_CODE))
    hooks = _TOP_HOOKS(False)
    if hooks is not None and "_checkpoint_hook" in getattr(hooks[0], "__qualname__", ""):
        return hooks[0]
    return None if torch.is_grad_enabled() else _frame_on_stack((_REENTRANT_CODE,))


def _frame_on_stack(codes):
    f = sys._getframe(2)
    while f is not None:
        if f.f_code in codes:
            return f
        f = f.f_back
    return None


def _refuse_plain_checkpoint(op, entered_in):
    """Raise if a torch checkpoint began inside the region that changes ``op``: its
    recomputation would run outside that region. A region entered inside the checkpointed
    function (``entered_in`` is the current checkpoint) is re-entered when it recomputes."""
    current = _checkpoint_token()
    if current is not None and current is not entered_in:
        raise RuntimeError(
            f"ampkit autocast: the active policy handles {op!r} differently from torch's autocast, and "
            "torch.utils.checkpoint recomputes the forward outside ampkit's region (it restores only torch's "
            "own autocast state), so the recomputed values would differ. Use ampkit.checkpoint(function, "
            "*args, use_reentrant=..., ...) in place of torch.utils.checkpoint.checkpoint: it takes the same "
            "arguments and replays the region's policy in the recomputation (or enter the region inside "
            "the checkpointed function)."
        )


def checkpoint(function, *args, use_reentrant=None, **kwargs):
    """``torch.utils.checkpoint.checkpoint`` that recomputes under the same ampkit policy.

    torch's checkpoint restores torch's own autocast state when it recomputes the
    forward (during backward, outside any ``with`` block), but not a policy's changes
    to it. This function takes the same arguments and wraps ``function`` so that the
    policies of the ampkit regions active now are applied again in the recomputation
    (torch's state itself is left to torch): gradients equal those of the same code
    without checkpointing. With the default policy it is torch's checkpoint; with a
    changed policy plain torch checkpointing raises a RuntimeError that names this
    function.

    >>> import torch, ampkit
    >>> lin = torch.nn.Linear(4, 4)
    >>> policy = ampkit.load_policy("torch_default").with_ops("cpu", fp32=["linear"])
    >>> with ampkit.autocast("cpu", policy=policy):
    ...     y = ampkit.checkpoint(lin, torch.randn(2, 4), use_reentrant=False)
    >>> y.dtype
    torch.float32
    >>> y.sum().backward()
    """
    if not callable(function):
        raise TypeError(f"ampkit.checkpoint: function must be callable, got {function!r}")
    if use_reentrant is not None and not isinstance(use_reentrant, bool):
        raise TypeError(f"ampkit.checkpoint: use_reentrant must be True, False or None, got {use_reentrant!r}")
    saved = list(_engine().devs().items())

    def under_policy(*a, **k):
        # ampkit's frames only: torch's autocast state is the one torch's checkpoint restores
        eng = _engine()
        pushed = 0
        try:
            for d, (enabled, dtype, policy, cache) in saved:
                eng.push(d, enabled, dtype, policy, cache)
                pushed += 1
            return function(*a, **k)
        finally:
            for _ in range(pushed):
                eng.pop()

    return torch.utils.checkpoint.checkpoint(under_policy, *args, use_reentrant=use_reentrant, **kwargs)


# --------------------------------------------------------------------------- composites
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


def _reaches(func, names, memo) -> bool:
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
            if isinstance(r, types.FunctionType) and (r.__module__ or "").startswith("torch") and _reaches(r, names, memo):
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


_guardfree_globals: dict = {}


def _guardfree(func):
    """A clone of ``func`` whose has_torch_function* guards return False."""
    key = id(func.__globals__)
    g = _guardfree_globals.get(key)
    if g is None or g.module_globals is not func.__globals__:
        g = _guardfree_globals[key] = _GuardFreeGlobals(func.__globals__)
    clone = types.FunctionType(func.__code__, g, func.__name__, func.__defaults__, func.__closure__)
    clone.__kwdefaults__ = func.__kwdefaults__
    return clone


def _run_inside(engine, target, func):
    """Action: run ``target`` with the mode re-pushed so its inner torch calls are seen."""
    mode = engine.mode
    active = engine.active_clones

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


def _classify(engine, func, table):
    """Action for a func not in the compiled ``table`` (kept there by the caller)."""
    if _is_inplace(func):
        return None
    user = _USER_WRAPPERS.get(func)  # (func is hashable: the table lookup that led here hashed it)
    if user is not None:  # a registered user op that the policy does not list
        return _run_inside(engine, user, func)
    if isinstance(func, types.FunctionType) and (getattr(func, "__module__", "") or "").startswith("torch"):
        if table.names and _reaches(func, table.names, table.reach):
            return _run_inside(engine, _guardfree(func), func)
    return None


# --------------------------------------------------------------------------- public API
def _default_policy() -> Policy:
    return _DEFAULT


# Loaded at import: code that torch.compile traces cannot read files.
_DEFAULT = load_policy("torch_default")


# (device_type, dtype argument, id(policy argument)) -> (policy argument, Policy, its
# lower-precision dtype for the device), for arguments that passed _region_args once: a
# region entered again skips the checks. Only a Policy object or None (the default) is
# kept (a name or a path is read again: the file may have changed); the entry holds the
# object, so its id() is not reused while the entry lives (a Policy hashes in Python).
_VALID: dict = {}


def _region_args(device_type, dtype, enabled, cache_enabled, policy):
    """Validated region arguments: (device_type, dtype, enabled, cache_enabled, Policy)."""
    if type(device_type) is str and (policy is None or type(policy) is Policy):
        try:
            hit = _VALID.get((device_type, dtype, id(policy)))
        except TypeError:  # an unhashable dtype: the checks below name it
            hit = None
        if hit is not None and (enabled is True or enabled is False) and (
                cache_enabled is None or cache_enabled is True or cache_enabled is False):
            if dtype is None:
                dtype = _get_dtype(device_type) if _is_enabled(device_type) else hit[2]
            return device_type, dtype, enabled, cache_enabled, hit[1]
    return _check_region_args(device_type, dtype, enabled, cache_enabled, policy, remember=True)


def _check_region_args(device_type, dtype, enabled, cache_enabled, policy, remember=False):
    """_region_args without the memo (``remember``: keep valid arguments in it). Code that
    torch.compile traces calls this: dynamo would guard on the memo's contents."""
    dtype_arg = dtype
    if not isinstance(device_type, str):
        raise ValueError(f"ampkit.autocast: device_type must be a string such as 'cpu' or 'cuda', got {device_type!r}")
    if device_type not in DEVICES:
        raise ValueError(
            f"ampkit.autocast: device type {device_type!r} is not supported; ampkit's policies describe "
            f"{', '.join(DEVICES)} (ampkit.is_autocast_available tells; torch.autocast({device_type!r}) "
            "runs torch's own table where torch has one)")
    pol = _default_policy() if policy is None else load_policy(policy)
    if pol.modules:  # a region sees ops, not modules: scopes would be dropped silently
        raise ValueError(
            f"ampkit.autocast: policy {pol.name!r} has module scopes "
            f"({', '.join(s.pattern for s in pol.modules)}), which a region cannot apply: it sees ops, "
            "not modules. Apply them to the model and give the region the rest: "
            "`with policy.apply(model), ampkit.autocast(device, policy=policy.without_modules()):`")
    rules = pol.rules(device_type)  # PolicyError (a ValueError) names the valid device types
    if dtype is None:  # as torch.autocast: an enclosing region's dtype, else the policy's
        dtype = torch.get_autocast_dtype(device_type) if torch.is_autocast_enabled(device_type) \
            else rules.lower_precision_dtype
    elif dtype not in _REGION_DTYPES:
        raise ValueError(
            f"ampkit.autocast: dtype {dtype!r} is not a lower-precision dtype; valid: torch.float16, torch.bfloat16"
        )
    if not isinstance(enabled, bool):
        raise ValueError(f"ampkit.autocast: enabled must be True or False, got {enabled!r}")
    if cache_enabled is not None and not isinstance(cache_enabled, bool):
        raise ValueError(f"ampkit.autocast: cache_enabled must be True, False or None, got {cache_enabled!r}")
    if remember and type(device_type) is str and (policy is None or type(policy) is Policy):
        if len(_VALID) > 64:  # e.g. a fresh policy built every step
            _VALID.clear()
        _VALID[(device_type, dtype_arg, id(policy))] = (policy, pol, rules.lower_precision_dtype)
    return device_type, dtype, enabled, cache_enabled, pol


@contextlib.contextmanager
def _compiled_region(device_type, dtype, enabled, cache_enabled, index):
    """A region inside traced code: torch's autocast, plus the delta's handler if any
    (index >= 0). A generator context, not a torch.autocast: some dynamo releases (2.11)
    cannot ask isinstance() of the torch.autocast that ampkit.autocast() would return."""
    with torch.amp.autocast(device_type, dtype=dtype, enabled=enabled, cache_enabled=cache_enabled):
        if index < 0:
            yield
        else:
            with _CompiledMode(index):
                yield


class autocast(torch.amp.autocast):
    """An ampkit autocast region: a ``torch.autocast`` region whose casts follow a policy.

    Args:
      device_type: ``"cpu"`` or ``"cuda"`` (a device type of the policy).
      dtype: the lower-precision dtype (``torch.float16`` or ``torch.bfloat16``);
        None takes the dtype of the enclosing autocast region for the device when one is
        on (ampkit's or torch's, as ``torch.autocast`` does), else the policy's
        ``lower_precision_dtype`` for the device.
      enabled: False makes the region a pure pass-through (it still nests).
      cache_enabled: cache casts of fp32 leaf tensors that require grad for the
        outermost region; None follows ``torch.is_autocast_cache_enabled()``.
      policy: a :class:`ampkit.Policy`, a shipped name or a YAML path
        (default ``"torch_default"``).

    It is a ``torch.amp.autocast``: inside it ``torch.is_autocast_enabled(device_type)``
    is True, and checkpointing, ``torch.amp.custom_fwd`` and ``torch.compile`` treat
    it as torch's own. Where the policy equals torch's table, torch's C++ autocast
    does the casting; ampkit's code runs only for the ops the policy changes.
    Works as a context manager and as a decorator.

    >>> import torch, ampkit
    >>> @ampkit.autocast("cpu", dtype=torch.bfloat16)
    ... def f(a, b):
    ...     return a @ b
    >>> f(torch.randn(2, 3), torch.randn(3, 2)).dtype
    torch.bfloat16
    >>> with ampkit.autocast("cpu"):
    ...     torch.is_autocast_enabled("cpu"), torch.get_autocast_dtype("cpu")
    (True, torch.bfloat16)
    """

    def __new__(cls, device_type, dtype=None, enabled=True, cache_enabled=None, *, policy=None):
        if _is_compiling():
            # Made inside code that torch.compile traces: a torch.autocast (which every dynamo
            # release knows) and, for a changed policy, a handler over a table built once at
            # trace time (_compiled_region). __init__ does not run: the object is not an
            # ampkit.autocast.
            dev, dtype, enabled, cache_enabled, pol = _check_region_args(device_type, dtype, enabled, cache_enabled, policy)
            cache = torch.is_autocast_cache_enabled() if cache_enabled is None else cache_enabled
            index = _compiled_table(dev, enabled, dtype, id(pol), cache)
            return _compiled_region(dev, dtype, enabled, cache_enabled, index)
        return super().__new__(cls)

    def __init__(self, device_type, dtype=None, enabled=True, cache_enabled=None, *, policy=None):
        dev, dtype, enabled, cache_enabled, pol = _region_args(device_type, dtype, enabled, cache_enabled, policy)
        if dev == "cpu" or not enabled or (dtype is _F16 and _CUDA_F16_CHECKED[0]):
            # torch.autocast.__init__ where it checks nothing that can fail: "cpu" with a
            # dtype _region_args accepted, a disabled region, or float16 on CUDA once torch
            # found CUDA available (it checks nothing else for float16): its attributes, set
            # directly
            self.fast_dtype = dtype
            self.device = dev
            self.custom_backend_name = _backend_name()
            self._cache_enabled = _is_cache_enabled() if cache_enabled is None else cache_enabled
            self._enabled = enabled
        else:  # cuda: torch checks the card (bf16 support, CUDA available)
            super().__init__(dev, dtype=dtype, enabled=enabled, cache_enabled=cache_enabled)
            if dtype is _F16 and self._enabled:
                _CUDA_F16_CHECKED[0] = True
        self.device_type = dev
        self.enabled = enabled
        self.cache_enabled = cache_enabled
        self.policy = pol
        self._ampkit_entered_in = None  # the thread it is active in, else None

    def __enter__(self):
        # torch's autocast keeps the state it restores on the object: entering an active
        # object again would overwrite it, so that is refused (a new object nests).
        if self._ampkit_entered_in is not None:
            raise RuntimeError(
                f"{self!r} is already active (entered and not exited); enter a new "
                "ampkit.autocast(...) to nest a region, or use it as a decorator")
        eng = _engine()
        if eng.reference:  # native off underneath: the tables alone decide
            self._ampkit_native = torch.autocast(self.device, dtype=self.fast_dtype, enabled=False,
                                                 cache_enabled=self._cache_enabled)
            self._ampkit_native.__enter__()
        elif _function_mode_on():  # torch.export's pre-dispatch mode is told by torch's __enter__
            self._ampkit_native = None
            super().__enter__()
        else:  # torch.autocast.__enter__ without a mode to tell: its calls, made directly
            self._ampkit_native = None
            dev = self.device
            self.prev_cache_enabled = _is_cache_enabled()
            self.prev = _is_enabled(dev)
            self.prev_fastdtype = _get_dtype(dev)
            _set_enabled(dev, self._enabled)
            _set_dtype(dev, self.fast_dtype)
            _increment_nesting()
            _set_cache_enabled(self._cache_enabled)
        try:
            eng.push(self.device_type, self.enabled, self.fast_dtype, self.policy, self._cache_enabled)
        except BaseException:
            self._native_exit()
            raise
        self._ampkit_entered_in = _thread_id()
        return self

    def __exit__(self, exc_type, exc_val, exc_tb):
        entered_in = getattr(self, "_ampkit_entered_in", None)
        if entered_in != _thread_id():  # checked before anything changes
            where = "was never entered" if entered_in is None else "was entered in another thread"
            raise RuntimeError(
                f"{self!r}.__exit__() called, but this region {where}; exit a region in "
                "the thread that entered it, once per __enter__() (a `with` block does)")
        self._ampkit_entered_in = None
        try:
            _engine().pop()
        finally:
            self._native_exit()
        return False

    def _native_exit(self):
        if self._ampkit_native is not None:
            self._ampkit_native.__exit__(None, None, None)
        elif _function_mode_on():
            super().__exit__(None, None, None)
        else:  # torch.autocast.__exit__'s calls, made directly
            if _decrement_nesting() == 0:
                _clear_cache()
            dev = self.device
            _set_enabled(dev, self.prev)
            _set_dtype(dev, self.prev_fastdtype)
            _set_cache_enabled(self.prev_cache_enabled)

    def __call__(self, func):
        if not callable(func):
            raise TypeError(f"{self!r} used as a decorator needs a function, got {func!r}")

        @functools.wraps(func)
        def decorated(*args, **kwargs):
            with autocast(self.device_type, self.fast_dtype, self.enabled, self.cache_enabled, policy=self.policy):
                return func(*args, **kwargs)

        return decorated

    def __repr__(self):
        return (
            f"ampkit.autocast({self.device_type!r}, dtype={self.fast_dtype}, enabled={self.enabled}, "
            f"cache_enabled={self.cache_enabled}, policy={self.policy.name!r})"
        )


@contextlib.contextmanager
def reference():
    """Regions entered inside run ampkit's Python engine over the whole policy, with
    torch's autocast off underneath: the YAML alone decides every cast. For proving a
    table against ``torch.autocast`` (the drift check, the table tests); slower."""
    eng = _engine()
    eng.reference += 1
    try:
        yield
    finally:
        eng.reference -= 1


def is_autocast_enabled(device_type: str) -> bool:
    """Whether autocast is on for ``device_type`` in this thread: an ampkit region or
    torch's own (they are the same state). Raises like torch for a device type autocast
    does not know (``RuntimeError``; ``TypeError`` for a non-string), naming it.

    >>> import ampkit
    >>> ampkit.is_autocast_enabled("cpu")
    False
    """
    return _ask_torch(torch.is_autocast_enabled, device_type)


def is_autocast_available(device_type: str) -> bool:
    """Whether ``ampkit.autocast(device_type)`` can run: torch has an autocast for the
    device type (``torch.amp.is_autocast_available``) and ampkit's policies describe it
    (cpu and cuda). Unlike torch's, False for device types such as ``"mps"`` or ``"xpu"``
    that torch's autocast knows but ampkit's policies do not; an unknown device string
    raises as torch's does.

    >>> import ampkit
    >>> ampkit.is_autocast_available("cpu"), ampkit.is_autocast_available("mps")
    (True, False)
    """
    if not isinstance(device_type, str):
        raise TypeError(f"is_autocast_available: device_type must be a string such as 'cpu' or 'cuda', got {device_type!r}")
    return bool(torch.amp.is_autocast_available(device_type)) and device_type in DEVICES


def is_autocast_cache_enabled() -> bool:
    """Whether autocast regions in this thread cache the casts of float32 leaf tensors that
    require grad (``cache_enabled`` of the innermost region; torch's own state, which
    ampkit's regions set as torch's do).

    >>> import torch, ampkit
    >>> with ampkit.autocast("cpu", cache_enabled=False):
    ...     ampkit.is_autocast_cache_enabled()
    False
    """
    return torch.is_autocast_cache_enabled()


def get_autocast_dtype(device_type: str) -> torch.dtype:
    """The dtype of the innermost autocast region for ``device_type`` in this thread
    (torch's default for the device when none is active). Raises like
    :func:`is_autocast_enabled` for an unknown device type."""
    return _ask_torch(torch.get_autocast_dtype, device_type)


def _ask_torch(query, device_type):
    name = query.__name__
    if not isinstance(device_type, str):
        raise TypeError(f"ampkit.{name}: device_type must be a string such as 'cpu' or "
                        f"'cuda', got {device_type!r}")
    try:
        return query(device_type)
    except RuntimeError as e:
        raise RuntimeError(
            f"ampkit.{name}: device_type {device_type!r} is not a device type torch's "
            f"autocast knows ({e}); ampkit's policies cover 'cpu' and 'cuda'") from e


def _current_policy(device_type):
    s = _engine().state(device_type)
    return s[2] if s is not None else _default_policy()


def custom_fwd(fwd=None, *, device_type: str, cast_inputs=None):
    """``torch.amp.custom_fwd`` that also carries the ampkit policy to :func:`custom_bwd`.

    With ``cast_inputs=None`` forward runs in the region it is called in and
    backward (with :func:`custom_bwd`) replays that region, policy included. With a
    dtype, the floating inputs are cast to it and forward runs with autocast off.
    ``torch.amp.custom_fwd`` itself works in ampkit regions as in torch's.
    """
    if not isinstance(device_type, str):
        raise ValueError(f"custom_fwd: device_type must be a string such as 'cuda', got {device_type!r}")
    if cast_inputs is not None and not (isinstance(cast_inputs, torch.dtype) and cast_inputs.is_floating_point):
        raise ValueError(f"custom_fwd: cast_inputs must be a floating torch.dtype or None, got {cast_inputs!r}")
    if fwd is None:
        return functools.partial(custom_fwd, device_type=device_type, cast_inputs=cast_inputs)
    inner = torch.amp.custom_fwd(fwd, device_type=device_type, cast_inputs=cast_inputs)

    @functools.wraps(fwd)
    def decorate_fwd(*args, **kwargs):
        args[0]._ampkit_policy = _current_policy(device_type)
        return inner(*args, **kwargs)

    return decorate_fwd


def custom_bwd(bwd=None, *, device_type: str):
    """``torch.amp.custom_bwd`` for ampkit: backward runs in the region forward ran in."""
    if not isinstance(device_type, str):
        raise ValueError(f"custom_bwd: device_type must be a string such as 'cuda', got {device_type!r}")
    if bwd is None:
        return functools.partial(custom_bwd, device_type=device_type)

    @functools.wraps(bwd)
    def decorate_bwd(*args, **kwargs):
        ctx = args[0]
        with autocast(
            device_type, dtype=ctx._dtype, enabled=ctx._fwd_used_autocast,
            policy=getattr(ctx, "_ampkit_policy", None),
        ):
            return bwd(*args, **kwargs)

    return decorate_bwd


# --------------------------------------------------------------------------- user ops
_USER_WRAPPERS: dict = {}  # wrapper -> original function


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
    if taken is not None and _USER_WRAPPERS.get(taken) is fn:
        return taken  # the same function again: nothing to change
    if taken is not None and not replace:
        first = _USER_WRAPPERS.get(taken)
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
        _USER_WRAPPERS.pop(old, None)
    _ops.USER_OPS[name] = wrapper
    _USER_WRAPPERS[wrapper] = fn
    _ops.VERSION[0] += 1  # compiled tables are keyed by it: rebuilt on next region entry
    _native.forget()
    wrapper.ampkit_op_name = name
    return wrapper


_module_policy.REGION[0] = autocast  # the region module scopes enter (see there)
