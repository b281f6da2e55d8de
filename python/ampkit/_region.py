"""An entered autocast region: torch's autocast state set, and the engine's level pushed.

:class:`Region` is ``ampkit.autocast`` without its argument handling: it takes arguments
already checked (:func:`check_policy_args`) and a Policy object. ``ampkit.autocast``
(ampkit._autocast) is a Region that validates and resolves what the user wrote; module
scopes (ampkit._module_scopes) enter Regions directly, below the Policy type.
"""

from __future__ import annotations

import threading

import torch

from ampkit._cast_rules import F16
from ampkit._engine import thread_engine

REGION_DTYPES = (torch.float16, torch.bfloat16)
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


def check_policy_args(device_type, dtype, enabled, cache_enabled, pol):
    """Check a region's arguments against its Policy ``pol``; returns (dtype, the device's
    rules), dtype None resolved as torch.autocast does."""
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
    elif dtype not in REGION_DTYPES:
        raise ValueError(
            f"ampkit.autocast: dtype {dtype!r} is not a lower-precision dtype; valid: torch.float16, torch.bfloat16"
        )
    if not isinstance(enabled, bool):
        raise ValueError(f"ampkit.autocast: enabled must be True or False, got {enabled!r}")
    if cache_enabled is not None and not isinstance(cache_enabled, bool):
        raise ValueError(f"ampkit.autocast: cache_enabled must be True, False or None, got {cache_enabled!r}")
    return dtype, rules


class Region(torch.amp.autocast):
    """A region over checked arguments and a Policy; see ``ampkit.autocast``."""

    def __init__(self, dev, dtype, enabled, cache_enabled, pol):
        if dev == "cpu" or not enabled or (dtype is F16 and _CUDA_F16_CHECKED[0]):
            # torch.autocast.__init__ where it checks nothing that can fail: "cpu" with a
            # dtype check_policy_args accepted, a disabled region, or float16 on CUDA once torch
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

    def __repr__(self):
        return (
            f"ampkit.autocast({self.device_type!r}, dtype={self.fast_dtype}, enabled={self.enabled}, "
            f"cache_enabled={self.cache_enabled}, policy={self.policy.name!r})"
        )
