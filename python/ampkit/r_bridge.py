"""The Python half of the R package (``r/ampkit``): what R calls through reticulate.

Each function here is one R -> Python crossing that does what the R code of a
training step would otherwise do in several (a crossing costs 30-50 us on a
small CPU; the work of a small step is a few hundred). The R package imports
this module once, unconverted, and keeps its functions as cached callables.
It is not part of ``ampkit``'s Python API (``ampkit.__all__``): Python users
call ``ampkit`` directly.

What lives here:

* autocast regions entered and left by an integer token (an int crosses
  reticulate cheaper than an object);
* the seed loop's scaler calls: ``scale_backward`` (``scaler$scale(loss)$backward()``
  in one call, leaving no scaled tensor to R), ``scaler_step``, ``scaler_update``;
* the CUDA memory reading that the per-step calls return, for R's garbage watch;
* garbage collection after an out-of-memory error (``collect_garbage``) and
  the test of an out-of-memory exception (``is_out_of_memory``);
* the rules R would otherwise repeat: shipped policy names, the scaler's
  integer state keys.

>>> import torch, ampkit
>>> from ampkit import r_bridge
>>> token = r_bridge.enter_autocast("cpu", torch.bfloat16)
>>> torch.is_autocast_enabled("cpu")
True
>>> r_bridge.exit_autocast(token)
>>> torch.is_autocast_enabled("cpu")
False
"""

from __future__ import annotations

import dataclasses
import gc
import inspect
import itertools
import os
import sys
import warnings
import weakref
from typing import Any, Callable

import torch

import ampkit

__all__ = [
    "ScalerCalls",
    "amp_loop",
    "amp_step",
    "bound_zero_grad",
    "call_method",
    "call_releasing",
    "check_autocast",
    "clear_policy_cache",
    "call_warn",
    "collect_garbage",
    "cuda_total_memory",
    "enter_autocast",
    "exit_autocast",
    "is_method",
    "is_out_of_memory",
    "is_torch_function",
    "live_tensor_bytes",
    "live_tensor_count",
    "load_scaler_state",
    "memory_allocated",
    "open_regions",
    "plain",
    "retry_call",
    "set_r_collector",
    "policy",
    "policy_names",
    "release_tensors",
    "scale_backward",
    "scaler_int_state_keys",
    "scaler_step",
    "scaler_update",
    "set_memory_reader",
    "trace_rows",
    "update_then",
    "zero_grad",
]

# ---------------------------------------------------------------- out of memory: collect, retry once

# R's collector (``gc()``), set by the R package: the tensors R dropped are freed there.
_r_collector: list[Callable[[], Any] | None] = [None]


def set_r_collector(fn: Callable[[], Any] | None) -> None:
    """The function that runs R's ``gc()`` (the R package sets it when it starts)."""
    _r_collector[0] = fn


def retry_call(fn: Callable, *args, **kwargs):
    """``fn(*args, **kwargs)``; after an out-of-memory error, collect garbage and call once more.

    The collection is R's ``gc()`` (the tensors R dropped), Python's ``gc.collect()`` and
    ``torch.cuda.empty_cache()``, as mlverse torch retries an allocation after ``gc()``.
    A second out-of-memory error propagates, its message saying that the retry was made.

    The per-step calls below make the first try themselves and call ``_retry`` only
    after an out-of-memory error: one Python frame a call, as in Python's own loop.
    """
    try:
        return fn(*args, **kwargs)
    except _OOM_TYPES:
        pass  # leave the except block: the traceback would keep the failed call's tensors
    return _retry(fn, args, kwargs)


def _retry(fn: Callable, args: tuple, kwargs: dict):
    """``retry_call``'s second try, after its first raised an out-of-memory error (which
    the caller must have left: its traceback would keep the failed call's tensors)."""
    freed = _collect_all()
    try:
        return fn(*args, **kwargs)
    except _OOM_TYPES as e:
        raise type(e)(
            f"{e} [ampkit: out of memory again after R's gc(), Python's gc and "
            f"torch.cuda.empty_cache() ({freed / 2**20:.0f} MiB freed) and one retry]"
        ) from None


