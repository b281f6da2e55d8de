"""ampkit.r_bridge, the Python half of the R package: each function against what the
R package's calls would do without it (the oracle is the plain Python code)."""

import gc

import pytest
import torch

import ampkit
from ampkit import r_bridge


def _loop_parts(seed=0):
    torch.manual_seed(seed)
    net = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    scaler = ampkit.GradScaler("cpu", init_scale=2.0**8, growth_interval=2)
    return net, opt, scaler


def test_region_by_token_is_ampkits_region_and_restores_the_state():
    x, w = torch.randn(2, 4), torch.randn(3, 4)
    with ampkit.autocast("cpu", dtype=torch.float16):
        expected = torch.nn.functional.linear(x, w)
    token = r_bridge.enter_autocast("cpu", torch.float16)
    try:
        got = torch.nn.functional.linear(x, w)
        assert torch.is_autocast_enabled("cpu")
        assert r_bridge.open_regions() >= 1
    finally:
        r_bridge.exit_autocast(token)
    assert got.dtype == expected.dtype == torch.float16
    assert torch.equal(got, expected)
    assert not torch.is_autocast_enabled("cpu")


def test_a_token_leaves_its_region_once():
    token = r_bridge.enter_autocast("cpu")
    r_bridge.exit_autocast(token)
    with pytest.raises(RuntimeError, match=f"no open region with token {token}"):
        r_bridge.exit_autocast(token)
    assert not torch.is_autocast_enabled("cpu")


def test_bad_region_arguments_raise_and_open_nothing():
    before = r_bridge.open_regions()
    with pytest.raises(ValueError, match="float64"):
        r_bridge.enter_autocast("cpu", torch.float64)
    with pytest.raises(ampkit.PolicyError, match="nope"):
        r_bridge.enter_autocast("cpu", policy="nope")
    assert r_bridge.open_regions() == before
    assert not torch.is_autocast_enabled("cpu")


def test_seed_step_through_the_bridge_equals_the_plain_step():
    x, y = torch.randn(5, 8), torch.randn(5, 4)
    results = []
    for via_bridge in (False, True):
        net, opt, scaler = _loop_parts()
        for _ in range(4):
            if via_bridge:
                token = r_bridge.enter_autocast("cpu")
                out = net(x)
                loss = torch.nn.functional.mse_loss(out, y)
                r_bridge.exit_autocast(token)
                calls = r_bridge.ScalerCalls(scaler)
                calls.scale_backward(loss)
                calls.step(opt)
                assert calls.update() == r_bridge.memory_allocated()  # the CUDA reading
                r_bridge.bound_zero_grad(opt)()
            else:
                with ampkit.autocast("cpu"):
                    out = net(x)
                    loss = torch.nn.functional.mse_loss(out, y)
                scaler.scale(loss).backward()
                scaler.step(opt)
                scaler.update()
                opt.zero_grad()
        results.append(([p.detach().clone() for p in net.parameters()], scaler.state_dict(), loss.item()))
    (p0, s0, l0), (p1, s1, l1) = results
    assert all(torch.equal(a, b) for a, b in zip(p0, p1))
    assert s0 == s1
    assert l0 == l1


def test_live_tensor_count_sees_new_tensors():
    before = r_bridge.live_tensor_count()
    keep = [torch.zeros(1) for _ in range(5)]
    assert r_bridge.live_tensor_count() == before + len(keep)


class _Flaky:
    def __init__(self, failures):
        self.failures, self.calls = failures, 0

    def __call__(self, value):
        self.calls += 1
        if self.calls <= self.failures:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB (simulated)")
        return value


