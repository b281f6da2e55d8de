"""``make_train_step(..., compile=...)``: which ``torch.compile`` the argument asks for,
checked before anything is built, and which errors mean "torch could not compile it".

    compile=None or False -> the model as given
    compile=True          -> torch.compile(ModelAndLoss(model, loss_fn)): the model's
                             forward and the loss in one compiled graph, so inductor fuses
                             the loss (a cross-entropy's softmax over the logits, say) with
                             the model's last kernels, forward and backward
    compile=dict(...)     -> the same with torch.compile(..., **dict); the keys are
                             torch.compile's own keyword arguments
    refused where the step may capture (capture is not False): whatever records CUDA
    graphs of its own, which cannot run inside the step's capture -- a mode whose inductor
    options turn on ``triton.cudagraphs`` ('reduce-overhead', 'max-autotune'), those
    options themselves, the 'cudagraphs' backend, or inductor's global
    ``triton.cudagraphs`` left on; the fix is 'max-autotune-no-cudagraphs' or the
    default mode.

torch.compile is lazy: the first call of the compiled model traces and compiles the
forward, its first backward compiles the backward. A step's first call is an eager
warm-up step, so both happen there, never inside a capture. Where that first call raises
one of torch's compile errors (``compile_failure``), the step runs the model uncompiled.

>>> import torch
>>> from ampkit._compile import compile_model
>>> mse = torch.nn.functional.mse_loss
>>> compile_model(torch.nn.Linear(2, 2), mse, None, capture="auto") is None
True
>>> compile_model(torch.nn.Linear(2, 2), mse, dict(mode="reduce-overhead"), capture="auto")
Traceback (most recent call last):
...
ValueError: make_train_step(compile={'mode': 'reduce-overhead'}): mode='reduce-overhead' records CUDA graphs of its own (inductor's triton.cudagraphs), which cannot run inside the step's own capture; use mode='max-autotune-no-cudagraphs' or the default mode (leave mode out), or pass capture=False
"""

from __future__ import annotations

import contextlib
import inspect

import torch

__all__ = ["ModelAndLoss", "compile_model", "compile_failure"]

_CUDAGRAPHS = "triton.cudagraphs"  # the inductor option behind torch's own CUDA graphs


class ModelAndLoss(torch.nn.Module):
    """The step's forward and loss as one module, what ``compile=`` compiles:
    ``ModelAndLoss(model, loss_fn)(inputs, targets)`` is ``loss_fn(model(*inputs), *targets)``.

    >>> lin = torch.nn.Linear(2, 1)
    >>> x, y = torch.ones(3, 2), torch.zeros(3, 1)
    >>> torch.equal(ModelAndLoss(lin, torch.nn.functional.mse_loss)([x], [y]),
    ...             torch.nn.functional.mse_loss(lin(x), y))
    True
    """

    def __init__(self, model, loss_fn):
        super().__init__()
        self.model = model
        self.loss_fn = loss_fn

    def forward(self, inputs, targets):
        return self.loss_fn(self.model(*inputs), *targets)


def compile_model(model, loss_fn, compile, capture):
    """``torch.compile(ModelAndLoss(model, loss_fn), ...)`` as ``compile`` asks, or ``None``
    when it asks for no compile. Raises TypeError/ValueError naming the value and what is
    valid; calls nothing of the model (torch.compile compiles at the first call)."""
    if compile is None or compile is False:
        return None
    if compile is True:
        kwargs = {}
    elif isinstance(compile, dict):
        kwargs = dict(compile)
    else:
        raise TypeError(
            f"compile={compile!r} is not valid; use None or False (no compile), True "
            "(torch.compile(model)) or a dict of torch.compile keyword arguments, e.g. "
            "dict(mode='max-autotune-no-cudagraphs')")
    where = f"make_train_step(compile={compile!r})"
    valid = [k for k in inspect.signature(torch.compile).parameters if k != "model"]
    unknown = sorted(set(kwargs) - set(valid), key=str)
    if unknown:
        raise ValueError(f"{where}: unknown torch.compile argument(s) {unknown}; valid: {valid}")
    if isinstance(model, torch._dynamo.eval_frame.OptimizedModule):
        raise ValueError(
            f"{where}: the model is already compiled (torch.compile); pass the module "
            "itself with compile=..., or the compiled one with compile=None")
    if capture is not False:
        why = _own_cuda_graphs(kwargs)
        if why is not None:
            raise ValueError(
                f"{where}: {why}, which cannot run inside the step's own capture; use "
                "mode='max-autotune-no-cudagraphs' or the default mode (leave mode out), "
                "or pass capture=False")
    try:
        return torch.compile(ModelAndLoss(model, loss_fn), **kwargs)
    except (RuntimeError, TypeError, ValueError) as e:  # an unknown mode or option, say
        raise ValueError(f"{where}: torch.compile refused it: {e}") from e


def _own_cuda_graphs(kwargs):
    """Why these torch.compile arguments record CUDA graphs of their own, or None."""
    backend = kwargs.get("backend")
    if backend == "cudagraphs":
        return "backend='cudagraphs' records CUDA graphs of its own"
    if backend not in (None, "inductor"):
        return None  # (mode and options are inductor's)
    options = kwargs.get("options") or {}
    if isinstance(options, dict) and _CUDAGRAPHS in options:
        on = options[_CUDAGRAPHS]
        return f"options={{'{_CUDAGRAPHS}': {on!r}}} records CUDA graphs of its own" if on else None
    mode = kwargs.get("mode")
    if isinstance(mode, str) and mode != "default":
        from torch._inductor import list_mode_options

        try:
            if list_mode_options(mode).get(_CUDAGRAPHS):
                return f"mode={mode!r} records CUDA graphs of its own (inductor's {_CUDAGRAPHS})"
        except Exception:  # noqa: BLE001 - an unknown mode: torch.compile names it
            return None
    import torch._inductor.config as inductor_config

    if inductor_config.triton.cudagraphs:
        return (f"torch._inductor.config.triton.cudagraphs is on (set globally), so the "
                f"compiled model records CUDA graphs of its own (pass options="
                f"{{'{_CUDAGRAPHS}': False}} to turn it off for this model)")
    return None


def compile_failure(error) -> bool:
    """Whether ``error`` is torch failing to compile (dynamo could not trace, a backend or
    inductor failed), rather than the model's own code raising (those pass through dynamo
    unchanged) or a bad operation found while tracing (``TorchRuntimeError``: the
    uncompiled model would raise it too)."""
    from torch._dynamo import exc

    if isinstance(error, (exc.TorchRuntimeError, exc.UserError)):
        return False
    if isinstance(error, exc.TorchDynamoException):
        return True
    return type(error).__module__.startswith("torch._inductor")


def cache_off_for_capture(kw, compile):
    # The capture runs the region with its cast cache off, and torch.compile guards on that
    # flag: a warm-up with the cache on would leave the capture to compile the model again.
    if kw.get("cache_enabled", False):
        raise ValueError(
            f"make_train_step(compile={compile!r}, autocast=dict(cache_enabled=True)): a "
            "step that may capture runs a compiled model with the cast cache off (the "
            "capture runs with it off, and torch.compile compiles again for each setting); "
            "leave cache_enabled out, or pass capture=False")
    kw["cache_enabled"] = False


def no_compiling(compiled):
    """Inside a capture: a compiled model whose guards fail raises instead of compiling."""
    if not compiled:
        return contextlib.nullcontext()
    return torch.compiler.set_stance("fail_on_recompile")
