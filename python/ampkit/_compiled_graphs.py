"""Graphs that torch.compile traced under an ampkit handler run with ``__torch_function__`` off.

Inside an ampkit region whose policy differs from torch's autocast (the fp8 category, a
moved op), ampkit's handler is a ``TorchFunctionMode`` (ampkit._engine.Mode). When
torch.compile traces code under it, dynamo inlines the handler's decisions into the graph;
but up to at least torch 2.13 the compiled graph then *runs* with the mode still on the
stack (pytorch/pytorch#196056 proposes the change made here). Every Python-level torch call
of inductor's generated code (its extern kernels such as ``_scaled_mm`` and ``mm``, views,
AOTAutograd's runtime checks) goes through the handler a second time: measured on an H200
at the GPT-2-small shape with every linear in fp8 (benchmarks/gpu/fp8_speed.py --cprofile,
benchmarks/results/gpu/fp8-host-h200-c846849/), ~2,100 calls a step through the handler and a
step of 50-60 ms for 20 ms of device time, where torchao's float8, with the same kernel
count, ran 28 ms.

:func:`install` wraps, once per process, dynamo's ``OutputGraph.call_user_compiler``: a
graph compiled while an ampkit handler was on the mode stack that dynamo traced under is
run inside ``torch._C.DisableTorchFunction()``, as dynamo already does for graphs that
inlined a tensor subclass's ``__torch_function__``. Dynamo's guards on the mode stack are
evaluated before the graph runs, so a region with another policy (or none) still gets a
graph of its own; eager code between graphs still runs under the handler.

>>> import torch, ampkit
>>> from ampkit._compiled_graphs import installed
>>> installed()  # ampkit's import installs it where dynamo has the hook
True
"""

from __future__ import annotations

import functools

import torch

_STATE = {"installed": False}


def _handler_types():
    from ampkit._compiled_regions import CompiledMode
    from ampkit._engine import Mode
    return (Mode, CompiledMode)


def _modes_dynamo_traced_under():
    """The torch function modes active where dynamo began tracing: dynamo pops them for the
    trace (torch >= 2.5) and keeps them in its state manager; older releases leave them on
    the stack."""
    try:
        from torch._dynamo.variables.torch_function import torch_function_mode_stack_state_mgr
        saved = list(torch_function_mode_stack_state_mgr.stack or ())
    except (ImportError, AttributeError):  # pragma: no cover - torch < 2.5
        saved = []
    return saved or list(torch.overrides._get_current_function_mode_stack())


def traced_under_ampkit() -> bool:
    """Whether dynamo is tracing under an ampkit handler (called at compile time)."""
    kinds = _handler_types()
    return any(isinstance(m, kinds) for m in _modes_dynamo_traced_under())


def without_torch_function(compiled_fn):
    """``compiled_fn`` run inside ``torch._C.DisableTorchFunction()``."""

    @functools.wraps(compiled_fn)
    def run(*args, **kwargs):
        with torch._C.DisableTorchFunction():
            return compiled_fn(*args, **kwargs)

    run._ampkit_torch_function_off = True
    return run


def install() -> bool:
    """Wrap dynamo's ``OutputGraph.call_user_compiler`` (once); False where this torch has
    no such hook (the graphs then run under the handler, as before)."""
    if _STATE["installed"]:
        return True
    try:
        from torch._dynamo.output_graph import OutputGraph
    except ImportError:  # pragma: no cover - a torch without dynamo
        return False
    original = getattr(OutputGraph, "call_user_compiler", None)
    if original is None:  # pragma: no cover - a dynamo without the hook
        return False

    @functools.wraps(original)
    def call_user_compiler(self, *args, **kwargs):
        compiled_fn = original(self, *args, **kwargs)
        if traced_under_ampkit() and not getattr(compiled_fn, "_ampkit_torch_function_off", False):
            compiled_fn = without_torch_function(compiled_fn)
        return compiled_fn

    OutputGraph.call_user_compiler = call_user_compiler
    _STATE["installed"] = True
    return True


def installed() -> bool:
    return _STATE["installed"]
