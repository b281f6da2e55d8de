"""What the eager train step costs against the same step written by hand, case by case.

    python benchmarks/eager_step_cost.py [--device cpu|cuda] [--profile cpu|full]
        [--cases seed_mlp,transformer] [--optimizers fused,plain,fallback]
        [--unit step|epoch] [--rounds N] [--threads N] [--shrink [--breakdown]]

For each benchmark case (shared_specs/benchmarks, built by ampkit.bench with make bench's
seeds) and optimizer setting, two steps train two copies of the same seeded model on the
same batches:

  hand    the hand-written loop (ampkit.bench.loop_step: ampkit.autocast, ampkit.GradScaler
          with make bench's settings, the optimizer)
  eager   ampkit.make_train_step(capture=False) with the same autocast arguments, scaler
          settings and optimizer settings

``fused``: the case's optimizer built with fused=True (AdamW also capturable): make bench's
ampkit_step_eager against ampkit_amp_fused; ``plain``: the case's optimizer as written
(ampkit_amp's; make_train_step's eager fallback for an optimizer without a fused path);
``fallback`` (CUDA): fused, the step captured on the case's batches (capture="auto"), then
both timed on batches one sample shorter, which the step runs as its eager fallback beside
the graph.

Timing: two warm-up epochs, then ``--rounds`` rounds, each one ``--unit`` (the next batch,
or an epoch) of each step, the order alternating round by round; the device synced around
each. Printed per case and setting: each step's median ms/step and the median over rounds
of the per-round ratio eager / hand-written, with its spread (min-max), by the wall clock
and, on the CPU, by this thread's CPU time (with one torch thread every op runs on it;
other jobs on a shared machine then stretch the wall clock, not the CPU time). A ratio is
never asserted: the tests prove what the step computes, not how fast.

On a GPU (the full profile, an epoch a round, the order alternating):

    PYTHONPATH=$PWD/python python3 benchmarks/eager_step_cost.py --device cuda

A CPU proxy for a GPU's host-bound steps (``--shrink``): each case at its full profile's
structure (the layers and blocks of the model the GPU runs, so the same parameters,
buffers and optimizer state to walk) with its tiny profile's widths, batch and sequence
length, so that every kernel is tiny and a step's time is nearly all host work (Python,
dispatch, launches). Printed per case and setting: the host microseconds the eager step
adds to the hand-written one (this thread's CPU time, eager minus hand: the median over
rounds of ``--block`` steps each, and the fastest eager round less the fastest hand
one, which the other jobs of a shared machine stretch least), beside each step's median.
``--breakdown`` adds, from cProfile over the eager step alone, the microseconds per call
spent in the step's own functions (``ampkit._train_step``, ``ampkit._rollback``): where
the added time goes. cProfile inflates every call, so read its figures against one
another, not against the others.

    PYTHONPATH=$PWD/python OMP_NUM_THREADS=1 python3 benchmarks/eager_step_cost.py --shrink --breakdown
"""

from __future__ import annotations

import argparse
import cProfile
import dataclasses
import pstats
import statistics
import sys
import time
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "python"))

import torch  # noqa: E402

import ampkit  # noqa: E402
import ampkit.bench as bench  # noqa: E402

# The sizes that give a model its structure (how many layers, blocks): kept from the full
# profile by --shrink; every other size comes from the tiny profile.
STRUCTURE = ("num_layers", "n_layers", "blocks")
# The modules whose functions --breakdown reports: the step's own work around the body.
STEP_MODULES = ("ampkit/_train_step.py", "ampkit/_rollback.py")
# The step's functions that hold the body (the model, the loss, backward, the scaler and
# the optimizer, as the hand-written loop runs them): --breakdown gives their own lines only.
HOLDERS = ("__call__", "_call", "_eager", "_body", "_warmup")


def shrunk(case):
    """The case with a 'shrunk' profile: the full profile's structure, the tiny one's sizes."""
    full, tiny = case.profile("full"), case.profile("tiny")
    sizes = {**tiny["sizes"], **{k: v for k, v in full["sizes"].items() if k in STRUCTURE}}
    profile = {**tiny, "sizes": sizes, "num_batches": 4}
    return dataclasses.replace(case, profiles={**case.profiles, "shrunk": profile})


def _sync(device):
    if device == "cuda":
        torch.cuda.synchronize()


