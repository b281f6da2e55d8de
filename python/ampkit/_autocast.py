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
import functools
import threading

import torch

from ampkit import _compiled_regions
from ampkit._bounded import BoundedCache
from ampkit._cast_rules import F16
from ampkit._engine import thread_engine
from ampkit._policy import DEVICES, Policy, load_policy

_REGION_DTYPES = (torch.float16, torch.bfloat16)
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


# The policy of a region given none. Loaded at import: code that torch.compile traces
# cannot read files.
DEFAULT_POLICY = load_policy("torch_default")
# (device_type, dtype argument, id(policy argument)) -> (policy argument, Policy, its
# lower-precision dtype for the device), for arguments that passed _region_args once: a
# region entered again skips the checks. Only a Policy object or None (the default) is
# kept (a name or a path is read again: the file may have changed); the entry holds the
# object, so its id() is not reused while the entry lives (a Policy hashes in Python).
_VALID = BoundedCache(64)


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
    pol = DEFAULT_POLICY if policy is None else load_policy(policy)
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
        _VALID.put((device_type, dtype_arg, id(policy)), (policy, pol, rules.lower_precision_dtype))
    return device_type, dtype, enabled, cache_enabled, pol


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
            # trace time (ampkit._compiled_regions). __init__ does not run: the object is not an
            # ampkit.autocast.
            dev, dtype, enabled, cache_enabled, pol = _check_region_args(device_type, dtype, enabled, cache_enabled, policy)
            cache = torch.is_autocast_cache_enabled() if cache_enabled is None else cache_enabled
            index = _compiled_regions.table_index(dev, enabled, dtype, id(pol), cache)
            return _compiled_regions.compiled_region(dev, dtype, enabled, cache_enabled, index)
        return super().__new__(cls)

    def __init__(self, device_type, dtype=None, enabled=True, cache_enabled=None, *, policy=None):
        dev, dtype, enabled, cache_enabled, pol = _region_args(device_type, dtype, enabled, cache_enabled, policy)
        if dev == "cpu" or not enabled or (dtype is F16 and _CUDA_F16_CHECKED[0]):
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
            if dtype is F16 and self._enabled:
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
        eng = thread_engine()
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
            thread_engine().pop()
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
    eng = thread_engine()
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
