"""CUDA variants of the scaler tests: fused optimizers bitwise vs torch's scaler, no host
sync under set_sync_debug_mode("error"), and a captured training step with an injected inf."""

from __future__ import annotations

import pytest
import torch

import ampkit
from conftest import SyncError, bits_equal

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]
F = torch.nn.functional
INF, NAN = float("inf"), float("nan")

OPTS = {
    "sgd_fused": lambda p, **k: torch.optim.SGD(p, lr=0.05, momentum=0.9, fused=True),
    "adam_fused": lambda p, **k: torch.optim.Adam(p, lr=1e-3, fused=True, **k),
    "adamw_fused": lambda p, **k: torch.optim.AdamW(p, lr=1e-3, fused=True, **k),
    "adam_foreach": lambda p, **k: torch.optim.Adam(p, lr=1e-3, foreach=True),
    "sgd_plain": lambda p, **k: torch.optim.SGD(p, lr=0.05, momentum=0.9, foreach=False),
}


def model(seed=0):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 8)).cuda()


def data(n, bad=()):
    g = torch.Generator(device="cuda").manual_seed(1)
    out = []
    for i in range(n):
        x = torch.randn(16, 32, device="cuda", generator=g)
        y = torch.randn(16, 8, device="cuda", generator=g)
        if i in bad:
            x[0, 0] = INF
        out.append((x, y))
    return out


def step(m, opt, scaler, x, y, guard=None):
    opt.zero_grad(set_to_none=True)
    with torch.autocast("cuda", dtype=torch.float16):  # the oracle autocast: same forward both runs
        out = m(x)
    loss = F.mse_loss(out.float(), y)
    if guard is not None:
        guard.__enter__()
    try:
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
    finally:
        if guard is not None:
            guard.__exit__(None, None, None)


def flat_state(m, opt, scaler):
    tracker = torch.tensor(scaler.state_dict()["_growth_tracker"], dtype=torch.int32, device="cuda")
    out = [scaler._scale, tracker] + [p.detach() for p in m.parameters()]
    for p in m.parameters():
        out += [v for _, v in sorted(opt.state.get(p, {}).items()) if torch.is_tensor(v)]
    return [t.clone() for t in out]


@pytest.mark.parametrize("opt_name", list(OPTS))
def test_cuda_trajectory_is_bitwise_torch(opt_name):
    batches = data(12, bad={2, 5, 6})
    runs = []
    for cls in (ampkit.GradScaler, torch.amp.GradScaler):
        m = model()
        runs.append((m, OPTS[opt_name](m.parameters()), cls("cuda", init_scale=2.0**16, growth_interval=2)))
    for i, (x, y) in enumerate(batches):
        snaps = []
        for m, opt, scaler in runs:
            step(m, opt, scaler, x, y)
            snaps.append(flat_state(m, opt, scaler))
        for a, b in zip(*snaps):
            assert a.dtype == b.dtype and torch.equal(a, b), f"step {i}"
    assert runs[0][2].stats().skipped == 3


@pytest.mark.parametrize("opt_name", ["sgd_fused", "adam_fused", "adamw_fused"])
@pytest.mark.parametrize("kw", [{}, dict(hysteresis=2, min_scale=1.0, max_scale=2.0**20)],
                         ids=["torch-like", "hysteresis+clamps"])
def test_fused_step_and_update_make_no_sync(opt_name, kw):
    m = model()
    opt = OPTS[opt_name](m.parameters())
    scaler = ampkit.GradScaler("cuda", init_scale=2.0**16, growth_interval=2, **kw)
    batches = data(6, bad={3})
    for x, y in batches[:2]:
        step(m, opt, scaler, x, y)  # lazy state first
    torch.cuda.synchronize()
    for x, y in batches[2:]:
        step(m, opt, scaler, x, y, guard=SyncError())
    assert scaler.stats().skipped == 1


def test_plain_optimizer_does_sync_as_documented():
    m = model()
    opt = OPTS["sgd_plain"](m.parameters())
    scaler = ampkit.GradScaler("cuda")
    x, y = data(1)[0]
    step(m, opt, scaler, x, y)
    with pytest.raises(RuntimeError, match="synchroniz"):
        step(m, opt, scaler, x, y, guard=SyncError())


@pytest.mark.parametrize("opt_name", ["sgd_fused", "adam_fused"])
def test_captured_step_skips_an_injected_inf(opt_name):
    m = model()
    kw = {} if opt_name == "sgd_fused" else dict(capturable=True)
    opt = OPTS[opt_name](m.parameters(), **kw)
    scaler = ampkit.GradScaler("cuda", init_scale=2.0**16, growth_interval=2, hysteresis=2)
    x, y = data(1)[0]
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            step(m, opt, scaler, x, y)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    opt.zero_grad(set_to_none=True)
    with torch.cuda.graph(graph):
        with ampkit.autocast("cuda", dtype=torch.float16):
            out = m(x)
        scaler.scale(F.mse_loss(out.float(), y)).backward()
        scaler.step(opt)
        scaler.update()
    graph.replay()
    s0 = scaler.stats()
    params = [p.detach().clone() for p in m.parameters()]
    good = x.clone()
    x[0, 0] = INF
    graph.replay()  # absorbed by hysteresis: skipped, scale kept
    s1 = scaler.stats()
    assert all(torch.equal(a, p) for a, p in zip(params, m.parameters()))
    assert (s1.scale, s1.skipped, s1.hysteresis_left) == (s0.scale, s0.skipped + 1, 1)
    graph.replay()  # second consecutive overflow: backs off
    s2 = scaler.stats()
    assert all(torch.equal(a, p) for a, p in zip(params, m.parameters()))
    assert (s2.scale, s2.skipped, s2.last_skipped) == (s0.scale / 2, s0.skipped + 2, s2.steps - 1)
    x.copy_(good)
    graph.replay()
    assert any(not torch.equal(a, p) for a, p in zip(params, m.parameters()))


