"""ampkit's fp8 tier against bf16 + torch.compile and torchao's float8 training, one process,
arms timed interleaved. Never a test (tests/python/test_fp8_speed_script.py runs --smoke).

    PYTHONPATH=$PWD/python python3 benchmarks/gpu/fp8_speed.py [--shapes gpt2,decoder16x2048]
        [--arms a,b,...] [--rounds 5] [--steps-per-round 10] [--out results.json] [--smoke]
        [--breakdown] [--cprofile STEPS] [--sync-check] [--gc-freeze] [--threads]

Shapes (the benchmark's GPT-2 case, ampkit.bench's builders, sizes overridden, no copy of
model code): ``gpt2`` is shared_specs/benchmarks/gpt2_small.yaml's full profile (12 x 768,
seq 512, batch 16); ``decoder16x2048`` the same model with 16 layers of width 2048 (16
heads, MLP 8192), seq 2048, batch 4; ``transformer``, ``text_classifier`` and ``seed_mlp`` are
those cases at their own full profile (the runner's fp8 cases: issue 27's "never slower than
bf16 + compile" there, with --breakdown's kernels a step to say where a slower arm loses). ``--smoke``: tiny sizes on the CPU, two rounds of two
steps, the ``aot_eager`` backend (inductor's CPU compile would take minutes), to prove the
script runs; its timings mean nothing.

Arms, each on a fresh copy of the same seeded weights, fused AdamW, synthetic tokens, the
whole model under torch.compile (default mode), every nn.Linear but the vocabulary head in
fp8 for the fp8 arms:

  bf16_compile           torch.autocast(bf16) + torch.compile(model)
  ampkit_bf16_compile    ampkit.autocast(bf16) (torch_default) + torch.compile(model)
  ampkit_fp8_tensorwise  ampkit.autocast(bf16, the fp8 policy, tensorwise recipe), the head (the
                         last nn.Linear) and any linear whose dimensions are not multiples of 16 kept
                         in bf16 by module scopes (the runner's ampkit_fp8 policy,
                         ampkit.bench.fp8_base_policy) + torch.compile(model)
  ampkit_fp8_rowwise     the same, rowwise recipe
  ampkit_fp8_delayed     the same, delayed recipe (amax_history 16; its casts need no amax of
                         their operand first: docs/autocast.md, "fp8")
  ampkit_fp8_tensorwise_fast, ampkit_fp8_delayed_fast  the tensorwise and delayed arms with the
                         recipe's fast_accum (the forward GEMM's use_fast_accum, as torchao's
                         default; the gradients' GEMMs precise)
  ampkit_fp8_auto        the policy ampkit.calibrate_fp8 gives for this model (base: the
                         tensorwise arm's policy; it keeps bf16 where fp8 does not pay); its
                         report (each module's measured times and error) is printed at its build
  torchao_tensorwise     torchao's convert_to_float8_training (tensorwise; the head left out,
                         ampkit.bench.convert_float8) + torch.autocast(bf16) + torch.compile(model)
  torchao_rowwise        the same, rowwise recipe
  ampkit_bf16_step       ampkit.make_train_step(model, loss, fused AdamW, autocast=dict(dtype=bf16),
                         compile=True): the model and the loss compiled together, the whole step
                         (backward, fused AdamW) captured in one CUDA graph (docs/train_step.md)
  ampkit_fp8_step        the same with the tensorwise arm's policy and head scope: ampkit_fp8_step
                         over ampkit_bf16_step is what fp8 gives inside the captured step,
                         ampkit_bf16_step over bf16_compile what the captured step gives
  ampkit_fp8_delayed_step  the same with the delayed arm's policy (its histories written in
                         the graph, no graph break)
  ampkit_fp8_delayed_fast_step  the same with the delayed_fast arm's policy

A step arm runs make_train_step's warm-up (its eager steps, then the call that captures)
inside the arm's warm-up, and fails (FAILED, with the reason) where the step runs uncompiled
or, on CUDA, does not replay its graph (capture=True); on the CPU (--smoke) it runs eagerly.

An arm that cannot be built (torchao missing, an error) is printed as SKIPPED or FAILED with
the reason and left out; the others run. Per shape: every arm is built and warmed up (its
compile s: build + 5 warm-up steps, the device synced; for auto, calibration included), then
``--rounds`` rounds of ``--steps-per-round`` steps of each arm, the arms' order rotating
round by round, the device synced around each timed block. A warmed-up arm should never
compile again: graphs dynamo compiles inside an arm's timed blocks are counted
(``timed_compiles`` in the JSON) and each round that compiled is printed as a warning, as the
timings then include tracing (issue 27 was such a compile: another arm's policy had made
dynamo give up the models' shared forward). Printed (flush=True, as it goes):
median ms/step [min, max], bf16_compile's median over this arm's (x bf16: > 1 is faster),
torchao's best median over this arm's, ampkit_bf16_step's median over this arm's (x bf16
step), peak MiB above what was allocated before its build, held MiB (what the arm keeps on
the device after its warm-up, the allocator's free cache released: a captured step's graph
pool included, which peak MiB does not see), compile s, and the loss of the arm's last timed step (sanity: all arms should agree to about
a percent). ``--out`` writes the same as JSON after each shape (a timeout keeps what ran).

``--breakdown``: after the timed rounds (never inside them), each arm's steps run 3 more
times under torch.profiler, the device synced: device ms a step by kernel kind (fp8_gemm,
gemm, attention, optimizer, triton (inductor's fused kernels, by their inductor names),
other; benchmarks/gpu/kernel_kinds.py, shared with compiled_step_probe.py) and the 15 kernels
that take the most, with their calls a step; in the JSON as each arm's ``breakdown``. With
--smoke, the CPU ops' self time stands in for kernels (so the code path runs in CI).

Memory: arms live side by side (interleaved timing). On the big shape a loop arm keeps
~10.2 GiB (fp32 weights and AdamW state of 0.91 B parameters; its grads are freed each step)
and needs its step's transient on top (bf16: ~15 GiB with the grads; fp8: ~9); a captured
step keeps its whole step for its life (weights, state, and a graph pool of its grads and
activations: ~25 GiB bf16, ~19 fp8, estimated from the loop arms' peaks; held MiB measures
it). So its default arms are four, the step arms are not among them, and an 80 GB card holds
bf16_compile with both step arms (~70 GiB at bf16_compile's peak), or bf16_compile, one
fp8 step and two fp8 loop arms (~65 GiB); name more with --arms only on a card that holds them.

The lead's H100 run, one shape a command (each well inside 10 minutes):

    PYTHONPATH=$PWD/python python3 benchmarks/gpu/fp8_speed.py --shapes gpt2 --out fp8_gpt2.json
    PYTHONPATH=$PWD/python python3 benchmarks/gpu/fp8_speed.py --shapes decoder16x2048 --out fp8_dec.json

and, to see where the fp8 arms' time goes (three arms, so each call stays well inside 9 minutes):

    PYTHONPATH=$PWD/python python3 benchmarks/gpu/fp8_speed.py --shapes decoder16x2048 --breakdown \
        --arms bf16_compile,ampkit_fp8_tensorwise,torchao_tensorwise --rounds 3 --out fp8_dec_breakdown.json
    PYTHONPATH=$PWD/python python3 benchmarks/gpu/fp8_speed.py --shapes gpt2 --breakdown \
        --arms bf16_compile,ampkit_fp8_tensorwise,torchao_tensorwise --out fp8_gpt2_breakdown.json

and the compiled captured step, fp8 against bf16 (each call ~4-6 minutes, bf16_compile in each):

    PYTHONPATH=$PWD/python python3 benchmarks/gpu/fp8_speed.py --shapes decoder16x2048 \
        --arms bf16_compile,ampkit_bf16_step,ampkit_fp8_step --out fp8_dec_step.json
    PYTHONPATH=$PWD/python python3 benchmarks/gpu/fp8_speed.py --shapes decoder16x2048 \
        --arms bf16_compile,ampkit_fp8_tensorwise,torchao_tensorwise,ampkit_fp8_step --out fp8_dec_step_ao.json
    PYTHONPATH=$PWD/python python3 benchmarks/gpu/fp8_speed.py --shapes decoder16x2048 \
        --arms bf16_compile,ampkit_fp8_tensorwise,ampkit_fp8_delayed,ampkit_fp8_delayed_step --out fp8_dec_delayed.json
"""
from __future__ import annotations

