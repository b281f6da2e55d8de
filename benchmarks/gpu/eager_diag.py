"""Where the eager train step's extra time goes on a GPU (issue 25): host or device?

    PYTHONPATH=$PWD/python python3 benchmarks/gpu/eager_diag.py convnet,seed_mlp [fused,fallback]

For each case and setting (benchmarks/eager_step_cost.py's pairs: the hand-written loop and
make_train_step on the same weights, optimizer and scaler settings):
  sync      host syncs per step (torch.cuda.set_sync_debug_mode("warn"), 3 steps each)
  clocks    median wall ms and this thread's CPU ms per step over 7 interleaved epochs
  kernels   CUDA kernels per step and their summed device time (torch.profiler, 3 steps),
            and the kernels the eager step launches that the hand loop does not
  host      cProfile of the eager step: the 12 functions with the most own time
"""
import collections, cProfile, io, pstats, statistics, sys, time, warnings
from pathlib import Path
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import torch
import ampkit.bench as bench
import eager_step_cost as esc

cases = sys.argv[1].split(",")
settings = sys.argv[2].split(",") if len(sys.argv) > 2 else ["fused", "fallback"]
print(torch.cuda.get_device_name(), torch.__version__, flush=True)
for case in cases:
    built = bench.build_case(case, "full", device="cuda")
    for setting in settings:
        steps, batches = esc.make_pair(built, torch.float16, setting)
        for name, fn in steps.items():  # warm
            for x, y in batches[:3]:
                fn(x, y)
        torch.cuda.synchronize()
        syncs = {}
        for name, fn in steps.items():
            with warnings.catch_warnings(record=True) as w:
                warnings.simplefilter("always")
                torch.cuda.set_sync_debug_mode(1)
                for x, y in batches[:3]:
                    fn(x, y)
                torch.cuda.set_sync_debug_mode(0)
            syncs[name] = [str(m.message)[:120] for m in w if "synchroniz" in str(m.message)]
        torch.cuda.synchronize()
        clocks = {n: ([], []) for n in steps}
        for r in range(7):
            for name in (list(steps) if r % 2 == 0 else list(steps)[::-1]):
                wall, cpu = esc.time_ms(steps[name], built, batches)
                clocks[name][0].append(wall); clocks[name][1].append(cpu)
        kern = {}
        for name, fn in steps.items():
            torch.cuda.synchronize()
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
                for x, y in batches[:3]:
                    fn(x, y)
                torch.cuda.synchronize()
            c = collections.Counter(); t = 0.0
            for e in prof.events():
                if e.device_type == torch.autograd.DeviceType.CUDA:
                    c[e.name[:70]] += 1; t += e.device_time_total if hasattr(e, "device_time_total") else e.cuda_time_total
            kern[name] = (c, t)
        print(f"== {case} {setting}  ({len(batches)} batches)")
        for name in steps:
            w, c = clocks[name]
            print(f"  {name:6s} wall {statistics.median(w):8.3f} ms  cpu {statistics.median(c):8.3f} ms  "
                  f"kernels/step {sum(kern[name][0].values())/3:7.1f}  device {kern[name][1]/3/1e3:8.3f} ms  syncs {len(syncs[name])}")
            for s in syncs[name][:3]:
                print("     sync:", s)
        extra = kern["eager"][0] - kern["hand"][0]
        fewer = kern["hand"][0] - kern["eager"][0]
        print("  eager-only kernels (per 3 steps):", dict(extra.most_common(8)))
        print("  hand-only kernels (per 3 steps):", dict(fewer.most_common(8)))
        pr = cProfile.Profile()
        x, y = batches[0]
        torch.cuda.synchronize()
        pr.enable()
        for x, y in batches[:10]:
            steps["eager"](x, y)
        pr.disable()
        torch.cuda.synchronize()
        s = io.StringIO()
        pstats.Stats(pr, stream=s).sort_stats("tottime").print_stats(12)
        print("\n".join(l for l in s.getvalue().splitlines() if l.strip() and ("/" in l or "{" in l))[:3000])
