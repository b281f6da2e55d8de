"""An armed doctor's cost on an eager step, measured A/B in one process: two copies of the
case's model (same seed), one with the doctor armed (every=10**9: only its step 0, in the
warm-up, is sampled), stepped in alternating chunks; the median step time of each and the
median of the per-chunk ratios (armed / off). Run it once per code version to compare them.

    python benchmarks/probes/doctor_ab.py [--device cuda] [--case seed_mlp] [--profile full]
        [--chunk 50] [--chunks 40] [--json PATH] [--control]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

import ampkit
from ampkit.bench import build_case, loop_step

ap = argparse.ArgumentParser()
ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
ap.add_argument("--case", default="seed_mlp")
ap.add_argument("--profile", default="full")
ap.add_argument("--chunk", type=int, default=50)
ap.add_argument("--chunks", type=int, default=40)
ap.add_argument("--json")
ap.add_argument("--control", action="store_true",
                help="arm nothing: both copies off, the ratio is the measurement's own noise")
ap.add_argument("--noop-hooks", action="store_true",
                help="give the 'armed' copy only the doctor's two root hooks, doing nothing: what "
                     "torch's module hook path costs by itself")
ap.add_argument("--floor", action="store_true",
                help="give the 'armed' copy the doctor's two root hooks doing only what no design "
                     "can skip: the post-hook puts a no-op hook on the output's gradient")
ap.add_argument("--floor-retain", action="store_true",
                help="as --floor, with the output retaining its gradient (a C++ hook that clones "
                     "it) in place of the Python hook")
ap.add_argument("--per-step", type=int, default=0, metavar="N",
                help="instead of chunks: N steps of each, alternating one by one, each timed on the "
                     "host without a sync (the step is host-bound): the ratio of the mean step times "
                     "(the flag sends every 32 steps included) and of the medians")
a = ap.parse_args()
dev = a.device
dtype = torch.float16 if dev == "cuda" else torch.bfloat16
built = build_case(a.case, a.profile, device=dev)


def sync():
    if dev == "cuda":
        torch.cuda.synchronize()


def make():
    model = built.new_model()
    opt = built.new_optimizer(model, fused=dev == "cuda")
    return model, loop_step(model, built.loss_fn, opt, lambda: ampkit.autocast(dev, dtype=dtype),
                            ampkit.GradScaler(dev))


off_model, off_step = make()
on_model, on_step = make()
doc = None if a.control or a.noop_hooks or a.floor or a.floor_retain else ampkit.doctor(on_model, every=10**9)
if a.noop_hooks:
    on_model.register_forward_pre_hook(lambda m, args, kwargs: None, with_kwargs=True)
    on_model.register_forward_hook(lambda m, args, out: None, always_call=True)
if a.floor or a.floor_retain:
    def _noop_grad(g):
        return None

    def _post(m, args, out):
        if a.floor_retain:
            out.retain_grad()
        else:
            out.register_hook(_noop_grad)

    on_model.register_forward_pre_hook(lambda m, args, kwargs: None, with_kwargs=True)
    on_model.register_forward_hook(_post, always_call=True)
n = len(built.batches)
for step in (off_step, on_step):
    for i in range(10):
        step(*built.batches[i % n])
sync()
times = {"off": [], "armed": []}
ratios = []
if a.per_step:
    a.chunks = 0
    clock = time.perf_counter
    for s in range(a.per_step):
        x, y = built.batches[s % n]
        for key, step in ((("off", off_step), ("armed", on_step)) if s % 2 == 0 else (("armed", on_step), ("off", off_step))):
            t = clock()
            step(x, y)
            times[key].append(clock() - t)
    sync()
    half = a.per_step // 2
    mean = {k: statistics.fmean(v) for k, v in times.items()}
    halves = [statistics.fmean(times["armed"][i:i + half]) / statistics.fmean(times["off"][i:i + half]) for i in (0, half)]
    ratios = [mean["armed"] / mean["off"]] * 3
for c in range(a.chunks):
    pair = {}
    for key, step in ((("off", off_step), ("armed", on_step)) if c % 2 == 0 else (("armed", on_step), ("off", off_step))):
        t = time.perf_counter()
        for i in range(a.chunk):
            step(*built.batches[i % n])
        sync()
        pair[key] = (time.perf_counter() - t) / a.chunk
        times[key].append(pair[key])
    ratios.append(pair["armed"] / pair["off"])
host = doc.host_verdict_steps if doc else 0
if doc:
    doc.close()
if a.per_step:  # the ratio of the mean step times; its "quartiles": the ratios of each half's means
    q = [min(halves), max(halves)]
else:
    q = statistics.quantiles(ratios, n=4)[::2]
res = {"control": a.control, "noop_hooks": a.noop_hooks, "floor": a.floor, "floor_retain": a.floor_retain,
       "case": a.case, "profile": a.profile, "device": dev,
       "card": torch.cuda.get_device_name() if dev == "cuda" else "cpu",
       "off_ms": statistics.median(times["off"]) * 1e3, "armed_ms": statistics.median(times["armed"]) * 1e3,
       "ratio": statistics.median(ratios), "ratio_q1": q[0], "ratio_q3": q[1],
       "steps_host_verdict": host, "per_step": a.per_step,
       "median_ratio": statistics.median(times["armed"]) / statistics.median(times["off"]),
       "steps_armed": 10 + (a.per_step or a.chunk * a.chunks)}
kind = ("control (both off) " if a.control else "no-op hooks " if a.noop_hooks else "floor " if a.floor
        else "floor (retain_grad) " if a.floor_retain else "")
how = f"per step x{a.per_step}, ratio of means" if a.per_step else f"{a.chunks} chunks of {a.chunk}, median ratio"
print(f"{kind}{a.case}/{a.profile} {dev} ({how}): off {res['off_ms']:.3f} ms, armed {res['armed_ms']:.3f} ms, "
      f"armed/off x{res['ratio']:.3f} [{q[0]:.3f}, {q[1]:.3f}], medians x{res['median_ratio']:.3f}, "
      f"host verdicts {host}/{res['steps_armed']}")
if a.json:
    with open(a.json, "w") as f:
        json.dump(res, f, indent=1)