import argparse
import contextlib
import copy
import dataclasses
import gc
import json
import statistics
import sys
import threading
import time
import traceback

import torch
from torch._dynamo.utils import counters

import ampkit
from ampkit.bench import build_case, convert_float8, float8_reason, load_case, loop_step
from kernel_kinds import profile_breakdown  # (this folder: the kernel categoriser compiled_step_probe.py shares)

ARMS = ("bf16_compile", "ampkit_bf16_compile", "ampkit_fp8_tensorwise", "ampkit_fp8_rowwise",
        "ampkit_fp8_delayed", "ampkit_fp8_auto", "torchao_tensorwise", "torchao_rowwise",
        "ampkit_bf16_step", "ampkit_fp8_step", "ampkit_fp8_delayed_step", "ampkit_fp8_tensorwise_fast",
        "ampkit_fp8_delayed_fast", "ampkit_fp8_delayed_fast_step")
# arm -> its fp8 recipe (None: bf16)
STEP_ARMS = {"ampkit_bf16_step": None, "ampkit_fp8_step": "tensorwise", "ampkit_fp8_delayed_step": "delayed",
             "ampkit_fp8_delayed_fast_step": "delayed_fast"}
# what each shape runs unless --arms says otherwise (the whole default run: ~8 minutes on an H100)
DEFAULT_ARMS = {
    "gpt2": ("bf16_compile", "ampkit_bf16_compile", "ampkit_fp8_tensorwise", "ampkit_fp8_rowwise",
             "ampkit_fp8_auto", "torchao_tensorwise", "torchao_rowwise"),
    "decoder16x2048": ("bf16_compile", "ampkit_fp8_tensorwise", "ampkit_fp8_rowwise", "torchao_tensorwise"),
}
SHAPES = {  # (case, profile, sizes over it, batches)
    "gpt2": ("gpt2_small", "full", {}, 4),
    "decoder16x2048": ("gpt2_small", "full", dict(n_layers=16, d_model=2048, n_heads=16, d_ff=8192, seq_len=2048,
                                                  batch_size=4), 4),
    # the benchmark's other cases with fp8 candidates, at their own full profile
    "transformer": ("transformer", "full", {}, 4),
    "text_classifier": ("text_classifier", "full", {}, 4),
    "seed_mlp": ("seed_mlp", "full", {}, 4),
}
SMOKE = {"gpt2": ("gpt2_small", "tiny", {}, 2), "decoder16x2048": ("gpt2_small", "tiny", dict(n_layers=2), 2),
         "transformer": ("transformer", "tiny", {}, 2), "text_classifier": ("text_classifier", "tiny", {}, 2),
         "seed_mlp": ("seed_mlp", "tiny", {}, 2)}
