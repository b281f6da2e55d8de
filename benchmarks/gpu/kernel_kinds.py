"""Where a training step's device time goes: torch.profiler over a few steps, each kernel
put in one kind, the time per step by kind and the kernels that take the most.

Imported by the GPU scripts beside it (fp8_speed.py, compiled_step_probe.py), run as
``python3 benchmarks/gpu/<script>.py`` (this folder is then the first entry of sys.path).

Kinds, the first that matches (a kernel's name, lower-cased; on the CPU, where there are no
kernels, the ops' self CPU time, so that the CPU smoke run exercises the same code):

  triton     inductor's generated kernels (``triton_poi_fused_...``, ``triton_red_...``,
             ``triton_per_...``): fused elementwise and reductions, named as inductor named them
  fp8_gemm   a kernel launched by ``aten::_scaled_mm``, or whose name says fp8
             (e4m3, e5m2, f8f8, ``_scaled_mm``)
  attention  flash / memory-efficient / cuDNN attention, sdpa (before gemm: cuDNN's sdpa
             kernels carry sm90_ and wgmma in their names)
  gemm       the other matrix multiplies (cuBLAS / cutlass / nvjet names; aten::mm on the CPU)
  optimizer  fused and multi-tensor optimizer kernels
  other      everything else (copies, torch's own elementwise kernels, reductions)

Ranges that torch.profiler shows on the device timeline but that are no kernel (user
annotations such as ``Optimizer.step#AdamW.step``, which span the kernels they hold) are
left out: counted, they would count those kernels twice.

>>> kernel_kind("triton_poi_fused__to_copy_abs_amax_0")
'triton'
>>> kernel_kind("nvjet_tst_128x256_64x4_1x2_h_bz_coopA_NTT"), kernel_kind("aten::_scaled_mm")
('gemm', 'fp8_gemm')
"""
from __future__ import annotations

import collections
import dataclasses
import time

import torch

KINDS = ("fp8_gemm", "gemm", "attention", "optimizer", "triton", "other")
TRITON = ("triton_",)
FP8_GEMM = ("scaled_mm", "e4m3", "e5m2", "f8f8")
GEMM = ("gemm", "gemv", "cutlass", "nvjet", "xmma", "sm90_", "sm80_", "aten::mm", "aten::addmm", "aten::bmm")
ATTENTION = ("flash", "fmha", "attention", "sdpa", "scaled_dot_product")
ANNOTATIONS = ("Optimizer.", "ProfilerStep")  # user-annotation ranges, by their name
OPTIMIZER = ("sgd", "adam", "multi_tensor_apply")


def kernel_kind(name: str, fp8_kernels=frozenset()) -> str:
    """The kind of a kernel (or, on the CPU, an op) called ``name``; ``fp8_kernels``: the names
    of kernels that ``aten::_scaled_mm`` launched, fp8 GEMMs whatever they are called."""
    n = name.lower()
    if n.startswith(TRITON):
        return "triton"
    if name in fp8_kernels or any(k in n for k in FP8_GEMM):
        return "fp8_gemm"
    for kind, keys in (("attention", ATTENTION), ("gemm", GEMM), ("optimizer", OPTIMIZER)):
        if any(k in n for k in keys):
            return kind
    return "other"


def is_annotation(event) -> bool:
    """Whether a device-side profiler event is a user-annotation range, not a kernel.

    >>> class E: name, is_user_annotation = "Optimizer.step#AdamW.step", False
    >>> is_annotation(E())
    True
    """
    return bool(getattr(event, "is_user_annotation", False)) or event.name.startswith(ANNOTATIONS)


@dataclasses.dataclass(frozen=True)
class KernelTotal:
    """One kernel's share of a step: device ms and calls per step."""

    name: str
    kind: str
    ms: float
    count: float


