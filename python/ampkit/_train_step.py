"""One mixed-precision training step, captured whole in a CUDA graph where it can be.

``make_train_step(model, loss_fn, optimizer)`` returns a ``TrainStep``: a callable
``step(inputs, targets) -> loss`` that does exactly what the hand-written AMP loop does,

    optimizer.zero_grad()                      # set_to_none=True
    with ampkit.autocast(**autocast):
        loss = loss_fn(model(*inputs), *targets)
    scaler.scale(loss).backward()
    scaler.step(optimizer)                     # skipped when a gradient is inf/NaN
    scaler.update()                            # backs the scale off after a skip
    return loss.detach()

and, on CUDA, runs it as one CUDA graph replay instead of a few hundred kernel launches
from Python. The state machine of one step object:

    WARMUP --(warmup eager steps on a side stream)--> capture --> GRAPH
    GRAPH: a batch of the captured shapes/dtypes        -> copy into static buffers, replay
           a batch of other shapes/dtypes               -> this call runs eagerly (warn once)
           optimizer hyperparameters, optimizer.load_state_dict(),
           train/eval mode or requires_grad changed     -> one eager step, then capture
                                                           again (twice at most, then
                                                           EAGER with a warning)
    EAGER: every call runs the loop above; ``step.reason`` says why.

Exact skips inside the graph: the graph contains no host decision. The scaler hands the
loss scale and its inf flag to a fused optimizer (``fused=True``), whose kernel unscales
the gradients and skips the update on the device when the flag is set; the scaler's
update is device arithmetic. A step with inf/NaN gradients therefore leaves parameters
and optimizer state unchanged and backs the scale off, whether replayed or eager.

>>> import torch, ampkit
>>> torch.manual_seed(0)  # doctest: +ELLIPSIS
<torch._C.Generator object at ...>
>>> model = torch.nn.Linear(8, 2)
>>> opt = torch.optim.SGD(model.parameters(), lr=0.1)
>>> step = ampkit.make_train_step(model, torch.nn.functional.mse_loss, opt,
...                               autocast=dict(device_type="cpu", dtype=torch.bfloat16),
...                               capture=False)
>>> loss = step(torch.randn(4, 8), torch.randn(4, 2))
>>> loss.shape, step.captured, step.reason
(torch.Size([]), False, 'capture=False was passed')
"""

from __future__ import annotations

import operator
import sys
import warnings
from collections.abc import Callable
from typing import Any

import torch

from ampkit._listeners import about_to_capture
from ampkit._autocast import autocast as autocast_region
from ampkit._capture import (CAPTURE_ERROR_MODE, AccumulationStreams, collector_paused, fresh_stream,
                             holds_ddp)
from ampkit._compile import cache_off_for_capture, compile_failure, compile_model, no_compiling
from ampkit._kernels import expect_compile
from ampkit._policy import load_policy
from ampkit._rollback import (HeldSignals, ModelBuffers, OptimizerCopy, park_grads, plain_value, unparked,
                              why_copy, zero_grads_the_graph_had)
from ampkit._scaler import GradScaler
from ampkit._trace import compiled_code_runs_eagerly
from ampkit._unchanged import SameSignature, signature

__all__ = ["TrainStep", "make_train_step"]

_CAPTURE_CHOICES = ("auto", True, False)
_GRAD_OF = operator.attrgetter("grad")
_WARMUP = 3
_DDP_WARMUP = 11  # torch's CUDA-graph notes: DDP needs 11 eager iterations before a capture
_MAX_RECAPTURES = 2
_AUTOCAST_KEYS = ("device_type", "dtype", "enabled", "cache_enabled", "policy")


