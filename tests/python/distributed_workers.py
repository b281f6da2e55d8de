"""What each rank runs in test_distributed.py (spawned processes import this module).

Every engine trains the same small model twice on each rank, with identical seeds: once
with ampkit (autocast + GradScaler), once with torch's reference (torch.autocast + the
scaler torch pairs with that engine: ``ShardedGradScaler`` for FSDP1, ``GradScaler``
otherwise). An overflow is planted on rank 1 only, at step ``OVERFLOW_AT``:
in the loss for DDP (its all-reduce spreads it, as a real overflow would), in rank 1's
local gradient shard for FSDP1/FSDP2 (where only a combined flag can make rank 0 see it).
Each rank returns, per step, whether it skipped, the scale, and its parameters.
"""

from __future__ import annotations

import copy

import torch
import torch.distributed as dist

import ampkit
from gloo_ranks import run_rank

ENGINES = ("ddp", "fsdp1", "fsdp2", "fsdp2_fused")
STEPS = 5
OVERFLOW_AT = 2
INIT_SCALE = 1024.0


def _model(outputs: int = 4):
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, outputs))


def _wrap(engine: str, model: torch.nn.Module) -> torch.nn.Module:
    if engine == "ddp":
        return torch.nn.parallel.DistributedDataParallel(model)
    if engine == "fsdp1":
        from torch.distributed.fsdp import FullyShardedDataParallel

        return FullyShardedDataParallel(model, device_id=torch.device("cpu"))
    try:
        from torch.distributed.fsdp import fully_shard
    except ImportError:  # torch < 2.6: FSDP2 lived here
        from torch.distributed._composable.fsdp import fully_shard

    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer)
    return fully_shard(model)


def _scaler(engine: str, kind: str):
    if kind == "ampkit":
        return ampkit.GradScaler("cpu", init_scale=INIT_SCALE, growth_interval=2)
    if engine == "fsdp1":
        from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

        return ShardedGradScaler("cpu", init_scale=INIT_SCALE, growth_interval=2)
    return torch.amp.GradScaler("cpu", init_scale=INIT_SCALE, growth_interval=2)


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def train(engine: str, kind: str, rank: int) -> list[dict]:
    """``fsdp2_fused``: FSDP2 with a one-output head, whose (1, 16) weight and (1,) bias
    leave rank 1 empty local shards, and fused AdamW (the scaler's read-only check)."""
    fused = engine == "fsdp2_fused"
    engine = "fsdp2" if fused else engine
    model = _wrap(engine, copy.deepcopy(_model(1 if fused else 4)))
    opt = (torch.optim.AdamW(model.parameters(), lr=0.1, fused=True) if fused
           else torch.optim.SGD(model.parameters(), lr=0.1))
    scaler = _scaler(engine, kind)
    region = ampkit.autocast if kind == "ampkit" else torch.autocast
    data = torch.Generator().manual_seed(100 + rank)
    out = []
    for step in range(STEPS):
        x = torch.randn(4, 8, generator=data)
        opt.zero_grad()
        with region("cpu", dtype=torch.bfloat16):
            loss = model(x).float().pow(2).mean()
        if engine == "ddp" and step == OVERFLOW_AT and rank == 1:
            loss = loss * float("inf")
        before = [_local(p).detach().clone() for p in model.parameters()]
        scaler.scale(loss).backward()
        if engine != "ddp" and step == OVERFLOW_AT and rank == 1:
            grad = next(p.grad for p in model.parameters() if p.grad is not None)
            _local(grad).view(-1)[0] = float("inf")
        scaler.step(opt)
        scaler.update()
        after = [_local(p).detach().clone() for p in model.parameters()]
        out.append({
            "scale": scaler.get_scale(),
            "changed": any(not torch.equal(a, b) for a, b in zip(before, after)),
            "params": [a.tolist() for a in after],  # values, not shared tensors, cross the queue
        })
    return out


def misuse(rank: int) -> dict:
    """Bad distributed input: each entry is the error (type, message) or None."""
    found = {}
    others = dist.new_group(ranks=[0])  # every rank must call new_group; rank 1 is not in it
    try:
        ampkit.GradScaler("cpu", process_group=others)
        found["not_a_member"] = None
    except Exception as e:  # noqa: BLE001 - reported to the test
        found["not_a_member"] = (type(e).__name__, str(e))
    model = torch.nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = ampkit.GradScaler("cpu", growth_factor=2.0 + rank)  # differs on rank 1
    scaler.scale(model(torch.randn(2, 4)).sum()).backward()
    try:
        scaler.step(opt)
        found["mismatch"] = None
    except Exception as e:  # noqa: BLE001
        found["mismatch"] = (type(e).__name__, str(e))
    return found


def _body(rank: int) -> dict:
    result = {}
    for engine in ENGINES:
        result[engine] = {kind: train(engine, kind, rank) for kind in ("ampkit", "torch")}
    result["misuse"] = misuse(rank)
    return result


def run(rank: int, world: int, port: int, out_dir: str) -> None:
    """The spawned entry point: every engine, then the misuse cases; results pickled to
    ``out_dir/rank<r>.pkl`` (gloo_ranks.run_rank)."""
    run_rank(rank, world, port, out_dir, _body)
