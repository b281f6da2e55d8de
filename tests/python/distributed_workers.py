"""What each rank runs in test_distributed.py and test_distributed_cuda.py (spawned
processes import this module).

Every case trains the same small model twice on each rank, with identical seeds: once
with ampkit (autocast + GradScaler), once with torch's reference (torch.autocast + the
scaler torch pairs with that engine: ``ShardedGradScaler`` for FSDP1, ``GradScaler``
otherwise). An overflow is planted on rank ``INF_RANK`` only, at step ``OVERFLOW_AT``:
in the loss for DDP (its all-reduce spreads it, as a real overflow would), in that rank's
local gradient shard for FSDP1/FSDP2 (where only a combined flag can make the other ranks
see it; under NO_SHARD and HYBRID_SHARD after the gradients' own reduction, so that the
other ranks do not see it either). Each rank returns, per step, the scaler's scale and
growth tracker, which optimizers moved, the bits of its local parameters, and whether
its own gradients held the inf.

The cases (``Case``): the engine, the scaler path (``step``: step() unscales plain SGD;
``unscale_``: unscale_() first, then step(); ``fused``: fused AdamW, and fused SGD for the
biases of the split layout, whose step gets ``grad_scale``/``found_inf`` and whose check
only reads the gradients), and for FSDP1 the
sharding strategy, ``use_orig_params`` and the layout (the root wrapped; only the first
layer wrapped, the optimizer over managed and unmanaged parameters; or two optimizers,
weights and biases, where under ``use_orig_params=True`` the ranks whose shard holds no
bias have no bias gradient at all).
"""

from __future__ import annotations

import copy
import dataclasses

import torch
import torch.distributed as dist

import ampkit
from gloo_ranks import run_rank

STEPS = 5
OVERFLOW_AT = 2
INF_RANK = 1
INIT_SCALE = 1024.0
PATHS = ("step", "unscale_", "fused")
STRATEGIES = ("FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD")


@dataclasses.dataclass(frozen=True)
class Case:
    engine: str  # "ddp", "fsdp1" or "fsdp2"
    path: str  # one of PATHS
    strategy: str = ""  # FSDP1's ShardingStrategy
    orig_params: bool = False  # FSDP1's use_orig_params
    layout: str = "whole"  # FSDP1: "whole" (the root wrapped), "partial" (the first layer only), "split"
    mesh: tuple = ()  # HYBRID_SHARD: (replicate, shard) sizes
    outputs: int = 4  # the head's outputs (1: FSDP2 leaves the last rank empty shards)
    offload: bool = False  # FSDP1 CPUOffload (GPUs only): gradients on the CPU, the scale on the GPU

    @property
    def name(self) -> str:
        parts = [self.engine]
        if self.engine == "fsdp1":
            parts += [self.strategy, "orig" if self.orig_params else "flat"]
            if self.mesh:
                parts.append("x".join(map(str, self.mesh)))
            if self.layout != "whole":
                parts.append(self.layout)
            if self.offload:
                parts.append("offload")
        return "-".join(parts + [self.path])


def _fsdp1_cases(strategy: str, mesh: tuple = ()) -> list[Case]:
    cases = [Case("fsdp1", p, strategy, o, mesh=mesh) for o in (False, True) for p in PATHS]
    return cases + [Case("fsdp1", p, strategy, True, "split", mesh) for p in PATHS]


# Two ranks: every engine, path, strategy and layout but HYBRID_SHARD.
CASES = (
    [Case("ddp", p) for p in PATHS]
    + [Case("fsdp2", p, outputs=1 if p == "fused" else 4) for p in PATHS]
    + [c for s in STRATEGIES for c in _fsdp1_cases(s)]
    + [Case("fsdp1", p, "FULL_SHARD", o, "partial") for o in (False, True) for p in ("step", "fused")]
)
# HYBRID_SHARD honestly needs four ranks: 2 replicas of a model sharded over 2.
HYBRID_CASES = _fsdp1_cases("HYBRID_SHARD", (2, 2))
# On two GPUs, the two degenerate layouts it can have: sharded over both, replicated over both.
HYBRID_CASES_ON_TWO = _fsdp1_cases("HYBRID_SHARD", (1, 2)) + _fsdp1_cases("HYBRID_SHARD", (2, 1))
# GPUs only: each rank's flag lives on the CPU and is combined on its GPU (no fused path:
# a fused CPU optimizer cannot take a flag on the GPU, with either scaler).
OFFLOAD_CASES = [Case("fsdp1", p, "FULL_SHARD", o, offload=True) for o in (False, True) for p in ("step", "unscale_")]


def _model(outputs: int):
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, outputs))