def test_retry_call_collects_and_retries_an_out_of_memory_error_once():
    collections = []
    r_bridge.set_r_collector(lambda: collections.append(1))
    try:
        once = _Flaky(1)
        assert r_bridge.retry_call(once, 7) == 7
        assert once.calls == 2 and len(collections) == 1
        twice = _Flaky(2)
        with pytest.raises(torch.OutOfMemoryError, match=r"Tried to allocate 2\.00 GiB.*out of memory again"):
            r_bridge.retry_call(twice, 7)
        assert twice.calls == 2 and len(collections) == 2
        with pytest.raises(ZeroDivisionError):
            r_bridge.retry_call(lambda: 1 / 0)
        assert len(collections) == 2
    finally:
        r_bridge.set_r_collector(None)


class _FlakyParts:
    """A scaler and an optimizer whose per-step methods raise an out-of-memory error on
    their first `failures` calls (or `error` instead), recording the calls that ran."""

    def __init__(self, failures, error=torch.OutOfMemoryError):
        self.failures, self.error, self.ran = failures, error, []

    def _call(self, name, *args, **kwargs):
        self.ran.append((name, args, kwargs))
        if len(self.ran) <= self.failures:
            raise self.error("CUDA out of memory. Tried to allocate 2.00 GiB (simulated)")

    def scale(self, loss):
        parts = self

        class Scaled:
            def backward(self, *args, **kwargs):
                parts._call("backward", loss, *args, **kwargs)

        return Scaled()

    def step(self, optimizer, *args, **kwargs):
        self._call("step", optimizer, *args, **kwargs)
        return "stepped"

    def update(self, new_scale=None):
        self._call("update", new_scale)

    def zero_grad(self, *args, **kwargs):
        self._call("zero_grad", *args, **kwargs)


# Each per-step call of the R loop, as R makes it, and the call it makes, as retry_call
# would make it (the oracle): (name, the call given the parts, what it returns).
_PER_STEP = [
    ("scale_backward", lambda p: r_bridge.ScalerCalls(p).scale_backward("loss", retain_graph=True), None),
    ("step", lambda p: r_bridge.ScalerCalls(p).step("opt", 1, k=2), "stepped"),
    ("update", lambda p: r_bridge.ScalerCalls(p).update(4.0), 0.0),
    ("update_deferred", lambda p: r_bridge.ScalerCalls(p).update_deferred(), None),
    ("bound_zero_grad", lambda p: r_bridge.bound_zero_grad(p)(set_to_none=False), 0.0),
    ("scale_backward_fn", lambda p: r_bridge.scale_backward(p, "loss", retain_graph=True), None),
    ("scaler_step_fn", lambda p: r_bridge.scaler_step(p, "opt", 1, k=2), "stepped"),
    ("scaler_update_fn", lambda p: r_bridge.scaler_update(p, 4.0), 0.0),
    ("zero_grad_fn", lambda p: r_bridge.zero_grad(p, set_to_none=False), 0.0),
]


@pytest.mark.parametrize("call, expected", [(c, e) for _, c, e in _PER_STEP], ids=[n for n, _, _ in _PER_STEP])
def test_per_step_calls_retry_an_out_of_memory_error_once_as_retry_call_does(call, expected):
    collections = []
    r_bridge.set_r_collector(lambda: collections.append(1))
    r_bridge.set_memory_reader(lambda: 0)
    try:
        clean = _FlakyParts(0)
        assert call(clean) == expected
        assert len(clean.ran) == 1 and collections == []
        once = _FlakyParts(1)
        assert call(once) == expected
        assert once.ran == clean.ran * 2 and len(collections) == 1  # the same call, again
        twice = _FlakyParts(2)
        with pytest.raises(torch.OutOfMemoryError, match=r"Tried to allocate 2\.00 GiB.*out of memory again"):
            call(twice)
        assert twice.ran == clean.ran * 2 and len(collections) == 2
        other = _FlakyParts(1, error=ZeroDivisionError)
        with pytest.raises(ZeroDivisionError):
            call(other)
        assert other.ran == clean.ran and len(collections) == 2  # not retried
    finally:
        r_bridge.set_r_collector(None)
        r_bridge.set_memory_reader(None)


