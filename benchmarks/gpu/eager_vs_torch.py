"""ampkit's eager AMP loop against torch's, case by case, interleaved in one process.

    python3 benchmarks/gpu/eager_vs_torch.py [--profile full] [--cases a,b] [--repeats 7 | --per-step N] [--json PATH]

For each benchmark case (shared_specs/benchmarks) three loops train fresh, identically
seeded copies of the case's model with the case's optimizer and data:

- ``torch_amp``:       torch.autocast + torch.amp.GradScaler (the rival)
- ``ampkit_amp``:      ampkit.autocast (default policy) + ampkit.GradScaler
- ``ampkit_override``: the same with a one-op policy override active (``cdist`` moved to
                       lower_precision_fp, an op no case calls): one ATen op, so the change
                       runs as a kernel at torch's Autocast key (ampkit/_kernels.py)
- ``ampkit_handler``:  an override that cannot run as a kernel (``norm``, a Python function
                       of torch, moved to lower_precision_fp): ampkit's handler mode is
                       pushed and sees every call
- with ``--control``: ``torch_amp_again``, a second torch_amp loop: its ratio to torch_amp
  is the noise floor of the ratios (identical code measured twice)
- with ``--split``: ``ampkit_region_torch_scaler``, ampkit.autocast with torch's scaler, which
  tells the region's cost from the scaler's
- with ``--compiled``: ``torch_compile_amp`` and ``ampkit_compile_amp``, the first two
  with ``torch.compile(model)`` (compiled during the warm-up)

Each repeat times one epoch of every loop, in an order that rotates from repeat to
repeat, after a warm-up; the device is synchronized before each clock read. Reported:
the median ms/step per loop and the median of the per-repeat ratios to torch_amp. With
``--per-step N`` the loops take single steps in turn instead (each synchronized before and
after), N each: the mean ms/step and the ratio of the means, with the ratios of each
half's means as their spread (finer than epochs, whose ratios move by several percent).
Timings are printed (and written as JSON), never asserted.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import torch

import ampkit
import ampkit.bench as bench

OVERRIDE = ampkit.load_policy("torch_default").with_ops(lower_precision_fp=["cdist"])
HANDLER = ampkit.load_policy("torch_default").with_ops(lower_precision_fp=["norm"])
LOOPS = ("torch_amp", "ampkit_amp", "ampkit_override", "ampkit_handler")
COMPILED = ("torch_compile_amp", "ampkit_compile_amp")
SPLIT = ("ampkit_region_torch_scaler",)
CONTROL = ("torch_amp_again",)


def make_loop(name, built):
    device = built.device
    dtype = torch.float16 if device == "cuda" else torch.bfloat16
    model = built.new_model()
    opt = built.new_optimizer(model)
    if name in COMPILED:
        model = torch.compile(model)
    if name.startswith("torch"):
        region = lambda: torch.autocast(device, dtype=dtype)  # noqa: E731
    else:
        policy = {"ampkit_override": OVERRIDE, "ampkit_handler": HANDLER}.get(name)
        region = lambda: ampkit.autocast(device, dtype=dtype, policy=policy)  # noqa: E731
    scaler = torch.amp.GradScaler(device) if name.startswith("torch") or name in SPLIT else ampkit.GradScaler(device)
    return bench.loop_step(model, built.loss_fn, opt, region, scaler)


def epoch(step, built):
    bench.synchronize(built.device)
    t0 = time.perf_counter()
    for x, y in built.batches:
        step(x, y)
    bench.synchronize(built.device)
    return (time.perf_counter() - t0) * 1000.0 / built.num_batches


def per_step_samples(loops, built, steps):
    """``steps`` steps of each loop, one by one in a rotating order, each timed alone from an
    idle device to its end (synchronized before and after): ms per step, per loop. Drift of
    the host or the card between loops cancels; the price is a sync per step, paid alike."""
    names = list(loops)
    samples = {name: [] for name in names}
    for s in range(steps):
        x, y = built.batches[s % built.num_batches]
        r = s % len(names)
        for name in names[r:] + names[:r]:
            bench.synchronize(built.device)
            t0 = time.perf_counter()
            loops[name](x, y)
            bench.synchronize(built.device)
            samples[name].append((time.perf_counter() - t0) * 1000.0)
    return samples


def run_case(case, profile, device, repeats, names=LOOPS, per_step=0):
    built = bench.build_case(case, profile, seed=0, device=device)
    loops = {name: make_loop(name, built) for name in names}
    for step in loops.values():  # warm-up: allocator, cuDNN/cuBLAS heuristics, first-call costs
        for i in range(max(3, built.warmup_steps)):
            step(*built.batches[i % built.num_batches])
    if per_step:  # the ratio of the mean step times; its spread: the ratios of each half's means
        samples = per_step_samples(loops, built, per_step)
        half = per_step // 2
        mean = {n: statistics.fmean(s) for n, s in samples.items()}
        halves = {n: sorted(statistics.fmean(samples[n][i:i + half]) / statistics.fmean(samples["torch_amp"][i:i + half])
                            for i in (0, half)) for n in names[1:]}
        out = {"case": case, "per_step": per_step, "ms_per_step": mean,
               "time_vs_torch_amp": {n: mean[n] / mean["torch_amp"] for n in names[1:]},
               "time_vs_torch_amp_halves": halves}
        if "torch_compile_amp" in names:
            out["compiled_ampkit_vs_torch"] = mean["ampkit_compile_amp"] / mean["torch_compile_amp"]
        return out
    samples = {name: [] for name in names}
    for r in range(repeats):
        order = names[r % len(names):] + names[:r % len(names)]
        for name in order:
            samples[name].append(epoch(loops[name], built))
    out = {"case": case, "ms_per_step": {n: statistics.median(s) for n, s in samples.items()}, "samples": samples}
    out["time_vs_torch_amp"] = {
        n: statistics.median(a / t for a, t in zip(samples[n], samples["torch_amp"])) for n in names[1:]
    }
    if repeats >= 4:  # the spread of the per-repeat ratios: their quartiles
        out["time_vs_torch_amp_quartiles"] = {
            n: statistics.quantiles([a / t for a, t in zip(samples[n], samples["torch_amp"])], n=4)[::2]
            for n in names[1:]}
    if "torch_compile_amp" in names:
        out["compiled_ampkit_vs_torch"] = statistics.median(
            a / t for a, t in zip(samples["ampkit_compile_amp"], samples["torch_compile_amp"]))
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--profile", default="full")
    ap.add_argument("--cases", default=None, help="comma-separated case names (default: every case)")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--compiled", action="store_true", help="also the torch.compile'd loops")
    ap.add_argument("--split", action="store_true", help="also ampkit.autocast with torch's scaler")
    ap.add_argument("--control", action="store_true", help="also torch_amp a second time (the noise floor)")
    ap.add_argument("--per-step", type=int, default=0, metavar="N",
                    help="in place of repeats of epochs: N single steps of each loop, interleaved one "
                         "by one, each synchronized (ratio of the mean step times)")
    ap.add_argument("--json", default=None)
    a = ap.parse_args(argv)
    names = LOOPS + (COMPILED if a.compiled else ()) + (SPLIT if a.split else ()) + (CONTROL if a.control else ())
    device = bench.resolve_device(a.device)
    cases = a.cases.split(",") if a.cases else list(bench.load_cases())
    card = torch.cuda.get_device_name() if device == "cuda" else "cpu"
    how = f"{a.per_step} single steps interleaved, means" if a.per_step else f"{a.repeats} interleaved repeats, medians"
    print(f"{card}, torch {torch.__version__}, profile {a.profile}, {how}")
    print(f"{'case':<16} {'torch_amp':>10} {'ampkit_amp':>11} {'ratio':>6} {'1 override':>11} {'ratio':>6} {'1 handler ov.':>13} {'ratio':>6}  (ms/step; ratio = time vs torch_amp)")
    results = []
    for case in cases:
        r = run_case(case, a.profile, device, a.repeats, names, a.per_step)
        m, q = r["ms_per_step"], r["time_vs_torch_amp"]
        line = (f"{case:<16} {m['torch_amp']:>10.3f} {m['ampkit_amp']:>11.3f} {q['ampkit_amp']:>6.3f}"
                f" {m['ampkit_override']:>11.3f} {q['ampkit_override']:>6.3f}"
                f" {m['ampkit_handler']:>13.3f} {q['ampkit_handler']:>6.3f}")
        if a.control:
            line += f"   control torch_amp again: ratio {q['torch_amp_again']:.3f}"
        if a.per_step:
            lo, hi = r["time_vs_torch_amp_halves"]["ampkit_amp"]
            line += f"   ampkit_amp halves [{lo:.3f}, {hi:.3f}]"
        if a.split:
            line += f"   ampkit region + torch scaler {m['ampkit_region_torch_scaler']:.3f} ratio {q['ampkit_region_torch_scaler']:.3f}"
        if a.compiled:
            line += (f"   compiled: torch {m['torch_compile_amp']:.3f} ampkit {m['ampkit_compile_amp']:.3f}"
                     f" ratio {r['compiled_ampkit_vs_torch']:.3f}")
        print(line, flush=True)
        results.append(r)
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"card": card, "torch": torch.__version__, "profile": a.profile, "results": results}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