def _torch_check(grads):
    """torch's check-and-multiply-by-1.0 (on float32 copies for bfloat16, which its CUDA
    kernel lacks: widening keeps every inf and NaN, so the flag is the same)."""
    found = torch.zeros((), device="cuda")
    copies = [g.float() if g.dtype == torch.bfloat16 else g.clone() for g in grads]
    torch._amp_foreach_non_finite_check_and_unscale_(copies, found, torch.ones((), device="cuda"))
    return found


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_fused_check_flags_like_torch_reads_only_and_captures(dtype):
    """The read-only check of the fused path (max |g| per tensor, one multi-tensor kernel) on
    CUDA: the same flag as torch's check-and-multiply-by-1.0 for NaN, inf and -inf anywhere
    (the tail of a multi-chunk tensor, a non-contiguous one, one of > 400 tensors), with empty
    tensors; the gradients are bitwise untouched; no sync, and it replays in a CUDA graph."""
    dev = torch.device("cuda")
    g = torch.Generator(device="cuda").manual_seed(0)
    bases = ([torch.randn(300_001, device=dev, generator=g).to(dtype),
              torch.randn(64, 96, device=dev, generator=g).to(dtype),
              torch.empty(0, device=dev, dtype=dtype)]
             + [torch.randn(17, device=dev, generator=g).to(dtype) for _ in range(450)])
    grads = [b.t() if b.dim() == 2 else b for b in bases]  # grads[1] is not contiguous
    key = {(dev, dtype): grads}
    scaler = ampkit.GradScaler("cuda")
    big = torch.finfo(dtype).max
    pokes = [(0, 0, None), (0, 300_000, NAN), (0, 123_456, INF), (1, 5000, -INF),
             (452, 16, NAN), (100, 0, -INF), (0, 7, big), (1, 8, -big)]
    for i, pos, value in pokes:
        flat = bases[i].view(-1)
        saved = flat[pos].clone()
        if value is not None:
            flat[pos] = value
        before = [b.clone() for b in bases]
        torch.cuda.synchronize()
        with SyncError():
            ours = scaler.found_inf(key, unscale=False)[dev]
        theirs = _torch_check(grads)
        assert torch.equal(ours, theirs), (i, pos, value)
        assert bool(theirs) == (value is not None and (value != value or abs(value) == INF))
        assert all(bits_equal(a, b) for a, b in zip(before, bases))
        flat[pos] = saved
    # Captured: the flag follows the data on every replay.
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        scaler.found_inf(key, unscale=False)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        flag = scaler.found_inf(key, unscale=False)[dev]
    for value in (1.0, NAN, 2.0, -INF, 3.0):
        bases[0][-1] = value
        graph.replay()
        assert torch.equal(flag, _torch_check(grads)), value
        assert bool(flag) == (value != value or value == -INF), value


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA GPUs")
def test_fused_step_skips_when_both_gpus_overflow():
    """A model across two GPUs, an inf input: both devices' flags are 1.0, and the fused
    kernel (which skips only on found_inf == 1.0) gets 1.0, not their sum."""
    torch.manual_seed(0)
    a, b = torch.nn.Linear(8, 8).to("cuda:0"), torch.nn.Linear(8, 1).to("cuda:1")
    params = list(a.parameters()) + list(b.parameters())
    opt = torch.optim.SGD(params, lr=0.1, fused=True)
    scaler = ampkit.GradScaler("cuda", init_scale=2.0**16)
    x = torch.randn(4, 8, device="cuda:0")
    x[0, 0] = INF
    scaler.scale(b(a(x).to("cuda:1")).pow(2).mean()).backward()
    before = [p.detach().clone() for p in params]
    scaler.step(opt)
    flags = scaler._per_optimizer[id(opt)].found_inf_per_device
    assert sorted(str(d) for d in flags) == ["cuda:0", "cuda:1"]
    assert [float(f) for f in flags.values()] == [1.0, 1.0]
    assert all(torch.equal(p.detach(), q) for p, q in zip(params, before))
    scaler.update()
    s = scaler.stats()
    assert (s.skipped, s.scale) == (1, 2.0**15)


def test_the_unscale_factor_is_torchs_to_the_bit_for_every_float32():
    """CUDA's float32 reciprocal, which the scaler unscales by, against torch's scaler's
    float(1 / double(scale)), for every positive finite float32."""
    from test_scaler import reciprocal_mismatches

    assert reciprocal_mismatches("cuda") == 0