BF16 = torch.bfloat16
# every arm's warm-up calls (the same for all: the same training step at each timed step);
# a step arm's are make_train_step's eager steps (STEP_EAGER_WARMUP), then the call that
# captures (and replays), then one replay, so that no timed round holds a capture
WARMUP_STEPS = 5
STEP_EAGER_WARMUP = WARMUP_STEPS - 2
BREAKDOWN_STEPS = 3
RECIPES = {"tensorwise": {"scaling": "tensorwise"}, "rowwise": {"scaling": "rowwise"},
           "delayed": {"scaling": "delayed", "amax_history": 16},
           "tensorwise_fast": {"scaling": "tensorwise", "fast_accum": True},
           "delayed_fast": {"scaling": "delayed", "amax_history": 16, "fast_accum": True}}


def build_shape(shape, smoke, device):
    """The shape's case with the shape's sizes, as a profile named after the shape."""
    name, profile, sizes, num_batches = (SMOKE if smoke else SHAPES)[shape]
    case = load_case(_case_path(name))
    base = case.profiles[profile]
    prof = {**base, "sizes": {**base["sizes"], **sizes}, "num_batches": num_batches}
    case = dataclasses.replace(case, profiles={**case.profiles, shape: prof})
    return build_case(case, shape, device=device)


