"""Where an armed doctor's step time goes, phase by phase: three copies of seed_mlp's eager
step (float16, an ampkit.GradScaler, fused SGD), stepped in interleaved chunks: off, armed,
and armed with the per-step record made a no-op (hooks run, nothing is held or sent). Each
phase's host time (forward and loss, backward, scaler step, update and zero_grad) is read
with perf_counter around it (no sync: the host's own time, which bounds this host-bound
step), medians in µs; and the CUDA allocator's device allocations during the timed steps.

    python benchmarks/probes/doctor_phases.py [--chunk 20] [--chunks 60] [--case seed_mlp]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

import ampkit
from ampkit._doctor import _step_watch
from ampkit.bench import build_case

ap = argparse.ArgumentParser()
ap.add_argument("--case", default="seed_mlp")
ap.add_argument("--chunk", type=int, default=20)
ap.add_argument("--chunks", type=int, default=60)
a = ap.parse_args()
dev = "cuda" if torch.cuda.is_available() else "cpu"  # (the CPU: a quick try of the probe itself)
built = build_case(a.case, "full" if dev == "cuda" else "tiny", device=dev)
dtype = torch.float16 if dev == "cuda" else torch.bfloat16


def sync():
    if dev == "cuda":
        torch.cuda.synchronize()


def device_allocs():
    return torch.cuda.memory_stats().get("num_device_alloc", 0) if dev == "cuda" else 0
n = len(built.batches)
_record = _step_watch.StepWatch.record
_QUIET = set()


def record(self, bad):  # the no-op record of the third copy's watch
    if id(self) in _QUIET:
        return None
    return _record(self, bad)


_step_watch.StepWatch.record = record


def make(kind):
    model = built.new_model()
    opt = built.new_optimizer(model, fused=dev == "cuda")
    scaler = ampkit.GradScaler(dev)
    doc = None
    if kind != "off":
        doc = ampkit.doctor(model, every=10**9)
        if kind == "no record":
            _QUIET.update(id(w) for w in doc._watches.values())
    times = {k: [] for k in ("forward", "backward", "scaler step", "update+zero", "step")}

    def step(x, y):
        t0 = time.perf_counter()
        with ampkit.autocast(dev, dtype=dtype):
            loss = built.loss_fn(model(x), y)
        t1 = time.perf_counter()
        scaler.scale(loss).backward()
        t2 = time.perf_counter()
        scaler.step(opt)
        t3 = time.perf_counter()
        scaler.update()
        opt.zero_grad(set_to_none=True)
        t4 = time.perf_counter()
        for k, v in zip(times, (t1 - t0, t2 - t1, t3 - t2, t4 - t3, t4 - t0)):
            times[k].append(v)

    return step, times, doc


kinds = ["off", "armed", "no record"]
runs = {k: make(k) for k in kinds}
for k in kinds:
    for i in range(20):
        runs[k][0](*built.batches[i % n])
    runs[k][1].update({p: [] for p in runs[k][1]})
sync()
allocs = {k: 0 for k in kinds}
wall = {k: [] for k in kinds}
for c in range(a.chunks):
    order = kinds[c % len(kinds):] + kinds[: c % len(kinds)]
    for k in order:
        before = device_allocs()
        t = time.perf_counter()
        for i in range(a.chunk):
            runs[k][0](*built.batches[i % n])
        sync()
        wall[k].append((time.perf_counter() - t) / a.chunk)
        allocs[k] += device_allocs() - before
print(f"{torch.cuda.get_device_name() if dev == 'cuda' else 'cpu'}, {a.case}: median host µs per phase (perf_counter, no sync)")
print("  " + " ".join(f"{p:>12s}" for p in runs['off'][1]) + f" {'wall/step':>10s} {'cudaMallocs':>11s}")
for k in kinds:
    ts = runs[k][1]
    print(f"  {k:10s}" + " ".join(f"{statistics.median(v) * 1e6:12.1f}" for v in ts.values())
          + f" {statistics.median(wall[k]) * 1e6:10.1f} {allocs[k]:11d}")
