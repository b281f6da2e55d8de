"""The host time of each piece of an armed doctor's per-step work, timed where the doctor
runs it inside a real eager seed_mlp step on CUDA (float16, an ampkit.GradScaler with a
fused SGD): each piece is wrapped with perf_counter around that one call, so the step's
own noise does not enter; medians over the steps (µs).

    python benchmarks/probes/doctor_host_cost.py [--steps 400]

Two pieces that are not the doctor's are timed beside them for scale: a flag copied to
pinned memory, and a device-to-device copy of it (one small launch in that place).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

import ampkit
from ampkit._doctor import _doctor, _step_watch
from ampkit.bench import build_case

ap = argparse.ArgumentParser()
ap.add_argument("--steps", type=int, default=400)
a = ap.parse_args()
built = build_case("seed_mlp", "full", device="cuda")
model = built.new_model()
opt = built.new_optimizer(model, fused=True)
scaler = ampkit.GradScaler("cuda")
samples: dict = {}


def timed(owner, name):
    f = getattr(owner, name)

    def run(*args, **kwargs):
        t = time.perf_counter()
        try:
            return f(*args, **kwargs)
        finally:
            samples.setdefault(name, []).append(time.perf_counter() - t)
    setattr(owner, name, run)


for owner, name in [(_doctor.doctor, "_root_pre"), (_doctor.doctor, "_root_post"), (_doctor.doctor, "_hook_grad"),
                    (_step_watch.StepWatch, "record"), (_step_watch.StepWatch, "_send"),
                    (_step_watch.StepWatch, "poll"), (_step_watch.StepWatch, "begin"), (_step_watch.StepWatch, "begin_new"),
                    (_step_watch.StepWatch, "keep_grad"),
                    (_doctor.doctor, "_gradients_checked"),  # (the scaler's listener point calls it)
                    (_doctor, "capturing"), (_doctor.doctor, "_log_rng"), (_doctor.doctor, "_new_step"),
                    (_step_watch.StepWatch, "check_pending"), (_doctor, "region_config"),
                    (_step_watch.StepWatch, "hold_output_grads"), (_doctor.doctor, "_scaler_report"),
                    (_doctor.doctor, "_steps")]:
    timed(owner, name)


class TimedGenerator:
    """The CUDA generator, each call the doctor makes on it timed where it runs."""

    def __init__(self, g):
        self.g = g

    def initial_seed(self):
        t = time.perf_counter()
        r = self.g.initial_seed()
        samples.setdefault("(C) generator.initial_seed", []).append(time.perf_counter() - t)
        return r

    def get_offset(self):
        t = time.perf_counter()
        r = self.g.get_offset()
        samples.setdefault("(C) generator.get_offset", []).append(time.perf_counter() - t)
        return r


raw_stream, get_device = torch._C._cuda_getCurrentRawStream, torch._C._cuda_getDevice
flag = torch.zeros((), device="cuda")
pinned = torch.full((64,), -1.0, pin_memory=True)
dev_ring = torch.zeros(64, device="cuda")
doc = ampkit.doctor(model, every=10**9)
doc._rng_gen = TimedGenerator(doc._rng_gen)
n = len(built.batches)
for i in range(a.steps + 10):
    x, y = built.batches[i % n]
    with ampkit.autocast("cuda", dtype=torch.float16):
        loss = built.loss_fn(model(x), y)
    scaler.scale(loss).backward()
    scaler.step(opt)
    t = time.perf_counter()
    raw_stream(get_device())
    samples.setdefault("(C) raw current stream, after step", []).append(time.perf_counter() - t)
    t = time.perf_counter()
    _step_watch.capturing()
    samples.setdefault("(C) capturing(), after step", []).append(time.perf_counter() - t)
    t = time.perf_counter()
    pinned[i % 64].copy_(flag, non_blocking=True)  # (what one flag a step sent at once would cost)
    samples.setdefault("(extra) d2h copy of a flag, after step", []).append(time.perf_counter() - t)
    t = time.perf_counter()
    dev_ring[i % 64].copy_(flag)
    samples.setdefault("(extra) d2d copy of a flag, after step", []).append(time.perf_counter() - t)
    scaler.update()
    opt.zero_grad(set_to_none=True)
    if i == 9:
        samples.clear()
torch.cuda.synchronize()
print(f"{torch.cuda.get_device_name()}: host verdicts {doc.host_verdict_steps}; us: median and mean a call, "
      "and the total a step")
for k, v in sorted(samples.items(), key=lambda kv: -statistics.median(kv[1])):
    print(f"  {k}: median {statistics.median(v) * 1e6:.1f}, mean {statistics.fmean(v) * 1e6:.1f}, "
          f"per step {sum(v) / a.steps * 1e6:.1f} (calls/step {len(v) / a.steps:.2f})")
doc.close()