def _case_path(name):
    from ampkit.bench import spec_dir
    return spec_dir() / ("%s.yaml" % name)


def fp8_policy(recipe, device, model):
    """The shipped fp8 policy with ``recipe``, the head (the model's last nn.Linear) and the
    linears whose dimensions are not multiples of 16 kept in bf16 by scopes: the runner's
    ampkit_fp8 policy (``ampkit.bench.fp8_base_policy``), the layers torchao's arms leave out."""
    from ampkit.bench import fp8_base_policy
    return fp8_base_policy(model, device).with_fp8_recipe(device, **RECIPES[recipe])


class Arm:
    """One arm ready to step: ``step(x, y) -> loss`` and what it holds (hooks, a note);
    ``check()``, called after the warm-up, raises where the arm is not what its name says
    (a step that did not compile, or did not capture)."""

    def __init__(self, step, held=(), note="", check=lambda: None):
        self.step, self.held, self.note, self.check = step, held, note, check


def build_arm(name, case, device, backend):
    model = case.new_model()
    opt_for = lambda m: case.new_optimizer(m, fused=True)  # noqa: E731
    compiled = lambda m: torch.compile(m, backend=backend)  # noqa: E731
    if name == "bf16_compile":
        opt = opt_for(model)
        return Arm(loop_step(compiled(model), case.loss_fn, opt, lambda: torch.autocast(device, dtype=BF16)))
    if name == "ampkit_bf16_compile":
        opt = opt_for(model)
        return Arm(loop_step(compiled(model), case.loss_fn, opt, lambda: ampkit.autocast(device, dtype=BF16)))
    if name in STEP_ARMS:
        return step_arm(model, case, device, backend, STEP_ARMS[name])
    if name.startswith("ampkit_fp8_"):
        recipe = name[len("ampkit_fp8_"):]
        policy = fp8_policy("tensorwise" if recipe == "auto" else recipe, device, model)
        note = ""
        if recipe == "auto":
            ids = case.batches[0][0]
            cal = ampkit.calibrate_fp8(model, (ids,), policy=policy, device_type=device, dtype=BF16)
            policy = cal.policy
            fp8 = [r.module for r in cal.report if r.precision == "fp8"]
            note = "auto: %d of %d linears in fp8 (%s), %d module scopes" % (
                len(fp8), len(cal.report), ", ".join(fp8[:6]) + (" ..." if len(fp8) > 6 else ""),
                len(policy.modules))
            # what decided it (each module's eager fp8 and bf16 times at its shapes, its error)
            print("calibrate_fp8's report:\n" + cal.table(), flush=True)
        scopes = policy.apply(model)
        region_policy = policy.without_modules()
        opt = opt_for(model)
        step = loop_step(compiled(model), case.loss_fn, opt,
                         lambda: ampkit.autocast(device, dtype=BF16, policy=region_policy))
        return Arm(step, held=(scopes,), note=note)
    if name.startswith("torchao_"):
        reason = float8_reason()
        if reason is not None:
            raise Skip(reason)
        model, note = convert_float8(model, name[len("torchao_"):])
        opt = opt_for(model)
        return Arm(loop_step(compiled(model), case.loss_fn, opt, lambda: torch.autocast(device, dtype=BF16)),
                   note=note)
    raise ValueError("unknown arm %r; valid: %s" % (name, ", ".join(ARMS)))