def make_train_step(
    model: torch.nn.Module,
    loss_fn: Callable[..., torch.Tensor],
    optimizer: torch.optim.Optimizer,
    *,
    scaler: Any = None,
    autocast: dict | None = None,
    capture: str | bool = "auto",
    warmup: int | None = None,
    compile: bool | dict | None = None,
) -> "TrainStep":
    """Build ``step(inputs, targets) -> loss``: one whole AMP training step.

    Args:
      model: the ``torch.nn.Module`` to train; called as ``model(*inputs)``.
      loss_fn: called as ``loss_fn(outputs, *targets)`` inside the autocast region;
        must return a scalar tensor.
      optimizer: a ``torch.optim.Optimizer`` over the model's parameters. For capture
        with loss scaling it must have a fused path (``SGD/Adam/AdamW(fused=True)``;
        Adam and AdamW also ``capturable=True``).
      scaler: an ``ampkit.GradScaler``. ``None`` makes one for the autocast device,
        enabled for float16 and disabled for bfloat16 (which needs no scaling).
      autocast: keyword arguments of ``ampkit.autocast`` (``device_type``, ``dtype``,
        ``enabled``, ``cache_enabled``, ``policy``). ``None``: the device of the model's
        parameters, float16 on CUDA and bfloat16 on CPU.
      capture: ``"auto"`` captures the step in a CUDA graph where that is exact and runs
        eagerly elsewhere with one warning; ``True`` raises where capture is impossible;
        ``False`` always runs eagerly.
      warmup: eager steps (real training steps, on a side stream) before the capture,
        at least 1: they create the optimizer state and the scaler's scale outside the
        graph. ``None``: 3, or 11 for a model that holds a ``DistributedDataParallel``
        (DDP gathers runtime statistics with host syncs in its first 10 iterations).
      compile: ``None`` or ``False``: the model as given. ``True``: the step compiles the
        model's forward and the loss together (``torch.compile`` of one module whose
        forward is ``loss_fn(model(*inputs), *targets)``, so inductor fuses the loss with
        the model's last kernels); a dict: the same with ``torch.compile(..., **compile)``.
        The first call (an eager warm-up step) compiles the forward and the backward; the capture
        then records the compiled kernels with the optimizer and the scaler, and never
        compiles (a recompile there fails the capture: the step runs eagerly, with the
        usual warning). Where the step may capture, the region's cast cache is off
        (``cache_enabled=False``, as inside the capture: torch.compile guards on it), and
        modes that record CUDA graphs of their own (``'reduce-overhead'``,
        ``'max-autotune'``) are refused: use ``'max-autotune-no-cudagraphs'`` or the
        default. Where torch cannot compile the model (dynamo or inductor raises at the
        first call), the step warns once and runs the model uncompiled: ``step.compiled``
        says which runs, ``step.compile_reason`` why not. The policy and module scopes
        apply inside compiled code; ``ampkit.doctor`` does not see the ops fused inside a
        compiled graph, and armed over a compiled step it currently fails in torch (see
        "With torch.compile" in docs/train_step.md): debug numerics with compile=None.

    Returns:
      A ``TrainStep``. ``step.captured`` says whether the last call replayed a graph,
      ``step.reason`` why it did not (``None`` when it did or still may). Whenever the step
      gives up on capturing (at construction or at a later call) it issues one
      ``UserWarning`` that names the reason and the fix; ``capture=False`` says "eager, I
      know" and warns nothing. ``step.on_warning``, a callable, takes the warnings of later
      calls instead of ``warnings.warn`` (the R package raises them as R warnings). A call that
      raises (anywhere: forward, loss, backward, optimizer step, scaler) changes nothing:
      parameters, gradients, buffers, optimizer state, scaler and step are as before it.

    Raises:
      TypeError/ValueError (``PolicyError`` for a policy) at construction, naming the bad
      argument: the autocast arguments are checked here, not at the first call.

    Example:
      >>> import torch, ampkit
      >>> model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU(), torch.nn.Linear(4, 1))
      >>> opt = torch.optim.SGD(model.parameters(), lr=1e-2)
      >>> step = ampkit.make_train_step(model, torch.nn.MSELoss(), opt, capture=False,
      ...                               autocast=dict(device_type="cpu", dtype=torch.bfloat16))
      >>> for _ in range(3):
      ...     loss = step(torch.randn(16, 4), torch.randn(16, 1))
      >>> bool(torch.isfinite(loss))
      True
    """
    return TrainStep(model, loss_fn, optimizer, scaler=scaler, autocast=autocast,
                     capture=capture, warmup=warmup, compile=compile)


