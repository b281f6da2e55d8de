"""What this CPU can do for mixed precision, measured and read, for the report and the budget.

Mixed precision on a CPU pays only where the CPU has bf16 (fp16) arithmetic: AVX-512
BF16 or AMX. Without it (an AVX2-only CPU), oneDNN and ATen emulate bf16 in software and
a bf16 matmul takes tens of times the float32 time: every AMP variant is then much
slower than fp32, for torch and ampkit alike, and the cpu profile must be cut to fit its
time budget. :func:`cpu_capability` reads the CPU's flags, torch's kernel level
(``torch.backends.cpu.get_cpu_capability()``) and the environment that caps them
(``ATEN_CPU_CAPABILITY``, ``ONEDNN_MAX_CPU_ISA``: how an AVX-512 machine emulates an
AVX2-only one), and times one small matmul in both dtypes.

>>> cap = capability_from(flags={"avx2", "avx512f", "avx512_bf16"}, isa="AVX512", model="X",
...                       env={}, bf16_slowdown=0.5)
>>> cap.native_bf16, cap.native_fp16, cap.emulated
(True, False, None)
>>> capability_from(flags={"avx2", "avx512f", "avx512_bf16"}, isa="AVX2", model="X",
...                 env={"ONEDNN_MAX_CPU_ISA": "AVX2", "ATEN_CPU_CAPABILITY": "avx2"},
...                 bf16_slowdown=90.0).native_bf16
False
"""

from __future__ import annotations

import dataclasses
import functools
import os
import platform
import time

# Flags of CPUs with bf16 / fp16 arithmetic (Linux /proc/cpuinfo names).
BF16_FLAGS = ("avx512_bf16", "amx_bf16")
FP16_FLAGS = ("avx512_fp16", "amx_fp16")
# oneDNN ISA caps (ONEDNN_MAX_CPU_ISA) below which it has no bf16 / fp16 kernels.
_ONEDNN_NO_BF16 = {"SSE41", "AVX", "AVX2", "AVX2_VNNI", "AVX512_CORE", "AVX512_CORE_VNNI"}
_ONEDNN_NO_FP16 = _ONEDNN_NO_BF16 | {"AVX2_VNNI_2", "AVX512_CORE_BF16", "AVX512_CORE_AMX"}
# A bf16 matmul this many times slower than float32 is emulated, whatever the flags say.
SLOW_BF16 = 3.0


@dataclasses.dataclass(frozen=True)
class CpuCapability:
    """The CPU as mixed precision sees it (a value: the report and the budget read it)."""

    model: str
    isa: str  # torch's kernel level: DEFAULT, AVX2, AVX512, ...
    flags: tuple  # the bf16/fp16-relevant flags the CPU reports
    native_bf16: bool
    native_fp16: bool
    bf16_slowdown: float  # a bf16 matmul's time / the float32 one's (measured)
    emulated: str | None  # the environment capping the kernels, e.g. "ATEN_CPU_CAPABILITY=avx2"

    @property
    def compile_reason(self):
        """Why a compiled variant cannot run on this CPU (None when it can)."""
        caps = dict(kv.split("=", 1) for kv in (self.emulated or "").split())
        return compile_reason({k: v for k, v in caps.items() if k == "ATEN_CPU_CAPABILITY"})

    def describe(self) -> str:
        """One paragraph for the report: what the CPU can do and what it means for the figures."""
        kind = "AVX-512" if self.isa.startswith("AVX512") else self.isa
        bf16 = "native bf16" if self.native_bf16 else "no native bf16"
        fp16 = "native fp16" if self.native_fp16 else "no native fp16"
        head = "%s: %s kernels, %s, %s%s; a bf16 matmul takes %.2gx the float32 time." % (
            self.model, kind, bf16, fp16, " (emulated: %s)" % self.emulated if self.emulated else "",
            self.bf16_slowdown)
        if self.slow_bf16:
            return head + (" bf16 is emulated in software here, so every AMP variant (torch's and "
                           "ampkit's alike) runs far slower than fp32: the figures compare ampkit with "
                           "torch_amp under the same handicap, not mixed precision with fp32, and the "
                           "cpu profile's run lengths (and, if need be, batch sizes) are cut to fit the "
                           "time budget.")
        return head + (" AMP variants use the CPU's bf16 arithmetic, so their speedups against fp32 are what "
                       "mixed precision gains on this CPU.")

    @property
    def slow_bf16(self) -> bool:
        """Whether bf16 runs emulated (measured: the flags may not tell, e.g. on other architectures)."""
        return self.bf16_slowdown >= SLOW_BF16

    def to_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d["flags"] = list(self.flags)
        d["summary"] = self.describe()
        return d


