"""The kernel route of a policy change, and the torch.compile hazard it is guarded against.

A region runs its policy changes that are one ATen op as kernels registered at torch's
``AutocastCPU``/``AutocastCUDA`` key (``torch.library``; ampkit/_kernels.py), so that it
pushes no ``TorchFunctionMode`` and unchanged ops cost nothing. This script measures, on
the CPU, with a stand-in kernel (linear moved to fp32):

1. registering and dropping such a kernel (ampkit does it per outermost region);
2. a call of the changed op through the Python kernel against native autocast;
3. the hazard: a model compiled while the kernel is registered keeps the kernel's casts
   after the kernel is gone. dynamo guards on torch's autocast state and the
   torch-function mode stack, not on dispatcher registrations. Hence ampkit uses the
   handler mode while torch.compile holds compiled code, and resets dynamo when the
   outermost region exits after a compile that traced through a kernel.

    python benchmarks/probes/autocast_kernel_override.py

Printed, never asserted.
"""
import statistics
import time
import warnings

import torch
from torch.library import Library

warnings.simplefilter("ignore")  # "overriding a previously registered kernel"
torch.set_num_threads(1)
AUTOCAST_CPU = torch._C.DispatchKeySet(torch._C.DispatchKey.AutocastCPU)


def linear_in_fp32(x, w, b=None):  # the policy change: linear moved to fp32
    with torch._C._ExcludeDispatchKeyGuard(AUTOCAST_CPU):
        return torch.ops.aten.linear(x.float(), w.float(), None if b is None else b.float())


def register():
    lib = Library("aten", "IMPL")
    lib.impl("linear", linear_in_fp32, "AutocastCPU")
    return lib


def per_call_us(fn, n=2000):
    runs = []
    for _ in range(7):
        t = time.perf_counter()
        for _ in range(n):
            fn()
        runs.append((time.perf_counter() - t) / n * 1e6)
    return statistics.median(runs)


reg, drop = [], []
for _ in range(50):
    t0 = time.perf_counter()
    lib = register()
    t1 = time.perf_counter()
    lib._destroy()
    reg.append((t1 - t0) * 1e6)
    drop.append((time.perf_counter() - t1) * 1e6)
print(f"register a kernel: {statistics.median(reg):.1f} us, drop it: {statistics.median(drop):.1f} us (medians of 50)")

x, w = torch.randn(8, 8), torch.randn(8, 8)
with torch.autocast("cpu"):
    native = per_call_us(lambda: torch.nn.functional.linear(x, w))
lib = register()
with torch.autocast("cpu"):
    kernel = per_call_us(lambda: torch.nn.functional.linear(x, w))
lib._destroy()
print(f"F.linear 8x8 in a region: native autocast {native:.2f} us, through the Python kernel {kernel:.2f} us")

lin = torch.nn.Linear(8, 8)
compiled = torch.compile(lin)
lib = register()
with torch.autocast("cpu"):
    print("kernel registered:  eager", lin(x).dtype, "| compiled", compiled(x).dtype)
lib._destroy()
with torch.autocast("cpu"):
    e, c = lin(x).dtype, compiled(x).dtype
print("kernel dropped:     eager", e, "| compiled", c, "<- stale" if c != e else "")
