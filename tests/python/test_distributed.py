"""The scaler on torch's distributed engines, two CPU processes over gloo.

The oracle is torch's own scaler for each engine (``ShardedGradScaler`` for FSDP1,
``GradScaler`` for DDP and FSDP2), run in the same processes on identically seeded
copies (distributed_workers.py). An overflow is planted on rank 1 only.
"""

from __future__ import annotations


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

ENGINES = workers.ENGINES
TIMEOUT_S = 240


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    """Both ranks' results, from one spawn of two processes (bounded in time)."""
    return dict(enumerate(spawn_ranks(workers.run, tmp_path_factory.mktemp("ranks"), TIMEOUT_S)))


@pytest.mark.parametrize("engine", ENGINES)
def test_every_rank_skips_the_overflow_step_with_the_reference_scale(ranks, engine):
    for rank in (0, 1):
        mine, ref = ranks[rank][engine]["ampkit"], ranks[rank][engine]["torch"]
        assert [s["scale"] for s in mine] == [s["scale"] for s in ref], f"rank {rank}"
        assert [s["changed"] for s in mine] == [s["changed"] for s in ref], f"rank {rank}"
        # The planted overflow is skipped everywhere: no rank's parameters move at that step.
        assert not mine[workers.OVERFLOW_AT]["changed"], f"rank {rank} stepped on the overflow"
        assert all(s["changed"] for i, s in enumerate(mine) if i != workers.OVERFLOW_AT)
    # Both ranks agree step by step.
    assert [s["scale"] for s in ranks[0][engine]["ampkit"]] == [
        s["scale"] for s in ranks[1][engine]["ampkit"]
    ]


@pytest.mark.parametrize("engine", ENGINES)
def test_parameters_equal_the_reference_bitwise(ranks, engine):
    for rank in (0, 1):
        for i, (a, b) in enumerate(zip(ranks[rank][engine]["ampkit"], ranks[rank][engine]["torch"])):
            for pa, pb in zip(a["params"], b["params"]):
                assert pa == pb, f"rank {rank}, step {i}: parameters differ from {engine}'s reference"


def test_a_group_without_this_rank_is_refused(ranks):
    assert ranks[0]["misuse"]["not_a_member"] is None  # rank 0 is in the group
    kind, message = ranks[1]["misuse"]["not_a_member"]
    assert kind == "ValueError" and "does not include this rank" in message and "rank 1" in message


def test_mismatched_settings_raise_on_every_rank(ranks):
    for rank in (0, 1):
        kind, message = ranks[rank]["misuse"]["mismatch"]
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