class TrainStep:
    """The callable returned by ``make_train_step``; see its docstring."""

    def __init__(self, model, loss_fn, optimizer, *, scaler=None, autocast=None,
                 capture="auto", warmup=None, compile=None):
        if not isinstance(model, torch.nn.Module):
            raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
        if not callable(loss_fn):
            raise TypeError(f"loss_fn must be callable, got {type(loss_fn).__name__}")
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError(
                f"optimizer must be a torch.optim.Optimizer, got {type(optimizer).__name__}")
        if isinstance(capture, str) and capture != "auto" or not (
                isinstance(capture, (str, bool))):
            raise ValueError(f"capture={capture!r} is not valid; use 'auto', True or False")
        ddp = holds_ddp(model)
        if warmup is None:
            warmup = _DDP_WARMUP if ddp else _WARMUP
        if isinstance(warmup, bool) or not isinstance(warmup, int):
            raise TypeError(f"warmup must be an int >= 1 or None, got {warmup!r}")
        if warmup < 1:
            raise ValueError(
                f"warmup={warmup} is not valid; it must be >= 1 so that the optimizer "
                "state and the loss scale are created before the capture, not inside it")
        if ddp and warmup < _DDP_WARMUP and capture is not False:
            raise ValueError(
                f"warmup={warmup} is too few for a DistributedDataParallel model: DDP "
                f"gathers runtime statistics (with host syncs) in its first 10 iterations, "
                f"which a capture cannot hold; pass warmup>={_DDP_WARMUP} or leave "
                f"warmup=None (it then is {_DDP_WARMUP})")
        compiled = compile_model(model, loss_fn, compile, capture)
        if compiled is not None:  # (the region then runs its policy where the compile sees it)
            expect_compile(self)

        self.model = model
        self._compiled = compiled  # the model and the loss compiled together (ModelAndLoss), or None
        self._compile_pending = compiled is not None  # no compiled call has succeeded yet
        self._compile_reason = None
        self.loss_fn = loss_fn
        self.optimizer = optimizer
        self._autocast = _autocast_kwargs(autocast, model)
        device_type = self._autocast["device_type"]
        if scaler is None:
            half = self._autocast["dtype"] == torch.float16
            scaler = GradScaler(device_type, enabled=half and self._autocast.get("enabled", True))
        elif not isinstance(scaler, GradScaler):
            raise TypeError(
                f"scaler must be an ampkit.GradScaler (or None for a default one), got "
                f"{type(scaler).__module__}.{type(scaler).__name__}; the step asks it whether "
                "its skips are sync-free (is_sync_free) and resets it after a failed capture")
        self.scaler = scaler
        self.warmup = warmup
        self._warm_left = warmup  # eager steps to run before the next capture
        self._streams_checked = False  # the first warm-up looks where gradients accumulate
        self._default_stream_grads = None  # ... and names them here if on the default stream
        self._capture = capture
        self.calls = 0
        self.replays = 0
        self.captures = 0
        self._warned = False
        self.on_warning = None  # a callable given the message instead of warnings.warn
        self._graph = None
        self._last_replayed = False
        self._stream = None
        self._rollback_pool = {}  # CPU optimizer state copies kept between eager steps (KeptCopies)
        self._kept_buffers = ModelBuffers(model)  # the buffers and their copy, kept between eager steps
        self._verdict = {}  # why_copy's verdict on the tensors, kept with its key
        self._reset_static()

        reasons = _static_refusals(capture, device_type, model, optimizer, scaler)
        self._autocast_uncompiled = dict(self._autocast)
        if compiled is not None and not reasons:
            cache_off_for_capture(self._autocast, compile)
        self.reason = "; ".join(reasons) if reasons else None
        if reasons and capture is True:
            raise RuntimeError(
                "make_train_step(capture=True) cannot capture this step in a CUDA graph: "
                + self.reason + ". Fix the above or pass capture='auto' to run eagerly.")
        if reasons and capture == "auto":
            self._warn(self.reason)
        self._eligible = not reasons
        self._model_modules = list(model.modules())
        self._params = [p for g in optimizer.param_groups for p in g["params"]]

    # -- public -------------------------------------------------------------------------
    @property
    def captured(self) -> bool:
        """True when the last call ran as a CUDA graph replay."""
        return self._last_replayed

    @property
    def autocast(self) -> dict:
        """The ``ampkit.autocast`` arguments of the step's region, resolved (a copy):
        ``device_type`` and ``dtype`` are always there; the dtype defaults to the policy's
        ``lower_precision_dtype`` for the device."""
        return dict(self._autocast)

    @property
    def rollback_copy(self) -> str | None:
        """Why the last eager call copied the parameters and the optimizer state before
        its optimizer step (so that a failure after it could be put back), or ``None``:
        it checked that nothing from the optimizer's first write to the end of
        ``scaler.update()`` can raise, and copied nothing (also ``None`` before any eager
        call). See "A call that raises changes nothing" in docs/train_step.md."""
        return self._copy_why

    @property
    def compiled(self) -> bool:
        """True when the step runs the model through ``torch.compile`` (``compile=...``);
        False when no compile was asked for, or torch could not compile the model."""
        return self._compiled is not None

    @property
    def compile_reason(self) -> str | None:
        """Why the step runs the model uncompiled though ``compile=...`` asked for it (the
        compile error of the first call), or ``None``."""
        return self._compile_reason

    def __call__(self, inputs, targets) -> torch.Tensor:
        # (a tensor each, the common case: no frame to find that out)
        flat_in = [inputs] if isinstance(inputs, torch.Tensor) else _as_tensors("inputs", inputs)
        flat_tg = [targets] if isinstance(targets, torch.Tensor) else _as_tensors("targets", targets)
        # All or nothing: a call that raises (in the forward, the loss, backward,
        # optimizer.step or the scaler) leaves the step object, the gradients, the model's
        # buffers, the parameters, the optimizer state and the scaler as they were.
        saved = self._save_for_rollback()
        try:
            loss = self._call(flat_in, flat_tg, saved[1])
        except BaseException as e:
            self._rollback(saved)
            self._deliver_held_signals()
            if self._compile_pending and compile_failure(e):
                self._run_uncompiled(e)
                return self(inputs, targets)  # the same call again, uncompiled
            raise
        if self._held is not None:  # a Ctrl-C held while the optimizer wrote: raised now
            self._deliver_held_signals()
        if self._compile_pending and not compiled_code_runs_eagerly():  # (compiled, not traced)
            self._compile_pending = False
        return loss

    def _run_uncompiled(self, error):
        # After the rollback: the failed call left nothing behind, and this choice stays.
        lines = [ln.strip() for ln in str(error).splitlines() if ln.strip()] or [""]
        first = " ".join(lines[:2]) if lines[0].endswith(":") else lines[0]  # (and the cause)
        self._compile_reason = (f"torch.compile could not compile the model at its first "
                                f"call: {type(error).__name__}: {first}")
        self._compiled = None
        self._compile_pending = False
        self._autocast = self._autocast_uncompiled
        message = (f"ampkit.make_train_step: running the model uncompiled: "
                   f"{self._compile_reason} (compile=None runs it uncompiled without this "
                   "warning)")
        if self.on_warning is not None:
            self.on_warning(message)
        else:
            warnings.warn(message, UserWarning, stacklevel=_user_stacklevel())

    def _call(self, flat_in, flat_tg, old_grads) -> torch.Tensor:
        # old_grads: the .grad references this call's rollback keeps (_save_for_rollback)
        self.calls += 1
        self._last_replayed = False
        if not self._eligible:  # (a step that gave up has dropped its graph)
            return self._eager(flat_in, flat_tg)
        if self._graph is not None:
            if self._beside_graph([*flat_in, *flat_tg]):
                why = self._other_why
                if self._capture is True:
                    raise RuntimeError(f"make_train_step(capture=True): {why}")
                self.reason = why
                if not self._warned:
                    self._warn(why)
                return self._eager(flat_in, flat_tg, beside_graph=True)
            if not self._same_state():
                self._drop_graph()
                if self.captures > _MAX_RECAPTURES:
                    return self._give_up(
                        "optimizer hyperparameters, train/eval mode or requires_grad "
                        f"changed after {self.captures} captures (a learning-rate schedule "
                        "with a float lr, say: give the optimizer a tensor lr to keep the "
                        "graph)", flat_in, flat_tg)
                # One eager step first: a parameter that now requires grad gets its
                # optimizer state there, not inside the capture (where it is never run).
                self._warm_left = 1
            else:
                return self._replay(flat_in, flat_tg)
        # A warm-up step or the capture: kept for a rollback on the host, not on the device
        # beside this call's own gradients (these calls run once or a few times).
        park_grads(old_grads)
        if self._warm_left > 0:
            self._warm_left -= 1
            return self._warmup(flat_in, flat_tg)
        if compiled_code_runs_eagerly():  # (an ampkit.trace(): a capture now would hold the
            return self._warmup(flat_in, flat_tg)  # uncompiled model; it comes after the trace)
        return self._capture_and_replay(flat_in, flat_tg)

    def _beside_graph(self, batch) -> bool:
        # Whether this batch runs beside the graph (it differs from the captured one). The
        # captured and the last other signature differ, so at most one quick check passes:
        # after a call beside the graph the other one is asked first, so that a run of
        # other batches pays one check a call.
        other = self._other_sig
        if self._grads_beside_graph and other is not None:
            if other.quick(batch):
                return True
            return not self._sig.quick(batch) and self._other_batch(batch)
        if self._sig.quick(batch):
            return False
        return (other is not None and other.quick(batch)) or self._other_batch(batch)

    def _other_batch(self, batch):
        # Whether this batch, which the quick checks matched neither with the captured one
        # nor with the last fallback's (a run of other batches alike pays those alone), has
        # other shapes, dtypes or devices than the captured one.
        other = self._other_sig
        sig = signature(batch)
        if sig == self._sig.signature:
            return False
        if other is None or sig != other.signature:  # (the reason is written once per other shape)
            self._other_sig = SameSignature(batch)
            self._other_why = (
                f"this batch has {_describe(sig)} but the graph was captured for "
                f"{_describe(self._sig.signature)} (dynamic shapes run eagerly)")
        return True

    def __repr__(self) -> str:
        mode = "graph" if self._graph is not None else (
            "warmup" if self._eligible else "eager")
        return (f"TrainStep(mode={mode!r}, calls={self.calls}, replays={self.replays}, "
                f"captures={self.captures}, reason={self.reason!r})")

    # -- the step itself ------------------------------------------------------------------
    def _body(self, flat_in, flat_tg, capturing=False, owned_grads=None) -> torch.Tensor:
        kw = self._autocast  # (unpacked below: the region never holds this dict)
        if capturing:  # a cast cached at capture would be a stale copy on replay
            kw = {**kw, "cache_enabled": False}
        with autocast_region(**kw):
            if self._compiled is None:
                loss = self.loss_fn(self.model(*flat_in), *flat_tg)
            else:
                loss = self._compiled(flat_in, flat_tg)
        if not isinstance(loss, torch.Tensor):
            raise TypeError(f"loss_fn must return a tensor, got {type(loss).__name__}")
        if loss.dim() != 0:
            raise ValueError(
                f"loss_fn must return a scalar tensor, got shape {tuple(loss.shape)}; "
                "reduce it (e.g. .mean())")
        self.scaler.scale(loss).backward()
        if capturing:  # a capture records the step, it does not run it: nothing to put back
            self.scaler.step(self.optimizer)
            self.scaler.update()
            return loss.detach()
        grads = types = None  # (read by why_copy, or here beside a graph: read once)
        if owned_grads is not None:
            grads, types = zero_grads_the_graph_had(self._params, owned_grads)
        # The optimizer writes parameters and state in place. Where nothing from its first
        # write to the end of update() can raise (why_copy), there is nothing to put back
        # and nothing is copied; a Ctrl-C that arrives meanwhile is held until the step is
        # whole. Otherwise (an unknown optimizer, a hook, a first step that creates state, a
        # scaler subclass ...) keep a copy to put back, taken after backward, when the
        # activations are freed.
        pool = self._rollback_pool
        why = self._copy_why = why_copy(self.optimizer, self.scaler, self._verdict,
                                             self._params, grads, types)
        if why is None:
            pool.pop("optimizer", None)  # (copies kept by an earlier call: memory only)
            held = self._held = HeldSignals()
            with held:
                self.scaler.step(self.optimizer)
                self.scaler.update()
            if not held.came:  # (nothing to deliver; a raise above leaves it to the rollback)
                self._held = None
        else:
            before = OptimizerCopy(self.optimizer, pool.setdefault("optimizer", {}))
            try:
                self.scaler.step(self.optimizer)
                self.scaler.update()
            except BaseException:
                before.restore()
                raise
        if owned_grads is not None:  # .grad: this step's; the graph's again at its next replay
            self._grads_beside_graph = True
        return loss.detach()

    def _eager(self, flat_in, flat_tg, beside_graph=False) -> torch.Tensor:
        # A failure puts back what this eager step writes in place before its optimizer
        # step: the model's buffers (BatchNorm statistics, in the forward). The gradients
        # need no copy: the step starts from none (set_to_none), and _rollback puts the
        # old .grad references back. beside_graph: a graph exists and owns gradient tensors
        # (it writes them by address, and overwrites them whole at each replay); this step
        # computes its own and leaves them as .grad, the graph's untouched; the next replay
        # makes the graph's .grad again (_replay). No copy either way.
        buffers = self._kept_buffers
        buffers.save()
        owned = self._graph_grads if beside_graph else None
        try:
            self.optimizer.zero_grad(set_to_none=True)
            return self._body(flat_in, flat_tg, owned_grads=owned)
        except BaseException:
            buffers.restore()
            raise

    # -- rollback of a failed call ----------------------------------------------------------
    _copy_why = None  # rollback_copy: set by each eager call
    _held = None  # the signals held while the optimizer wrote without a copy (HeldSignals)

    def _save_for_rollback(self):
        # Host objects only (no tensor work: a replay must stay one launch); what an eager
        # step writes in place is kept by _eager and _body. (The attributes that are not
        # rolled back are left out when a rollback runs, not on every call.)
        return vars(self).copy(), list(map(_GRAD_OF, self._params))  # (C-level: every call)

    def _rollback(self, saved):
        attrs, grads = saved
        for k in _NOT_ROLLED_BACK:
            attrs.pop(k, None)
        vars(self).update(attrs)
        for p, g in zip(self._params, grads):
            p.grad = unparked(g)
        # The failed iteration's stages (an unscale_ that ran before optimizer.step raised,
        # say) must not leak into the next call; the scale itself changes only in update(),
        # which changes nothing when it raises.
        self.scaler.reset_iteration()

    def _deliver_held_signals(self):
        held, self._held = self._held, None
        if held is not None:
            held.deliver()

    def _side_stream(self):
        if self._stream is None:
            self._stream = torch.cuda.Stream()
        self._stream.wait_stream(torch.cuda.current_stream())
        return self._stream

    def _warmup(self, flat_in, flat_tg):
        try:
            with torch.cuda.stream(self._side_stream()):
                if self._streams_checked:
                    return self._eager(flat_in, flat_tg)
                with AccumulationStreams(self._params) as where:
                    loss = self._eager(flat_in, flat_tg)
                self._streams_checked = True
                self._default_stream_grads = where.on_default_stream()
                return loss
        finally:  # the rollback of a failed step ran on the side stream too
            torch.cuda.current_stream().wait_stream(self._stream)

    def _capture_and_replay(self, flat_in, flat_tg) -> torch.Tensor:
        if self._default_stream_grads:
            # Checked before anything is captured: such a capture fails, or worse.
            why = self._default_stream_grads
            if self._capture is True:
                raise RuntimeError(f"make_train_step(capture=True): {why}")
            return self._give_up(why, flat_in, flat_tg)
        self._static_in = [t.detach().clone() for t in flat_in]
        self._static_tg = [t.detach().clone() for t in flat_tg]
        state_before = set(self.optimizer.state)
        scale_before = self.scaler.scale_tensor
        self.optimizer.zero_grad(set_to_none=True)
        graph = torch.cuda.CUDAGraph()
        about_to_capture.notify()
        stream = fresh_stream()
        stream.wait_stream(self._side_stream())
        try:
            with collector_paused(), no_compiling(self.compiled), \
                    torch.cuda.graph(graph, stream=stream, capture_error_mode=CAPTURE_ERROR_MODE):
                static_loss = self._body(self._static_in, self._static_tg, capturing=True)
            torch.cuda.current_stream().wait_stream(stream)
            self._stream.wait_stream(stream)
        except Exception as e:  # noqa: BLE001 - reported, then eager or re-raised
            self._after_failed_capture(state_before)
            why = f"the capture failed: {type(e).__name__}: {e}"
            if self._capture is True:
                raise RuntimeError(f"make_train_step(capture=True): {why}") from e
            return self._give_up(why, flat_in, flat_tg)
        # Lazily created state inside the graph would be re-created on every replay.
        why = None
        if set(self.optimizer.state) != state_before:
            why = ("the optimizer created state during the capture (raise warmup so "
                   "that every parameter has taken a step first)")
            self._forget_state_since(state_before)
        elif self.scaler.scale_tensor is not scale_before:
            why = "the scaler created its scale during the capture (raise warmup)"
        if why is not None:
            self._drop_graph()
            torch.cuda.synchronize()
            if self._capture is True:
                raise RuntimeError(f"make_train_step(capture=True): {why}")
            return self._give_up(why, flat_in, flat_tg)
        self._keep_graph(graph, static_loss, flat_in, flat_tg)
        # The capture recorded the work without running it: run it for this batch.
        return self._replay(flat_in, flat_tg)

    def _keep_graph(self, graph, static_loss, flat_in, flat_tg):
        # What later calls read to replay the graph, or to run beside it (batches of other
        # shapes), and to notice that it no longer holds (the optimizer's state, the modes).
        self._graph = graph
        self._graph_grads = [p.grad for p in self._params]  # (the capture's: in its pool)
        self._static_loss = static_loss
        self._sig = SameSignature([*flat_in, *flat_tg])
        self._key = self._state_key()
        # optimizer.load_state_dict() installs new state/param_groups objects (new tensors).
        self._opt_objs = (self.optimizer.state, self.optimizer.param_groups)
        self.captures += 1
        self.reason = None

    def _replay(self, flat_in, flat_tg) -> torch.Tensor:
        if self._grads_beside_graph:  # an eager fallback's gradients were .grad until now
            self._give_graph_its_grads()
        for buf, t in zip(self._static_in, flat_in):
            buf.copy_(t, non_blocking=True)
        for buf, t in zip(self._static_tg, flat_tg):
            buf.copy_(t, non_blocking=True)
        self._graph.replay()
        self.replays += 1
        self._last_replayed = True
        # A fresh tensor: the static one is overwritten by the next replay.
        return self._static_loss.clone()

    def _give_graph_its_grads(self):
        for p, g in zip(self._params, self._graph_grads):
            p.grad = g
        self._grads_beside_graph = False

    # -- bookkeeping --------------------------------------------------------------------
    def _give_up(self, why, flat_in, flat_tg):
        self._eligible = False
        self._drop_graph()
        self.reason = why
        self._warn(why)
        return self._eager(flat_in, flat_tg)

    def _after_failed_capture(self, state_before):
        try:
            torch.cuda.synchronize()
        except Exception:  # noqa: BLE001 - the eager step will surface a broken context
            pass
        self.optimizer.zero_grad(set_to_none=True)  # grads from the aborted capture
        self.scaler.reset_iteration()  # forget the aborted iteration's stages
        self._forget_state_since(state_before)

    def _forget_state_since(self, state_before):
        # State allocated during a capture was only recorded, never computed: drop it so
        # that the next eager step creates it again.
        for p in [p for p in self.optimizer.state if p not in state_before]:
            del self.optimizer.state[p]

    def _drop_graph(self):
        self._graph = None
        self._reset_static()
        self.optimizer.zero_grad(set_to_none=True)  # grads lived in the graph's pool

    def _reset_static(self):
        self._static_in = self._static_tg = self._static_loss = self._graph_grads = None
        self._grads_beside_graph = False
        self._sig = self._key = self._opt_objs = self._other_sig = self._other_why = None

    def _same_state(self):
        state, groups = self._opt_objs
        return (self.optimizer.state is state and self.optimizer.param_groups is groups
                and self._state_key() == self._key)

    def _state_key(self):
        # Host scalars are baked into the graph; tensors (a tensor lr) are read by address.
        groups = tuple(
            tuple((k, v) for k, v in g.items() if k != "params" and plain_value(v))
            for g in self.optimizer.param_groups)
        return (groups, tuple(m.training for m in self._model_modules),
                tuple(p.requires_grad for p in self._params))

    def _warn(self, why):
        if self._warned:
            return
        self._warned = True
        message = (f"ampkit.make_train_step: running eagerly, not as a CUDA graph: {why} "
                   "(capture=False runs eagerly without this warning)")
        if self.on_warning is not None:
            self.on_warning(message)
        else:
            warnings.warn(message, UserWarning, stacklevel=_user_stacklevel())


