"""Probe (issue 26): how far is make_train_step over a torch.compile'd model from torch's best?

    PYTHONPATH=$PWD/python python3 compiled_step_probe.py CASES ROUNDS

Per case (full profile, fp16, fused optimizer), variants built one after another, then timed
in interleaved rounds of one epoch each (device synced around each epoch):
  ro        torch.compile(model, mode="reduce-overhead") under torch.autocast + torch.amp.GradScaler
  co        torch.compile(model) (default mode) under torch.autocast + torch.amp.GradScaler
  step      ampkit.make_train_step(model) (captured)
  step_co   ampkit.make_train_step(torch.compile(model)) (compiled forward/backward, whole step captured)
"""
import statistics, sys, time, traceback
import torch, ampkit
from ampkit.bench import build_case

cases = sys.argv[1].split(",")
rounds = int(sys.argv[2])
variants_wanted = sys.argv[3].split(",") if len(sys.argv) > 3 else ["ro", "co", "step", "step_co"]
dev = "cuda"
print(torch.cuda.get_device_name(), torch.__version__, flush=True)


def torch_loop(model, b, mode):
    cm = torch.compile(model, mode=mode)
    opt = b.new_optimizer(model, fused=True)
    scaler = torch.amp.GradScaler("cuda")
    def step(x, y):
        with torch.autocast("cuda", dtype=torch.float16):
            loss = b.loss_fn(cm(x), y)
        scaler.scale(loss).backward()
        scaler.step(opt); scaler.update(); opt.zero_grad(set_to_none=True)
        return loss
    return step


def ampkit_step(model, b, compiled):
    m = torch.compile(model) if compiled else model
    opt = b.new_optimizer(model, fused=True)
    st = ampkit.make_train_step(m, b.loss_fn, opt, capture=True)
    def step(x, y):
        return st(x, y)
    step.st = st
    return step


builders = {"ro": lambda m, b: torch_loop(m, b, "reduce-overhead"),
            "co": lambda m, b: torch_loop(m, b, None),
            "step": lambda m, b: ampkit_step(m, b, False),
            "step_co": lambda m, b: ampkit_step(m, b, True)}

for case in cases:
    b = build_case(case, "full", device=dev)
    steps, compile_s, peak = {}, {}, {}
    for v in variants_wanted:
        try:
            torch.cuda.synchronize(); t0 = time.perf_counter()
            fn = builders[v](b.new_model(), b)
            for i in range(max(4, b.warmup_steps)):
                x, y = b.batches[i % len(b.batches)]
                fn(x, y)
            torch.cuda.synchronize(); compile_s[v] = time.perf_counter() - t0
            steps[v] = fn
        except Exception as e:
            print("%s %s FAILED: %s" % (case, v, "".join(traceback.format_exception_only(e)).strip()[:600]), flush=True)
    times = {v: [] for v in steps}
    for r in range(rounds):
        order = list(steps)[r % len(steps):] + list(steps)[:r % len(steps)]
        for v in order:
            torch.cuda.synchronize(); torch.cuda.reset_peak_memory_stats()
            t0 = time.perf_counter()
            for x, y in b.batches:
                steps[v](x, y)
            torch.cuda.synchronize()
            times[v].append((time.perf_counter() - t0) * 1e3 / len(b.batches))
            peak[v] = max(peak.get(v, 0), torch.cuda.max_memory_allocated() / 2**20)
    base = min(statistics.median(times[v]) for v in ("ro", "co") if v in times) if any(v in times for v in ("ro", "co")) else None
    for v in times:
        med = statistics.median(times[v])
        extra = ""
        if hasattr(steps[v], "st"):
            extra = " captured=%s reason=%s" % (steps[v].st.captured, steps[v].st.reason)
        print("%-16s %-8s %8.3f ms/step  best-torch/this %s  peak %7.0f MiB  build+warm %6.1f s%s" % (
            case, v, med, "%.3f" % (base / med) if base else "-", peak[v], compile_s[v], extra), flush=True)