def compile_reason(env=None):
    """Why torch.compile's results cannot be trusted on this CPU (None when they can): its
    CPU kernels ignore ATEN_CPU_CAPABILITY, so under that emulation a compiled model gives
    wrong values (NaN even in float32).

    >>> compile_reason({}) is None, "not runnable" in compile_reason({"ATEN_CPU_CAPABILITY": "avx2"})
    (True, True)
    """
    env = os.environ if env is None else env
    if env.get("ATEN_CPU_CAPABILITY"):
        return ("torch.compile gives wrong results (NaN) on the CPU under ATEN_CPU_CAPABILITY=%s "
                "(its generated kernels ignore the emulated capability): not runnable here"
                % env["ATEN_CPU_CAPABILITY"])
    return None


def _cpu_flags_and_model():
    flags, model = set(), None
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags") and not flags:
                    flags = set(line.split(":", 1)[1].split())
                elif line.startswith("model name") and model is None:
                    model = line.split(":", 1)[1].strip()
    except OSError:
        pass
    return flags, model or platform.processor() or platform.machine()


def capability_from(flags, isa: str, model: str, env, bf16_slowdown: float) -> CpuCapability:
    """The capability from what was read (a pure function: the tests give it any CPU)."""
    onednn = (env.get("ONEDNN_MAX_CPU_ISA") or "").upper()
    aten = env.get("ATEN_CPU_CAPABILITY") or ""
    emulated = " ".join("%s=%s" % (k, env[k]) for k in ("ONEDNN_MAX_CPU_ISA", "ATEN_CPU_CAPABILITY")
                        if env.get(k)) or None
    capped = isa.upper() not in ("AVX512", "SVE256", "SVE") or aten.lower() in ("avx2", "default")
    native_bf16 = any(f in flags for f in BF16_FLAGS) and onednn not in _ONEDNN_NO_BF16 and not capped
    native_fp16 = any(f in flags for f in FP16_FLAGS) and onednn not in _ONEDNN_NO_FP16 and not capped
    shown = tuple(sorted(f for f in flags if f in BF16_FLAGS + FP16_FLAGS + ("avx2", "avx512f")))
    return CpuCapability(model=model, isa=isa, flags=shown, native_bf16=native_bf16,
                         native_fp16=native_fp16, bf16_slowdown=float(bf16_slowdown), emulated=emulated)


def bf16_matmul_slowdown(n: int = 128, tries: int = 3) -> float:
    """A bf16 matmul's time over a float32 one's (n x n, best of ``tries``, on one thread):
    about 1 or below with bf16 arithmetic, tens without. Milliseconds even where bf16 is
    emulated."""
    import torch

    def best(dtype):
        a, b = torch.randn(n, n).to(dtype), torch.randn(n, n).to(dtype)
        a @ b
        times = []
        for _ in range(tries):
            t0 = time.perf_counter()
            a @ b
            times.append(time.perf_counter() - t0)
        return min(times)

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # one thread: with several, small bf16 matmuls time erratically
    try:
        return best(torch.bfloat16) / max(best(torch.float32), 1e-9)
    finally:
        torch.set_num_threads(threads)


@functools.lru_cache(maxsize=None)
def cpu_capability() -> CpuCapability:
    """This machine's :class:`CpuCapability` (read and measured once per process)."""
    import torch

    flags, model = _cpu_flags_and_model()
    isa = torch.backends.cpu.get_cpu_capability()
    return capability_from(flags, isa, model, dict(os.environ), bf16_matmul_slowdown())
