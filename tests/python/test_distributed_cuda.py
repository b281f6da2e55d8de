"""The scaler on torch's distributed engines on GPUs: test_distributed.py's matrix, one
process a GPU over NCCL, float16 autocast.

Two GPUs run every two-rank case (DDP, FSDP2, FSDP1 in both ``use_orig_params`` modes,
FULL_SHARD, SHARD_GRAD_OP, NO_SHARD, three layouts; each through the scaler's three
paths), HYBRID_SHARD in the two layouts two ranks allow (sharded over both, replicated
over both), and FSDP1 with CPU offload (the flag on the CPU, combined on the GPU). Four
GPUs or more also run the 2 x 2 HYBRID_SHARD cases. The oracle, the planted overflow
and the checks are test_distributed.py's (distributed_workers.py).
"""

from __future__ import annotations

import functools

import pytest
import torch
import torch.distributed as dist

import distributed_workers as workers
from gloo_ranks import spawn_ranks

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(torch.cuda.device_count() < 2,
                       reason=f"needs two CUDA GPUs or more ({torch.cuda.device_count()} here)"),
    pytest.mark.skipif(not dist.is_available() or not dist.is_nccl_available(),
                       reason="needs torch.distributed with NCCL"),
]

TIMEOUT_S = 420
TWO_GPU_CASES = workers.CASES + workers.HYBRID_CASES_ON_TWO + workers.OFFLOAD_CASES


@pytest.fixture(scope="module")
def gpu_ranks(tmp_path_factory):
    """Both GPUs' results for every two-rank case, from one spawn (bounded in time)."""
    return spawn_ranks(functools.partial(workers.run, cases="two_gpus", device_type="cuda"),
                       tmp_path_factory.mktemp("gpu_ranks"), TIMEOUT_S)


@pytest.fixture(scope="module")
def gpu_hybrid_ranks(tmp_path_factory):
    """Four GPUs' results for the 2 x 2 HYBRID_SHARD cases, from one spawn."""
    if torch.cuda.device_count() < 4:
        pytest.skip(f"2 x 2 HYBRID_SHARD needs four GPUs ({torch.cuda.device_count()} here); "
                    "two GPUs run its degenerate layouts")
    return spawn_ranks(functools.partial(workers.run, cases="hybrid", device_type="cuda"),
                       tmp_path_factory.mktemp("gpu_hybrid"), TIMEOUT_S, world=4)


@pytest.mark.parametrize("case", TWO_GPU_CASES, ids=lambda c: c.name)
def test_every_gpu_skips_the_one_rank_overflow_as_the_reference(gpu_ranks, case):
    workers.assert_agrees([r[case.name] for r in gpu_ranks], case)


@pytest.mark.parametrize("case", workers.HYBRID_CASES, ids=lambda c: c.name)
def test_hybrid_shard_on_four_gpus_skips_the_one_rank_overflow_as_the_reference(gpu_hybrid_ranks, case):
    workers.assert_agrees([r[case.name] for r in gpu_hybrid_ranks], case)
