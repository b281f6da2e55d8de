"""A region's policy changes run as kernels at torch's Autocast dispatch key.

An op in a region's delta (``_native.delta``: handled otherwise than torch's own table)
that is one ATen op, reached by every Python spelling of the op, runs as a Python kernel
registered (``torch.library``) at ``AutocastCPU`` / ``AutocastCUDA`` for that ATen op while
a region that changes it is active. The region then pushes no ``TorchFunctionMode`` for
it, so every other call of the region costs what it costs under ``torch.autocast``; only
calls of the changed op pay for Python. A kernel holds nothing itself: it asks this
thread's innermost ampkit frame for the op's action, and without one (a plain
``torch.autocast`` region, another thread, a nested region that does not change the op)
does what native autocast does for that op (the shipped ``torch_default`` table, which the
drift check proves equal to native; ops native does not list fall through to the kernels
below autocast). A kernel is registered when the first region needing it is entered
and then stays registered, idle, when no region holds it: outside ampkit's regions it does
what native autocast does for its op (the same casts, through one Python call), and the
next region that needs it registers nothing. Dropping and registering kernels each step
cost about 100 us a step on the development VM (the dispatcher rebuilds its caches after a
registration changes), against about 15 us a step for a kept kernel. ``drop_idle()``
gives the idle ones back to torch.

``torch.compile``: dynamo guards compiled code on torch's autocast state and the
torch-function mode stack, not on dispatcher registrations; a graph compiled while such a
kernel is registered keeps its casts after the kernel is gone
(``benchmarks/probes/autocast_kernel_override.py`` (deleted since; at d0f6c33)). Hence:

- while torch.compile holds code it compiled in this process (until ``torch._dynamo.reset()``),
  regions push the handler mode for their whole delta (dynamo guards on it), as they did
  before kernels existed;
- a compile that starts inside a region running kernels (a kernel sees fake tensors) is
  noted, and when the outermost region exits ``torch._dynamo.reset()`` drops everything
  compiled meanwhile, so no graph traced under the kernels outlives them (that call's own
  compiled result ran without the region's changes, and the next region, finding nothing
  compiled, would run kernels and be traced under them again);
- so code that is about to compile a model it calls inside a region says so first
  (``expect_compile(owner)``: ``make_train_step(compile=...)`` does, for the life of the
  step): while it lives the process counts as using torch.compile, and its first region
  pushes the handler mode.

``AMPKIT_AUTOCAST_KERNELS=0`` in the environment (or ``ENABLED[0] = False``) turns the
route off: every change then runs through the handler mode.
"""

from __future__ import annotations

import os
import sys
import threading
import types
import warnings
import weakref

import torch

from ampkit import _ops
from ampkit._bounded import BoundedCache

ENABLED = [os.environ.get("AMPKIT_AUTOCAST_KERNELS", "1") != "0"]
KEYS = {"cpu": "AutocastCPU", "cuda": "AutocastCUDA"}

# Python functions of torch (not C builtins) whose only ATen call for the op is the op of
# the same name, with the arguments it was given (checked per op by
# tests/python/test_autocast_kernels.py against the handler's result).
STRAIGHT = frozenset({
    "torch.functional.cdist",
    "torch.nn.functional.layer_norm",
    "torch.nn.functional.group_norm",
    "torch.nn.functional.mse_loss",
    "torch.nn.functional.l1_loss",
    "torch.nn.functional.binary_cross_entropy",
    "torch._tensor.Tensor.__rmatmul__",
})
# Categories a kernel can run: fp32_output adds a dtype= (its ATen overloads differ),
# decompose needs the Python engine, and ops with a narrowed fp32 cast read the Python
# call's arguments.
CATEGORIES = frozenset({"lower_precision_fp", "fp32", "promote", "banned", None})

_lock = threading.RLock()
# (id(overload), device_type) -> [C++ library object, [one item per region holding it],
# (overload, device_type)]; keyed by id() (an OpOverload hashes in Python; overloads live
# as long as torch.ops)
_held: dict = {}
_kernels: dict = {}  # (overload, device_type) -> its kernel (built once: it holds no region)
_overloads: dict = {}  # op name -> tuple of OpOverloads ((): not a kernel op)
# id(acts) -> (acts, the records acquire returned for it): a region entered again with the
# same table finds its kernels' records without a lookup per op (drop_idle clears it)
_kept = BoundedCache(256)
_traced = [False]  # a kernel ran on fake tensors (a compile) since the last reset
_compile_expected = [0]  # owners of expect_compile() alive: torch.compile is in play


def overloads(name: str) -> tuple:
    """The ATen overloads (without out= and in-place ones) a kernel for op ``name``
    would be registered for; () when the op cannot run as a kernel."""
    hit = _overloads.get(name)
    if hit is None:
        hit = _overloads[name] = _find_overloads(name)
    return hit


def _find_overloads(name: str) -> tuple:
    if name in _ops.USER_OPS:
        return ()
    aten = name.replace(".", "_")
    try:
        packet = getattr(torch.ops.aten, aten)
    except (AttributeError, RuntimeError):
        return ()
    funcs = _ops.resolve(name)
    if not funcs:
        return ()
    for f in funcs:
        if isinstance(f, types.FunctionType):
            if f"{f.__module__}.{f.__qualname__}" not in STRAIGHT:
                return ()
        elif getattr(f, "__name__", None) not in (aten, *_ops.dunders(name)):
            return ()
    out = []
    for ov in packet.overloads():
        op = getattr(packet, ov)
        schema = op._schema
        if ov == "out" or ov.endswith("_out") or ov.startswith("out") or schema.is_mutable:
            continue
        if not any("Tensor" in str(a.type) for a in schema.arguments):  # sum.int and the like
            continue
        try:  # TorchScript-only overloads (index_put.hacked_twin) are not in the dispatcher
            torch._C._dispatch_has_kernel_for_dispatch_key(op.name(), KEYS["cpu"])
        except RuntimeError:
            continue
        out.append(op)
    return tuple(out)