def _collect_all() -> float:
    before = memory_allocated()
    if _r_collector[0] is not None:
        _r_collector[0]()
    return before - collect_garbage()


# ---------------------------------------------------------------- autocast regions

_open: dict[int, Any] = {}
_tokens = itertools.count(1)


def enter_autocast(device_type, dtype=None, enabled=True, cache_enabled=None, policy=None) -> int:
    """Build and enter ``ampkit.autocast(...)``; return the token that leaves it."""
    cm = ampkit.autocast(device_type, dtype, enabled, cache_enabled,
                         policy=None if policy is None else _policy_arg(policy))
    try:
        cm.__enter__()
        oom = False
    except _OOM_TYPES:
        oom = True  # (retried outside the except block: see retry_call)
    if oom:
        _retry(cm.__enter__, (), {})
    token = next(_tokens)
    _open[token] = cm
    return token


def exit_autocast(token: int) -> None:
    """Leave the region of ``token``."""
    cm = _open.pop(token, None)
    if cm is None:
        raise RuntimeError(
            f"exit_autocast: no open region with token {token!r}; "
            f"open tokens: {sorted(_open) or 'none'}. Each token leaves its region once."
        )
    cm.__exit__(None, None, None)


def open_regions() -> int:
    """How many regions R has entered and not left."""
    return len(_open)


# ---------------------------------------------------------------- tensors alive

def live_tensor_count() -> int:
    """How many ``torch.Tensor`` objects are alive in this interpreter (for tests)."""
    return sum(1 for o in gc.get_objects() if issubclass(type(o), torch.Tensor))


def live_tensor_bytes() -> int:
    """Bytes of the storages of all live tensors, each storage counted once (for tests)."""
    seen: dict[int, int] = {}
    for o in gc.get_objects():
        if issubclass(type(o), torch.Tensor) and not o.is_meta:
            try:
                st = o.untyped_storage()
                ptr = st.data_ptr()
            except (RuntimeError, NotImplementedError):  # fake, functional, sparse tensors
                continue
            seen[ptr] = max(seen.get(ptr, 0), st.nbytes())
    return sum(seen.values())


# ---------------------------------------------------------------- tensors R has dropped

# References to a tensor held only by R, counted inside release_tensors(): R's wrapper
# (one), the list R passed, the loop variable and getrefcount's argument.
_R_ONLY_REFS = 4


def release_tensors(tensors) -> int:
    """Free the memory of tensors that R no longer references; return how many were freed.

    R hands the module outputs of earlier steps whose R objects no binding references
    any more (R's reference count, checked by the R package): such a tensor is still
    alive only because R has not collected its wrapper yet. A tensor is freed only if
    nothing else holds it or its memory: no other Python reference, no other owner of
    its TensorImpl (the autograd graph, a view of it), no other tensor on its storage
    (a detached copy) but, for a view (a linear layer's 3-d output is one), its base,
    which nothing else may hold either; and it is not a leaf that requires grad.
    Freed means: it (and a view's base) set to an empty tensor, which frees the
    storage, and a tensor that is not a view detached from its graph (which, without
    a backward pass, holds the forward's saved tensors). The R wrapper, when R
    collects it, frees an empty shell of shape (0,).
    """
    n = 0
    for t in tensors:
        if (not isinstance(t, torch.Tensor) or sys.getrefcount(t) > _R_ONLY_REFS
                or t._use_count() != 1 or t.is_leaf and t.requires_grad):
            continue
        base = None
        if t._is_view():
            base = t._base
            # the view's bookkeeping and `base`; a base's Python object is also
            # referenced by its TensorImpl, hence 3 (with getrefcount's argument)
            if base._use_count() != 2 or sys.getrefcount(base) > 3:
                continue
        # the tensors above and the `untyped_storage()` object: no other tensor on it
        if torch._C._storage_Use_Count(t.untyped_storage()._cdata) != (3 if base is not None else 2):
            continue
        # (housekeeping, not the user's ops: out of sight of __torch_function__ modes, so
        # that a trace or a region recording around the next call does not list it)
        with torch._C.DisableTorchFunction():
            if base is None and t.grad_fn is not None:
                t.detach_()  # its graph (saved tensors, if no backward ran) goes with it
            if base is not None:
                base.set_()
            t.set_()  # empty: the storage is freed
        base = None
        n += 1
    return n