# The warning is issued once per step object (a failed call does not take it back); the
# side stream and the rollback copies are caches; _copy_why says how the last eager call,
# failed or not, guarded its optimizer step; _held is delivered after the rollback.
_NOT_ROLLED_BACK = ("_warned", "_stream", "_rollback_pool", "on_warning", "_copy_why", "_held",
                    "_kept_buffers", "_verdict")

# -- helpers ------------------------------------------------------------------------------


def _user_stacklevel():
    # Point the warning at the caller's line, outside this file.
    level, frame = 1, sys._getframe(1)
    while frame is not None and frame.f_code.co_filename == __file__:
        level, frame = level + 1, frame.f_back
    return level


def _policy_dtype(kw):
    """The region's default dtype: the policy's for the device, as ``ampkit.autocast`` takes it."""
    return load_policy(kw.get("policy") or "torch_default").rules(kw["device_type"]).lower_precision_dtype


def _autocast_kwargs(autocast, model):
    if autocast is None:
        autocast = {}
    if not isinstance(autocast, dict):
        raise TypeError(
            f"autocast must be a dict of ampkit.autocast arguments (e.g. "
            f"dict(device_type='cuda', dtype=torch.float16)) or None, got {autocast!r}")
    unknown = sorted(set(autocast) - set(_AUTOCAST_KEYS))
    if unknown:
        raise ValueError(f"unknown autocast key(s) {unknown}; valid keys: {list(_AUTOCAST_KEYS)}")
    kw = dict(autocast)
    if "device_type" not in kw:
        devices = {p.device.type for p in model.parameters()}
        if len(devices) != 1:
            raise ValueError(
                f"cannot infer autocast device_type from parameters on {sorted(devices)}; "
                "pass autocast=dict(device_type=..., dtype=...)")
        kw["device_type"] = devices.pop()
    if kw["device_type"] not in ("cuda", "cpu"):
        raise ValueError(
            f"autocast device_type={kw['device_type']!r} is not valid; use 'cuda' or 'cpu'")
    # Validated now, not at the first call: the region is built from these arguments.
    try:
        if kw.get("dtype") is None:
            kw["dtype"] = _policy_dtype(kw)
        region = autocast_region(**kw)
    except (TypeError, ValueError) as e:  # PolicyError is a ValueError
        raise type(e)(f"make_train_step(autocast={autocast!r}): {e}") from e
    if "policy" in kw:
        kw["policy"] = region.policy  # loaded once, not at every call
    return kw


