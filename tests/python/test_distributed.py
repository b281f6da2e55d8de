"""The scaler on torch's distributed engines, CPU processes over gloo.

The oracle is torch's own scaler for each engine (``ShardedGradScaler`` for FSDP1,
``GradScaler`` for DDP and FSDP2), run in the same processes on identically seeded
copies (distributed_workers.py). An overflow is planted on rank 1 only. Two ranks run
DDP, FSDP2 and FSDP1 (both ``use_orig_params`` modes, FULL_SHARD, SHARD_GRAD_OP,
NO_SHARD, three layouts), each through the scaler's three paths; four ranks run
HYBRID_SHARD (2 replicas, each sharded over 2), which two ranks cannot lay out. One
launch per world size runs all its cases. The same matrix on GPUs:
test_distributed_cuda.py.
"""

from __future__ import annotations

import functools

import pytest
import torch

import ampkit

dist = pytest.importorskip("torch.distributed")
if not dist.is_available() or not dist.is_gloo_available():
    pytest.skip("torch.distributed with gloo is not available", allow_module_level=True)

if tuple(int(v) for v in torch.__version__.split("+")[0].split(".")[:2]) < (2, 5):
    # measured on 2.4.1 (cpu tests, no CUDA driver): fully_shard creates CUDA streams
    pytest.skip("FSDP2 (fully_shard) runs on CUDA only in torch < 2.5: these CPU tests need torch >= 2.5",
                allow_module_level=True)

import distributed_workers as workers  # noqa: E402
from gloo_ranks import spawn_ranks  # noqa: E402

TIMEOUT_S = 240


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    """Both ranks' results for every two-rank case, from one spawn (bounded in time)."""
    return spawn_ranks(functools.partial(workers.run, cases="two"), tmp_path_factory.mktemp("ranks"), TIMEOUT_S)


@pytest.fixture(scope="module")
def hybrid_ranks(tmp_path_factory):
    """The four ranks' results for every HYBRID_SHARD case, from one spawn."""
    return spawn_ranks(functools.partial(workers.run, cases="hybrid"), tmp_path_factory.mktemp("hybrid"),
                       TIMEOUT_S, world=4)


@pytest.mark.parametrize("case", workers.CASES, ids=lambda c: c.name)
def test_every_rank_skips_the_one_rank_overflow_as_the_reference(ranks, case):
    workers.assert_agrees([r[case.name] for r in ranks], case)


@pytest.mark.parametrize("case", workers.HYBRID_CASES, ids=lambda c: c.name)
def test_hybrid_shard_every_rank_skips_the_one_rank_overflow_as_the_reference(hybrid_ranks, case):
    workers.assert_agrees([r[case.name] for r in hybrid_ranks], case)


def test_a_group_without_this_rank_is_refused(ranks):
    assert ranks[0]["misuse"]["not_a_member"] is None  # rank 0 is in the group
    kind, message = ranks[1]["misuse"]["not_a_member"]
    assert kind == "ValueError" and "does not include this rank" in message and "rank 1" in message


def test_mismatched_settings_raise_on_every_rank(ranks):
    for result in ranks:
        kind, message = result["misuse"]["mismatch"]
        assert kind == "RuntimeError", message
        assert "differ across the ranks" in message and "rank 0" in message and "rank 1" in message
        assert "2.0" in message and "3.0" in message  # the two growth factors, named


def test_a_process_group_before_init_process_group_is_refused():
    if dist.is_initialized():
        pytest.skip("this process already runs torch.distributed")
    with pytest.raises(RuntimeError, match="init_process_group"):
        ampkit.GradScaler("cpu", process_group=object())


def test_a_single_process_run_makes_no_collective():
    # No process group: step() must not need torch.distributed at all.
    model = torch.nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = ampkit.GradScaler("cpu")
    scaler.scale(model(torch.randn(2, 4)).sum()).backward()
    scaler.step(opt)
    scaler.update()
    assert not dist.is_initialized()
    assert scaler.stats().steps == 1