def call_releasing(dead, fn, *args, **kwargs):
    """``release_tensors(dead)``, then ``fn(*args, **kwargs)``: the release costs R no extra call.

    The release only saves memory: should it fail (a torch without the reference counts
    it reads), the call still runs, and the tensors are left to R's collector.
    """
    try:
        release_tensors(dead)
    except Exception:  # noqa: BLE001 - never let the optional release break the user's call
        pass
    del dead
    return fn(*args, **kwargs)


# ---------------------------------------------------------------- the seed loop's calls

# Each per-step call makes its first try itself and calls `_retry` only after an
# out-of-memory error, outside the except block (see retry_call): one Python frame
# between R and torch, where `retry_call(lambda: ...)` made three or four.

def scale_backward(scaler, loss, *args, **kwargs) -> None:
    """``scaler.scale(loss).backward()`` in one call: the scaled tensor never reaches R."""
    ScalerCalls(scaler).scale_backward(loss, *args, **kwargs)


def scaler_step(scaler, optimizer, *args, **kwargs):
    """``scaler.step(optimizer)``, retried once after an out-of-memory error."""
    return ScalerCalls(scaler).step(optimizer, *args, **kwargs)


def zero_grad(opt, *args, **kwargs) -> float:
    """``opt.zero_grad()``; returns the CUDA memory allocated (``memory_allocated``)."""
    return bound_zero_grad(opt)(*args, **kwargs)


def scaler_update(scaler, new_scale=None) -> float:
    """``scaler.update(new_scale)``; returns the CUDA memory allocated."""
    return ScalerCalls(scaler).update(new_scale)


class ScalerCalls:
    """A scaler's per-step calls, bound once: R passes no scaler on the hot path.

    reticulate 1.28 converts every Python object an R call passes through R's
    ``r_to_py()`` dispatch (about 30 us an argument on a small CPU), so the calls a
    loop makes each step take as few object arguments as they can. Each method is the
    call itself (the bound method is what R calls: no second layer).
    """

    __slots__ = ("scaler",)

    def __init__(self, scaler):
        self.scaler = scaler

    def scale_backward(self, loss, *args, **kwargs) -> None:
        scaler = self.scaler
        try:
            scaler.scale(loss).backward(*args, **kwargs)
            return
        except _OOM_TYPES:
            pass
        _retry(lambda: scaler.scale(loss).backward(*args, **kwargs), (), {})

    def step(self, optimizer, *args, **kwargs):
        scaler = self.scaler
        try:
            return scaler.step(optimizer, *args, **kwargs)
        except _OOM_TYPES:
            pass
        return _retry(scaler.step, (optimizer, *args), kwargs)

    def update(self, new_scale=None) -> float:
        scaler = self.scaler
        try:
            scaler.update(new_scale)
        except _OOM_TYPES:
            pass
        else:
            return float(_memory_reader[0]())
        _retry(scaler.update, (new_scale,), {})
        return float(_memory_reader[0]())

    def update_deferred(self) -> None:
        """``scaler.update()`` as R's deferred ``$update()`` runs it (see ``update_then``)."""
        scaler = self.scaler
        try:
            scaler.update()
            return
        except _OOM_TYPES:
            pass
        _retry(scaler.update, (), {})