def native_has_kernel(op, device_type: str) -> bool:
    """Whether torch's own autocast registers a kernel for ``op``: asked when ampkit's
    kernel for it is built, before ampkit registers it (the kernel is built once)."""
    return torch._C._dispatch_has_kernel_for_dispatch_key(op.name(), KEYS[device_type])


def acquire(acts, make_kernel) -> tuple:
    """Register (or count one more holder of) the kernel of each (overload, device_type) of
    ``acts`` ({key: action}); ``make_kernel(op, device_type, name)`` builds one, ``name``
    being the policy's op name (the action's ``op``). Returns what to give ``release``:
    the holders' records themselves (an OpOverload hashes in Python).

    A table seen before takes no lock: a holder is one item of the record's list (append
    and pop are atomic), and the table's records are still registered if ``_kept`` still
    has them after the append (drop_idle empties ``_kept`` before it counts holders)."""
    kept = _kept.get(id(acts))
    if kept is not None and kept[0] is acts:
        for held in kept[1]:
            held[1].append(None)
        if _kept.get(id(acts)) is kept:
            return kept[1]
        release(kept[1])  # drop_idle ran meanwhile: take the locked way
    done = []
    with _lock:
        try:
            for key, act in acts.items():
                held = _held.get((id(key[0]), key[1]))
                if held is None:
                    held = _held[(id(key[0]), key[1])] = [_register(key, act.op, make_kernel), [], key]
                held[1].append(None)
                done.append(held)
        except BaseException:
            release(done)
            raise
        records = _kept.put(id(acts), (acts, tuple(done)))  # (a fresh policy every step: bounded)
    return records[1]


_warned = [False]


def _register(key, name, make_kernel):
    """One registration, the C++ library object itself: torch.library.Library's Python
    bookkeeping tripled the cost of a region (about 7 us against 20+ on the dev VM)."""
    kernel = _kernels.get(key)
    if kernel is None:
        kernel = _kernels[key] = make_kernel(*key, name)
    op, device_type = key
    lib = torch._C._dispatch_library("IMPL", "aten", "", __file__, 0)
    overload = op.name().split("::", 1)[1]
    if _warned[0]:
        lib.impl(overload, KEYS[device_type], kernel, False)
    else:  # torch warns once per process that a kernel replaces native autocast's
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            lib.impl(overload, KEYS[device_type], kernel, False)
        _warned[0] = True
    return lib


def release(records) -> None:
    """Count one holder less of each kernel ``acquire`` returned.

    A kernel no region holds stays registered (idle), doing native's handling: dropping
    and registering it again each step cost about 100 us a step on the development VM
    (an MLP step of 0.87 ms: 0.98 ms; 0.88 ms with the kernel kept), far more than the
    registration itself, the dispatcher's caches being rebuilt after each change."""
    for held in records:
        held[1].pop()


def held() -> dict:
    """{(overload, device_type): regions holding its kernel now} (for tests)."""
    with _lock:
        return {v[2]: len(v[1]) for v in _held.values() if v[1]}


def registered() -> frozenset:
    """The (overload, device_type) keys whose kernel is registered, held or idle."""
    with _lock:
        return frozenset(v[2] for v in _held.values())


def drop_idle() -> None:
    """Unregister the kernels no region holds: torch's own autocast kernels are back."""
    with _lock:
        _kept.clear()
        for key in [k for k, v in _held.items() if not v[1]]:
            _held.pop(key)[0].reset()


def expect_compile(owner) -> None:
    """Say that torch.compile will trace regions in this process while ``owner`` lives:
    ``dynamo_used()`` is True until it is collected (a reset included), so that a region
    entered before the first compile does not run kernels that the compile would trace
    past."""
    _compile_expected[0] += 1
    weakref.finalize(owner, _compile_no_longer_expected)


def _compile_no_longer_expected() -> None:
    _compile_expected[0] -= 1


def dynamo_used() -> bool:
    """Whether torch.compile holds code it compiled in this process (none after a reset),
    or was said to be coming (``expect_compile``)."""
    if _compile_expected[0]:
        return True
    convert_frame = sys.modules.get("torch._dynamo.convert_frame")
    if convert_frame is None:
        return False
    codes = getattr(convert_frame, "output_codes", None)
    return True if codes is None else bool(getattr(codes, "seen", True))  # unknown torch: say yes


def note_if_traced(args) -> None:
    """Called by a kernel: remember a compile that traced through it (fake tensors)."""
    if not _traced[0]:
        for a in args:
            if isinstance(a, torch.Tensor) and _is_fake(a):
                _traced[0] = True
                return


def _is_fake(t) -> bool:
    return type(t) is not torch.Tensor and type(t) is not torch.nn.Parameter and (
        torch._subclasses.fake_tensor.is_fake(t))


def forget_compiled_if_traced() -> None:
    """At the outermost region's exit: drop what torch.compile traced under kernels."""
    if _traced[0]:
        _traced[0] = False
        torch._dynamo.reset()
