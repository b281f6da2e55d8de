"""Where an armed doctor's extra host time goes, torch's own code included: the same eager
seed_mlp step (float16, an ampkit.GradScaler, fused SGD on CUDA) run under cProfile with
the doctor off and then armed; the functions whose own time per step grew most, and the
step's wall time each way (cProfile slows both alike; the difference is what to read).

    python benchmarks/probes/doctor_profile_diff.py [--steps 600] [--top 30]
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import time

import torch

import ampkit
from ampkit.bench import build_case, loop_step

ap = argparse.ArgumentParser()
ap.add_argument("--steps", type=int, default=600)
ap.add_argument("--top", type=int, default=30)
ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
a = ap.parse_args()
dev = a.device
dtype = torch.float16 if dev == "cuda" else torch.bfloat16
built = build_case("seed_mlp", "full" if dev == "cuda" else "tiny", device=dev)


def sync():
    if dev == "cuda":
        torch.cuda.synchronize()


def run(armed):
    model = built.new_model()
    opt = built.new_optimizer(model, fused=dev == "cuda")
    step = loop_step(model, built.loss_fn, opt, lambda: ampkit.autocast(dev, dtype=dtype), ampkit.GradScaler(dev))
    doc = ampkit.doctor(model, every=10**9) if armed else None
    n = len(built.batches)
    for i in range(20):
        step(*built.batches[i % n])
    sync()
    prof = cProfile.Profile()
    t = time.perf_counter()
    prof.enable()
    for i in range(a.steps):
        step(*built.batches[i % n])
    sync()
    prof.disable()
    wall = (time.perf_counter() - t) / a.steps
    if doc is not None:
        doc.close()
    st = pstats.Stats(prof)
    own = {k: v[2] for k, v in st.stats.items()}  # (file, line, name) -> total own time
    calls = {k: v[1] for k, v in st.stats.items()}
    return wall, own, calls


run(False)  # (a warm-up, discarded: the first run pays for the card's and allocator's first steps)
wall_off, off, _ = run(False)
wall_on, on, calls = run(True)
print(f"{torch.cuda.get_device_name() if dev == 'cuda' else 'cpu'}: wall per step under cProfile: "
      f"off {wall_off * 1e6:.0f} us, armed {wall_on * 1e6:.0f} us (+{(wall_on - wall_off) * 1e6:.0f})")
print(f"own time per step, armed - off (us); total of the differences "
      f"{sum(on.values()) / a.steps * 1e6 - sum(off.values()) / a.steps * 1e6:+.0f}")
diff = {k: (on.get(k, 0.0) - off.get(k, 0.0)) / a.steps * 1e6 for k in set(on) | set(off)}
for k, d in sorted(diff.items(), key=lambda kv: -abs(kv[1]))[: a.top]:
    f, line, name = k
    print(f"  {d:+8.1f}  calls/step {calls.get(k, 0) / a.steps:5.2f}  {name}  ({f.split('site-packages/')[-1]}:{line})")