def _fully_shard():
    try:
        from torch.distributed.fsdp import fully_shard
    except ImportError:  # torch < 2.6: FSDP2 lived here
        from torch.distributed._composable.fsdp import fully_shard
    return fully_shard


def _wrap(case: Case, model: torch.nn.Module, device: torch.device) -> torch.nn.Module:
    if case.engine == "ddp":
        model = model.to(device)
        return torch.nn.parallel.DistributedDataParallel(
            model, device_ids=[device.index] if device.type == "cuda" else None)
    from torch.distributed.device_mesh import init_device_mesh

    if case.engine == "fsdp2":
        fully_shard = _fully_shard()
        # the mesh on this run's device (left out, it would be the GPU's wherever there is one)
        mesh = init_device_mesh(device.type, (dist.get_world_size(),))
        model = model.to(device)
        for layer in model:
            if isinstance(layer, torch.nn.Linear):
                fully_shard(layer, mesh=mesh)
        return fully_shard(model, mesh=mesh)
    from torch.distributed.fsdp import CPUOffload, FullyShardedDataParallel, ShardingStrategy

    options = dict(use_orig_params=case.orig_params, device_id=device,
                   sharding_strategy=ShardingStrategy[case.strategy])
    if case.offload:
        options["cpu_offload"] = CPUOffload(offload_params=True)
    if case.mesh:
        options["device_mesh"] = init_device_mesh(device.type, case.mesh,
                                                  mesh_dim_names=("replicate", "shard"))
    if case.layout == "partial":  # the head stays a plain module, on this rank's device
        model[0] = FullyShardedDataParallel(model[0], **options)
        return model.to(device)
    return FullyShardedDataParallel(model, **options)


def _optimizers(case: Case, model: torch.nn.Module) -> list[torch.optim.Optimizer]:
    fused = case.path == "fused"
    if case.layout != "split":
        params = list(model.parameters())
        return [torch.optim.AdamW(params, lr=0.1, fused=True) if fused
                else torch.optim.SGD(params, lr=0.1, momentum=0.9)]
    named = list(model.named_parameters())
    weights = [p for n, p in named if n.endswith("weight")]
    biases = [p for n, p in named if n.endswith("bias")]
    return [torch.optim.AdamW(weights, lr=0.1, fused=True) if fused else torch.optim.SGD(weights, lr=0.1),
            torch.optim.SGD(biases, lr=0.05, momentum=0.9, fused=fused or None)]


def _reference_sharded_scaler():
    """torch's ShardedGradScaler, with the one thing its fused path lacks.

    Its ``unscale_`` all-reduces the inf flag over the ranks; the check its ``step`` makes
    for a fused optimizer (``_check_inf_per_device``) does not, so under a one-rank
    overflow the other ranks step (and unscale_ first is no way round: its flag has shape
    (1,), on which fused AdamW's step raises). The reference all-reduces (MAX) that
    check's flags too, and changes nothing else."""
    from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

    class Reference(ShardedGradScaler):
        def _check_inf_per_device(self, optimizer):
            found = super()._check_inf_per_device(optimizer)
            for flag in found.values():
                dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self.process_group)
            return found

    return Reference


def _scaler(case: Case, kind: str, device: torch.device):
    options = dict(init_scale=INIT_SCALE, growth_interval=2)
    if kind == "ampkit":
        return ampkit.GradScaler(device.type, **options)
    if case.engine == "fsdp1":
        return _reference_sharded_scaler()(device.type, **options)
    return torch.amp.GradScaler(device.type, **options)


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def _bits(t: torch.Tensor) -> list[int]:
    return _local(t).detach().reshape(-1).view(torch.int32).tolist()


