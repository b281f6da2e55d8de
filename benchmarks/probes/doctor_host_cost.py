"""Where an armed doctor's host time goes in an eager step (the seed_mlp full profile on
CUDA by default): the doctor's hooks wrapped with perf_counter, mean microseconds per call,
and the cost of one small torch launch and one conditional-copy launch for scale.

    python benchmarks/probes/doctor_host_cost.py [--device cuda] [--steps 200] [--cprofile]
"""

from __future__ import annotations

import argparse
import collections
import time

import torch

import ampkit
from ampkit import _doctor, _doctor_step
from ampkit.bench import build_case, loop_step

ap = argparse.ArgumentParser()
ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
ap.add_argument("--profile", default="full")
ap.add_argument("--steps", type=int, default=200)
ap.add_argument("--cprofile", action="store_true", help="also print cProfile's top functions of an armed run")
a = ap.parse_args()
dev = a.device
acc = collections.defaultdict(float)
calls = collections.Counter()


def wrap(owner, name, label):
    f = getattr(owner, name)

    def timed(*args, **kwargs):
        t = time.perf_counter()
        try:
            return f(*args, **kwargs)
        finally:
            acc[label] += time.perf_counter() - t
            calls[label] += 1
    setattr(owner, name, timed)


for owner, name in [(_doctor.doctor, "_root_pre"), (_doctor.doctor, "_root_post"),
                    (_doctor.doctor, "_backward_end"), (_doctor, "scaler_checked"),
                    (_doctor_step.StepWatch, "record"), (_doctor_step.StepWatch, "begin"),
                    (_doctor_step.StepWatch, "keep_grad"), (_doctor.doctor, "_remember"),
                    (_doctor_step.StepWatch, "_launch")]:
    wrap(owner, name, f"{getattr(owner, '__name__', owner)}.{name}")

built = build_case("seed_mlp", a.profile, device=dev)
dtype = torch.float16 if dev == "cuda" else torch.bfloat16


def run(armed):
    model = built.new_model()
    opt = built.new_optimizer(model, fused=dev == "cuda")
    step = loop_step(model, built.loss_fn, opt, lambda: ampkit.autocast(dev, dtype=dtype),
                     ampkit.GradScaler(dev))
    doc = ampkit.doctor(model, every=10**9) if armed else None
    for i in range(10):
        step(*built.batches[i % len(built.batches)])
    if dev == "cuda":
        torch.cuda.synchronize()
    acc.clear()
    calls.clear()
    t = time.perf_counter()
    for i in range(a.steps):
        step(*built.batches[i % len(built.batches)])
    if dev == "cuda":
        torch.cuda.synchronize()
    dt = (time.perf_counter() - t) / a.steps
    if doc:
        doc.close()
    return dt


off = [run(False) for _ in range(2)]
on = [run(True) for _ in range(2)]
print(f"{dev} seed_mlp/{a.profile}: off {min(off)*1e6:.0f} us/step, armed {min(on)*1e6:.0f} us/step")
for k in sorted(acc, key=acc.get, reverse=True):
    print(f"  {k}: {acc[k] / a.steps * 1e6:.1f} us/step ({calls[k] / a.steps:.1f} calls/step)")
x = torch.zeros((), device=dev)
flag = torch.zeros((), dtype=torch.bool, device=dev)
src = torch.zeros(1 << 20, dtype=torch.uint8, device=dev)
dst = torch.zeros_like(src)
w = _doctor_step.StepWatch(torch.device(dev), [])
extra = []
if dev == "cuda":  # what a host-side verdict would cost: a flag copied to pinned memory, an event
    pinned = torch.zeros((), dtype=torch.bool, pin_memory=True)
    ev = torch.cuda.Event()
    extra = [("flag -> pinned, non_blocking", lambda: pinned.copy_(flag, non_blocking=True)),
             ("event.record()", lambda: ev.record()), ("event.query()", lambda: ev.query()),
             ("pinned.item()", lambda: pinned.item())]
for label, fn in [("x.add_(1)", lambda: x.add_(1)), ("record, 1 tensor of 1 MiB held", lambda: (setattr(w, "held", [(src, dst)]), w.record(flag))),
                  ("torch.where 1 MiB", lambda: torch.where(flag, src, dst, out=dst))] + extra:
    for _ in range(20):
        fn()
    t = time.perf_counter()
    for _ in range(1000):
        fn()
    el = (time.perf_counter() - t) / 1000
    if dev == "cuda":
        torch.cuda.synchronize()
    print(f"  launch {label}: {el * 1e6:.1f} us host")

if a.cprofile:  # where the armed step's host time goes, function by function
    import cProfile
    import pstats
    prof = cProfile.Profile()
    prof.enable()
    run(True)
    prof.disable()
    pstats.Stats(prof).sort_stats("tottime").print_stats(25)
