"""make_train_step on a DistributedDataParallel model: the defaults DDP needs, and on CUDA a
capture with default arguments where the DDP is built so that a capture can hold it.

One process, a world of one (gloo on the CPU, NCCL on a GPU): what is checked here is what
the step does with a DDP model, not the collectives (tests/python/test_distributed.py has
those over two ranks).

    PYTHONPATH=$PWD/python python3 -m pytest -q tests/python/test_train_step_ddp.py     # CPU part
    PYTHONPATH=$PWD/python python3 -m pytest -q -m cuda tests/python/test_train_step_ddp.py
"""

import socket
import warnings

import pytest
import torch
import torch.distributed as dist

import ampkit

DDP = torch.nn.parallel.DistributedDataParallel
LOSS = torch.nn.functional.mse_loss
cuda = pytest.mark.cuda


@pytest.fixture
def world_of_one(request):
    backend = getattr(request, "param", "gloo")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def mlp(device="cpu"):
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(),
                               torch.nn.Linear(64, 8)).to(device)


def test_a_ddp_model_warms_up_for_11_steps_by_default(world_of_one):
    model = DDP(mlp())
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ac = dict(device_type="cpu", dtype=torch.bfloat16)
    assert ampkit.make_train_step(model, LOSS, opt, autocast=ac, capture=False).warmup == 11
    # a module that holds a DDP counts too; a plain one keeps 3
    holder = torch.nn.Sequential(model)
    assert ampkit.make_train_step(holder, LOSS, opt, autocast=ac, capture=False).warmup == 11
    assert ampkit.make_train_step(mlp(), LOSS, opt, autocast=ac, capture=False).warmup == 3


def test_too_few_warmup_steps_for_ddp_raise_naming_the_fix(world_of_one):
    model = DDP(mlp())
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ac = dict(device_type="cpu", dtype=torch.bfloat16)
    with pytest.raises(ValueError, match=r"warmup=3 is too few .*warmup>=11 or leave warmup=None"):
        ampkit.make_train_step(model, LOSS, opt, autocast=ac, warmup=3)
    # no capture, no need: the value is kept
    assert ampkit.make_train_step(model, LOSS, opt, autocast=ac, warmup=3, capture=False).warmup == 3


def cuda_ddp(on_side_stream):
    model = mlp("cuda")
    if not on_side_stream:
        return DDP(model, device_ids=[torch.cuda.current_device()])
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        ddp = DDP(model, device_ids=[torch.cuda.current_device()])
    torch.cuda.current_stream().wait_stream(side)
    return ddp


def cuda_batches(n=20):
    g = torch.Generator(device="cuda").manual_seed(1)
    return [(torch.randn(16, 32, device="cuda", generator=g),
             torch.randn(16, 8, device="cuda", generator=g)) for _ in range(n)]


def losses_of(on_side_stream, **kw):
    model = cuda_ddp(on_side_stream)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True, capturable=True)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        step = ampkit.make_train_step(model, LOSS, opt, **kw)
        losses = torch.stack([step(x, y) for x, y in cuda_batches()])
    torch.cuda.synchronize()
    # ampkit's own warnings (torch >= 2.11 may add one about AccumulateGrad's stream)
    return step, losses, [str(w.message) for w in caught
                          if str(w.message).startswith("ampkit.make_train_step")]


@cuda
@pytest.mark.parametrize("world_of_one", ["nccl"], indirect=True)
def test_ddp_on_a_side_stream_captures_with_default_arguments(world_of_one):
    step, losses, caught = losses_of(True)
    assert step.warmup == 11 and step.captured and step.captures == 1 and step.reason is None
    assert caught == []
    _, eager, _ = losses_of(True, capture=False)
    assert torch.equal(losses, eager)


@cuda
@pytest.mark.parametrize("world_of_one", ["nccl"], indirect=True)
def test_ddp_on_the_default_stream_runs_eagerly_with_one_warning_naming_the_line(world_of_one):
    step, losses, caught = losses_of(False)
    assert not step.captured and step.captures == 0
    assert "Build the DDP module on a side stream" in step.reason
    assert len(caught) == 1 and "with torch.cuda.stream(torch.cuda.Stream())" in caught[0]
    _, eager, _ = losses_of(False, capture=False)
    assert torch.equal(losses, eager)  # refused before any capture was tried


@cuda
@pytest.mark.parametrize("world_of_one", ["nccl"], indirect=True)
def test_capture_true_on_a_default_stream_ddp_raises_and_changes_nothing(world_of_one):
    model = cuda_ddp(False)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True, capturable=True)
    step = ampkit.make_train_step(model, LOSS, opt, capture=True)
    data = cuda_batches()
    for x, y in data[:step.warmup]:
        step(x, y)
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(RuntimeError, match="side stream"):
        step(*data[step.warmup])
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    assert step.calls == step.warmup


def fsdp2_mlp():
    try:
        from torch.distributed.fsdp import fully_shard
    except ImportError:  # torch < 2.6
        from torch.distributed._composable.fsdp import fully_shard
    from torch.distributed.device_mesh import init_device_mesh

    model = mlp()
    mesh = init_device_mesh("cpu", (1,))
    fully_shard(model[0], mesh=mesh)
    return fully_shard(model, mesh=mesh)


def test_an_fsdp2_models_eager_step_checks_instead_of_copying_and_equals_the_loop(world_of_one):
    # FSDP2's parameters and optimizer state are DTensors: the step checks their local
    # shards (no copy of the parameters and state each step) and trains bitwise as the
    # hand-written ampkit loop does.
    ac = dict(device_type="cpu", dtype=torch.bfloat16)
    g = torch.Generator().manual_seed(3)
    data = [(torch.randn(16, 32, generator=g), torch.randn(16, 8, generator=g)) for _ in range(4)]
    model = fsdp2_mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    step = ampkit.make_train_step(model, LOSS, opt, autocast=ac, capture=False)
    ref = fsdp2_mlp()
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    why = []
    for x, y in data:
        loss = step(x, y)
        why.append(step.rollback_copy)
        ref_opt.zero_grad()
        with ampkit.autocast(**ac):
            ref_loss = LOSS(ref(x), y)
        ref_loss.backward()
        ref_opt.step()
        assert torch.equal(loss, ref_loss.detach())
    assert "creates its state" in why[0] and why[1:] == [None, None, None]
    for p, q in zip(model.parameters(), ref.parameters()):
        assert torch.equal(p.to_local(), q.to_local())