def update_then(update: Callable[[], Any], fn: Callable | None, *args, **kwargs):
    """``update()``, then ``fn(*args, **kwargs)``: R's ``scaler$update()`` costs no crossing.

    ``scaler$update()`` changes nothing but the scaler's own state, so the R package
    defers it to its next call into Python (in the seed's loop, ``opt$zero_grad()``) and
    makes both there. Anything in R that reads the scaler (its methods, ``$py``) runs a
    deferred update first (``fn=None``: nothing else). The update runs before ``fn``;
    an error in it propagates from this call (``fn`` is not run).

    >>> import torch, ampkit
    >>> w = torch.nn.Parameter(torch.ones(2)); opt = torch.optim.SGD([w], lr=0.1)
    >>> s = ampkit.GradScaler("cpu", init_scale=4.0, growth_interval=1)
    >>> s.scale(w.sum()).backward(); _ = s.step(opt)
    >>> update_then(ScalerCalls(s).update_deferred, opt.zero_grad); s.get_scale(), w.grad
    (8.0, None)
    """
    update()
    return None if fn is None else fn(*args, **kwargs)


def bound_zero_grad(opt) -> Callable[..., float]:
    """``opt.zero_grad`` bound once (see ``ScalerCalls``); returns the CUDA memory reading.

    The function returned is the call itself (``zero_grad``'s body: no second layer).
    """
    def zero_grad_bound(*args, **kwargs) -> float:
        try:
            opt.zero_grad(*args, **kwargs)
        except _OOM_TYPES:
            pass
        else:
            return float(_memory_reader[0]())
        _retry(opt.zero_grad, args, kwargs)
        return float(_memory_reader[0]())

    return zero_grad_bound


def call_method(obj, name: str, *args, **kwargs):
    """``obj.name(*args, **kwargs)``, retried once after an out-of-memory error."""
    return retry_call(getattr(obj, name), *args, **kwargs)


def is_method(obj, name: str) -> bool:
    """Whether ``obj.name`` is a method of ``obj``'s class (not an instance attribute)."""
    return inspect.isroutine(getattr(type(obj), name, None)) and name not in getattr(obj, "__dict__", ())


def is_torch_function(fn) -> bool:
    """Whether ``fn`` is a Python function of torch or ampkit (R calls those in one crossing).

    >>> import json, torch.nn.functional as F
    >>> is_torch_function(F.mse_loss), is_torch_function(len), is_torch_function(json.dumps)
    (True, False, False)
    """
    module = getattr(fn, "__module__", None) or ""
    return inspect.isfunction(fn) and module.split(".", 1)[0] in ("torch", "ampkit")


def call_warn(fn: Callable, *args, **kwargs) -> list:
    """``[fn(*args, **kwargs), [warning messages]]``: R re-raises the warnings as R warnings."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = fn(*args, **kwargs)
    return [out, [str(w.message) for w in caught]]


# ---------------------------------------------------------------- memory

def _cuda_allocated() -> int:
    # The nested stats skip torch.cuda.memory_allocated()'s flatten and sort.
    if not torch.cuda.is_initialized():
        return 0
    stats = getattr(torch._C, "_cuda_memoryStats", None)
    if stats is None:
        return torch.cuda.memory_allocated()
    return stats(torch.cuda.current_device())["allocated_bytes"]["all"]["current"]


_memory_reader: list[Callable[[], int]] = [_cuda_allocated]


def set_memory_reader(fn: Callable[[], int] | None = None) -> None:
    """Replace the CUDA memory reading (tests); ``None`` restores it."""
    _memory_reader[0] = _cuda_allocated if fn is None else fn


def memory_allocated() -> float:
    """CUDA memory allocated by tensors, in bytes (0.0 before CUDA is used).

    A float: reticulate 1.28 wraps a Python int past 2^31 into a negative R integer.
    """
    return float(_memory_reader[0]())


def cuda_total_memory() -> float:
    """The current CUDA device's memory in bytes, 0.0 without CUDA."""
    if not torch.cuda.is_available():
        return 0.0
    return float(torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory)


