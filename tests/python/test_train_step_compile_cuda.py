"""make_train_step(..., compile=...) on CUDA: the compiled captured step against the compiled
eager step (run on the device).

    PYTHONPATH=$PWD/python python3 -m pytest -q -m cuda tests/python/test_train_step_compile_cuda.py

Both run the kernels inductor generated for the same model (each compiled by its own step):
losses, parameters and optimizer state are compared bit for bit, an overflowing step
(an inf through the targets) included.
"""

import math

import pytest
import torch
import torch._dynamo

import ampkit

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

AC = dict(device_type="cuda", dtype=torch.float16)
N_STEPS = 20
WARMUP = 3
INF_STEPS = {1, 9}  # 1 inside the warm-up, 9 replayed
NAN_STEPS = {14}


@pytest.fixture(autouse=True)
def fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def make_mlp(seed=0):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.GELU(),
                               torch.nn.Linear(128, 32)).cuda()


def make_batches(n=N_STEPS, seed=1):
    g = torch.Generator(device="cuda").manual_seed(seed)
    out = []
    for i in range(n):
        x = torch.randn(32, 64, device="cuda", generator=g)
        y = torch.randn(32, 32, device="cuda", generator=g)
        if i in INF_STEPS:
            y[0, 0] = math.inf
        if i in NAN_STEPS:
            y[2, 3] = math.nan
        out.append((x, y))
    return out


def run(capture, mode):
    model = make_mlp()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True, capturable=True)
    step = ampkit.make_train_step(
        model, torch.nn.functional.mse_loss, opt, autocast=AC, capture=capture, warmup=WARMUP,
        scaler=ampkit.GradScaler("cuda", init_scale=2.0**12, growth_interval=4),
        compile=dict(mode=mode) if mode else True)
    losses, modes, skipped = [], [], []
    for i, (x, y) in enumerate(make_batches()):
        before = [p.detach().clone() for p in model.parameters()]
        losses.append(step(x, y))
        modes.append(step.captured)
        if all(torch.equal(a, b) for a, b in zip(before, model.parameters())):
            skipped.append(i)
    torch.cuda.synchronize()
    state = [v for s in opt.state.values() for v in s.values() if isinstance(v, torch.Tensor)]
    torch._dynamo.reset()
    return dict(losses=losses, modes=modes, skipped=skipped, step=step,
                tensors=[p.detach() for p in model.parameters()] + state)


@pytest.mark.parametrize("mode", [None, "max-autotune-no-cudagraphs"], ids=["default", "mat"])
def test_the_compiled_captured_step_equals_the_compiled_eager_step_bitwise(mode):
    eager = run(False, mode)
    captured = run(True, mode)
    step = captured["step"]
    # Compiled in the warm-up: the capture (under fail_on_recompile) compiled nothing.
    assert captured["modes"] == [False] * WARMUP + [True] * (N_STEPS - WARMUP)
    assert step.compiled and step.captures == 1 and step.reason is None
    assert eager["step"].compiled
    assert eager["skipped"] == captured["skipped"] == sorted(INF_STEPS | NAN_STEPS)
    # The default mode compiles the same kernels twice: bitwise. max-autotune picks each
    # GEMM's kernel by timing the candidates, once per compilation, so the two steps may
    # run different kernels, which differ in the last bits (H200: 1 element of 128 in one
    # tensor, 7.6e-8 relative): there, equal to float32 rounding of a few ulps.
    tol = dict(rtol=0, atol=0) if mode is None else dict(rtol=1e-6, atol=1e-9)
    torch.testing.assert_close(captured["losses"], eager["losses"], equal_nan=True, **tol)
    torch.testing.assert_close(captured["tensors"], eager["tensors"], **tol)
    se, sc = eager["step"].scaler.stats(), step.scaler.stats()
    assert (sc.steps, sc.skipped, sc.history_scales) == (se.steps, se.skipped, se.history_scales)


def test_a_compiled_step_that_may_capture_runs_with_the_cast_cache_off():
    model = make_mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, fused=True)
    step = ampkit.make_train_step(model, torch.nn.functional.mse_loss, opt, autocast=AC,
                                  compile=True)
    assert step.autocast["cache_enabled"] is False
    with pytest.raises(ValueError, match=r"cache_enabled=True.*leave cache_enabled out, or pass "
                                         r"capture=False"):
        ampkit.make_train_step(model, torch.nn.functional.mse_loss, opt, compile=True,
                               autocast=dict(AC, cache_enabled=True))