def step_arm(model, case, device, backend, recipe):
    """ampkit.make_train_step(compile=True), fused AdamW, the case's loss: the model and the
    loss compiled together, the whole step captured in one CUDA graph (on the CPU, --smoke:
    eager, as no CUDA graph exists there). ``recipe``: None for bf16, else the fp8 policy of
    that recipe with the head's scope, as the ampkit_fp8_* arms."""
    held, region = (), dict(device_type=device, dtype=BF16)
    if recipe is not None:
        policy = fp8_policy(recipe, device, model)
        held = (policy.apply(model),)
        region["policy"] = policy.without_modules()
    cuda = device == "cuda"
    step = ampkit.make_train_step(model, case.loss_fn, case.new_optimizer(model, fused=True), autocast=region,
                                  compile=True if backend == "inductor" else dict(backend=backend),
                                  capture=cuda, warmup=STEP_EAGER_WARMUP)

    def check():
        if not step.compiled:
            raise RuntimeError("the step runs the model uncompiled: %s" % step.compile_reason)
        if cuda and not step.captured:
            raise RuntimeError("the step did not replay a CUDA graph after its warm-up: %s" % step.reason)

    return Arm(step, held=held, note="captured" if cuda else "eager (no CUDA graph on the CPU)",
               check=check)


class Skip(Exception):
    """An arm that cannot run here, with the reason (not a failure)."""


def _sync(device):
    if device == "cuda":
        torch.cuda.synchronize()


def _mem(device):
    return torch.cuda.memory_allocated() if device == "cuda" else 0


def _peak(device):
    return torch.cuda.max_memory_allocated() if device == "cuda" else 0


def _reset_peak(device):
    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()


def _held(device):
    """Bytes the process holds on the device once the allocator's free cache is released: a
    captured step's graph keeps its private pool (its activations' peak, its gradients) for
    its life, which memory_allocated does not count."""
    if device != "cuda":
        return 0
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    return torch.cuda.memory_reserved()


def run_shape(shape, arms, args, device, backend):
    case = build_shape(shape, args.smoke, device)
    print("== %s: %s, %d batches of %s" % (shape, case.sizes, len(case.batches), tuple(case.batches[0][0].shape)),
          flush=True)
    live, info = {}, {}
    for name in arms:
        _sync(device)
        held_before = _held(device)
        before = _mem(device)
        _reset_peak(device)
        t0 = time.perf_counter()
        graphs, breaks = counters["stats"]["unique_graphs"], sum(counters["graph_break"].values())
        try:
            arm = build_arm(name, case, device, backend)
            for i in range(WARMUP_STEPS):
                loss = arm.step(*case.batches[i % len(case.batches)])
            _sync(device)
            arm.check()
        except Skip as e:
            print("%-24s SKIPPED: %s" % (name, e), flush=True)
            info[name] = {"status": "skipped", "reason": str(e)}
            continue
        except Exception as e:  # noqa: BLE001 - an arm that fails is recorded, the others run
            why = "".join(traceback.format_exception_only(e)).strip()[:800]
            print("%-24s FAILED: %s" % (name, why), flush=True)
            info[name] = {"status": "failed", "reason": why}
            continue
        info[name] = {"status": "ok", "compile_s": time.perf_counter() - t0, "note": arm.note, "samples": [],
                      "base_bytes": before, "peak_mib": (_peak(device) - before) / 2 ** 20,
                      "warmup_loss": float(loss.detach()), "held_mib": (_held(device) - held_before) / 2 ** 20,
                      # dynamo's graphs and graph breaks in its build and warm-up (a break: one more
                      # graph, and the host's time between them, every step)
                      "graphs": counters["stats"]["unique_graphs"] - graphs,
                      "graph_breaks": sum(counters["graph_break"].values()) - breaks}
        live[name] = arm
        print("%-24s built and warmed up in %.1f s, %d graph(s), %d graph break(s)%s" % (
            name, info[name]["compile_s"], info[name]["graphs"], info[name]["graph_breaks"],
            "  (%s)" % arm.note if arm.note else ""), flush=True)
    names = list(live)
    batches = case.batches
    if args.gc_freeze:  # the objects the builds left (dynamo's, inductor's) out of every later collection
        gc.collect()
        gc.freeze()
    for r in range(args.rounds):
        for name in names[r % max(1, len(names)):] + names[:r % max(1, len(names))]:
            _sync(device)
            _reset_peak(device)
            t0 = time.perf_counter()
            graphs = counters["stats"]["unique_graphs"]
            waits = HostWaits(device)
            sampler = ThreadSampler() if args.threads else contextlib.nullcontext()
            with waits, sampler:
                for i in range(args.steps_per_round):
                    loss = live[name].step(*batches[i % len(batches)])
                _sync(device)
            compiled = counters["stats"]["unique_graphs"] - graphs
            if compiled:
                print("%-24s WARNING: compiled %d graph(s) in timed round %d (its time includes tracing)"
                      % (name, compiled, r + 1), flush=True)
            ms = (time.perf_counter() - t0) * 1e3 / args.steps_per_round
            rec = info[name]
            rec["samples"].append(ms)
            waits.add_to(rec.setdefault("host_waits", {}), args.steps_per_round)
            if args.threads:
                sampler.add_to(rec.setdefault("threads", {}))
            rec["timed_compiles"] = rec.get("timed_compiles", 0) + compiled
            rec["peak_mib"] = max(rec["peak_mib"], (_peak(device) - rec["base_bytes"]) / 2 ** 20)
            rec["loss"] = float(loss.detach())
        print("round %d/%d done" % (r + 1, args.rounds), flush=True)
    for name in names:
        print("%-16s %-24s in the timed rounds, a step: %s" % (shape, name, HostWaits.line(info[name]["host_waits"])),
              flush=True)
        if args.threads:
            seen = sorted(info[name]["threads"].items(), key=lambda kv: -kv[1])
            print("%-16s %-24s other threads' frames in the timed rounds (samples every 2 ms): %s" % (
                shape, name, "; ".join("%d x %s" % (n, where) for where, n in seen[:8]) or "none"), flush=True)
    if args.cprofile:
        for name in names:
            print("%-16s %-24s host Python by own time (cProfile, %d steps):\n%s" % (
                shape, name, args.cprofile, host_python_profile(live[name].step, batches, args.cprofile, device)),
                  flush=True)
    if args.sync_check:
        for name in names:
            syncs = host_syncs(live[name].step, batches, device)
            info[name]["host_syncs"] = len(syncs)
            print("%-16s %-24s host syncs in one step: %d%s" % (shape, name, len(syncs), "".join(
                "\n    " + where for where in syncs[:5])), flush=True)
    if args.breakdown:
        for name in names:
            bd = profile_breakdown(live[name].step, batches, BREAKDOWN_STEPS, device)
            info[name]["breakdown"] = bd.to_dict()
            print("\n".join(["%-16s %-24s %s" % (shape, name, bd.lines()[0])] + bd.lines()[1:]), flush=True)
    return summarize(shape, info, device)


