"""Host cost of one eager AMP step, phase by phase: torch's region and scaler against ampkit's.

    PYTHONPATH=python python benchmarks/probes/scaler_host_cost.py [--steps 3000] [--repeats 7]

A tiny model (``--layers`` Linear layers of width 8, ReLU between, batch 4; 2 by default,
24 to weigh what each parameter costs) so that the step is host-bound: what is left is
Python and dispatcher time. Each variant trains its own identically seeded copy
with torch.autocast + torch.amp.GradScaler ("torch") or ampkit.autocast + ampkit.GradScaler
("ampkit"); the step is split into phases, each timed with perf_counter around the call:

    region   entering and leaving an empty region (the forward runs outside the timed
             span: it is the same code for both, and costs the same under both regions)
    scale    scaler.scale(loss)
    step     scaler.step(opt) (unscale, inf check, the optimizer step)
    update   scaler.update()

for three optimizers: SGD with momentum and foreach=True (the benchmark cases' path on
CUDA: SGD and AdamW default to foreach there), AdamW foreach=True, and fused SGD (the
sync-free path). Reported: per phase the median over repeats of the per-step median host
time (us), and the aten ops the profiler counts per step for the same phase. Variants are
interleaved (the order alternates each repeat). Printed (and written as JSON), never asserted.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import torch
from torch.profiler import ProfilerActivity, profile, record_function

import ampkit

PHASES = ("region", "scale", "step", "update")
OPTIMIZERS = {
    "sgd_foreach": lambda ps: torch.optim.SGD(ps, lr=1e-3, momentum=0.9, foreach=True),
    "adamw_foreach": lambda ps: torch.optim.AdamW(ps, lr=1e-3, foreach=True),
    "sgd_fused": lambda ps: torch.optim.SGD(ps, lr=1e-3, momentum=0.9, fused=True),
}


def make(variant, opt_name, layers=2):
    torch.manual_seed(0)
    mods = []
    for i in range(layers):
        mods += [torch.nn.Linear(8, 8)] + ([torch.nn.ReLU()] if i < layers - 1 else [])
    model = torch.nn.Sequential(*mods)
    opt = OPTIMIZERS[opt_name](list(model.parameters()))
    x, y = torch.randn(4, 8), torch.randn(4, 8)
    if variant == "torch":
        region = lambda: torch.autocast("cpu", dtype=torch.bfloat16)  # noqa: E731
        scaler = torch.amp.GradScaler("cpu")
    else:
        region = lambda: ampkit.autocast("cpu", dtype=torch.bfloat16)  # noqa: E731
        scaler = ampkit.GradScaler("cpu")
    clock = time.perf_counter

    def step(times=None, mark=None):
        mark = mark or _no_mark
        with mark("region"):
            t0 = clock()
            with region():
                pass
            t1 = clock()
        with region():
            loss = torch.nn.functional.mse_loss(model(x), y)
        with mark("scale"):
            t2 = clock()
            scaled = scaler.scale(loss)
            t3 = clock()
        scaled.backward()
        with mark("step"):
            t4 = clock()
            scaler.step(opt)
            t5 = clock()
        with mark("update"):
            t6 = clock()
            scaler.update()
            t7 = clock()
        opt.zero_grad(set_to_none=True)
        if times is not None:
            times["region"].append(t1 - t0)
            times["scale"].append(t3 - t2)
            times["step"].append(t5 - t4)
            times["update"].append(t7 - t6)

    return step, model, scaler


class _no_mark:
    def __init__(self, name):
        pass

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def op_counts(step, steps=20):
    """aten ops per step inside each phase (children of the phase's record_function)."""
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(steps):
            step(mark=record_function)
    counts = {p: 0 for p in PHASES}
    names = {p: {} for p in PHASES}
    for ev in prof.events():
        if not ev.name.startswith("aten::"):
            continue
        parent = ev.cpu_parent
        while parent is not None and parent.name not in PHASES:
            if parent.name.startswith("aten::"):  # count top-level aten ops only
                break
            parent = parent.cpu_parent
        if parent is None or parent.name not in PHASES:
            continue
        counts[parent.name] += 1
        names[parent.name][ev.name] = names[parent.name].get(ev.name, 0) + 1
    return ({p: c / steps for p, c in counts.items()},
            {p: {n: c / steps for n, c in sorted(d.items())} for p, d in names.items()})


def run(steps, repeats, opt_names=tuple(OPTIMIZERS), layers=2):
    out = {}
    for opt_name in opt_names:
        loops = {v: make(v, opt_name, layers) for v in ("torch", "ampkit")}
        for step, _, _ in loops.values():
            for _ in range(200):
                step()
        samples = {v: {p: [] for p in PHASES} for v in loops}
        for r in range(repeats):
            for v in (("torch", "ampkit") if r % 2 == 0 else ("ampkit", "torch")):
                times = {p: [] for p in PHASES}
                for _ in range(steps):
                    loops[v][0](times)
                for p in PHASES:
                    samples[v][p].append(statistics.median(times[p]) * 1e6)
        res = {}
        for v, (step, model, scaler) in loops.items():
            counts, names = op_counts(step)
            res[v] = {"us": {p: statistics.median(samples[v][p]) for p in PHASES},
                      "ops": counts, "op_names": names}
        # the same trajectory: both trained the same model on the same data
        tm, am = loops["torch"][1], loops["ampkit"][1]
        res["same_params"] = all(torch.equal(a, b) for a, b in zip(tm.parameters(), am.parameters()))
        res["same_scale"] = loops["torch"][2].get_scale() == loops["ampkit"][2].get_scale()
        out[opt_name] = res
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=3000)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--optimizers", default=",".join(OPTIMIZERS))
    ap.add_argument("--layers", type=int, default=2, help="Linear layers of the model (2 parameters each)")
    ap.add_argument("--names", action="store_true", help="also list the aten ops of each phase")
    ap.add_argument("--json", default=None)
    a = ap.parse_args(argv)
    torch.set_num_threads(1)
    res = run(a.steps, a.repeats, tuple(a.optimizers.split(",")), a.layers)
    print(f"torch {torch.__version__}, cpu, 1 thread, {a.layers} layers, {a.steps} steps x {a.repeats} repeats; "
          "host us per step (median) and aten ops per step")
    print(f"{'optimizer':<14} {'phase':<7} {'torch us':>9} {'ampkit us':>10} {'ratio':>6} {'torch ops':>10} {'ampkit ops':>11}")
    for opt_name, r in res.items():
        t, k = r["torch"], r["ampkit"]
        for p in PHASES + ("total",):
            tu = sum(t["us"].values()) if p == "total" else t["us"][p]
            ku = sum(k["us"].values()) if p == "total" else k["us"][p]
            to = sum(t["ops"].values()) if p == "total" else t["ops"][p]
            ko = sum(k["ops"].values()) if p == "total" else k["ops"][p]
            print(f"{opt_name:<14} {p:<7} {tu:>9.1f} {ku:>10.1f} {ku / tu:>6.2f} {to:>10.1f} {ko:>11.1f}")
        print(f"{opt_name:<14} same parameters: {r['same_params']}, same scale: {r['same_scale']}")
        if a.names:
            for p in PHASES:
                print(f"   {p}: torch {t['op_names'][p]}\n   {' ' * len(p)}  ampkit {k['op_names'][p]}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"torch": torch.__version__, "layers": a.layers, "steps": a.steps, "repeats": a.repeats, "results": res}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
