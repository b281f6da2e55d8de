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
                      composites) -> push this thread's Mode (a TorchFunctionMode)
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

Where each step lives, from the region down: torch's state and the engine's level
(ampkit._region, what this module's ``autocast`` enters once it has checked its
arguments); a thread's stack of regions and the mode (ampkit._engine); compiled tables
(ampkit._cast_tables); one category's cast (ampkit._cast_rules); the kernels
(ampkit._kernel_bridge over ampkit._kernels); composites seen through
(ampkit._composites); the plain-checkpoint guard (ampkit._checkpoint_guard); the
delta (ampkit._native). Beside them: regions inside compiled code
(ampkit._compiled_regions), ``checkpoint`` and ``custom_fwd``/``custom_bwd``
(ampkit._replayed_regions), ``ampkit.op`` (ampkit._user_ops).

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

import torch

from ampkit import _compiled_regions
from ampkit._bounded import BoundedCache
from ampkit._engine import thread_engine
from ampkit._policy import DEVICES, Policy, load_policy
from ampkit._region import Region, check_policy_args

_is_compiling = torch.compiler.is_compiling
_is_enabled, _get_dtype = torch.is_autocast_enabled, torch.get_autocast_dtype


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
    dtype, rules = check_policy_args(device_type, dtype, enabled, cache_enabled, pol)
    if remember and type(device_type) is str and (policy is None or type(policy) is Policy):
        _VALID.put((device_type, dtype_arg, id(policy)), (policy, pol, rules.lower_precision_dtype))
    return device_type, dtype, enabled, cache_enabled, pol


class autocast(Region):
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
        Region.__init__(self, dev, dtype, enabled, cache_enabled, pol)  # (no super() object: a hot path)

    def __call__(self, func):
        if not callable(func):
            raise TypeError(f"{self!r} used as a decorator needs a function, got {func!r}")

        @functools.wraps(func)
        def decorated(*args, **kwargs):
            with autocast(self.device_type, self.fast_dtype, self.enabled, self.cache_enabled, policy=self.policy):
                return func(*args, **kwargs)

        return decorated


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