@dataclasses.dataclass(frozen=True)
class Breakdown:
    """Device ms per step by kind (every kind of KINDS, zeros included) and the ``top``
    kernels by total time, over ``steps`` profiled steps on ``device`` ("cuda": kernels;
    "cpu": ops' self CPU time)."""

    device: str
    steps: int
    kinds: dict
    top: tuple
    launches: float = 0.0  # kernels (on the CPU: ops) a step, all of them
    wall_ms: float = 0.0  # the profiled steps' wall time a step, the device synced at the end
    host_top: tuple = ()  # on CUDA: the host's events (ops, runtime calls) by self CPU time, as KernelTotals

    def to_dict(self) -> dict:
        return {"device": self.device, "steps": self.steps, "kinds_ms": dict(self.kinds),
                "total_ms": sum(self.kinds.values()), "launches": self.launches, "wall_ms": self.wall_ms,
                "top": [dataclasses.asdict(k) for k in self.top],
                "host_top": [dataclasses.asdict(k) for k in self.host_top]}

    def lines(self, width=100):
        """Printable: one line of kinds, then one line per top kernel."""
        out = ["device ms a step: " + ", ".join("%s %.3f" % (k, self.kinds[k]) for k in KINDS)
               + ", total %.3f, %.0f %s a step" % (sum(self.kinds.values()), self.launches,
                                                    "kernels" if self.device == "cuda" else "ops")]
        for k in self.top:
            name = k.name if len(k.name) <= width else k.name[:width - 3] + "..."
            out.append("  %8.3f ms %6.1fx  %-9s %s" % (k.ms, k.count, k.kind, name))
        if self.host_top:  # where the host's time goes, when the wall is above the device's total
            out.append("host: %.3f ms a step of wall (profiled), its events by self CPU time:" % self.wall_ms)
            for k in self.host_top:
                name = k.name if len(k.name) <= width else k.name[:width - 3] + "..."
                out.append("  %8.3f ms %6.1fx  %s" % (k.ms, k.count, name))
        return out


def profile_breakdown(step, batches, steps=3, device="cuda", top=15) -> Breakdown:
    """Run ``step(x, y)`` over ``steps`` of ``batches`` under torch.profiler (the device
    synced before and after) and break its time down (module docstring)."""
    from torch.profiler import ProfilerActivity, profile
    cuda = device == "cuda"
    if cuda:
        torch.cuda.synchronize()
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=acts) as prof:
        t0 = time.perf_counter()
        for i in range(steps):
            step(*batches[i % len(batches)])
        if cuda:
            torch.cuda.synchronize()
        wall_ms = (time.perf_counter() - t0) * 1e3 / steps
    return dataclasses.replace(breakdown_of(prof.events(), steps, device, top), wall_ms=wall_ms)


def breakdown_of(events, steps, device, top=15) -> Breakdown:
    """A :class:`Breakdown` of torch.profiler's FunctionEvents."""
    cuda = device == "cuda"
    fp8 = frozenset(k.name for e in events if e.name == "aten::_scaled_mm" for k in e.kernels)
    times, counts = collections.Counter(), collections.Counter()
    host_times, host_counts = collections.Counter(), collections.Counter()
    for e in events:
        if cuda:
            if e.device_type == torch.autograd.DeviceType.CPU and not e.name.startswith("ProfilerStep"):
                host_times[e.name] += e.self_cpu_time_total
                host_counts[e.name] += 1
            if e.device_type != torch.autograd.DeviceType.CUDA or is_annotation(e):
                continue
            us = e.device_time_total if hasattr(e, "device_time_total") else e.cuda_time_total
        else:
            if e.device_type != torch.autograd.DeviceType.CPU or e.name.startswith("ProfilerStep"):
                continue
            us = e.self_cpu_time_total
        times[e.name] += us
        counts[e.name] += 1
    kinds = dict.fromkeys(KINDS, 0.0)
    for name, us in times.items():
        kinds[kernel_kind(name, fp8)] += us / 1e3 / steps
    top_k = tuple(KernelTotal(name, kernel_kind(name, fp8), us / 1e3 / steps, counts[name] / steps)
                  for name, us in times.most_common(top))
    host = tuple(KernelTotal(name, "host", us / 1e3 / steps, host_counts[name] / steps)
                 for name, us in host_times.most_common(top))
    return Breakdown(device, steps, kinds, top_k, sum(counts.values()) / steps, host_top=host)
