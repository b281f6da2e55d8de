"""The compiled captured step against torch's compiled rivals (issue 26), one process,
variants timed interleaved. Never a test.

    PYTHONPATH=$PWD/python python3 benchmarks/gpu/compiled_step_probe.py CASES ROUNDS [VARIANTS]

Per case (full profile, fp16, fused optimizer, the case's batches), every variant is built
and warmed up one after another (its compile time: the build and warm-up's wall time, the
device synced; its peak memory: the most allocated during build, warm-up (captures
included) and its timed epochs, above what was allocated before its build), then
``ROUNDS`` rounds of one epoch of each, the order rotating round by round, the device
synced around each epoch. Variants (default all):

  ro        torch.compile(model, mode="reduce-overhead") under torch.autocast + torch.amp.GradScaler
  mat       torch.compile(model, mode="max-autotune-no-cudagraphs"), same loop
  co        torch.compile(model) (default mode), same loop
  step      ampkit.make_train_step(model) (captured, uncompiled)
  compiled  ampkit.make_train_step(model, compile=True) (ampkit_step_compiled)
  compiled_mat  make_train_step(model, compile=dict(mode="max-autotune-no-cudagraphs"))
  compiled_loss make_train_step(compile=True) of a module whose forward is the model and the
            loss together (WithLoss): inductor compiles (and fuses) the loss with the model
  ro_loss   ro of the same WithLoss module: torch's reduce-overhead with the loss compiled too
            (not one of the issue's rivals, which compile the model as users write it)

Printed per variant: median ms/step, the fastest of torch's compiled rivals (ro, mat, co)
over it, peak MiB, compile s. ``--breakdown``: per variant, the device ms a step of its
kernels by kind (benchmarks/gpu/kernel_kinds.py: fp8_gemm, gemm, attention, optimizer, triton,
other), torch.profiler over 3 steps. The floor (``--floor``, on by default): the device time of
the step's GEMMs and optimizer kernels alone, from torch.profiler over 5 steps of ``co``
(the gemm, fp8_gemm and optimizer kinds of kernel_kinds.py), printed with each variant's
time over it.
"""
import statistics, sys, time, traceback
import torch, ampkit
from ampkit.bench import build_case, loop_step
from kernel_kinds import profile_breakdown  # (this folder: the kernel categoriser fp8_speed.py shares)

cases = sys.argv[1].split(",")
rounds = int(sys.argv[2])
wanted = sys.argv[3].split(",") if len(sys.argv) > 3 else ["ro", "mat", "co", "step", "compiled", "compiled_mat"]
RIVALS = ("ro", "mat", "co")
print(torch.cuda.get_device_name(), torch.__version__, flush=True)
torch._dynamo.config.cache_size_limit = 64  # (one model class compiled by several variants)


class WithLoss(torch.nn.Module):
    """The model and the loss in one forward: (x, y) -> loss_fn(model(x), y)."""

    def __init__(self, model, loss_fn):
        super().__init__()
        self.model, self.loss_fn = model, loss_fn

    def forward(self, x, y):
        return self.loss_fn(self.model(x), y)


def torch_loop(model, b, mode):
    """torch's AMP loop (the benchmark's hand-written step) over torch.compile(model, mode)."""
    opt = b.new_optimizer(model, fused=True)
    return loop_step(torch.compile(model, mode=mode), b.loss_fn, opt,
                     lambda: torch.autocast("cuda", dtype=torch.float16), torch.amp.GradScaler("cuda"))


def ampkit_step(model, b, compile):
    opt = b.new_optimizer(model, fused=True)
    st = ampkit.make_train_step(model, b.loss_fn, opt, capture=True, compile=compile,
                                autocast=dict(device_type="cuda", dtype=torch.float16))
    step = lambda x, y: st(x, y)  # noqa: E731
    step.st = st
    return step


builders = {"ro": lambda m, b: torch_loop(m, b, "reduce-overhead"),
            "mat": lambda m, b: torch_loop(m, b, "max-autotune-no-cudagraphs"),
            "co": lambda m, b: torch_loop(m, b, None),
            "step": lambda m, b: ampkit_step(m, b, None),
            "compiled": lambda m, b: ampkit_step(m, b, True),
            "compiled_mat": lambda m, b: ampkit_step(m, b, dict(mode="max-autotune-no-cudagraphs")),
            "compiled_loss": lambda m, b: with_loss_step(m, b),
            "ro_loss": lambda m, b: with_loss_torch(m, b, "reduce-overhead")}


