"""The benchmark's peak memory counts cuBLAS's workspaces alike in every variant (CUDA).

cuBLAS keeps a workspace per (handle, stream) for the life of the process, made by the
first matmul there. ``reset_peak_memory`` makes them before a measurement starts
(``prime_library_workspaces``), so that no variant's turn makes them: the Python runner's
per-turn accounting and the R runner's process-wide peak then count them the same way.

    PYTHONPATH=$PWD/python python3 -m pytest -q -m cuda tests/python/test_bench_peak_cuda.py
"""

import pytest
import torch

from ampkit.bench import TurnMemory, reset_peak_memory

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


def _matmuls():
    """What a variant's first step does to cuBLAS: matmuls forward and backward, in float32
    and under float16 and bfloat16 autocast; returns the bytes left allocated after."""
    x = torch.randn(64, 256, device="cuda", requires_grad=True)
    lin = torch.nn.Linear(256, 256, device="cuda")
    before = torch.cuda.memory_allocated()
    for dtype in (None, torch.float16, torch.bfloat16):
        with torch.autocast("cuda", dtype=dtype or torch.float16, enabled=dtype is not None):
            out = lin(x)
        out.float().sum().backward()
        out = None
    x.grad = None
    lin.zero_grad(set_to_none=True)
    torch.cuda.synchronize()
    return torch.cuda.memory_allocated() - before


def test_without_priming_a_first_matmul_leaves_a_workspace_behind():
    # the oracle for the test below: in this process, the workspaces are real allocations
    torch._C._cuda_clearCublasWorkspaces()
    torch.cuda.empty_cache()
    assert _matmuls() > 0


def test_after_reset_peak_memory_a_variant_makes_no_workspace():
    torch._C._cuda_clearCublasWorkspaces()
    torch.cuda.empty_cache()
    reset_peak_memory("cuda")
    assert _matmuls() == 0


def test_a_turn_that_frees_the_workspaces_is_charged_for_what_it_allocates_alone():
    # reduce-overhead's CUDA-graph trees free every cuBLAS workspace around a recording;
    # a turn doing so keeps what it allocated as its own (held), the next turn is not
    # charged for making the workspaces again, and the freed bytes are real (the oracle)
    torch._C._cuda_clearCublasWorkspaces()  # only the primed ones below (other tests' streams made some)
    torch.cuda.empty_cache()
    reset_peak_memory("cuda")
    floor = torch.cuda.memory_allocated()
    freeing, after = TurnMemory(floor), TurnMemory(floor)
    freeing.begin()
    before = torch.cuda.memory_allocated()
    torch._C._cuda_clearCublasWorkspaces()
    freed = before - torch.cuda.memory_allocated()
    extra = 2 << 20  # what the turn allocates beyond the freed workspaces' bytes
    kept = torch.empty(freed + extra, dtype=torch.uint8, device="cuda")
    freeing.end()
    after.begin()
    _matmuls()
    after.end()
    assert freed > 0
    # the workspaces made again are not part of what it holds (on an H200 the second priming
    # made one 1 MiB cuBLASLt workspace more than the first: within half of what was freed)
    assert 0 <= freeing.held - kept.numel() < freed // 2
    assert 0 <= freeing.peak - (floor + extra) < freed // 2  # its top: the workspaces were gone then
    assert after.held == 0 and after.peak >= floor
    assert after.peak - floor < freed  # its own matmuls' transient bytes, no workspace
