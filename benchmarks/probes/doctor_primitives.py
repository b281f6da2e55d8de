"""What the calls an armed doctor makes every step cost on this host, one by one: each is
run in a tight loop (median over repeats of 2000 calls, ns a call), so that the host's
speed for Python bytecode, torch's C++ bindings and CUDA API calls can be told apart. Then
a cProfile of 300 armed eager seed_mlp steps, the doctor's functions by their own time.

    python benchmarks/probes/doctor_primitives.py [--device cuda]
"""

from __future__ import annotations

import argparse
import collections
import cProfile
import pstats
import statistics
import time
import weakref

import torch

import ampkit
from ampkit._doctor import _replay, _step_watch
from ampkit.bench import build_case, loop_step

ap = argparse.ArgumentParser()
ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
ap.add_argument("--steps", type=int, default=300)
a = ap.parse_args()
dev = a.device
x = torch.randn(64, 64, device=dev, requires_grad=True)
y = (x * 2).sum(1)
flag = torch.zeros((), device=dev)
gen = _replay.cuda_generator(torch.device(dev)) if dev == "cuda" else torch.default_generator
lst: list = []


def nothing():
    return None


def hook_dict():
    z = x * 1.0
    hooks = z._backward_hooks = collections.OrderedDict()
    z.grad_fn._register_hook_dict(z)
    hooks[1] = nothing


def mul_only():
    x * 1.0


calls = {
    "python call": nothing,
    "list append+clear": lambda: (lst.append(flag), lst.clear()),
    "capturing()": _step_watch.capturing,
    "raw current stream": (lambda: torch._C._cuda_getCurrentRawStream(torch._C._cuda_getDevice())) if dev == "cuda" else nothing,
    "generator.initial_seed()": gen.initial_seed,
    "generator.get_offset()": gen.get_offset if dev == "cuda" else nothing,
    "torch.is_autocast_enabled(dev)": lambda: torch.is_autocast_enabled(dev),
    "torch.is_grad_enabled()": torch.is_grad_enabled,
    "x.data_ptr()": x.data_ptr,
    "x.detach()": x.detach,
    "x.nbytes": lambda: x.nbytes,
    "x._version": lambda: x._version,
    "weakref.ref(x)": lambda: weakref.ref(x),
    "region_config((dev,))": lambda: _replay.region_config((dev,)),
    "x * 1.0 (one launch)": mul_only,
    "x * 1.0 + hook dict": hook_dict,
    "torch.zeros(())": lambda: torch.zeros((), device=dev),
}
print(f"{torch.cuda.get_device_name() if dev == 'cuda' else 'cpu'}: ns a call (median of 15 x 2000)")
for name, f in calls.items():
    reps = []
    for _ in range(15):
        t = time.perf_counter()
        for _ in range(2000):
            f()
        reps.append((time.perf_counter() - t) / 2000 * 1e9)
    if dev == "cuda":
        torch.cuda.synchronize()
    print(f"  {name:34s} {statistics.median(reps):9.0f}")

built = build_case("seed_mlp", "full" if dev == "cuda" else "tiny", device=dev)
model = built.new_model()
opt = built.new_optimizer(model, fused=dev == "cuda")
dtype = torch.float16 if dev == "cuda" else torch.bfloat16
step = loop_step(model, built.loss_fn, opt, lambda: ampkit.autocast(dev, dtype=dtype), ampkit.GradScaler(dev))
doc = ampkit.doctor(model, every=10**9)
n = len(built.batches)
for i in range(20):
    step(*built.batches[i % n])
prof = cProfile.Profile()
prof.enable()
for i in range(a.steps):
    step(*built.batches[i % n])
prof.disable()
if dev == "cuda":
    torch.cuda.synchronize()
doc.close()
st = pstats.Stats(prof)
rows = []
for (file, line, fn), (cc, nc, tt, ct, _) in st.stats.items():
    rows.append((tt, ct, nc, f"{file.split('/')[-1]}:{line} {fn}"))
rows.sort(reverse=True)
print(f"cProfile of {a.steps} armed steps (us a step: own time, cumulative; calls a step), top 40 by own time:")
for tt, ct, nc, name in rows[:40]:
    print(f"  {tt / a.steps * 1e6:8.1f} {ct / a.steps * 1e6:8.1f} {nc / a.steps:6.2f}  {name}")
print("the doctor's own functions by cumulative time (us a step; calls a step):")
for tt, ct, nc, name in sorted(rows, key=lambda r: -r[1]):
    if name.startswith(("_doctor.py", "_step_watch.py", "_op_watch.py", "_replay.py", "_replaying.py")):
        print(f"  {tt / a.steps * 1e6:8.1f} {ct / a.steps * 1e6:8.1f} {nc / a.steps:6.2f}  {name}")