def test_entering_a_region_retries_an_out_of_memory_error_once(monkeypatch):
    entered = []
    real_enter = ampkit.autocast.__enter__

    def flaky_enter(self):
        entered.append(1)
        if len(entered) == 1:
            raise torch.OutOfMemoryError("CUDA out of memory (simulated)")
        return real_enter(self)

    monkeypatch.setattr(ampkit.autocast, "__enter__", flaky_enter)
    collections = []
    r_bridge.set_r_collector(lambda: collections.append(1))
    try:
        token = r_bridge.enter_autocast("cpu", torch.bfloat16)
        try:
            assert torch.is_autocast_enabled("cpu") and len(entered) == 2 and len(collections) == 1
        finally:
            r_bridge.exit_autocast(token)
        assert not torch.is_autocast_enabled("cpu")
    finally:
        r_bridge.set_r_collector(None)


def test_is_out_of_memory_names():
    assert r_bridge.is_out_of_memory("OutOfMemoryError")
    assert r_bridge.is_out_of_memory("torch.OutOfMemoryError")
    assert not r_bridge.is_out_of_memory("RuntimeError")


def test_rules_r_asks_for():
    assert "torch_default" in r_bridge.policy_names()
    assert r_bridge.policy("torch_default") is r_bridge.policy("torch_default")
    assert r_bridge.policy("torch_default") == ampkit.load_policy("torch_default")
    keys = r_bridge.scaler_int_state_keys()
    sd = ampkit.GradScaler("cpu").state_dict()
    assert keys == sorted(k for k, v in sd.items() if type(v) is int)
    assert "growth_interval" in keys


def test_load_scaler_state_takes_r_numbers():
    a = ampkit.GradScaler("cpu", init_scale=2.0**5, growth_interval=7)
    sd = a.state_dict()
    as_from_r = {k: float(v) if type(v) is int else v for k, v in sd.items()}
    b = ampkit.GradScaler("cpu")
    r_bridge.load_scaler_state(b, as_from_r)
    assert b.state_dict() == sd
    with pytest.raises(Exception, match="growth_interval"):
        r_bridge.load_scaler_state(ampkit.GradScaler("cpu"), {**as_from_r, "growth_interval": 2.5})


def test_check_autocast_raises_what_the_region_would():
    net = torch.nn.Linear(2, 2)
    r_bridge.check_autocast(net, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="float64"):
        r_bridge.check_autocast(net, dtype=torch.float64)
    with pytest.raises(ValueError, match="'yes'"):
        r_bridge.check_autocast(net, enabled="yes")
    with pytest.raises(ampkit.PolicyError, match="nope"):
        r_bridge.check_autocast(net, policy="nope")


def test_call_warn_returns_the_warnings():
    import warnings

    def f():
        warnings.warn("careful")
        return 3

    assert r_bridge.call_warn(f) == [3, ["careful"]]


def test_memory_reader_can_be_replaced_and_restored():
    r_bridge.set_memory_reader(lambda: 2**33)
    try:
        assert r_bridge.memory_allocated() == float(2**33)
        net, opt, _ = _loop_parts()
        assert r_bridge.zero_grad(opt) == float(2**33)
    finally:
        r_bridge.set_memory_reader(None)
    if not torch.cuda.is_initialized():
        assert r_bridge.memory_allocated() == 0.0


def test_trace_rows_and_plain():
    with ampkit.trace() as tr:
        with ampkit.autocast("cpu"):
            torch.mm(torch.randn(2, 2), torch.randn(2, 2))
    rows = r_bridge.trace_rows(tr)
    assert rows and all(isinstance(r, dict) for r in rows)
    assert all(v is None or isinstance(v, (str, int, float, bool)) for r in rows for v in r.values())
    assert r_bridge.plain({"a": (1, 2)}) == {"a": [1, 2]}


def _held_by_r_alone(t):
    # release_tensors() counts R's wrapper as one reference: a one-element list stands in.
    return [t]


