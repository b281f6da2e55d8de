"""The Python runner: train each case under each variant and time it.

The timing protocol (the R runner, benchmarks/run.R, follows it line by line):
  1. build the case once (seeded data on the device); per variant, a fresh seeded model;
  2. run `warmup_steps` untimed steps (cycling over the batches); a compiled variant runs
     at least one, and its first step, in which torch.compile compiles the forward and
     backward, is timed apart (compile_s); a recompilation later, in the timed steps,
     is written in the record's note;
  3. `repeats` times: synchronize, read the clock, one epoch over the `num_batches`
     batches, synchronize, read the clock: one sample of ms/step;
  4. the final loss is the mean loss of the last repeat, read after the clock stopped
     (the loop itself never syncs with the host);
  5. skipped steps from the scaler: with fewer steps than its growth interval the scale
     only ever halves, once per skipped step, so skipped = log2(init_scale / final_scale).
"""

from __future__ import annotations

import contextlib
import gc
import math
import sys
import time

import torch

from ampkit.bench._build import BuiltCase
from ampkit.bench._resolved import resolve_run
from ampkit.bench._results import make_record
from ampkit.bench._spec import Variant, load_variants

INIT_SCALE = 2.0 ** 16
GROWTH_INTERVAL = 2000


def synchronize(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def reset_peak_memory(device: str) -> None:
    gc.collect()
    if device == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()


def peak_memory(device: str):
    return int(torch.cuda.max_memory_allocated()) if device == "cuda" else None


def _get_tf32():
    try:  # the legacy flags; they raise once someone has used the new per-backend API
        return ("legacy", torch.get_float32_matmul_precision(), torch.backends.cudnn.allow_tf32)
    except RuntimeError:
        return ("new", torch.backends.cuda.matmul.fp32_precision, torch.backends.cudnn.conv.fp32_precision)


def _set_tf32(on: bool, api: str) -> None:
    if api == "legacy":
        torch.set_float32_matmul_precision("high" if on else "highest")
        torch.backends.cudnn.allow_tf32 = on
    else:
        torch.backends.cuda.matmul.fp32_precision = "tf32" if on else "ieee"
        torch.backends.cudnn.conv.fp32_precision = "tf32" if on else "ieee"


@contextlib.contextmanager
def precision_flags(variant: Variant, device: str):
    """TF32 on for fp32_tf32 only (also for cuDNN, whose default is on), restored after."""
    if device != "cuda":
        yield
        return
    saved = _get_tf32()
    _set_tf32(bool(variant.tf32), saved[0])
    try:
        yield
    finally:
        if saved[0] == "legacy":
            torch.set_float32_matmul_precision(saved[1])
            torch.backends.cudnn.allow_tf32 = saved[2]
        else:
            torch.backends.cuda.matmul.fp32_precision = saved[1]
            torch.backends.cudnn.conv.fp32_precision = saved[2]


def make_scaler(variant: Variant, device: str):
    if variant.scaler == "torch":
        return torch.amp.GradScaler(device, init_scale=INIT_SCALE, growth_interval=GROWTH_INTERVAL)
    if variant.scaler == "ampkit":
        import ampkit
        return ampkit.GradScaler(device, init_scale=INIT_SCALE, growth_interval=GROWTH_INTERVAL)
    return None


def compile_model(variant: Variant, model):
    """The module a variant's loop calls: `torch.compile(model, mode=...)` for a compiled
    variant, the model itself otherwise. Dynamo is reset first, so that each variant
    compiles from scratch (no earlier variant's graphs, guards or recompile counts)."""
    if variant.compile == "none":
        return model
    torch._dynamo.reset()
    return torch.compile(model, mode=None if variant.compile == "default" else variant.compile)


def compile_counts() -> dict:
    """Dynamo's and inductor's running counts in this process (they only grow): graphs
    compiled, and inductor's on-disk FX graph cache hits and misses (a hit compiles in a
    fraction of a miss's time, so compile_s depends on what an earlier run left there)."""
    from torch._dynamo.utils import counters
    return {"graphs": int(counters["stats"]["unique_graphs"]),
            "cache_hits": int(counters["inductor"]["fxgraph_cache_hit"]),
            "cache_misses": int(counters["inductor"]["fxgraph_cache_miss"])}


def compile_note(variant: Variant, warmup_steps: int, before: dict, warm: dict, end: dict):
    """The record's note for a compiled variant (None for others): what compiled during the
    warm-up (from compile_counts() before it, after it, and after the timed steps), and
    whether anything recompiled in the timed steps, whose samples would then include it."""
    if variant.compile == "none":
        return None
    note = "torch.compile (mode %s): %d graph(s) compiled during the %d untimed warm-up step(s), " \
        "the first timed apart as compile_s (inductor cache: %d hit(s), %d miss(es))" % (
            variant.compile, warm["graphs"] - before["graphs"], warmup_steps,
            warm["cache_hits"] - before["cache_hits"], warm["cache_misses"] - before["cache_misses"])
    if end["graphs"] > warm["graphs"]:
        return note + "; %d RECOMPILED during the timed steps, whose samples include that compile time" \
            % (end["graphs"] - warm["graphs"])
    return note + "; none in the timed steps"


def make_step(variant: Variant, built: BuiltCase, model, opt, scaler, train_step_warmup: int = 3):
    """The training step of a variant: a function (inputs, targets) -> loss tensor."""
    device, loss_fn = built.device, built.loss_fn
    dtype = variant.resolved_dtype(device)
    dtype = getattr(torch, dtype) if dtype else None
    if variant.runner == "train_step":  # ampkit's graph-captured step
        import ampkit
        return ampkit.make_train_step(model, loss_fn, opt, scaler=scaler,
                                      autocast=dict(device_type=device, dtype=dtype),
                                      warmup=train_step_warmup)
    model = compile_model(variant, model)
    if variant.autocast == "torch":
        region = lambda: torch.autocast(device_type=device, dtype=dtype)  # noqa: E731
    elif variant.autocast == "ampkit":
        import ampkit
        region = lambda: ampkit.autocast(device, dtype=dtype)  # noqa: E731
    else:
        region = contextlib.nullcontext

    return loop_step(model, loss_fn, opt, region, scaler)


def loop_step(model, loss_fn, opt, region, scaler=None):
    """The hand-written AMP training step: forward and loss in ``region()``, then backward
    and the optimizer step (through ``scaler`` when given). Returns step(x, y) -> loss.

    >>> import torch, contextlib
    >>> lin = torch.nn.Linear(3, 1); opt = torch.optim.SGD(lin.parameters(), lr=0.1)
    >>> step = loop_step(lin, torch.nn.functional.mse_loss, opt, contextlib.nullcontext)
    >>> step(torch.randn(4, 3), torch.randn(4, 1)).dim()
    0
    """
    if scaler is None:
        def step(x, y):
            with region():
                loss = loss_fn(model(x), y)
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            return loss
    else:
        def step(x, y):
            with region():
                loss = loss_fn(model(x), y)
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
            opt.zero_grad(set_to_none=True)
            return loss
    return step


def skipped_from_scale(final_scale, total_steps: int):
    if final_scale is None or total_steps >= GROWTH_INTERVAL or final_scale <= 0:
        return None
    return max(0, int(round(math.log2(INIT_SCALE / final_scale))))


def run_variant(built: BuiltCase, variant: Variant, language: str = "python", placement=None) -> dict:
    """Train `built` under `variant`; a record with status ok, skipped (with the reason) or
    failed (with the error), never a zero. ``placement`` (``ampkit.bench.Placement``): run
    across processes, on every rank at once: the model wrapped in its engine, a barrier
    before each clock read, each sample the slowest rank's, and a run that failed on one
    rank failed on all."""
    if not isinstance(variant, Variant):
        raise TypeError(
            "run_variant(built, variant): variant must be an ampkit.bench.Variant, got %r; "
            "get one with ampkit.bench.load_variants()[%r] (names: %s)"
            % (variant, variant if isinstance(variant, str) else "fp32",
               ", ".join(sorted(load_variants()))))
    device = built.device
    run = resolve_run(built, variant, language, placement=placement)
    common = dict(run=run)
    reason = variant.skip_reason(device)
    if reason:
        return make_record(status="skipped", reason=reason, **common)
    sync = (lambda: synchronize(device)) if placement is None else placement.sync
    t_start = time.perf_counter()
    model = opt = scaler = step = None
    try:
        reset_peak_memory(device)
        with precision_flags(variant, device):
            model = built.new_model()
            if placement is not None:
                model = placement.wrap(model)
            opt = built.new_optimizer(model, fused=variant.fused_optimizer)
            scaler = make_scaler(variant, device)
            step = make_step(variant, built, model, opt, scaler,
                             **({} if placement is None else dict(train_step_warmup=placement.train_step_warmup())))
            batches, n = built.batches, built.num_batches
            warmup, compile_s, counts0 = run.warmup_steps, None, compile_counts()
            for i in range(warmup):
                t0 = time.perf_counter()
                step(*batches[i % n])
                if i == 0 and variant.compile != "none":
                    synchronize(device)
                    compile_s = time.perf_counter() - t0
            counts_warm = compile_counts()
            samples, losses = [], []
            for _ in range(built.repeats):
                losses = []
                sync()
                t0 = time.perf_counter()
                for x, y in batches:
                    losses.append(step(x, y))
                sync()
                samples.append((time.perf_counter() - t0) * 1000.0 / n)
            final_loss = built.mean_loss(losses)
            peak = peak_memory(device)
            if placement is not None:  # the slowest rank sets the pace, the largest the peak
                samples = placement.slowest(samples)
                peak = None if peak is None else int(placement.slowest([peak])[0])
            final_scale = float(scaler.get_scale()) if scaler is not None else None
            captured = getattr(step, "captured", None) if variant.runner == "train_step" else None
            note = getattr(step, "reason", None) if variant.runner == "train_step" else \
                compile_note(variant, warmup, counts0, counts_warm, compile_counts())
        error = None
    except Exception as e:  # a failure is a result: record it, with the error, and go on
        error = "%s: %s" % (type(e).__name__, e)
    finally:
        del model, opt, scaler, step
        reset_peak_memory(device)
    if placement is not None:
        error = placement.first_error(error)
    if error is not None:
        return make_record(status="failed", error=error, wall_s=time.perf_counter() - t_start, **common)
    return make_record(status="ok", samples_ms=samples, final_loss=final_loss,
                       graph_captured=captured, reason=note, compile_s=compile_s,
                       peak_memory_bytes=peak, final_scale=final_scale,
                       skipped_steps=skipped_from_scale(final_scale, run.warmup_steps + built.repeats * n),
                       wall_s=time.perf_counter() - t_start, **common)


_PROGRESS: dict = {}  # language -> seconds the finished runs of this runner took (their wall_s)


def progress(language: str, i: int, total: int, rec: dict, file=sys.stderr) -> None:
    """One line per finished run, with the time left at the pace so far:
    '[python  3/24, ~1 min 40 s left] seed_mlp / torch_amp: 12.31 ms/step ...'."""
    spent = (0.0 if i <= 1 else _PROGRESS.get(language, 0.0)) + float(rec.get("wall_s") or 0.0)
    _PROGRESS[language] = spent
    left = spent / max(i, 1) * (total - i)
    eta = "" if i >= total else ", ~%s left" % (
        "%d min %02d s" % divmod(int(left), 60) if left >= 60 else "%d s" % int(left))
    head = "[%-6s %2d/%d%s] %s / %s:" % (language, i, total, eta, rec["case"], rec["variant"])
    if rec["status"] == "ok":
        tail = "%.2f ms/step (median of %d, %.2f-%.2f), final loss %.5g" % (
            rec["median"], len(rec["samples"]), rec["min"], rec["max"], rec["final_loss"])
    elif rec["status"] == "skipped":
        tail = "skipped: " + rec["reason"]
    else:
        tail = "FAILED: " + rec["error"]
    print(head, tail, file=file, flush=True)