def train(case: Case, kind: str, rank: int, device: torch.device, dtype: torch.dtype) -> list[dict]:
    model = _wrap(case, copy.deepcopy(_model(case.outputs)), device)
    opts = _optimizers(case, model)
    scaler = _scaler(case, kind, device)
    region = ampkit.autocast if kind == "ampkit" else torch.autocast
    unscale_first = case.path == "unscale_"
    data = torch.Generator().manual_seed(100 + rank)
    out = []
    for step in range(STEPS):
        x = torch.randn(4, 8, generator=data).to(device)
        for opt in opts:
            opt.zero_grad()
        with region(device.type, dtype=dtype):
            loss = model(x).float().pow(2).mean()
        planted = step == OVERFLOW_AT and rank == INF_RANK
        if planted and case.engine == "ddp":
            loss = loss * float("inf")
        before = [[_local(p).detach().clone() for g in o.param_groups for p in g["params"]] for o in opts]
        scaler.scale(loss).backward()
        if planted and case.engine != "ddp":  # into the last optimizer's first local gradient
            grad = next(_local(p.grad) for g in opts[-1].param_groups for p in g["params"]
                        if p.grad is not None and _local(p.grad).numel())
            grad.view(-1)[0] = float("inf")
        if step == OVERFLOW_AT:  # this rank's own gradients, before any flag is combined
            saw_inf = any(not bool(torch.isfinite(_local(p.grad)).all()) for o in opts
                          for g in o.param_groups for p in g["params"] if p.grad is not None)
        for opt in opts:
            if unscale_first:
                scaler.unscale_(opt)
            scaler.step(opt)
        scaler.update()
        state = scaler.state_dict()
        after = [[_local(p).detach() for g in o.param_groups for p in g["params"]] for o in opts]
        out.append({
            "scale": state["scale"],
            "tracker": state["_growth_tracker"],
            "changed": [any(not torch.equal(a, b) for a, b in zip(x, y)) for x, y in zip(before, after)],
            "holds": [any(a.numel() for a in x) for x in after],
            "params": [_bits(p) for p in model.parameters()],
            "saw_inf": step == OVERFLOW_AT and saw_inf,
        })
    return out


def assert_agrees(per_rank: list[dict], case: Case) -> None:
    """What both suites check of a case, from every rank's ``train`` records (ampkit's and
    the reference's): each rank skips, scales and steps as the reference on that rank,
    bitwise; the ranks agree; and the case did what it is for (the overflow was planted,
    seen by its own rank alone where a combined flag is needed, skipped and backed off)."""
    steps = range(STEPS)
    for rank, runs in enumerate(per_rank):
        mine, ref = runs["ampkit"], runs["torch"]
        for i in steps:
            for key in ("scale", "tracker", "changed"):
                assert mine[i][key] == ref[i][key], f"rank {rank}, step {i}: {key} {mine[i][key]} != {ref[i][key]}"
            assert mine[i]["params"] == ref[i]["params"], f"rank {rank}, step {i}: parameters differ"
        # The planted overflow is skipped where it lies (the last optimizer's), on every
        # rank; every other step moves each optimizer's local values where it has some.
        for i in steps:
            expected = list(mine[i]["holds"])
            if i == OVERFLOW_AT:
                expected[-1] = False
            assert mine[i]["changed"] == expected, f"rank {rank}, step {i}: moved {mine[i]['changed']}, expected {expected}"
        seen = mine[OVERFLOW_AT]["saw_inf"]
        assert seen == (rank == INF_RANK or case.engine == "ddp"), f"rank {rank} saw the inf: {seen}"
    first = per_rank[0]["ampkit"]
    for rank, runs in enumerate(per_rank):
        for key in ("scale", "tracker"):
            assert [s[key] for s in runs["ampkit"]] == [s[key] for s in first], f"rank {rank}'s {key} parts from rank 0's"
    assert first[OVERFLOW_AT]["scale"] == first[OVERFLOW_AT - 1]["scale"] / 2  # backed off
    if case.layout == "split" and case.strategy != "NO_SHARD" and (not case.mesh or case.mesh[1] > 1):
        # the case this layout is for: a rank whose shard holds no bias has no bias gradient
        assert any(not runs["ampkit"][0]["holds"][-1] for runs in per_rank)


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


def _body(rank: int, cases: list[Case], device_type: str, with_misuse: bool) -> dict:
    device = torch.device(device_type, rank) if device_type == "cuda" else torch.device("cpu")
    dtype = torch.float16 if device_type == "cuda" else torch.bfloat16
    result = {c.name: {kind: train(c, kind, rank, device, dtype) for kind in ("ampkit", "torch")}
              for c in cases}
    if with_misuse:
        result["misuse"] = misuse(rank)
    return result


def run(rank: int, world: int, port: int, out_dir: str, cases: str = "two",
        device_type: str = "cpu") -> None:
    """The spawned entry point (bind ``cases``/``device_type`` with functools.partial).

    ``cases``: ``"two"`` (CASES and the misuse cases, two ranks), ``"hybrid"``
    (HYBRID_CASES, four ranks) or ``"two_gpus"`` (CASES, HYBRID_CASES_ON_TWO and
    OFFLOAD_CASES). Results pickled to ``out_dir/rank<r>.pkl`` (gloo_ranks.run_rank);
    NCCL on ``"cuda"``."""
    chosen = {"two": CASES, "hybrid": HYBRID_CASES,
              "two_gpus": CASES + HYBRID_CASES_ON_TWO + OFFLOAD_CASES}[cases]
    backend = "nccl" if device_type == "cuda" else "gloo"
    run_rank(rank, world, port, out_dir,
             lambda r: _body(r, chosen, device_type, with_misuse=cases == "two"), backend=backend)