def make_pair(built, dtype, setting):
    """({"hand": hand-written step, "eager": make_train_step}, the batches to time them on):
    same weights, optimizer and scaler settings. ``fallback``: the step is captured on the
    case's batches, then timed on batches one sample shorter, each of which runs as its
    eager fallback next to the graph (the gradients the graph owns kept)."""
    device, fused = built.device, setting != "plain"

    def scaler():
        return ampkit.GradScaler(device, init_scale=bench.INIT_SCALE, growth_interval=bench.GROWTH_INTERVAL)

    m1 = built.new_model()
    o1 = built.new_optimizer(m1, fused=fused)
    hand = bench.loop_step(m1, built.loss_fn, o1, lambda: ampkit.autocast(device, dtype=dtype), scaler())
    m2 = built.new_model()
    o2 = built.new_optimizer(m2, fused=fused)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (the fallback's warning about the other shape)
        eager = ampkit.make_train_step(m2, built.loss_fn, o2, scaler=scaler(),
                                       capture="auto" if setting == "fallback" else False,
                                       autocast=dict(device_type=device, dtype=dtype))
        if setting != "fallback":
            return {"hand": hand, "eager": eager}, built.batches
        for i in range(6):  # warm-up, capture, replays
            eager(*built.batches[i % built.num_batches])
            hand(*built.batches[i % built.num_batches])
        if not eager.captured:
            raise RuntimeError(f"fallback: the step was not captured: {eager.reason}")
        shorter = [(x[:-1], y[:-1]) for x, y in built.batches]
        eager(*shorter[0])
        if eager.captured:
            raise RuntimeError("fallback: a shorter batch replayed the graph")

    # (the step warned once, above: its later fallback calls are timed bare, as a loop runs
    # them, without a warnings filter around each)
    return {"hand": hand, "eager": eager}, shorter


def time_ms(step, built, batches):
    """(wall ms, this thread's CPU ms) per step over ``batches``, the device synced around."""
    _sync(built.device)
    t0, c0 = time.perf_counter(), time.thread_time()
    for x, y in batches:
        step(x, y)
    _sync(built.device)
    return (time.perf_counter() - t0) * 1e3 / len(batches), (time.thread_time() - c0) * 1e3 / len(batches)


def measure(built, dtype, setting, rounds, unit, warmup_epochs=2, block=1):
    steps, epoch = make_pair(built, dtype, setting)
    for _ in range(warmup_epochs):
        for s in steps.values():
            time_ms(s, built, epoch)
    times = {k: [] for k in steps}
    names = list(steps)
    for r in range(rounds):
        # a round: one step (the next batch), `block` of them, or one epoch of each, the
        # order alternating
        batches = epoch if unit == "epoch" else [epoch[(r + i) % len(epoch)] for i in range(block)]
        for k in (names if r % 2 == 0 else names[::-1]):
            times[k].append(time_ms(steps[k], built, batches))
    out = {}
    for i, clock in enumerate(("wall", "cpu")):
        ratios = [e[i] / h[i] for e, h in zip(times["eager"], times["hand"])]
        out[clock] = ({k: statistics.median(t[i] for t in v) for k, v in times.items()}, ratios)
    out["added_us"] = [(e[1] - h[1]) * 1e3 for e, h in zip(times["eager"], times["hand"])]
    out["fastest_added_us"] = (min(e[1] for e in times["eager"]) - min(h[1] for h in times["hand"])) * 1e3
    return out


def breakdown(built, dtype, setting, steps=200):
    """{function: microseconds per step} of the eager step's own functions, by cProfile,
    largest first: cumulative (a function's callees in its figure), but for the HOLDERS
    of the body, whose own lines only are counted (marked "own")."""
    pair, epoch = make_pair(built, dtype, setting)
    eager = pair["eager"]
    for x, y in epoch:
        eager(x, y)
    prof = cProfile.Profile()
    prof.enable()
    for i in range(steps):
        eager(*epoch[i % len(epoch)])
    prof.disable()
    out = {}
    for (path, line, fn), (_, _, own, cum, _) in pstats.Stats(prof).stats.items():
        if path.replace("\\", "/").endswith(STEP_MODULES):
            name = f"{Path(path).stem}.{fn}" + (f":{line}" if fn.startswith("<") else "")
            if fn in HOLDERS:
                name, cum = name + " (own)", own
            out[name] = cum * 1e6 / steps
    return dict(sorted(out.items(), key=lambda kv: -kv[1]))


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    ap.add_argument("--profile", default=None, help="default: cpu on the CPU, full on CUDA")
    ap.add_argument("--cases", default="", help="default: every case of shared_specs/benchmarks")
    ap.add_argument("--optimizers", default=None,
                    help="fused, plain, fallback (CUDA: a captured step's eager fallback, fused); "
                         "default: fused,plain on the CPU, fused,plain,fallback on CUDA")
    ap.add_argument("--unit", default=None, choices=("step", "epoch"),
                    help="what each step runs in a round (default: a step on the CPU, where "
                         "nothing runs ahead; an epoch on CUDA, whose steps overlap the host's work)")
    ap.add_argument("--rounds", type=int, default=None, help="default: 120 steps or 15 epochs")
    ap.add_argument("--threads", type=int, default=None,
                    help="torch threads (default: 1 on the CPU, as make bench runs; torch's own on CUDA)")
    ap.add_argument("--shrink", action="store_true",
                    help="the CPU proxy for host-bound GPU steps: each case at its full "
                         "structure with tiny sizes; prints the host us the eager step adds")
    ap.add_argument("--block", type=int, default=None,
                    help="with --shrink: steps of each in a round (default 5)")
    ap.add_argument("--breakdown", action="store_true",
                    help="with --shrink: cProfile's us per step in the step's own functions")
    args = ap.parse_args(argv)
    if (args.breakdown or args.block) and not args.shrink:
        ap.error("--breakdown and --block go with --shrink")
    args.block = args.block or 5
    if args.shrink and (args.device != "cpu" or args.profile):
        ap.error("--shrink runs on the CPU at its own profile: leave --device and --profile out")
    profile = "shrunk" if args.shrink else args.profile or ("full" if args.device == "cuda" else "cpu")
    unit = args.unit or ("epoch" if args.device == "cuda" else "step")
    rounds = args.rounds or (15 if unit == "epoch" else 120)
    threads = args.threads or (1 if args.device == "cpu" else None)
    if threads:
        torch.set_num_threads(threads)
    dtype = torch.float16 if args.device == "cuda" else torch.bfloat16
    card = torch.cuda.get_device_name() if args.device == "cuda" else "cpu"
    print(f"{card}, torch {torch.__version__}, profile {profile}, {torch.get_num_threads()} thread(s), "
          f"{rounds} rounds of " + (f"{args.block} steps" if args.shrink else f"one {unit}") + " of each, interleaved")
    if args.shrink:
        return run_shrunk(args, dtype, rounds)
    clocks = ("wall", "cpu") if args.device == "cpu" else ("wall",)
    print(f"{'case':<16}{'optimizer':<10}{'clock':<6}{'hand ms':>9}{'eager ms':>10}{'ratio':>8}  "
          "[min, max] of the rounds")
    for case in [c for c in args.cases.split(",") if c] or list(bench.load_cases()):
        built = bench.build_case(case, profile, seed=0, device=args.device)
        settings = args.optimizers or ("fused,plain,fallback" if args.device == "cuda" else "fused,plain")
        for opt in [o for o in settings.split(",") if o]:
            if opt not in ("fused", "plain", "fallback") or (opt, args.device) == ("fallback", "cpu"):
                ap.error(f"--optimizers: {opt!r} is not fused, plain or (on CUDA) fallback")
            res = measure(built, dtype, opt, rounds, unit)
            for clock in clocks:
                med, ratios = res[clock]
                print(f"{case:<16}{opt:<10}{clock:<6}{med['hand']:>9.3f}{med['eager']:>10.3f}"
                      f"{statistics.median(ratios):>8.3f}  [{min(ratios):.3f}, {max(ratios):.3f}]", flush=True)
    return 0


def run_shrunk(args, dtype, rounds):
    print(f"{'case':<16}{'optimizer':<10}{'hand us':>9}{'eager us':>10}{'added us':>10}"
          f"{'fastest':>9}  [min, max] of the rounds (thread CPU time, us a step; rounds of "
          f"{args.block} steps; fastest: the fastest eager round less the fastest hand one)")
    cases = bench.load_cases()
    for name in [c for c in args.cases.split(",") if c] or list(cases):
        built = bench.build_case(shrunk(cases[name]), "shrunk", seed=0, device="cpu")
        for opt in [o for o in (args.optimizers or "fused,plain").split(",") if o]:
            if opt not in ("fused", "plain"):
                raise SystemExit(f"--optimizers: {opt!r} is not fused or plain (the CPU has no graph)")
            res = measure(built, dtype, opt, rounds, args.unit or "step", block=args.block)
            med, added = res["cpu"][0], res["added_us"]
            print(f"{name:<16}{opt:<10}{med['hand'] * 1e3:>9.0f}{med['eager'] * 1e3:>10.0f}"
                  f"{statistics.median(added):>10.1f}{res['fastest_added_us']:>9.1f}  "
                  f"[{min(added):.0f}, {max(added):.0f}]", flush=True)
            if args.breakdown:
                for fn, us in list(breakdown(built, dtype, opt).items())[:8]:
                    print(f"{'':<26}{us:>9.1f} us  {fn}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