def host_python_profile(step, batches, steps, device, top=25):
    """The host's Python functions by their own time over ``steps`` steps (cProfile; the
    device synced before and after), as printable lines: where a host-bound step's time goes."""
    import cProfile
    import io
    import pstats
    _sync(device)
    prof = cProfile.Profile()
    prof.enable()
    for i in range(steps):
        step(*batches[i % len(batches)])
    _sync(device)
    prof.disable()
    out = io.StringIO()
    stats = pstats.Stats(prof, stream=out)
    stats.sort_stats("tottime").print_stats(top)
    stats.print_callers(r"method 'to' of")  # (who casts outside the generated code: issue 27's open question)
    return "\n".join(line for line in out.getvalue().splitlines() if line.strip())


class HostWaits:
    """What can stall a host-bound step's host on the device or on itself, counted over a
    block: the caching allocator's cudaMalloc and cudaFree calls (cudaFree waits for the
    device) and its retries, and Python's garbage collections (by generation) and their time."""

    KEYS = ("cuda_mallocs", "cuda_frees", "alloc_retries", "gc0", "gc1", "gc2", "gc_ms")

    def __init__(self, device):
        self.device, self.counts = device, dict.fromkeys(self.KEYS, 0)

    def _allocator(self):
        if self.device != "cuda":
            return {}
        st = torch.cuda.memory_stats()
        return {"cuda_mallocs": st.get("num_device_alloc", 0), "cuda_frees": st.get("num_device_free", 0),
                "alloc_retries": st.get("num_alloc_retries", 0)}

    def _on_gc(self, phase, info):
        if phase == "start":
            self._t0 = time.perf_counter()
        else:
            self.counts["gc%d" % info["generation"]] += 1
            self.counts["gc_ms"] += (time.perf_counter() - self._t0) * 1e3

    def __enter__(self):
        self._before = self._allocator()
        gc.callbacks.append(self._on_gc)
        return self

    def __exit__(self, *exc):
        gc.callbacks.remove(self._on_gc)
        for k, v in self._allocator().items():
            self.counts[k] += v - self._before[k]
        return False

    def add_to(self, totals, steps):
        """Adds this block's counts to ``totals`` (the steps under "steps")."""
        for k, v in self.counts.items():
            totals[k] = totals.get(k, 0) + v
        totals["steps"] = totals.get("steps", 0) + steps

    @staticmethod
    def line(totals):
        n = max(1, totals.get("steps", 0))
        return ", ".join("%s %.2f" % (k, totals.get(k, 0) / n) for k in HostWaits.KEYS)


