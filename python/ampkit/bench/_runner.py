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

``run_variant`` runs these steps for one variant. ``run_interleaved`` (the runner, in one
process or across processes, uses it for each case's variants) runs steps 1-2 for each
of several variants, then 3 as `repeats` rounds
of one epoch per variant, the order rotating (round r starts at the (r mod k)-th of the k
variants still running), so that the variants' samples come from the same minutes; both are made of ``VariantRun``'s pieces
(build, warm_up, epoch, record), one implementation. A variant's turns keep its own random
state, so a run trains the same, step for step, alone or interleaved. A variant paired
with another (``Variant.paired_with``: ampkit_step_eager with its hand-written control)
runs with it as one unit of the rotation when both are in the group (``paired_units``):
on the CPU one step of each per batch, each timed alone, the order alternating
(``ampkit.bench._pairing``); its record's ``paired`` keeps the per-pair times and ratios.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import math
import sys
import time
import warnings

import torch

from ampkit.bench._build import BuiltCase
from ampkit.bench._pairing import pair_groups, pair_order, pair_summary, pair_unit
from ampkit.bench._resolved import resolve_run
from ampkit.bench._results import make_record
from ampkit.bench._spec import Variant, load_variants

INIT_SCALE = 2.0 ** 16
GROWTH_INTERVAL = 2000


def synchronize(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def reset_peak_memory(device: str) -> None:
    """Free what nothing holds and restart the peak count, with the device's library
    workspaces allocated first (``prime_library_workspaces``), so that every variant's peak
    counts them alike."""
    gc.collect()
    if device == "cuda":
        torch.cuda.empty_cache()
        prime_library_workspaces()
        torch.cuda.reset_peak_memory_stats()


def prime_library_workspaces() -> None:
    """Allocate the cuBLAS / cuBLASLt workspaces of this thread's and autograd's handles on
    the current stream, by a tiny matmul forward and backward in each float dtype.

    cuBLAS keeps a workspace (32 MiB on an H100) per (handle, stream) for the life of the
    process, made by the first matmul there; the forward runs on this thread's handle, the
    backward on autograd's device thread's. Made during the first variant's turn, they were
    counted in that variant's peak alone: the Python runner's per-turn accounting left them
    out of every later variant (what the others held), while the R runner, which reads the
    process's peak, counted them in every variant (R / Python peak 1.13 on convnet's
    ampkit_amp, ~64 MiB more on every AMP row, r-loop-h100-072fbe6). Made here, before the
    group's floor is read (Python) and before each variant's reset (R), they are part of the
    floor every variant's peak starts from, in both runners. A no-op once they exist.
    """
    x = torch.ones(16, 16, device="cuda", requires_grad=True)
    w = torch.ones(16, 16, device="cuda", requires_grad=True)  # no initialiser: no random numbers drawn
    b = torch.ones(16, device="cuda", requires_grad=True)  # with a bias: cuBLASLt's fused GEMM (its own workspace)
    for dtype in (None, torch.float16, torch.bfloat16):
        with torch.autocast("cuda", dtype=dtype or torch.float16, enabled=dtype is not None):
            out = torch.nn.functional.linear(x, w, b)
        out.float().sum().backward()
    synchronize("cuda")


class TurnMemory:
    """One variant's peak memory on CUDA, counted over its turns among the group's others.

    ``begin()`` / ``end()`` bracket each turn: the turn's peak is the allocator's peak during
    it, less what was allocated when it began, plus ``floor`` (what was allocated before any
    of the group was built) and ``held`` (what this variant's earlier turns left allocated).

    cuBLAS's workspaces are made again at both edges of every turn
    (``prime_library_workspaces``): reduce-overhead's CUDA-graph trees free every workspace
    of the process around their warm-ups and recordings. Left freed, the workspaces that are
    part of ``floor`` went out of that variant's ``held`` (lowering each of its later peaks
    by their size, ~32 MiB a handle and stream on an H100), and the next variant's first
    matmul made them again inside its own turn (raising its peak by as much).
    """

    def __init__(self, floor: int):
        self.floor, self.held, self.peak = floor, 0, None
        self.start = None  # what was allocated when the turn began

    def begin(self) -> None:
        prime_library_workspaces()
        self.start = _allocated("cuda")
        torch.cuda.reset_peak_memory_stats()

    def end(self) -> None:
        top = int(torch.cuda.max_memory_allocated()) - self.start + self.floor + self.held
        self.peak = top if self.peak is None else max(self.peak, top)
        prime_library_workspaces()  # those this turn freed, outside its figures
        self.held += _allocated("cuda") - self.start


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


def compile_model(variant: Variant, model, reset: bool = True):
    """The module a variant's loop calls: `torch.compile(model, mode=...)` for a compiled
    variant, the model itself otherwise. With ``reset`` dynamo is reset first, so that the
    variant compiles from scratch (no earlier variant's graphs, guards or recompile counts);
    a group of variants timed in turn (``run_interleaved``) resets once, before the group,
    since a reset would drop the graphs of the group's variants built before."""
    if variant.compile == "none":
        return model
    if reset:
        torch._dynamo.reset()
    return torch.compile(model, mode=None if variant.compile == "default" else variant.compile)


def step_compile(variant: Variant, reset: bool = True):
    """``make_train_step(compile=...)`` for a variant of the train_step runner: False, True
    (the default mode) or ``dict(mode=...)``; with ``reset`` dynamo is reset first for a
    compiled one, as ``compile_model`` does for the loop.

    >>> from ampkit.bench import load_variants
    >>> step_compile(load_variants()["ampkit_step"]), step_compile(load_variants()["ampkit_step_compiled"])
    (False, True)
    """
    if variant.compile == "none":
        return False
    if reset:
        torch._dynamo.reset()
    return True if variant.compile == "default" else dict(mode=variant.compile)


def train_step_note(variant: Variant, step, warmup_steps: int, before: dict, warm: dict, end: dict):
    """The record's note for a variant of the train_step runner: why the step did not
    capture (``step.reason``), and for a compiled one why it runs uncompiled
    (``step.compile_reason``) and ``compile_note``; None when there is nothing to say."""
    parts = [step.reason]
    if variant.compile != "none":
        parts += [step.compile_reason, compile_note(variant, warmup_steps, before, warm, end)]
    return "; ".join(p for p in parts if p) or None


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
    whether anything recompiled in the timed steps, whose samples would then include it.

    >>> v = load_variants()["torch_compile_amp"]
    >>> c = lambda g: dict(graphs=g, cache_hits=0, cache_misses=0)
    >>> "2 graph(s) compiled" in compile_note(v, 1, c(0), c(2), c(2))
    True
    >>> "reused the graphs" in compile_note(v, 1, c(2), c(2), c(2))  # a group's earlier variant compiled them
    True
    """
    if variant.compile == "none":
        return None
    note = "torch.compile (mode %s): %d graph(s) compiled during the %d untimed warm-up step(s), " \
        "the first timed apart as compile_s (inductor cache: %d hit(s), %d miss(es))" % (
            variant.compile, warm["graphs"] - before["graphs"], warmup_steps,
            warm["cache_hits"] - before["cache_hits"], warm["cache_misses"] - before["cache_misses"])
    if warm["graphs"] == before["graphs"]:
        note += " (no graph compiled: a compiled run then reused the graphs an earlier variant of its group " \
            "compiled for the same code and guards, and compile_s times no compilation)"
    if end["graphs"] > warm["graphs"]:
        return note + "; %d RECOMPILED during the timed steps, whose samples include that compile time" \
            % (end["graphs"] - warm["graphs"])
    return note + "; none in the timed steps"


def make_step(variant: Variant, built: BuiltCase, model, opt, scaler, reset: bool = True, policy=None):
    """The training step of a variant: a function (inputs, targets) -> loss tensor.
    ``reset``: whether a compiled variant resets dynamo first (``compile_model``);
    ``policy``: the ampkit region's cast policy (a name or a Policy; None: the default), for
    an fp8 variant the tables of the one its ``setup_fp8`` installed (``region_policy``)."""
    device, loss_fn = built.device, built.loss_fn
    dtype = variant.resolved_dtype(device)
    dtype = getattr(torch, dtype) if dtype else None
    if variant.runner == "train_step":  # ampkit's graph-captured step (eager with capture: false)
        import ampkit
        # make_train_step's defaults, on every engine (it warms a DDP model up for 11 steps).
        # Its warning that it runs eagerly (on the CPU: always) is not printed: the record
        # carries the same reason (step.reason, train_step_note).
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="ampkit.make_train_step: running eagerly",
                                    category=UserWarning)
            return ampkit.make_train_step(model, loss_fn, opt, scaler=scaler,
                                          autocast=dict(device_type=device, dtype=dtype),
                                          capture=variant.capture, compile=step_compile(variant, reset))
    model = compile_model(variant, model, reset)
    if variant.autocast == "torch":
        region = lambda: torch.autocast(device_type=device, dtype=dtype)  # noqa: E731
    elif variant.autocast == "ampkit":
        import ampkit
        region = lambda: ampkit.autocast(device, dtype=dtype, policy=policy)  # noqa: E731
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


def rotation(k: int, rounds: int) -> list:
    """The order in which ``k`` interleaved variants run in each of ``rounds`` rounds (one
    timed epoch each a round): round r starts at variant r mod k and goes on in order.

    >>> rotation(3, 4)
    [[0, 1, 2], [1, 2, 0], [2, 0, 1], [0, 1, 2]]
    """
    return [round_order(k, r) for r in range(rounds)]


def round_order(k: int, r: int) -> list:
    """Round ``r``'s order of ``k`` variants (see ``rotation``).

    >>> round_order(3, 1)
    [1, 2, 0]
    """
    return [(r + j) % k for j in range(k)]


def _allocated(device: str):
    return int(torch.cuda.memory_allocated()) if device == "cuda" else None


def _rng_state(device: str):
    return torch.get_rng_state(), (torch.cuda.get_rng_state() if device == "cuda" else None)


def _set_rng_state(state) -> None:
    cpu, cuda = state
    torch.set_rng_state(cpu)
    if cuda is not None:
        torch.cuda.set_rng_state(cuda)


def _check_variant(variant, caller: str) -> None:
    if not isinstance(variant, Variant):
        raise TypeError(
            "%s(built, variant): variant must be an ampkit.bench.Variant, got %r; "
            "get one with ampkit.bench.load_variants()[%r] (names: %s)"
            % (caller, variant, variant if isinstance(variant, str) else "fp32",
               ", ".join(sorted(load_variants()))))


class VariantRun:
    """One variant of a built case being measured, in pieces, so that the same code times
    it alone (``run_variant``) or in turn with others (``run_interleaved``):

        build()    a fresh seeded model (wrapped by the placement), its optimizer, scaler, step
        warm_up()  the untimed steps (a compiled variant's first one timed apart)
        epoch()    sync, clock, one epoch over the batches, sync, clock: one sample
        record()   the record (across processes a collective: every rank calls it in turn)
        close()    drop the model, optimizer, scaler and step

    Each piece is a turn of this variant: it runs under the variant's precision flags with
    its own random state (saved at the end of its turn, restored at the start of the next:
    a dropout mask does not depend on what ran in between), and its time is added to
    ``wall_s``. Peak memory on CUDA is its own: the allocator's peak during each of its
    turns, less what the others held then (``TurnMemory``; ``floor``: what was allocated
    before any of the group was built, the case's batches and cuBLAS's workspaces).
    ``attempt(piece)`` runs a piece and keeps the error instead of raising; across processes
    every rank then agrees (``Placement.first_error``) and a failed variant is closed on all.
    """

    def __init__(self, built: BuiltCase, variant: Variant, language: str, placement, floor):
        self.built, self.variant, self.placement = built, variant, placement
        self.device = built.device
        self.run = resolve_run(built, variant, language, placement=placement)
        self.skip = variant.skip_reason(self.device)
        self.error = None
        self.model = self.opt = self.scaler = self.step = None
        self.samples, self.losses, self.positions = [], [], []
        self.compile_s = self.counts = None
        self.timed_graphs = 0  # graphs dynamo compiled during this variant's own timed epochs
        self.model_note = None  # what a float8 or fp8 variant did to the model, for the record
        self.fp8 = None  # an fp8 variant's installed policy (ampkit.bench._fp8_tier.Fp8Setup)
        self.wall_s = 0.0
        self.memory = TurnMemory(floor) if self.device == "cuda" and floor is not None else None
        self.rng = None
        self.step_ms, self.epoch_losses = [], []  # a paired round's step times and losses
        self.pair_this, self.pair_control = [], []  # the paired variant's timed pairs (ms)
        self.pair_with = self.pair_unit = None

    @contextlib.contextmanager
    def _turn(self):
        t0 = time.perf_counter()
        if self.memory is not None:
            self.memory.begin()
        if self.rng is not None:
            _set_rng_state(self.rng)
        try:
            with precision_flags(self.variant, self.device):
                yield
        finally:
            self.rng = _rng_state(self.device)
            if self.memory is not None:
                self.memory.end()
            self.wall_s += time.perf_counter() - t0

    def sync(self) -> None:
        if self.placement is None:
            synchronize(self.device)
        else:
            self.placement.sync()

    def build(self) -> None:
        with self._turn():
            built, variant, placement = self.built, self.variant, self.placement
            model = built.new_model()
            if variant.float8 != "none":  # torchao swaps the layers, keeping the parameters
                from ampkit.bench._float8 import convert_float8, float8_layers
                if not float8_layers(model)[0]:  # e.g. convnet: its one nn.Linear is the head
                    self.skip = ("%s: no nn.Linear of %s can go to float8 (its head stays in high precision "
                                 "and float8 GEMMs need dimensions that are multiples of 16): nothing to "
                                 "measure" % (variant.name, built.name))
                    return
                model, self.model_note = convert_float8(model, variant.float8)
            if variant.fp8 != "none":  # ampkit's fp8 tier: scopes on the model, their tables the region's
                from ampkit.bench._fp8_tier import setup_fp8
                self.fp8 = setup_fp8(variant.fp8, model, (built.batches[0][0],), self.device,
                                     getattr(torch, variant.resolved_dtype(self.device)))
                if self.fp8 is None:  # e.g. convnet, as for float8
                    self.skip = ("%s: no nn.Linear of %s can go to fp8 (its head stays in the region dtype and "
                                 "fp8 GEMMs need dimensions that are multiples of 16): nothing to measure"
                                 % (variant.name, built.name))
                    return
                self.model_note = self.fp8.note
            if placement is not None:
                model = placement.wrap(model)
            self.model = model
            self.opt = built.new_optimizer(model, fused=variant.fused_optimizer)
            self.scaler = make_scaler(variant, self.device)
            # dynamo is reset once for the group (run_interleaved), not per variant
            self.step = make_step(variant, built, model, self.opt, self.scaler, reset=False,
                                  policy=self.fp8 and self.fp8.region_policy)
            if placement is not None:  # a train step's own warm-up, as make_train_step chose it
                self.run = dataclasses.replace(self.run, warmup_steps=placement.warmup_steps(
                    variant, built.warmup_steps, self.step))

    def warm_up(self) -> None:
        with self._turn():
            batches, n = self.built.batches, self.built.num_batches
            before = compile_counts()
            for i in range(self.run.warmup_steps):
                t0 = time.perf_counter()
                self.step(*batches[i % n])
                if i == 0 and self.variant.compile != "none":
                    synchronize(self.device)
                    self.compile_s = time.perf_counter() - t0
            self.counts = (before, compile_counts())

    def epoch(self) -> None:
        with self._turn():
            losses = []
            graphs = compile_counts()["graphs"] if self.variant.compile != "none" else 0
            self.sync()
            t0 = time.perf_counter()
            for x, y in self.built.batches:
                losses.append(self.step(x, y))
            self.sync()
            self.samples.append((time.perf_counter() - t0) * 1000.0 / self.built.num_batches)
            self.losses = losses
            if self.variant.compile != "none":
                self.timed_graphs += compile_counts()["graphs"] - graphs

    def begin_round(self) -> None:
        """A paired round (step unit) begins: no step timed yet, no loss kept."""
        self.step_ms, self.epoch_losses = [], []

    def timed_step(self, i: int) -> None:
        """One step on batch ``i``, in a turn of its own, timed alone by the wall clock (on the
        CPU no sync is needed); the turn's bookkeeping (random state, flags, memory) and the
        compile counts stay outside the clock."""
        with self._turn():
            graphs = compile_counts()["graphs"] if self.variant.compile != "none" else 0
            x, y = self.built.batches[i]
            t0 = time.perf_counter()
            loss = self.step(x, y)
            ms = (time.perf_counter() - t0) * 1000.0
            self.epoch_losses.append(loss)
            self.step_ms.append(ms)
            if self.variant.compile != "none":
                self.timed_graphs += compile_counts()["graphs"] - graphs

    def end_round(self) -> None:
        """A paired round ends: its sample is its steps' times summed / num_batches (the
        same ms/step as an epoch's), its losses the last round's."""
        if self.error is None:
            self.samples.append(sum(self.step_ms) / self.built.num_batches)
            self.losses = self.epoch_losses
        self.epoch_losses = []

    def attempt(self, piece) -> bool:
        """Run ``piece`` (a method of this class, unbound); False when it failed here or, across
        processes, on any rank (the error is then the first failing rank's, on every rank)."""
        if self.error is None:
            try:
                piece(self)
            except Exception as e:  # a failure is a result: record it, with the error, and go on
                self.error = "%s: %s" % (type(e).__name__, e)
        if self.placement is not None:
            self.error = self.placement.first_error(self.error)
        if self.error is not None:
            self.close()
        return self.error is None

    def close(self) -> None:
        if self.fp8 is not None:
            self.fp8.scopes.remove()
            self.fp8 = None
        self.model = self.opt = self.scaler = self.step = None
        self.losses = []
        gc.collect()

    def record(self, interleaved=None) -> dict:
        """The record: skipped (with the reason), failed (with the error) or ok. ``interleaved``
        (a dict: the group's variants and the rounds) goes in the record of a variant that was
        measured in turn with others, with this variant's place in each round."""
        run = self.run
        if self.skip:
            return make_record(run, status="skipped", reason=self.skip)
        extra = {} if interleaved is None else dict(interleaved=dict(interleaved, positions=list(self.positions)))
        if self.pair_this:
            extra["paired"] = pair_summary(self.pair_with, self.pair_unit, self.pair_this, self.pair_control)
        if self.error is None:
            try:
                final_loss = self.built.mean_loss(self.losses)
                final_scale = float(self.scaler.get_scale()) if self.scaler is not None else None
                # what compiled in this variant's own epochs (the group's others compile in theirs)
                before, warm = self.counts
                end = dict(warm, graphs=warm["graphs"] + self.timed_graphs)
                if self.variant.runner == "train_step":
                    captured = self.step.captured
                    note = train_step_note(self.variant, self.step, self.run.warmup_steps, before, warm, end)
                else:
                    captured = None
                    note = compile_note(self.variant, self.run.warmup_steps, before, warm, end)
                note = "; ".join(p for p in (self.model_note, note) if p) or None
            except Exception as e:  # noqa: BLE001 - recorded
                self.error = "%s: %s" % (type(e).__name__, e)
            if self.placement is not None:
                self.error = self.placement.first_error(self.error)
        if self.error is not None:
            return make_record(run, status="failed", error=self.error, wall_s=self.wall_s, **extra)
        samples, peak = self.samples, self.memory and self.memory.peak
        if self.placement is not None:  # the slowest rank sets the pace, the largest the peak
            samples = self.placement.slowest(samples)
            peak = None if peak is None else int(self.placement.slowest([peak])[0])
        return make_record(run, status="ok", samples_ms=samples, final_loss=final_loss,
                           graph_captured=captured, reason=note, compile_s=self.compile_s,
                           peak_memory_bytes=peak, final_scale=final_scale,
                           skipped_steps=skipped_from_scale(final_scale, run.warmup_steps + len(samples) *
                                                            self.built.num_batches),
                           wall_s=self.wall_s, fp8_modules=self.fp8 and self.fp8.modules, **extra)


def run_interleaved(built: BuiltCase, variants, language: str = "python", placement=None,
                    before_piece=None) -> list:
    """Train ``built`` under each of ``variants`` in turn and time them in the same window;
    one record per variant, in order (each as ``run_variant`` makes it).

    Every variant is built and warmed up first (one after the other), then ``built.repeats``
    rounds each time one epoch of every variant still running, round r starting at the
    (r mod k)-th of the k running (``rotation``): a drift of the machine over the minutes of
    the measure hits every variant alike, and each sample pairs with the others' of the
    same round. A variant that
    fails (in its build, warm-up or an epoch) is recorded as failed and freed; the others go
    on. Across processes (``placement``) every rank must call this with the same variants:
    after each piece the ranks agree on whether it failed, so that each records the same.
    With several variants each record's ``interleaved`` names the group, the rounds and the
    variant's place in each round. Compiled variants share a group like the others
    (``compiling_group``): dynamo is reset once before the group and after it, not between
    its variants, and its recompile limit is raised meanwhile, so that each compiled
    variant keeps its graphs while the others compile theirs. ``before_piece()`` is called
    before each piece (the distributed runner re-arms its watchdog there)."""
    for v in variants:
        _check_variant(v, "run_interleaved")
    compiled = sum(1 for v in variants if v.compile != "none")
    with compiling_group(compiled):
        return _run_group(built, variants, language, placement, before_piece)


def _run_group(built: BuiltCase, variants, language: str, placement, before_piece) -> list:
    before = before_piece or (lambda: None)
    reset_peak_memory(built.device)
    floor = _allocated(built.device)  # the case's batches: what every variant's peak starts from
    runs = [VariantRun(built, v, language, placement, floor) for v in variants]
    try:
        for r in runs:
            if not r.skip:
                for piece in (VariantRun.build, VariantRun.warm_up):
                    before()
                    if not r.attempt(piece) or r.skip:  # skipped when built: nothing it can measure
                        r.close()
                        break
        unit = pair_unit(built.device, placement)
        for rnd in range(built.repeats):
            # rotated over the variants still running, so that a skipped or failed one
            # does not give the one after it the first place twice as often; a paired
            # variant and its control are one unit, at the place of the first of them
            running = paired_units([r for r in runs if not r.skip and r.error is None])
            for place, j in enumerate(round_order(len(running), rnd)):
                before()
                if len(running[j]) == 2:
                    _paired_round(running[j], rnd, unit, before)
                    for r in running[j]:
                        if r.error is None:
                            r.positions.append(place)
                elif running[j][0].attempt(VariantRun.epoch):
                    running[j][0].positions.append(place)
        took_part = [r.variant.name for r in runs if r.positions]
        group = {"group": took_part, "rounds": built.repeats} if len(took_part) > 1 else None
        return [r.record(group if r.positions else None) for r in runs]
    finally:
        for r in runs:
            r.close()
        del runs
        reset_peak_memory(built.device)


def paired_units(runs) -> list:
    """The units of a round (``pair_groups`` of the runs' variants): a one-element list per
    variant, and [first, second] per variant and its control that both run, at the place
    of the first of them. Works on anything with a ``variant``."""
    return [[runs[i] for i in unit] for unit in pair_groups([r.variant for r in runs])]


def _paired_round(pair, rnd: int, unit: str, before) -> None:
    """One round of a pair (``paired_units``): on the CPU ("step") one step of each per batch,
    each timed alone, the order ``pair_order(i, rnd)``; else ("epoch") an epoch of each,
    adjacent, the order ``pair_order(0, rnd)``. The paired variant keeps the pairs' times."""
    this = pair[0] if pair[0].variant.paired_with == pair[1].variant.name else pair[1]
    control = pair[1] if this is pair[0] else pair[0]
    this.pair_with, this.pair_unit = control.variant.name, unit
    if unit == "epoch":
        for k in pair_order(0, rnd):
            before()
            pair[k].attempt(VariantRun.epoch)
        if this.error is None and control.error is None:
            this.pair_this.append(this.samples[-1])
            this.pair_control.append(control.samples[-1])
        return
    for r in pair:
        r.begin_round()
    for i in range(this.built.num_batches):
        for k in pair_order(i, rnd):
            pair[k].attempt(lambda run: run.timed_step(i))
        if this.error is None and control.error is None:
            this.pair_this.append(this.step_ms[-1])
            this.pair_control.append(control.step_ms[-1])
    for r in pair:
        r.end_round()


RECOMPILE_LIMIT = 64  # dynamo's recompile (cache size) limit in a group with compiled variants


def _limit_name() -> str:
    """Dynamo's per-code-object limit: ``recompile_limit`` (``cache_size_limit`` before torch 2.6,
    an alias after)."""
    return "recompile_limit" if hasattr(torch._dynamo.config, "recompile_limit") else "cache_size_limit"


@contextlib.contextmanager
def compiling_group(compiled: int):
    """Around a group of variants of which ``compiled`` are compiled (nothing when none):
    ``torch._dynamo.reset()`` before and after, and dynamo's recompile limit raised to at
    least ``RECOMPILE_LIMIT`` (8 a compiled variant, if more) meanwhile, restored after.
    The variants compile the same model class's code: every torch.compile of a new model,
    mode or autocast region adds cache entries for the same code objects, and past the
    limit (8 by default) dynamo would run the rest eagerly, untold.

    >>> name = _limit_name(); limit = getattr(torch._dynamo.config, name)
    >>> with compiling_group(2):
    ...     getattr(torch._dynamo.config, name) >= RECOMPILE_LIMIT
    True
    >>> getattr(torch._dynamo.config, name) == limit
    True
    """
    if not compiled:
        yield
        return
    name = _limit_name()
    limit = max(int(getattr(torch._dynamo.config, name)), RECOMPILE_LIMIT, 8 * int(compiled))
    torch._dynamo.reset()
    try:
        with torch._dynamo.config.patch(**{name: limit}):
            yield
    finally:
        torch._dynamo.reset()


def run_variant(built: BuiltCase, variant: Variant, language: str = "python", placement=None) -> dict:
    """Train `built` under `variant`; a record with status ok, skipped (with the reason) or
    failed (with the error), never a zero. ``placement`` (``ampkit.bench.Placement``): run
    across processes, on every rank at once: the model wrapped in its engine, a barrier
    before each clock read, each sample the slowest rank's, and a run that failed on one
    rank failed on all. The same pieces as ``run_interleaved``, for one variant."""
    _check_variant(variant, "run_variant")
    return run_interleaved(built, [variant], language, placement)[0]


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
    if rec["status"] == "ok" and rec.get("reason"):  # what the run did (fp8 auto's choice, graphs compiled)
        print("        note: " + rec["reason"], file=file, flush=True)
