"""Where an eager AMP step's time goes: torch's scaler against ampkit's, kernel by kernel.

    python3 benchmarks/gpu/scaler_profile.py [--case seed_mlp] [--profile full] [--steps 20]

Builds the case's loop three ways (torch.autocast + torch.amp.GradScaler; ampkit.autocast +
ampkit.GradScaler; ampkit.autocast + torch's scaler), times interleaved epochs (medians,
synchronized), then runs torch.profiler over a few steps of each and prints the device
kernels (count and total time per step) and the host time of the scaler calls. Printed,
never asserted.
"""
from __future__ import annotations

import argparse
import collections
import statistics
import sys
import time

import torch
from torch.profiler import ProfilerActivity, profile

import ampkit
import ampkit.bench as bench

NAMES = ("torch_amp", "ampkit_amp", "ampkit_region_torch_scaler")


def make(name, built):
    device = built.device
    dtype = torch.float16 if device == "cuda" else torch.bfloat16
    model, = (built.new_model(),)
    opt = built.new_optimizer(model)
    region = (lambda: torch.autocast(device, dtype=dtype)) if name == "torch_amp" else (
        lambda: ampkit.autocast(device, dtype=dtype))
    scaler = ampkit.GradScaler(device) if name == "ampkit_amp" else torch.amp.GradScaler(device)
    return bench.loop_step(model, built.loss_fn, opt, region, scaler), scaler, opt


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--case", default="seed_mlp")
    ap.add_argument("--profile", default="full")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--repeats", type=int, default=9)
    a = ap.parse_args(argv)
    device = bench.resolve_device("auto")
    built = bench.build_case(a.case, a.profile, seed=0, device=device)
    card = torch.cuda.get_device_name() if device == "cuda" else "cpu"
    print(f"{card}, torch {torch.__version__}, case {a.case}/{a.profile}")
    loops = {n: make(n, built) for n in NAMES}
    for step, _, _ in loops.values():
        for i in range(5):
            step(*built.batches[i % built.num_batches])
    samples = {n: [] for n in NAMES}
    for r in range(a.repeats):
        for n in NAMES[r % 3:] + NAMES[:r % 3]:
            step = loops[n][0]
            bench.synchronize(device)
            t0 = time.perf_counter()
            for x, y in built.batches:
                step(x, y)
            bench.synchronize(device)
            samples[n].append((time.perf_counter() - t0) * 1e3 / built.num_batches)
    for n in NAMES:
        print(f"{n:<28} {statistics.median(samples[n]):8.3f} ms/step  ratio to torch_amp "
              f"{statistics.median(s / t for s, t in zip(samples[n], samples['torch_amp'])):.3f}")
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device == "cuda" else [])
    for n in NAMES:
        step = loops[n][0]
        with profile(activities=acts) as prof:
            for i in range(a.steps):
                step(*built.batches[i % built.num_batches])
            bench.synchronize(device)
        rows = []
        for e in prof.key_averages():
            dev_us = getattr(e, "device_time_total", 0) or getattr(e, "cuda_time_total", 0)
            rows.append((e.key, e.count / a.steps, e.self_cpu_time_total / a.steps,
                         (getattr(e, "self_device_time_total", 0) or 0) / a.steps))
        for title, key in (("self cpu", 2), ("self device", 3)):
            print(f"\n== {n}: per step, top by {title} (count, self cpu us, self device us)")
            for k, c, cpu, dev in sorted(rows, key=lambda r: -r[key])[:30]:
                print(f"  {k[:70]:<70} {c:6.1f} {cpu:9.1f} {dev:9.1f}")
        print(f"  total: self cpu {sum(r[2] for r in rows):.1f} us, self device {sum(r[3] for r in rows):.1f} us")
    return 0


if __name__ == "__main__":
    sys.exit(main())