def collect_garbage(empty_cache: bool = True) -> float:
    """Python's ``gc.collect()`` and, with CUDA and ``empty_cache``, ``torch.cuda.empty_cache()``.

    R runs its own ``gc()`` first (the tensors R dropped are freed there); this frees
    Python's cycles and hands cached blocks back (after an out-of-memory error; R's
    ``amp_gc()`` keeps the cache). Returns the CUDA memory allocated after.
    """
    gc.collect()
    if empty_cache and torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.empty_cache()
    return memory_allocated()


def is_out_of_memory(type_name: str) -> bool:
    """Whether an exception type name (from ``reticulate::py_last_error()``) is an OOM.

    >>> is_out_of_memory("OutOfMemoryError"), is_out_of_memory("torch.OutOfMemoryError")
    (True, True)
    >>> is_out_of_memory("RuntimeError")
    False
    """
    return type_name.rsplit(".", 1)[-1] in _OOM_NAMES


_OOM_TYPES = tuple(
    {t for t in (getattr(torch, "OutOfMemoryError", None), getattr(torch.cuda, "OutOfMemoryError", None)) if t}
)
_OOM_NAMES = frozenset(t.__name__ for t in _OOM_TYPES) | {"OutOfMemoryError"}


# ---------------------------------------------------------------- rules R asks for

def policy_names() -> list[str]:
    """The names of the shipped policies (``"torch_default"``, ...)."""
    from ampkit._specs import policy_dir

    folder = policy_dir()
    return sorted(p.stem for p in folder.glob("*.yaml")) if folder.is_dir() else []


_policy_cache: dict[str, ampkit.Policy] = {}


def _is_name(s: str) -> bool:
    # load_policy's rule: a shipped name has no directory separator and no YAML ending.
    return os.sep not in s and "/" not in s and not s.endswith((".yaml", ".yml"))


def policy(x) -> ampkit.Policy:
    """``ampkit.load_policy(x)``, kept for shipped names (a file given by path is read again)."""
    if isinstance(x, str) and _is_name(x):
        p = _policy_cache.get(x)
        if p is None:
            p = _policy_cache[x] = ampkit.load_policy(x)
        return p
    return ampkit.load_policy(x)


def clear_policy_cache() -> None:
    """Forget the shipped policies loaded so far (the next region loads them again)."""
    _policy_cache.clear()


def _policy_arg(x):
    return None if x is None else policy(x)


def scaler_int_state_keys(scaler=None) -> list[str]:
    """The keys of ``GradScaler.state_dict()`` whose values are integers."""
    sd = (scaler if scaler is not None else ampkit.GradScaler("cpu")).state_dict()
    return sorted(k for k, v in sd.items() if isinstance(v, int) and not isinstance(v, bool))


def load_scaler_state(scaler, state: dict) -> None:
    """``scaler.load_state_dict(state)``, whole floats of integer keys made ints first.

    R numbers arrive as Python floats; the scaler's own ``state_dict()`` says which
    keys hold integers.
    """
    ints = set(scaler_int_state_keys(scaler))
    fixed = dict(state)
    for k in ints & set(fixed):
        v = fixed[k]
        if isinstance(v, float) and v.is_integer():
            fixed[k] = int(v)
    scaler.load_state_dict(fixed)


# ---------------------------------------------------------------- Python -> R data

def _plain(v):
    if isinstance(v, torch.dtype):
        return str(v).replace("torch.", "")
    if v is None or isinstance(v, (str, int, float, bool)):
        return v
    if isinstance(v, (tuple, list)):
        return ", ".join(str(_plain(x)) for x in v)
    return str(v)


def plain(obj):
    """A dataclass or dict as a dict of plain values (tuples become lists)."""
    if dataclasses.is_dataclass(obj):
        obj = {f.name: getattr(obj, f.name) for f in dataclasses.fields(obj)}
    if isinstance(obj, dict):
        return {k: list(v) if isinstance(v, tuple) else v for k, v in obj.items()}
    return obj


