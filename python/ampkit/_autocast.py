"""The autocast engine: one TorchFunctionMode per thread, driven by a Policy.

How a call is handled inside an ampkit region (this is the whole algorithm)::

    outermost region enters  -> push this thread's _Mode (never a second one)
    every torch call         -> action = table.get(func)          # one dict lookup
        None                 -> func(*args)                       # unlisted: untouched
        unseen func          -> classify once, store in table
        listed op            -> t = first tensor argument; if t is on a device whose
                                region is enabled, apply that device's category:
            lower_precision_fp : cast floating non-float64 tensors on the device to the
                                 region dtype (fp32 leaf params requiring grad: cached)
            fp32               : cast them to float32 (nll_loss on a large input: only
                                 the elements it reads, ampkit._narrow_casts)
            fp32_output        : call with dtype=float32 unless a dtype is given
            promote            : cast them to the widest floating input dtype
            banned             : raise RuntimeError(message)
            decompose          : run ampkit._decompositions' Python version of the C++
                                 composite with the mode re-pushed, so each part is
                                 cast by its own rule (cross_entropy on cuda)
        Python function of torch that can reach a listed op (F.multi_head_attention_forward,
        torch.functional.einsum ...): run a clone of it whose has_torch_function guards
        return False, with the mode re-pushed, so the calls in its body are seen (native
        autocast sees them because it works below Python).
    outermost region exits   -> pop the mode, free the cast cache

In-place ops (``add_``, ``__iadd__``) and calls with ``out=`` are never cast.
Nested regions and ``enabled=False`` only push and pop a frame of per-device state.
The mode stack of torch is thread-local, so other threads are unaffected.

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

import dis
import functools
import threading
import types

import torch
from torch.overrides import TorchFunctionMode, handle_torch_function, has_torch_function

from ampkit import _decompositions, _narrow_casts, _ops
from ampkit._policy import CATEGORIES, Policy, PolicyError, load_policy

Tensor = torch.Tensor
_F32 = torch.float32
_F64 = torch.float64
_CASTABLE = frozenset(
    d for d in vars(torch).values() if isinstance(d, torch.dtype) and d.is_floating_point and d is not torch.float64
)
_REGION_DTYPES = (torch.float16, torch.bfloat16)
_MISS = object()
_SEQ = (list, tuple)
_GUARDS = ("has_torch_function", "has_torch_function_unary", "has_torch_function_variadic")


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
    """The per-device autocast state of one nesting level (immutable once built)."""

    __slots__ = ("devs", "key")

    def __init__(self, devs):
        # devs: {device_type: (enabled, dtype, policy, cache_enabled)}
        self.devs = devs
        # policies cache their hash; the registry version invalidates tables when
        # ampkit.op (re)registers a user op.
        self.key = (_ops.VERSION[0],) + tuple(sorted((d, s[1], s[2], s[3]) for d, s in devs.items() if s[0]))


class _Engine:
    """The state of one thread: frames, the mode, compiled tables, the cast cache."""

    def __init__(self):
        self.depth = 0
        self.frames = [_Frame({})]
        self.tables = {}  # frame.key -> {func: action}
        self.cache = {}  # id(fp32 leaf) -> (leaf, cast)
        self.trace = None
        self.active_clones = set()
        self.mode = _Mode(self)

    def push(self, device_type, enabled, dtype, policy, cache_enabled):
        devs = dict(self.frames[-1].devs)
        devs[device_type] = (enabled, dtype, policy, cache_enabled)
        self.frames.append(_Frame(devs))
        self._retable()
        if self.depth == 0:
            self.mode.__enter__()
        self.depth += 1

    def pop(self):
        self.frames.pop()
        self.depth -= 1
        if self.depth == 0:
            self.cache.clear()
            self.mode.__exit__(None, None, None)
        self._retable()

    def _retable(self):
        key = self.frames[-1].key
        table = self.tables.get(key)
        if table is None:
            if len(self.tables) > 64:  # e.g. a fresh policy built every step
                self.tables.clear()
            table = self.tables[key] = _compile(self, self.frames[-1])
        self.mode.real = table
        self.mode.table = table if self.trace is None else _EMPTY

    def set_trace(self, tr):
        self.trace = tr
        self.mode.table = self.mode.real if tr is None else _EMPTY

    def state(self, device_type):
        return self.frames[-1].devs.get(device_type)


_EMPTY: dict = {}
_tls = threading.local()


def _engine() -> _Engine:
    try:
        return _tls.engine
    except AttributeError:
        e = _tls.engine = _Engine()
        return e


class _Mode(TorchFunctionMode):
    """The one handler. Kept minimal: it runs for every torch call in a region."""

    def __init__(self, engine):
        super().__init__()
        self.engine = engine
        self.table = {}
        self.real = {}

    def __torch_function__(self, func, types, args=(), kwargs=None):
        try:
            act = self.table.get(func, _MISS)
        except TypeError:  # an unhashable callable: never listed, run as is
            act = None
        if act is None:
            return func(*args, **kwargs) if kwargs else func(*args)
        if act is _MISS:
            return self._slow(func, args, kwargs or {})
        return act(func, args, kwargs or {})

    def _slow(self, func, args, kwargs):
        real = self.real
        try:
            act = real.get(func, _MISS)
        except TypeError:  # an unhashable callable: never classified, run as is
            act = None
        if act is _MISS:
            act = real[func] = _classify(self.engine, func)
        tr = self.engine.trace
        if tr is None:
            return func(*args, **kwargs) if act is None else act(func, args, kwargs)
        return tr._record(func, act, args, kwargs)


# --------------------------------------------------------------------------- casting
def _caster(engine, device_type, to, lower, cache_enabled):
    """Return cast_all(values) -> list: eligible tensors (also in lists) cast to ``to``.

    Mirrors ATen's cached_cast: only floating, non-float64 tensors on the device;
    fp32 leaves that require grad and are not views are cast once per outermost
    region (when casting to the region dtype and the cache is enabled).
    """
    on = _on_device(device_type)
    cache = engine.cache
    may_cache = cache_enabled and to is lower

    def cast_t(a):  # a: an eligible tensor whose dtype differs from ``to``
        if may_cache and a.requires_grad and a.dtype is _F32 and a.is_leaf and not a._is_view():
            hit = cache.get(id(a))
            if hit is not None and hit[0] is a:
                return hit[1]
            out = a.to(dtype=to)
            cache[id(a)] = (a, out)
            return out
        return a.to(dtype=to)

    def cast_all(values):
        out = []
        for x in values:
            if isinstance(x, Tensor):
                dt = x.dtype
                if dt is not to and dt in _CASTABLE and on(x):
                    x = cast_t(x)
            elif type(x) in _SEQ and x and isinstance(x[0], Tensor):
                x = type(x)(
                    cast_t(t) if isinstance(t, Tensor) and t.dtype is not to and t.dtype in _CASTABLE and on(t) else t
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


def _rule(engine, name, category, device_type, dtype, cache_enabled, message):
    """The action of one listed op on one device: (func, args, kwargs) -> result.

    It only touches tensors on ``device_type``; calls without such tensors run as is.
    """
    on = _on_device(device_type)
    if category == "lower_precision_fp" or category == "fp32":
        cast_all = _caster(engine, device_type, dtype if category == "lower_precision_fp" else _F32, dtype, cache_enabled)

        def act(func, args, kwargs):
            if not kwargs:
                return func(*cast_all(args))
            if kwargs.get("out") is not None:
                return func(*args, **kwargs)
            return func(*cast_all(args), **dict(zip(kwargs, cast_all(kwargs.values()))))

        if category == "fp32" and name in _narrow_casts.NARROWED:
            cast_everything = act
            narrowed = _narrow_casts.NARROWED

            def act(func, args, kwargs):
                t = _first_tensor(args, kwargs)
                n = narrowed[name]  # (looked up per call: tests swap it)
                if t is not None and on(t) and n.pays(t):
                    out = n.run(func, args, kwargs)
                    if out is not _narrow_casts.NOT_NARROWED:
                        return out
                return cast_everything(func, args, kwargs)

    elif category == "fp32_output":

        def act(func, args, kwargs):
            t = _first_tensor(args, kwargs)  # torch.sum(input=x) names its tensor
            if (
                t is None or kwargs.get("dtype") is not None or kwargs.get("out") is not None or t.dtype not in _CASTABLE or not on(t)
                or any(isinstance(a, torch.dtype) for a in args)
            ):
                return func(*args, **kwargs)
            kwargs = dict(kwargs)
            kwargs["dtype"] = _F32
            try:
                return func(*args, **kwargs)
            except TypeError as e:
                if "dtype" not in str(e):
                    raise
                raise TypeError(
                    f"ampkit autocast: op {name!r} is in the fp32_output category, but "
                    f"{_ops.op_name(func)} takes no dtype= argument; list it under fp32 instead"
                ) from e

    elif category == "promote":
        casts = {d: _caster(engine, device_type, d, dtype, cache_enabled) for d in (_F32, dtype)}

        def act(func, args, kwargs):
            if not kwargs:
                return func(*casts[_widest(args, on, dtype)](args))
            if kwargs.get("out") is not None:
                return func(*args, **kwargs)
            cast_all = casts[_widest((*args, *kwargs.values()), on, dtype)]
            return func(*cast_all(args), **dict(zip(kwargs, cast_all(kwargs.values()))))

    elif category == "decompose":
        act = _decomposer(engine, name, on)

    elif category == "banned":

        def act(func, args, kwargs):
            t = _first_tensor(args, kwargs)
            if t is None or not on(t):
                return func(*args, **kwargs)
            raise RuntimeError(message)

    else:  # pragma: no cover - categories are validated by Policy
        raise PolicyError(f"unknown category {category!r}")
    act.rule = category
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


def _compile(engine, frame) -> dict:
    """{func: action} for every listed op of every enabled device of ``frame``."""
    per_func = {}
    names = set()
    for device_type, (enabled, dtype, policy, cache_enabled) in frame.devs.items():
        if not enabled:
            continue
        rules = policy.rules(device_type)
        listed = [(cat, rules.ops(cat)) for cat in CATEGORIES] + [("decompose", rules.decompose)]
        for cat, ops in listed:
            for name in ops:
                msg = rules.ban_message(name) if cat == "banned" else None
                act = _rule(engine, name, cat, device_type, dtype, cache_enabled, msg)
                for func in _ops.resolve(name):
                    if _is_inplace(func):
                        continue
                    per_func.setdefault(func, []).append(act)
                    if not isinstance(func, types.FunctionType):  # builtins: ATen-style names
                        names.add(getattr(func, "__name__", name))
                names.add(name.rsplit(".", 1)[-1])
    table = {f: _dispatch(acts) for f, acts in per_func.items()}
    table[_NAMES_KEY] = frozenset(names)
    table[_REACH_KEY] = {}
    return table


_NAMES_KEY = object()
_REACH_KEY = object()


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


def _classify(engine, func):
    """Action for a func not in the compiled table (cached by the caller)."""
    if _is_inplace(func):
        return None
    user = _USER_WRAPPERS.get(func)  # (func is hashable: _slow looked it up in a dict first)
    if user is not None:  # a registered user op that the policy does not list
        return _run_inside(engine, user, func)
    if isinstance(func, types.FunctionType) and (getattr(func, "__module__", "") or "").startswith("torch"):
        table = engine.mode.real
        names = table.get(_NAMES_KEY)
        if names and _reaches(func, names, table[_REACH_KEY]):
            return _run_inside(engine, _guardfree(func), func)
    return None


# --------------------------------------------------------------------------- public API
_DEFAULT = []


def _default_policy() -> Policy:
    if not _DEFAULT:
        _DEFAULT.append(load_policy("torch_default"))
    return _DEFAULT[0]


class autocast:
    """An ampkit autocast region: the signature and semantics of ``torch.autocast``.

    Args:
      device_type: ``"cpu"`` or ``"cuda"`` (a device type of the policy).
      dtype: the lower-precision dtype (``torch.float16`` or ``torch.bfloat16``);
        None takes the policy's ``lower_precision_dtype`` for the device.
      enabled: False makes the region a pure pass-through (it still nests).
      cache_enabled: cache casts of fp32 leaf tensors that require grad for the
        outermost region; None follows ``torch.is_autocast_cache_enabled()``.
      policy: a :class:`ampkit.Policy`, a shipped name or a YAML path
        (default ``"torch_default"``).

    Works as a context manager and as a decorator.

    >>> import torch, ampkit
    >>> @ampkit.autocast("cpu", dtype=torch.bfloat16)
    ... def f(a, b):
    ...     return a @ b
    >>> f(torch.randn(2, 3), torch.randn(3, 2)).dtype
    torch.bfloat16
    """

    def __init__(self, device_type, dtype=None, enabled=True, cache_enabled=None, *, policy=None):
        if not isinstance(device_type, str):
            raise ValueError(f"ampkit.autocast: device_type must be a string such as 'cpu' or 'cuda', got {device_type!r}")
        pol = _default_policy() if policy is None else load_policy(policy)
        rules = pol.rules(device_type)  # PolicyError (a ValueError) names the valid device types
        if dtype is None:
            dtype = rules.lower_precision_dtype
        elif dtype not in _REGION_DTYPES:
            raise ValueError(
                f"ampkit.autocast: dtype {dtype!r} is not a lower-precision dtype; valid: torch.float16, torch.bfloat16"
            )
        if not isinstance(enabled, bool):
            raise ValueError(f"ampkit.autocast: enabled must be True or False, got {enabled!r}")
        if cache_enabled is not None and not isinstance(cache_enabled, bool):
            raise ValueError(f"ampkit.autocast: cache_enabled must be True, False or None, got {cache_enabled!r}")
        self.device_type = device_type
        self.fast_dtype = dtype
        self.enabled = enabled
        self.cache_enabled = cache_enabled
        self.policy = pol

    def __enter__(self):
        cache = torch.is_autocast_cache_enabled() if self.cache_enabled is None else self.cache_enabled
        _engine().push(self.device_type, self.enabled, self.fast_dtype, self.policy, cache)
        return self

    def __exit__(self, exc_type, exc_val, exc_tb):
        _engine().pop()
        return False

    def __call__(self, func):
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


def is_autocast_enabled(device_type: str) -> bool:
    """Whether an enabled ampkit region for ``device_type`` is active in this thread."""
    s = _engine().state(device_type)
    return bool(s and s[0])


def get_autocast_dtype(device_type: str) -> torch.dtype:
    """The dtype of the innermost ampkit region for ``device_type`` in this thread
    (the default policy's dtype when none is active)."""
    s = _engine().state(device_type)
    if s is not None:
        return s[1]
    return _default_policy().rules(device_type).lower_precision_dtype


def _current_policy(device_type):
    s = _engine().state(device_type)
    return s[2] if s is not None else _default_policy()


def _cast_tree(value, device_type, dtype):
    if isinstance(value, Tensor):
        ok = value.is_floating_point() and value.dtype is not _F64 and value.device.type == device_type
        return value.to(dtype) if ok else value
    if isinstance(value, (str, bytes)):
        return value
    if isinstance(value, dict):
        return {k: _cast_tree(v, device_type, dtype) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_cast_tree(v, device_type, dtype) for v in value)
    return value


def custom_fwd(fwd=None, *, device_type: str, cast_inputs=None):
    """``torch.amp.custom_fwd`` for ampkit regions (decorate ``Function.forward``).

    With ``cast_inputs=None`` forward runs under the region state it is called in
    and backward (with :func:`custom_bwd`) replays that state. With a dtype, the
    floating inputs are cast to it and forward runs with ampkit autocast disabled.
    """
    if not isinstance(device_type, str):
        raise ValueError(f"custom_fwd: device_type must be a string such as 'cuda', got {device_type!r}")
    if fwd is None:
        return functools.partial(custom_fwd, device_type=device_type, cast_inputs=cast_inputs)

    @functools.wraps(fwd)
    def decorate_fwd(*args, **kwargs):
        ctx = args[0]
        ctx._ampkit_dtype = get_autocast_dtype(device_type)
        ctx._ampkit_policy = _current_policy(device_type)
        enabled = is_autocast_enabled(device_type)
        if cast_inputs is None:
            ctx._ampkit_fwd_used_autocast = enabled
            return fwd(*args, **kwargs)
        ctx._ampkit_fwd_used_autocast = False
        if not enabled:
            return fwd(*args, **kwargs)
        with autocast(device_type, enabled=False, policy=ctx._ampkit_policy):
            return fwd(*_cast_tree(args, device_type, cast_inputs), **_cast_tree(kwargs, device_type, cast_inputs))

    return decorate_fwd


def custom_bwd(bwd=None, *, device_type: str):
    """``torch.amp.custom_bwd`` for ampkit: backward runs in the state forward ran in."""
    if not isinstance(device_type, str):
        raise ValueError(f"custom_bwd: device_type must be a string such as 'cuda', got {device_type!r}")
    if bwd is None:
        return functools.partial(custom_bwd, device_type=device_type)

    @functools.wraps(bwd)
    def decorate_bwd(*args, **kwargs):
        ctx = args[0]
        with autocast(
            device_type, dtype=ctx._ampkit_dtype, enabled=ctx._ampkit_fwd_used_autocast, policy=ctx._ampkit_policy
        ):
            return bwd(*args, **kwargs)

    return decorate_bwd


# --------------------------------------------------------------------------- user ops
_USER_WRAPPERS: dict = {}  # wrapper -> original function


def op(fn=None, *, name=None):
    """Make a user function an op that policies can list under ``name``.

    Inside an ampkit region the function takes part in torch's function dispatch,
    so a policy can put it in a category (its inputs are then cast and its body
    runs as one leaf op, like a native op). Unlisted, its body runs with the
    region active. Outside regions it behaves exactly as before; torch is never
    patched. Register before building a policy that names it.

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
    if isinstance(fn, str) and name is None:
        return functools.partial(op, name=fn)
    if fn is None:
        return functools.partial(op, name=name)
    if not callable(fn):
        raise TypeError(f"ampkit.op: expected a function to register, got {fn!r}")
    if name is None:
        name = getattr(fn, "__name__", None)
    if not isinstance(name, str) or not name.isidentifier():
        raise ValueError(f"ampkit.op: op name must be an identifier, got {name!r}")
    if name not in _ops.USER_OPS and _ops.resolve(name):
        raise ValueError(f"ampkit.op: {name!r} already names a torch op; register your function under another name")

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
    wrapper.ampkit_op_name = name
    return wrapper