def _static_refusals(capture, device_type, model, optimizer, scaler):
    """Why this step cannot be a CUDA graph, as a list of readable reasons."""
    if capture is False:
        return ["capture=False was passed"]
    if device_type != "cuda":
        return [f"autocast device_type is {device_type!r}; CUDA graphs need 'cuda'"]
    if not torch.cuda.is_available():
        return ["CUDA is not available"]
    reasons = []
    devices = {p.device for p in model.parameters()} | {
        p.device for g in optimizer.param_groups for p in g["params"]}
    if any(d.type != "cuda" for d in devices) or len(devices) > 1:
        reasons.append(f"parameters are on {sorted(map(str, devices))}; capture needs them "
                       "all on one CUDA device")
    elif devices and next(iter(devices)) != torch.device("cuda", torch.cuda.current_device()):
        reasons.append(f"parameters are on {next(iter(devices))} but the current device is "
                       f"cuda:{torch.cuda.current_device()} (use torch.cuda.set_device)")
    return reasons + _optimizer_refusals(optimizer, scaler)


def _optimizer_refusals(optimizer, scaler):
    """Why this optimizer, with this scaler, cannot run inside a CUDA graph."""
    name = type(optimizer).__name__
    groups = optimizer.param_groups
    scaling = scaler.is_enabled()
    if not scaler.is_sync_free(optimizer):
        return [f"{name} has no fused path that takes the loss scale and the inf flag on "
                f"the device, so skipping a step would need a host sync (construct it with "
                f"fused=True: SGD, Adam and AdamW have one)"]
    if any("capturable" in g for g in groups):
        if not all(g.get("capturable", False) for g in groups):
            return [f"{name} was built with capturable=False (construct it with "
                    f"capturable=True{', fused=True' if scaling else ''})"]
        return []
    if isinstance(optimizer, torch.optim.SGD):
        return []
    return [f"{name} has no capturable path (use SGD, or Adam/AdamW with capturable=True)"]


def _as_tensors(what, value):
    if isinstance(value, torch.Tensor):
        return [value]
    items = list(value) if isinstance(value, (tuple, list)) else [value]
    for i, t in enumerate(items):
        if not isinstance(t, torch.Tensor):
            where = what if len(items) == 1 and not isinstance(value, (tuple, list)) \
                else f"{what}[{i}]"
            raise TypeError(f"{where} must be a torch.Tensor (or {what} a tuple/list of "
                            f"tensors), got {type(t).__name__}")
    return items


def _describe(sig):
    return ", ".join(f"{list(s)} {str(d).replace('torch.', '')}" for s, d, _ in sig)