def test_release_tensors_frees_tensors_held_by_nothing_else():
    lin = torch.nn.Linear(8, 4)
    out = lin(torch.randn(16, 8))
    r_side = _held_by_r_alone(out)
    del out
    assert r_bridge.release_tensors(list(r_side)) == 1
    assert r_side[0].shape == (0,) and r_side[0].grad_fn is None
    # a linear layer's 3-d output is a view of its 2-d product: both go
    view = lin(torch.randn(2, 16, 8))
    assert view._is_view()
    r_side = _held_by_r_alone(view)
    del view
    assert r_bridge.release_tensors(list(r_side)) == 1
    assert r_side[0].shape == (0,) and r_side[0]._base.untyped_storage().nbytes() == 0


def test_release_tensors_leaves_tensors_that_something_else_holds():
    lin = torch.nn.Linear(8, 4)
    kept = lin(torch.randn(16, 8))                 # `kept` stands for R's reference,
    also_kept = [kept]                             # and this one is another holder
    base = lin(torch.randn(16, 8))
    view = base.view(64)                           # a view whose base is held elsewhere
    detached = lin(torch.randn(16, 8))
    copy = detached.detach()                       # another tensor on the same storage
    param = lin.weight                             # a leaf that requires grad
    before = kept.clone()
    saved = lin(torch.randn(16, 8))
    loss = (saved ** 2).sum()                      # PowBackward0 saves `saved`: the graph owns it too
    assert r_bridge.release_tensors([kept, view, param, saved, detached]) == 0
    assert torch.equal(also_kept[0], before) and view.sum() == base.sum() and param.numel() == 32
    assert torch.equal(copy, detached.detach())
    loss.backward()                                # the graph is intact
    assert saved.numel() == 64 and lin.weight.grad is not None


def test_call_releasing_releases_then_calls():
    out = torch.nn.Linear(8, 4)(torch.randn(2, 8))
    r_side = _held_by_r_alone(out)
    del out
    assert r_bridge.call_releasing(list(r_side), torch.add, torch.ones(2), 1).tolist() == [2.0, 2.0]
    assert r_side[0].shape == (0,)


def test_live_tensor_bytes_counts_a_storage_once():
    before = r_bridge.live_tensor_bytes()
    t = torch.zeros(1024)
    views = [t[:10], t.view(32, 32)]
    assert r_bridge.live_tensor_bytes() - before == 4096
    del t, views


def test_update_then_is_the_update_then_the_call():
    # The deferred update with the next call, against update() and zero_grad() in turn.
    runs = []
    for merged in (True, False):
        net, opt, scaler = _loop_parts(seed=3)
        calls = r_bridge.ScalerCalls(scaler)
        x, y = torch.randn(5, 8), torch.randn(5, 4)
        scales = []
        for _ in range(5):
            scaler.scale(torch.nn.functional.mse_loss(net(x), y)).backward()
            scaler.step(opt)
            if merged:
                r_bridge.update_then(calls.update_deferred, opt.zero_grad, set_to_none=True)
            else:
                scaler.update()
                opt.zero_grad(set_to_none=True)
            scales.append(scaler.get_scale())
            assert all(p.grad is None for p in net.parameters())
        runs.append((scales, [p.detach().clone() for p in net.parameters()]))
    assert runs[0][0] == runs[1][0]
    assert runs[0][0][-1] != 2.0**8  # growth_interval 2: the scale moved, so updates ran
    assert all(torch.equal(a, b) for a, b in zip(runs[0][1], runs[1][1]))


def test_update_then_without_a_call_only_updates_and_an_update_error_skips_the_call():
    net, opt, scaler = _loop_parts()
    calls = r_bridge.ScalerCalls(scaler)
    scaler.scale(net(torch.randn(2, 8)).sum()).backward()
    scaler.step(opt)
    assert r_bridge.update_then(calls.update_deferred, None) is None
    ran = []
    with pytest.raises(RuntimeError, match="update"):  # no step since that update
        r_bridge.update_then(calls.update_deferred, lambda: ran.append(1))
    assert ran == []