def with_loss_step(model, b):
    opt = b.new_optimizer(model, fused=True)
    st = ampkit.make_train_step(WithLoss(model, b.loss_fn), lambda loss: loss, opt, capture=True,
                                compile=True, autocast=dict(device_type="cuda", dtype=torch.float16))
    step = lambda x, y: st((x, y), [])  # noqa: E731
    step.st = st
    return step


def with_loss_torch(model, b, mode):
    opt = b.new_optimizer(model, fused=True)
    compiled = torch.compile(WithLoss(model, b.loss_fn), mode=mode)
    inner = loop_step(lambda xy: compiled(*xy), lambda loss, _: loss, opt,
                      lambda: torch.autocast("cuda", dtype=torch.float16), torch.amp.GradScaler("cuda"))
    return lambda x, y: inner((x, y), None)


def breakdown_ms(fn, b, steps=3):
    """Device ms per step of every kernel, by kind (kernel_kinds.KINDS)."""
    return profile_breakdown(fn, b.batches, steps, "cuda").kinds


def floor_ms(fn, b, steps=5):
    """Device ms per step of the GEMM and optimizer kernels (breakdown_ms over ``steps``)."""
    return {k: v for k, v in breakdown_ms(fn, b, steps).items() if k in ("gemm", "fp8_gemm", "optimizer")}


for case in cases:
    b = build_case(case, "full", device="cuda")
    steps, compile_s, peak, base_mem = {}, {}, {}, {}
    for v in wanted:
        try:
            torch.cuda.synchronize()
            base_mem[v] = torch.cuda.memory_allocated()
            torch.cuda.reset_peak_memory_stats()
            t0 = time.perf_counter()
            fn = builders[v](b.new_model(), b)
            for i in range(max(4, b.warmup_steps) + (11 if v.startswith("compiled") or v == "step" else 0)):
                fn(*b.batches[i % len(b.batches)])
            torch.cuda.synchronize()
            compile_s[v] = time.perf_counter() - t0
            peak[v] = (torch.cuda.max_memory_allocated() - base_mem[v]) / 2**20
            steps[v] = fn
        except Exception as e:
            print("%s %s FAILED: %s" % (case, v, "".join(traceback.format_exception_only(e)).strip()[:600]), flush=True)
    floor = None
    if "co" in steps and "--no-floor" not in sys.argv:
        try:
            floor = floor_ms(steps["co"], b)
            print("%s floor (device ms a step, co's kernels): %s" % (
                case, ", ".join("%s %.3f" % kv for kv in sorted(floor.items()))), flush=True)
        except Exception as e:
            print("%s floor FAILED: %s" % (case, e), flush=True)
    times = {v: [] for v in steps}
    names = list(steps)
    for r in range(rounds):
        for v in names[r % len(names):] + names[:r % len(names)]:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            t0 = time.perf_counter()
            for x, y in b.batches:
                steps[v](x, y)
            torch.cuda.synchronize()
            times[v].append((time.perf_counter() - t0) * 1e3 / len(b.batches))
            peak[v] = max(peak[v], (torch.cuda.max_memory_allocated() - base_mem[v]) / 2**20)
    rivals = [statistics.median(times[v]) for v in RIVALS if v in times]
    best = min(rivals) if rivals else None
    total_floor = sum(floor.values()) if floor else None
    if "--breakdown" in sys.argv:
        for v in names:
            try:
                kinds = breakdown_ms(steps[v], b)
                print("%-16s %-13s device ms a step: %s, total %.3f" % (
                    case, v, ", ".join("%s %.3f" % kv for kv in sorted(kinds.items())), sum(kinds.values())), flush=True)
            except Exception as e:
                print("%s %s breakdown FAILED: %s" % (case, v, e), flush=True)
    for v in names:
        med = statistics.median(times[v])
        extra = ""
        if hasattr(steps[v], "st"):
            st = steps[v].st
            extra = " captured=%s compiled=%s reason=%s" % (st.captured, st.compiled, st.reason or st.compile_reason)
        print("%-16s %-13s %8.3f ms/step  [%.3f, %.3f]  best-torch/this %s  /floor %s  peak %7.0f MiB  compile %6.1f s%s" % (
            case, v, med, min(times[v]), max(times[v]), "%.3f" % (best / med) if best else "-",
            "%.2f" % (med / total_floor) if total_floor else "-", peak[v], compile_s[v], extra), flush=True)
    del steps
    torch._dynamo.reset()
    torch.cuda.empty_cache()