class ThreadSampler:
    """The process's other Python threads, sampled every 2 ms over a block (their name and
    innermost frame): a thread that runs Python beside a host-bound step takes the GIL from
    it, and every call the step makes that releases the GIL (kernel launches) waits to get it
    back."""

    def __enter__(self):
        self.seen, self._stop = {}, threading.Event()
        main = threading.main_thread().ident

        def run():
            skip, names = (main, threading.get_ident()), {}
            while not self._stop.wait(0.002):
                for ident, frame in sys._current_frames().items():
                    if ident in skip:
                        continue
                    if ident not in names:
                        names = {t.ident: t.name for t in threading.enumerate()}
                    where = "%s: %s:%d %s" % (names.get(ident, ident), frame.f_code.co_filename.rsplit("/", 1)[-1],
                                              frame.f_lineno, frame.f_code.co_name)
                    self.seen[where] = self.seen.get(where, 0) + 1

        self._thread = threading.Thread(target=run, name="fp8_speed-sampler", daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()
        return False

    def add_to(self, totals):
        for k, v in self.seen.items():
            totals[k] = totals.get(k, 0) + v


def host_syncs(step, batches, device):
    """Where one step makes the host wait for the device (torch.cuda.set_sync_debug_mode's
    warnings; a sync serializes a host-bound step's host and device time): the last frames of
    each warning's stack outside torch, as printable lines; nothing off CUDA."""
    if device != "cuda":
        return []
    import traceback
    import warnings
    _sync(device)
    found = []

    def note(message, category, filename, lineno, file=None, line=None):
        if "prototype feature" in str(message):  # (the mode's own notice, not a sync)
            return
        frames = [f for f in traceback.extract_stack()[:-1] if "/torch/" not in f.filename]
        found.append("%s at %s" % (str(message).splitlines()[0][:80], " <- ".join(
            "%s:%d" % (f.filename.rsplit("/", 1)[-1], f.lineno) for f in frames[-3:][::-1])))

    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.showwarning = note
        torch.cuda.set_sync_debug_mode("warn")
        try:
            step(*batches[0])
        finally:
            torch.cuda.set_sync_debug_mode("default")
    _sync(device)
    return found


def summarize(shape, info, device):
    med = {n: statistics.median(r["samples"]) for n, r in info.items() if r["status"] == "ok" and r["samples"]}
    base, base_step = med.get("bf16_compile"), med.get("ampkit_bf16_step")
    ao = [med[n] for n in ("torchao_tensorwise", "torchao_rowwise") if n in med]
    best_ao = min(ao) if ao else None
    print("%-16s %-24s %9s %19s %8s %10s %11s %9s %9s %9s %9s" % (
        "shape", "arm", "ms/step", "[min, max]", "x bf16", "x torchao", "x bf16 step", "peak MiB", "held MiB",
        "compile s", "loss"))
    for n, r in info.items():
        if n not in med:
            print("%-16s %-24s %s: %s" % (shape, n, r["status"].upper(), r.get("reason", "no timed rounds")))
            continue
        m = med[n]
        r["median_ms"], r["vs_bf16_compile"] = m, (base / m if base else None)
        r["vs_torchao_best"] = best_ao / m if best_ao else None
        r["vs_bf16_step"] = base_step / m if base_step else None
        print("%-16s %-24s %9.3f [%8.3f, %8.3f] %8s %10s %11s %9.0f %9.0f %9.1f %9.4f" % (
            shape, n, m, min(r["samples"]), max(r["samples"]),
            "%.3f" % r["vs_bf16_compile"] if base else "-", "%.3f" % r["vs_torchao_best"] if best_ao else "-",
            "%.3f" % r["vs_bf16_step"] if base_step else "-", r["peak_mib"], r["held_mib"], r["compile_s"],
            r["loss"]), flush=True)
    for r in info.values():
        r.pop("base_bytes", None)
    return {"shape": shape, "device": device, "arms": info}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shapes", default="gpt2,decoder16x2048")
    ap.add_argument("--arms", default=None, help="comma-separated, of: %s (default: per shape, %s)" % (
        ", ".join(ARMS), "; ".join("%s: %s" % (s, ",".join(a)) for s, a in DEFAULT_ARMS.items())))
    ap.add_argument("--rounds", type=int, default=None)
    ap.add_argument("--steps-per-round", type=int, default=None)
    ap.add_argument("--out", default=None)
    ap.add_argument("--smoke", action="store_true")
    ap.add_argument("--breakdown", action="store_true", help="after the timed rounds, each arm's device time "
                    "a step by kernel kind and its top 15 kernels (torch.profiler, %d steps)" % BREAKDOWN_STEPS)
    ap.add_argument("--sync-check", action="store_true", help="after the timed rounds, the host syncs one "
                    "step of each arm makes (torch.cuda.set_sync_debug_mode), and where")
    ap.add_argument("--threads", action="store_true", help="sample the other Python threads every 2 ms in "
                    "the timed rounds and print where they were (GIL contention with a host-bound step)")
    ap.add_argument("--gc-freeze", action="store_true", help="gc.freeze() after the arms are built: the "
                    "objects their compilations left are not scanned by the timed rounds' collections")
    ap.add_argument("--cprofile", type=int, default=0, metavar="STEPS",
                    help="after the timed rounds, each arm's host Python by own time over STEPS steps (cProfile)")
    args = ap.parse_args(argv)
    shapes = args.shapes.split(",")
    for s in shapes:
        if s not in SHAPES:
            ap.error("unknown shape %r; valid: %s" % (s, ", ".join(SHAPES)))
    arms = None if args.arms is None else args.arms.split(",")
    for a in arms or ():
        if a not in ARMS:
            ap.error("unknown arm %r; valid: %s" % (a, ", ".join(ARMS)))
    if args.smoke:
        device, backend = "cpu", "aot_eager"
        args.rounds, args.steps_per_round = args.rounds or 2, args.steps_per_round or 2
    else:
        if not torch.cuda.is_available():
            ap.error("needs a CUDA GPU (fp8: capability >= 8.9); --smoke runs tiny sizes on the CPU")
        device, backend = "cuda", "inductor"
        args.rounds, args.steps_per_round = args.rounds or 5, args.steps_per_round or 10
        print(torch.cuda.get_device_name(), "capability", torch.cuda.get_device_capability(), flush=True)
    print("torch", torch.__version__, "ampkit", ampkit.__version__, flush=True)
    torch._dynamo.config.cache_size_limit = 64  # one model class, compiled once per arm
    torch._dynamo.config.accumulated_cache_size_limit = 512
    results = []
    for shape in shapes:
        results.append(run_shape(shape, arms or list(DEFAULT_ARMS[shape]), args, device, backend))
        if args.out:
            with open(args.out, "w") as f:
                json.dump({"argv": sys.argv, "torch": torch.__version__, "results": results}, f, indent=1)
        torch._dynamo.reset()
        if device == "cuda":
            torch.cuda.empty_cache()
    return results


if __name__ == "__main__":
    with contextlib.suppress(KeyboardInterrupt):
        main()
