"""AMP training steps on torch's distributed engines, one process per GPU (torchrun).

    torchrun --nproc-per-node N benchmarks/gpu/distributed_step.py \
        [--case transformer] [--engines ddp,fsdp2] [--variants torch_amp,ampkit_amp,ampkit_step] \
        [--repeats 5] [--json PATH]

Every rank builds the case's model (the same seed on every rank), wraps it in the engine
and trains it with each variant in turn:

- ``torch_amp``:   torch.autocast + torch.amp.GradScaler, the case's optimizer
- ``ampkit_amp``:  ampkit.autocast + ampkit.GradScaler, the case's optimizer
- ``ampkit_step``: ampkit.make_train_step with the fused (capturable) optimizer: captured in
  a CUDA graph where that works, eager otherwise (the record says which, and why)

DDP is built on a side stream and gets 11 eager warm-up steps before a capture (what torch's
CUDA-graph notes ask of DDP); NCCL's async error handling is off so that the collectives
can be captured. Each repeat times one pass over the case's batches after a warm-up, with
the device synchronized and the ranks at a barrier before each clock read; the per-step
time is the slowest rank's. Rank 0 prints and writes the results; nothing is asserted.
Throughput = world size x batch / step time; scaling efficiency comes from comparing a
run with N processes against one with 1 (benchmarks/gpu/distributed_all.sh does both).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

os.environ.setdefault("TORCH_NCCL_ASYNC_ERROR_HANDLING", "0")  # before init: capturable NCCL

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

import ampkit  # noqa: E402
import ampkit.bench as bench  # noqa: E402

DDP_WARMUP = 11  # eager DDP iterations before a capture (torch's CUDA graphs notes)


BUCKET_VIEW = False  # --bucket-view: DDP(gradient_as_bucket_view=True), for every variant


def wrap(engine, model):
    if engine == "ddp":
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            wrapped = torch.nn.parallel.DistributedDataParallel(
                model, device_ids=[torch.cuda.current_device()], gradient_as_bucket_view=BUCKET_VIEW)
        torch.cuda.current_stream().wait_stream(side)
        return wrapped
    if engine == "fsdp2":
        from torch.distributed.fsdp import fully_shard

        for m in model.modules():
            if m is not model and type(m).__name__ in ("TransformerEncoderLayer", "EncoderLayer", "Block"):
                fully_shard(m)
        return fully_shard(model)
    if engine == "none":
        return model
    raise ValueError(f"unknown engine {engine!r}; choose ddp, fsdp2 or none")


def make(variant, engine, built):
    model = wrap(engine, built.new_model())
    fused = variant == "ampkit_step"
    opt = built.new_optimizer(model, fused=fused)
    if variant == "torch_amp":
        region = lambda: torch.autocast("cuda", dtype=torch.float16)  # noqa: E731
        return bench.loop_step(model, built.loss_fn, opt, region, torch.amp.GradScaler("cuda")), None
    if variant == "ampkit_amp":
        region = lambda: ampkit.autocast("cuda", dtype=torch.float16)  # noqa: E731
        return bench.loop_step(model, built.loss_fn, opt, region, ampkit.GradScaler("cuda")), None
    if variant == "ampkit_step":
        warmup = DDP_WARMUP if engine == "ddp" else 3
        step = ampkit.make_train_step(model, built.loss_fn, opt, scaler=ampkit.GradScaler("cuda"),
                                      autocast=dict(device_type="cuda", dtype=torch.float16), warmup=warmup)
        return step, step
    raise ValueError(f"unknown variant {variant!r}")


def check_capture(engine, built, steps=12):
    """A captured make_train_step against an eager one on the same data: losses and this
    rank's parameters (its shard under FSDP2), bitwise, and for DDP the replicas agreeing
    across ranks. Returns a dict of findings."""
    runs = {}
    for capture in (False, "again", "auto"):  # "again": a second eager run, for determinism
        torch.manual_seed(0)
        model = wrap(engine, built.new_model())
        opt = built.new_optimizer(model, fused=True)
        step = ampkit.make_train_step(model, built.loss_fn, opt, scaler=ampkit.GradScaler("cuda"),
                                      autocast=dict(device_type="cuda", dtype=torch.float16),
                                      capture=False if capture == "again" else capture,
                                      warmup=DDP_WARMUP if engine == "ddp" else 3)
        losses = [step(*built.batches[i % built.num_batches]).item() for i in range(steps)]
        params = [(p.to_local() if hasattr(p, "to_local") else p).detach().clone() for p in model.parameters()]
        runs[capture] = (losses, params, step.captures)
    (le, pe, _), (lc, pc, captures) = runs[False], runs["auto"]
    la, pa, _ = runs["again"]
    out = {"eager_repeatable": la == le and all(torch.equal(a, b) for a, b in zip(pe, pa)),
           "captured": captures > 0, "losses_equal": le == lc,
           "params_equal": all(torch.equal(a, b) for a, b in zip(pe, pc)),
           "max_param_diff": max(float((a.float() - b.float()).abs().max()) for a, b in zip(pe, pc)),
           "last_loss_eager": le[-1], "last_loss_captured": lc[-1]}
    if engine == "ddp":
        total = torch.stack([p.double().sum() for p in pc]).sum().reshape(1)
        both = [torch.zeros_like(total) for _ in range(dist.get_world_size())]
        dist.all_gather(both, total)
        out["replicas_agree"] = all(torch.equal(both[0], t) for t in both)
    flags = torch.tensor([float(out["losses_equal"]), float(out["params_equal"])], device="cuda")
    dist.all_reduce(flags, op=dist.ReduceOp.MIN)  # every rank's verdict
    out["all_ranks_equal"] = bool(flags.min().item() == 1.0)
    return out


def timed_pass(step, built):
    torch.cuda.synchronize()
    dist.barrier()
    t0 = time.perf_counter()
    for x, y in built.batches:
        step(x, y)
    torch.cuda.synchronize()
    elapsed = torch.tensor([(time.perf_counter() - t0) * 1e3 / built.num_batches], device="cuda")
    dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)  # the slowest rank sets the pace
    return elapsed.item()


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--case", default="transformer")
    ap.add_argument("--profile", default="full")
    ap.add_argument("--engines", default="ddp,fsdp2")
    ap.add_argument("--variants", default="torch_amp,ampkit_amp,ampkit_step")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--json", default=None)
    ap.add_argument("--bucket-view", action="store_true", help="DDP(gradient_as_bucket_view=True)")
    ap.add_argument("--check", action="store_true", help="also compare captured and eager steps")
    a = ap.parse_args(argv)
    global BUCKET_VIEW
    BUCKET_VIEW = a.bucket_view
    local = int(os.environ.get("LOCAL_RANK", 0))
    torch.cuda.set_device(local)
    dist.init_process_group("nccl", device_id=torch.device("cuda", local))
    rank, world = dist.get_rank(), dist.get_world_size()
    built = bench.build_case(a.case, a.profile, seed=0, device="cuda")
    batch = built.batches[0][0].shape[0]
    card = torch.cuda.get_device_name()
    records = []
    for engine in a.engines.split(",") if a.check else ():
        try:
            found = check_capture(engine, built)
        except Exception as e:  # noqa: BLE001 - recorded
            found = {"error": f"{type(e).__name__}: {e}"[:600]}
        record = {"check": "captured_vs_eager", "engine": engine, "world_size": world, **found}
        records.append(record)
        if rank == 0:
            print(json.dumps(record), flush=True)
    for engine in a.engines.split(","):
        for variant in a.variants.split(","):
            record = {"case": a.case, "profile": a.profile, "engine": engine, "variant": variant,
                      "world_size": world, "ddp_bucket_view": BUCKET_VIEW, "card": card, "torch": torch.__version__}
            step = train_step = None
            try:
                step, train_step = make(variant, engine, built)
                for i in range(max(3, built.warmup_steps) + (DDP_WARMUP if train_step else 0)):
                    step(*built.batches[i % built.num_batches])
                samples = [timed_pass(step, built) for _ in range(a.repeats)]
                ms = statistics.median(samples)
                record.update(ms_per_step=ms, samples=samples,
                              samples_per_s=world * batch * 1e3 / ms)
                if train_step is not None:
                    record.update(captured=train_step.captures > 0, replays=train_step.replays,
                                  eager_reason=train_step.reason)
            except Exception as e:  # noqa: BLE001 - recorded, the next variant runs
                record["error"] = f"{type(e).__name__}: {e}"[:600]
                torch.cuda.synchronize()
            records.append(record)
            if rank == 0:
                shown = {k: v for k, v in record.items() if k not in ("samples", "card", "torch")}
                print(json.dumps(shown), flush=True)
            del step, train_step
            torch.cuda.empty_cache()
    if rank == 0 and a.json:
        with open(a.json, "w") as f:
            json.dump({"card": card, "torch": torch.__version__, "world_size": world, "records": records}, f, indent=1)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