def trace_rows(tr) -> list[dict]:
    """A trace's records as a list of dicts of plain values (R makes a data.frame)."""
    recs = getattr(tr, "records", tr)
    recs = recs() if callable(recs) else recs
    rows = []
    for r in recs:
        if dataclasses.is_dataclass(r):
            d = {f.name: getattr(r, f.name) for f in dataclasses.fields(r)}
        elif hasattr(r, "_asdict"):
            d = r._asdict()
        elif isinstance(r, dict):
            d = r
        else:
            d = vars(r)
        rows.append({k: _plain(v) for k, v in d.items()})
    return rows


# ---------------------------------------------------------------- checks at construction

def check_autocast(model=None, device_type=None, dtype=None, enabled=True, cache_enabled=None, policy=None) -> None:
    """Build (and drop) the ``ampkit.autocast`` these arguments describe: its errors now.

    ``device_type=None`` takes the device of ``model``'s first parameter (``"cpu"``
    without parameters), as ``make_train_step`` does.
    """
    if device_type is None:
        p = next(iter(model.parameters()), None) if model is not None else None
        device_type = p.device.type if p is not None else "cpu"
    ampkit.autocast(device_type, dtype, enabled, cache_enabled, policy=_policy_arg(policy))


# ---------------------------------------------------------------- the R loop's Python twin

def amp_step(net, loss_fn, opt, scaler, x, y, device: str, autocast: bool = True):
    """One step of the seed's loop in Python (``amp_loop``'s): the forward and loss in
    ``ampkit.autocast(device, enabled=autocast)``, then ``scaler.scale(loss).backward()``,
    ``scaler.step(opt)``, ``scaler.update()``, ``opt.zero_grad()``. Returns the loss.

    >>> import torch
    >>> net = torch.nn.Linear(4, 2); opt = torch.optim.SGD(net.parameters(), lr=0.1)
    >>> scaler = ampkit.GradScaler("cpu", enabled=False)
    >>> amp_step(net, torch.nn.MSELoss(), opt, scaler, torch.ones(3, 4), torch.zeros(3, 2), "cpu").dtype
    torch.float32
    """
    with ampkit.autocast(device, enabled=autocast):
        output = net(x)
        loss = loss_fn(output, y)
    scaler.scale(loss).backward()
    scaler.step(opt)
    scaler.update()
    opt.zero_grad()
    return loss


def amp_loop(net, batches, device: str, autocast: bool, scale: bool, steps: int, *, lr: float,
             scaler_kwargs: dict | None = None, record: bool = False):
    """The seed's hand-written AMP loop in Python, the twin that R's loop is held against
    (R tests for equal results, R benchmarks for time): ``steps`` steps over ``batches``
    ((input, target) pairs, cycled) with MSE, SGD(``lr``) and ``ampkit.GradScaler(device,
    enabled=scale, **scaler_kwargs)``. Returns (losses, scaler): every step's loss as a
    float with ``record=True`` (one host sync a step), else only the last one.

    >>> import torch
    >>> net = torch.nn.Linear(4, 2)
    >>> batches = [(torch.randn(3, 4), torch.randn(3, 2))]
    >>> losses, scaler = amp_loop(net, batches, "cpu", True, False, 2, lr=0.1, record=True)
    >>> len(losses), scaler.is_enabled()
    (2, False)
    """
    loss_fn = torch.nn.MSELoss()
    opt = torch.optim.SGD(net.parameters(), lr=lr)
    scaler = ampkit.GradScaler(device, enabled=scale, **(scaler_kwargs or {}))
    losses, loss = [], None
    for s in range(int(steps)):
        x, y = batches[s % len(batches)]
        loss = amp_step(net, loss_fn, opt, scaler, x, y, device, autocast)
        if record:
            losses.append(loss.item())
    if not record and loss is not None:
        losses.append(loss.item())
    return losses, scaler
