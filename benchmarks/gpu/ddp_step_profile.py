"""Where a DDP training step's GPU time goes: torch_amp eager against the captured ampkit_step.

    torchrun --standalone --nproc-per-node 1 benchmarks/gpu/ddp_step_profile.py \
        [--case transformer] [--profile full] [--options default,gradient_as_bucket_view=true]

For each DDP configuration (``--options``: ';'-separated specs as ``run.py --ddp-options``
takes them), times in one process, the variants interleaved round by round:

    torch_amp            torch.autocast + torch.amp.GradScaler, the case's optimizer (eager)
    torch_amp_fused      the same with ampkit_step's optimizer (fused, capturable AdamW)
    ampkit_step          ampkit.make_train_step (captured), fused AdamW, ampkit.GradScaler
    ampkit_step_nocheck  the same with the scaler's gradient check replaced by a constant
                         flag: NOT exact, only to measure what the check costs in the graph
    ampkit_step_plain    the captured step on the bare model (no DDP): what DDP adds

then runs torch.profiler over a few steps of torch_amp and ampkit_step and prints the
device kernels per step (count, total us), their sum against the step's wall time (the
idle gaps), and the top kernels. Printed, never asserted; with more than one process
every rank runs, rank 0 prints (a step's time is rank 0's).
"""
from __future__ import annotations

import argparse
import collections
import os
import statistics
import subprocess
import sys
import time

import torch
from torch.profiler import ProfilerActivity, profile

import ampkit
import ampkit.bench as bench
from eager_vs_torch import epoch  # (this folder: the same timed epoch as the eager loops)

DTYPE = {"cuda": torch.float16, "cpu": torch.bfloat16}  # (the CPU: a smoke test with gloo)
VARIANTS = ("torch_amp", "torch_amp_fused", "ampkit_step", "ampkit_step_nocheck", "ampkit_step_plain")


class NoCheckScaler(ampkit.GradScaler):
    """The scaler with its gradient check replaced by a constant 0.0 flag (no gradient read)."""

    def found_inf(self, grouped, unscale):
        flags = getattr(self, "_zero_flags", None)
        if flags is None:
            flags = self._zero_flags = {d: torch.zeros((), device=d) for d, _ in grouped}
        return dict(flags)


def build(name, built, engine, device):
    torch.manual_seed(0)
    model = built.new_model()
    if name != "ampkit_step_plain":
        model = bench.Placement(engine, device).wrap(model)
    kw = dict(init_scale=bench.INIT_SCALE, growth_interval=bench.GROWTH_INTERVAL)
    if name.startswith("torch_amp"):
        opt = built.new_optimizer(model, fused=name.endswith("fused"))
        scaler = torch.amp.GradScaler(device, **kw)
        region = lambda: torch.autocast(device, dtype=DTYPE[device])  # noqa: E731
        return bench.loop_step(model, built.loss_fn, opt, region, scaler)
    opt = built.new_optimizer(model, fused=True)
    scaler = (NoCheckScaler if name.endswith("nocheck") else ampkit.GradScaler)(device, **kw)
    return ampkit.make_train_step(model, built.loss_fn, opt, scaler=scaler,
                                  autocast=dict(device_type=device, dtype=DTYPE[device]),
                                  warmup=bench.Placement(engine, device).train_step_warmup())


def kernel_table(step, built, steps, rank, title, trace=None):
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if built.device == "cuda" else [])
    with profile(activities=acts) as prof:
        bench.synchronize(built.device)
        t0 = time.perf_counter()
        for i in range(steps):
            step(*built.batches[i % built.num_batches])
        bench.synchronize(built.device)
        wall = (time.perf_counter() - t0) * 1e6 / steps
    if trace and rank == 0:  # the timeline (chrome trace, gzipped) of the profiled steps
        prof.export_chrome_trace(trace)
        subprocess.run(["gzip", "-f", trace], check=False)
    per = collections.defaultdict(lambda: [0, 0.0])
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            k = per[e.name]
            k[0] += 1
            k[1] += e.time_range.elapsed_us()
    if rank:
        return
    total = sum(v[1] for v in per.values()) / steps
    count = sum(v[0] for v in per.values()) / steps
    print(f"\n== {title}: {count:.0f} kernels/step, kernel time {total:.0f} us/step, "
          f"wall under the profiler {wall:.0f} us/step")
    for name, (c, us) in sorted(per.items(), key=lambda kv: -kv[1][1])[:40]:
        print(f"  {us / steps:9.1f} us {c / steps:6.1f}x  {name[:110]}")


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--case", default="transformer")
    ap.add_argument("--profile", default="full")
    ap.add_argument("--options", default="default;gradient_as_bucket_view=true")
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--prof-steps", type=int, default=5)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--trace-dir", default=None,
                    help="write rank 0's chrome traces of the profiled steps here (gzipped)")
    a = ap.parse_args(argv)
    os.environ.setdefault("TORCH_NCCL_ASYNC_ERROR_HANDLING", "0")
    import torch.distributed as dist

    if a.device == "cuda":
        local = int(os.environ.get("LOCAL_RANK", 0))
        torch.cuda.set_device(local)
        dist.init_process_group("nccl", device_id=torch.device("cuda", local))
    else:
        dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    built = bench.build_case(a.case, a.profile, seed=0, device=a.device)
    if rank == 0:
        card = torch.cuda.get_device_name() if a.device == "cuda" else "cpu"
        print(f"{card} x{world}, torch {torch.__version__}, "
              f"case {a.case}/{a.profile}", flush=True)
    names = [v for v in a.variants.split(",") if v]
    for spec in a.options.split(";"):
        engine = bench.Engine.parse("ddp", spec)
        steps = {n: build(n, built, engine, a.device) for n in names}
        for n, step in steps.items():
            for i in range(bench.Placement(engine, a.device).train_step_warmup() + 3):
                step(*built.batches[i % built.num_batches])
        samples = {n: [] for n in names}
        for r in range(a.rounds):
            order = names[r % len(names):] + names[:r % len(names)]
            for n in order:
                dist.barrier()
                samples[n].append(epoch(steps[n], built))
        if rank == 0:
            print(f"\n# {engine.label()}, {world} process(es): ms/step, median of {a.rounds} epochs "
                  f"of {built.num_batches} steps [min, max]; ratio: torch_amp / variant")
            base = statistics.median(samples.get("torch_amp", [float("nan")]))
            for n in names:
                m = statistics.median(samples[n])
                cap = getattr(steps[n], "captured", None)
                print(f"  {n:<22} {m:8.3f} [{min(samples[n]):.3f}, {max(samples[n]):.3f}]  "
                      f"ratio {base / m:.3f}  captured={cap}", flush=True)
        for n in ("torch_amp", "ampkit_step"):
            if n in steps:
                trace = None if not a.trace_dir else os.path.join(
                    a.trace_dir, "trace-%s-%s-x%d.json" % ("_".join(f"{k}" for k, _ in engine.options) or "default",
                                                        n, world))
                kernel_table(steps[n], built, a.prof_steps, rank, f"{engine.label()} / {n}", trace)
        del steps
        if a.device == "cuda":
            torch.cuda.empty_cache()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
