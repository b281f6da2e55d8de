"""Region semantics of ampkit.autocast, each checked against torch.autocast.

Nesting, enabled=False inside, an exception inside, threads, decorator use, the
cast cache's lifetime, what is (not) cast, in-place and out= calls, custom_fwd /
custom_bwd, user ops registered with ampkit.op, bad arguments.
"""

from __future__ import annotations

import contextlib
import gc
import threading
import weakref

import pytest
import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

import ampkit
from ampkit import _autocast, _engine
from conftest import needs_no_declared_differences

pytestmark = pytest.mark.usefixtures("ampkit_quiet")
BF16, F16, F32 = torch.bfloat16, torch.float16, torch.float32


def modes():
    return torch._C._len_torch_function_stack()


def lin(x=None, w=None):
    x = torch.randn(2, 4) if x is None else x
    w = torch.randn(3, 4) if w is None else w
    return F.linear(x, w)


# --------------------------------------------------------------------- nesting
@pytest.mark.parametrize("lib", ["torch", "ampkit"])
def test_nesting_changes_and_restores_dtype(lib):
    ac = torch.autocast if lib == "torch" else ampkit.autocast
    enabled = torch.is_autocast_enabled if lib == "torch" else ampkit.is_autocast_enabled
    dtype = torch.get_autocast_dtype if lib == "torch" else ampkit.get_autocast_dtype
    seen = []
    with ac("cpu", dtype=BF16):
        seen.append((lin().dtype, enabled("cpu"), dtype("cpu")))
        with ac("cpu", dtype=F16):
            seen.append((lin().dtype, enabled("cpu"), dtype("cpu")))
            with ac("cpu", enabled=False):
                seen.append((lin().dtype, enabled("cpu")))
            seen.append((lin().dtype, enabled("cpu")))
        seen.append((lin().dtype, enabled("cpu"), dtype("cpu")))
    seen.append((lin().dtype, enabled("cpu")))
    assert seen == [
        (BF16, True, BF16), (F16, True, F16), (F32, False), (F16, True), (BF16, True, BF16), (F32, False)
    ]


@needs_no_declared_differences
def test_no_mode_with_the_default_policy():
    """A region whose policy equals torch's table is torch's autocast alone: no Python handler."""
    base = modes()
    with ampkit.autocast("cpu"):
        assert modes() == base
        with ampkit.autocast("cpu", enabled=False), ampkit.autocast("cpu", dtype=F16):
            assert modes() == base
    assert modes() == base


@needs_no_declared_differences
def test_one_mode_for_a_changed_policy_however_deep_and_none_after():
    # norm (a Python function of torch) cannot run as a kernel at the Autocast key: the
    # change needs the handler mode (a change of linear alone pushes none: test_autocast_kernels)
    changed = ampkit.load_policy("torch_default").with_ops("cpu", fp32=["linear"], lower_precision_fp=["norm"])
    base = modes()
    with ampkit.autocast("cpu"):
        with ampkit.autocast("cpu", policy=changed):
            assert modes() == base + 1
            with ampkit.autocast("cpu", enabled=False), ampkit.autocast("cpu", dtype=F16, policy=changed):
                assert modes() == base + 1
            with ampkit.autocast("cpu"):  # the default policy inside: the mode stays, passing through
                assert modes() == base + 1 and lin().dtype == BF16
        assert modes() == base
    assert modes() == base


@needs_no_declared_differences
def test_a_region_entered_again_acts_as_on_its_first_entry():
    """A region that leaves everything to torch's autocast is entered by a shorter path from
    its second entry on; around and inside regions that change the policy (the handler
    pushed) and a trace, each call's dtype is what the same nesting gives the first time,
    and the default regions' dtypes are torch.autocast's."""
    changed = ampkit.load_policy("torch_default").with_ops("cpu", fp32=["linear"], lower_precision_fp=["norm"])
    x, w = torch.randn(2, 4), torch.randn(3, 4)
    with torch.autocast("cpu", dtype=BF16):
        native = lin(x, w).dtype
    with torch.autocast("cpu", dtype=F16):
        native16 = lin(x, w).dtype

    def walk():
        seen = []
        base = modes()
        with ampkit.autocast("cpu"):
            seen.append((lin(x, w).dtype, modes() - base))
            with ampkit.autocast("cpu", dtype=F16):
                seen.append((lin(x, w).dtype, modes() - base))
            with ampkit.autocast("cpu", policy=changed):
                seen.append((lin(x, w).dtype, modes() - base))
                with ampkit.autocast("cpu"):  # the default inside the handler: it stays
                    seen.append((lin(x, w).dtype, modes() - base))
            with ampkit.trace() as tr:
                with ampkit.autocast("cpu"):
                    seen.append((lin(x, w).dtype, modes() - base))
            seen.append((lin(x, w).dtype, modes() - base, len(tr) > 0))
        seen.append((lin(x, w).dtype, modes() - base))
        return seen

    first = walk()
    assert first == [(native, 0), (native16, 0), (F32, 1), (native, 1), (native, 1), (native, 0, True), (F32, 0)]
    assert walk() == first and walk() == first


def _torch_state():
    nesting = torch.autocast_increment_nesting()
    torch.autocast_decrement_nesting()
    return torch.is_autocast_enabled("cpu"), torch.get_autocast_dtype("cpu"), torch.is_autocast_cache_enabled(), nesting


class _PassThrough(TorchFunctionMode):
    def __torch_function__(self, func, types, args=(), kwargs=None):
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("under_a_mode", [False, True], ids=["plain", "under-a-torch-function-mode"])
def test_entry_and_exit_set_torchs_state_as_torch_autocast_does(under_a_mode):
    """Enabled, dtype, cast-cache flag and nesting count, inside, nested and after, also
    while a torch-function mode is active (torch's own __enter__/__exit__ run then)."""
    seen = {}
    for name, region in (("torch", torch.autocast), ("ampkit", ampkit.autocast)):
        with _PassThrough() if under_a_mode else contextlib.nullcontext():
            states = [_torch_state()]
            with region("cpu", dtype=F16, cache_enabled=False):
                states.append(_torch_state())
                with region("cpu", enabled=False):
                    states.append(_torch_state())
                with pytest.raises(KeyError), region("cpu", dtype=BF16):
                    states.append(_torch_state())
                    raise KeyError("inside")
                states.append(_torch_state())
            states.append(_torch_state())
        seen[name] = states
    assert seen["ampkit"] == seen["torch"]


def test_the_state_is_torchs():
    """An ampkit region is a torch autocast region as torch sees it, and the other way round."""
    with ampkit.autocast("cpu", dtype=F16):
        assert torch.is_autocast_enabled("cpu") and torch.get_autocast_dtype("cpu") == F16
        assert ampkit.is_autocast_enabled("cpu") and ampkit.get_autocast_dtype("cpu") == F16
        with ampkit.autocast("cpu", enabled=False):
            assert not torch.is_autocast_enabled("cpu")
    with torch.autocast("cpu"):
        assert ampkit.is_autocast_enabled("cpu")
    assert not torch.is_autocast_enabled("cpu")
    assert ampkit.get_autocast_dtype("cpu") == torch.get_autocast_dtype("cpu")
    assert ampkit.get_autocast_dtype("cuda") == torch.get_autocast_dtype("cuda")
    assert isinstance(ampkit.autocast("cpu"), torch.amp.autocast)


def test_exception_inside_restores_everything():
    base = modes()
    w = torch.randn(3, 4, requires_grad=True)
    with pytest.raises(ZeroDivisionError):
        with ampkit.autocast("cpu", dtype=BF16):
            with ampkit.autocast("cpu", dtype=F16):
                lin(w=w)
                1 / 0
    assert not ampkit.is_autocast_enabled("cpu")
    assert modes() == base
    assert _engine.thread_engine().cache == {} and _engine.thread_engine().depth == 0
    assert lin().dtype == F32
    with ampkit.autocast("cpu"):
        with pytest.raises(ValueError):
            with ampkit.autocast("cpu", enabled=False):
                raise ValueError("inner")
        assert ampkit.is_autocast_enabled("cpu") and lin().dtype == BF16


def test_reference_inside_a_region_leaves_that_region_as_it_was():
    changed = ampkit.load_policy("torch_default").with_ops("cpu", fp32=["linear"])
    a = torch.randn(4, 4)
    with ampkit.autocast("cpu", policy=changed):
        with _autocast.reference(), ampkit.autocast("cpu", policy=changed):
            pass
        with torch.autocast("cpu", enabled=False):  # the outer region still follows torch's switch
            assert torch.mm(a, a).dtype == F32 and F.linear(a.to(BF16), a.to(BF16)).dtype == BF16
        assert torch.mm(a, a).dtype == BF16 and F.linear(a, a).dtype == F32


# --------------------------------------------------------------------- threads
def test_other_threads_are_unaffected():
    out = {}
    inside = threading.Event()
    done = threading.Event()

    def worker():
        inside.wait()
        out["worker"] = (lin().dtype, ampkit.is_autocast_enabled("cpu"))
        with ampkit.autocast("cpu", dtype=F16):
            out["worker_region"] = lin().dtype
        done.set()

    t = threading.Thread(target=worker)
    t.start()
    with ampkit.autocast("cpu", dtype=BF16):
        inside.set()
        done.wait(10)
        out["main"] = lin().dtype
    t.join(10)
    assert out == {"worker": (F32, False), "worker_region": F16, "main": BF16}


def test_decorated_function_in_many_threads():
    @ampkit.autocast("cpu", dtype=F16)
    def f(x, w):
        return F.linear(x, w).dtype, ampkit.get_autocast_dtype("cpu")

    res = []
    ts = [threading.Thread(target=lambda: res.append(f(torch.randn(2, 4), torch.randn(3, 4)))) for _ in range(4)]
    for t in ts:
        t.start()
    for t in ts:
        t.join(10)
    assert res == [(F16, F16)] * 4
    assert lin().dtype == F32


# --------------------------------------------------------------------- decorator
@pytest.mark.parametrize("enabled", [True, False])
def test_decorator_matches_torch_decorator(enabled):
    def body(x, w):
        return F.linear(x, w)

    x, w = torch.randn(2, 4), torch.randn(3, 4)
    a = ampkit.autocast("cpu", enabled=enabled)(body)(x, w)
    n = torch.autocast("cpu", enabled=enabled)(body)(x, w)
    assert a.dtype == n.dtype and torch.equal(a, n)
    assert ampkit.autocast("cpu")(body).__name__ == "body"


# --------------------------------------------------------------------- cache
# ampkit's own cast cache serves the ops ampkit casts (a policy's delta, the trace, the
# reference engine); these tests run the reference engine, so every listed op uses it.
@pytest.fixture
def reference_engine():
    with _autocast.reference():
        yield


def _cached_cast_of(w):
    hits = [c for (src, c) in _engine.thread_engine().cache.values() if src is w]
    return hits[0] if hits else None


def test_cache_lives_for_the_outermost_region_and_is_freed(reference_engine):
    w = torch.nn.Parameter(torch.randn(3, 4))
    x = torch.randn(2, 4)
    with ampkit.autocast("cpu"):
        y1 = F.linear(x, w)
        with ampkit.autocast("cpu"):  # nested: the same cache
            y2 = F.linear(x, w)
        cast = _cached_cast_of(w)
        assert cast is not None and cast.dtype == BF16
        ref = weakref.ref(cast)
        del cast
        y3 = F.linear(x, w)
        assert ref() is not None  # still cached after the inner exit
    del y1, y2, y3  # their graphs hold the cast weight for backward
    gc.collect()
    assert ref() is None  # freed at the outermost exit
    assert _engine.thread_engine().cache == {}


def test_cache_shares_one_cast_like_native():
    """Two uses of a weight in a region share one cast node in the graph, natively and in ampkit."""

    def shared(region):
        w = torch.nn.Parameter(torch.randn(3, 4))
        with region:
            y1, y2 = F.linear(torch.randn(2, 4), w), F.linear(torch.randn(2, 4), w)
        return bool(copies(y1) & copies(y2))

    def copies(y):  # the cast nodes (ToCopyBackward) reachable from y's graph
        out, todo = set(), [y.grad_fn]
        while todo:
            n = todo.pop()
            if n is None:
                continue
            if "ToCopy" in n.name():
                out.add(n)
            todo.extend(m for m, _ in n.next_functions)
        return out

    assert shared(torch.autocast("cpu")) is True
    assert shared(ampkit.autocast("cpu")) is True
    assert shared(torch.autocast("cpu", cache_enabled=False)) is False
    assert shared(ampkit.autocast("cpu", cache_enabled=False)) is False


@pytest.mark.parametrize(
    "make",
    [
        lambda: torch.randn(3, 4),  # no grad
        lambda: torch.randn(3, 8, requires_grad=True)[:, :4],  # not a leaf
        lambda: torch.nn.Parameter(torch.randn(4, 3)).t(),  # a view
    ],
    ids=["no_grad", "non_leaf", "view"],
)
def test_cache_skips_what_native_skips(make, reference_engine):
    w = make()
    with ampkit.autocast("cpu"):
        F.linear(torch.randn(2, 4), w)
        assert _cached_cast_of(w) is None


def test_cache_disabled_and_disabled_region_cache_nothing(reference_engine):
    w = torch.nn.Parameter(torch.randn(3, 4))
    for region in (ampkit.autocast("cpu", cache_enabled=False), ampkit.autocast("cpu", enabled=False)):
        with region:
            F.linear(torch.randn(2, 4), w)
            assert _engine.thread_engine().cache == {}


def test_cache_enabled_none_follows_torch_flag(reference_engine):
    w = torch.nn.Parameter(torch.randn(3, 4))
    prev = torch.is_autocast_cache_enabled()
    try:
        torch.set_autocast_cache_enabled(False)
        with ampkit.autocast("cpu"):
            F.linear(torch.randn(2, 4), w)
            assert _cached_cast_of(w) is None
    finally:
        torch.set_autocast_cache_enabled(prev)


# --------------------------------------------------------------------- what is cast
def outcome(call, region):
    try:
        with region:
            return call()
    except RuntimeError as e:
        return type(e)



@pytest.mark.parametrize(
    "call",
    [
        pytest.param(lambda: F.linear(torch.randn(2, 4, dtype=torch.float64), torch.randn(3, 4, dtype=torch.float64)), id="float64"),
        pytest.param(lambda: torch.cat([torch.randn(2, 3), torch.randn(2, 3, dtype=torch.float64)]), id="promote_ignores_float64"),
        pytest.param(lambda: torch.cat([torch.arange(3), torch.arange(3)]), id="integers"),
        pytest.param(lambda: F.linear(torch.randn(2, 4, device="meta"), torch.randn(3, 4, device="meta")), id="other_device"),
        pytest.param(lambda: torch.mm(torch.randn(2, 4), torch.randn(4, 3), out=torch.empty(2, 3)), id="out"),
        pytest.param(lambda: torch.randn(2, 3).addmm_(torch.randn(2, 4), torch.randn(4, 3)), id="inplace_method"),
        pytest.param(lambda: torch.randn(2, 3).add_(torch.randn(2, 3)), id="inplace_unlisted"),
        pytest.param(lambda: torch.mm(torch.randn(2, 4), torch.randn(4, 3).to(BF16)), id="mixed_listed"),
        pytest.param(lambda: torch.randn(2, 4) @ torch.randn(4, 3), id="matmul_operator"),
        pytest.param(lambda: torch.randn(2, 4).matmul(torch.randn(4, 3)), id="matmul_method"),
        pytest.param(lambda: torch.einsum("ij,jk->ik", torch.randn(2, 4), torch.randn(4, 3)), id="einsum_composite"),
        pytest.param(lambda: F.mse_loss(torch.randn(3).to(BF16), torch.randn(3)), id="fp32_mixed"),
        pytest.param(lambda: F.linear(input=torch.randn(2, 4), weight=torch.randn(3, 4)), id="keyword_args"),
    ],
)
@pytest.mark.parametrize("enabled", [True, False], ids=["enabled", "disabled"])
def test_what_is_cast_matches_native(call, enabled):
    torch.manual_seed(0)
    n = outcome(call, torch.autocast("cpu", enabled=enabled))
    torch.manual_seed(0)
    a = outcome(call, ampkit.autocast("cpu", enabled=enabled))
    if isinstance(n, type) or isinstance(a, type):  # mixed dtypes without autocast: both raise
        assert a is n
        return
    assert a.dtype == n.dtype and a.device == n.device
    if a.device.type != "meta":
        assert torch.equal(a, n)


def test_casts_are_recorded_by_autograd():
    w = torch.nn.Parameter(torch.randn(3, 4))
    with ampkit.autocast("cpu"):
        y = F.linear(torch.randn(2, 4), w)
    y.float().sum().backward()
    assert y.dtype == BF16 and w.grad.dtype == F32


# --------------------------------------------------------------------- custom_fwd / custom_bwd
def make_function(fwd_deco, bwd_deco, seen):
    class MyMM(torch.autograd.Function):
        @staticmethod
        @fwd_deco
        def forward(ctx, a, b):
            ctx.save_for_backward(a, b)
            out = a.mm(b)
            seen.append(("fwd", a.dtype, out.dtype))
            return out

        @staticmethod
        @bwd_deco
        def backward(ctx, g):
            a, b = ctx.saved_tensors
            ga = g.mm(b.t())
            seen.append(("bwd", g.dtype, ga.dtype))
            return ga, a.t().mm(g)

    return MyMM


@pytest.mark.parametrize("enabled", [True, False], ids=["enabled", "disabled"])
@pytest.mark.parametrize("cast_inputs", [None, torch.float32], ids=["no_cast", "cast_fp32"])
def test_custom_fwd_bwd_match_torch(cast_inputs, enabled):
    def go(lib):
        seen = []
        if lib == "torch":
            fwd = torch.amp.custom_fwd(device_type="cpu", cast_inputs=cast_inputs)
            bwd = torch.amp.custom_bwd(device_type="cpu")
            region = torch.autocast("cpu", enabled=enabled)
        else:
            fwd = ampkit.custom_fwd(device_type="cpu", cast_inputs=cast_inputs)
            bwd = ampkit.custom_bwd(device_type="cpu")
            region = ampkit.autocast("cpu", enabled=enabled)
        fn = make_function(fwd, bwd, seen)
        a = torch.randn(2, 3, requires_grad=True)
        b = torch.randn(3, 2, requires_grad=True)
        with region:
            out = fn.apply(a.to(BF16) if enabled else a, b)
        out.float().sum().backward()
        return seen, out.dtype, a.grad.dtype

    assert go("ampkit") == go("torch")


def test_custom_fwd_outside_region_is_plain():
    seen = []
    fn = make_function(ampkit.custom_fwd(device_type="cpu", cast_inputs=F32), ampkit.custom_bwd(device_type="cpu"), seen)
    a, b = torch.randn(2, 3, requires_grad=True), torch.randn(3, 2, requires_grad=True)
    fn.apply(a, b).sum().backward()
    assert seen == [("fwd", F32, F32), ("bwd", F32, F32)]


# --------------------------------------------------------------------- user ops
@ampkit.op
def my_attention(q, k, v):
    return torch.softmax(q @ k.transpose(-2, -1), dim=-1) @ v


@ampkit.op(name="my_scale")
def _scale(x, w):
    return F.linear(x, w) * 2


def test_user_op_outside_regions_is_the_plain_function():
    q = torch.randn(2, 3, 4)
    ref = torch.softmax(q @ q.transpose(-2, -1), dim=-1) @ q
    assert torch.equal(my_attention(q, q, q), ref)
    assert my_attention.__name__ == "my_attention"


def test_custom_policy_softmax_fp32_and_my_attention_low():
    policy = ampkit.load_policy("torch_default").with_ops(
        "cpu", fp32=["softmax"], lower_precision_fp=["my_attention"]
    )
    q = torch.randn(2, 3, 4)
    with ampkit.trace() as tr, ampkit.autocast("cpu", policy=policy):
        att = my_attention(q, q, q)
        sm = torch.softmax(q.to(BF16), dim=-1)
    assert att.dtype == BF16  # my_attention ran as one low-precision op
    ref = torch.softmax(q.to(BF16) @ q.to(BF16).transpose(-2, -1), dim=-1) @ q.to(BF16)
    assert torch.equal(att, ref)
    assert sm.dtype == F32  # softmax outside my_attention follows the policy
    rules = [(r.op, r.rule) for r in tr.records if r.rule != "none"]
    assert rules == [("my_attention", "lower_precision_fp"), ("softmax", "fp32")]
    with ampkit.autocast("cpu"):  # the default policy does not list softmax on cpu
        assert torch.softmax(q.to(BF16), dim=-1).dtype == BF16


@pytest.mark.parametrize("by_keyword, positional", [
    (lambda x: torch.sum(input=x), lambda x: torch.sum(x)),
    (lambda x: torch.cumsum(input=x, dim=0), lambda x: torch.cumsum(x, 0)),
    (lambda x: torch.softmax(input=x, dim=0), lambda x: torch.softmax(x, 0)),
], ids=["sum", "cumsum", "softmax"])
def test_fp32_output_sees_a_tensor_passed_by_keyword(by_keyword, positional):
    """A keyword call gets the positional call's float32 output (native does the same on cuda,
    where these ops are fp32_output; the cpu table has none, so a policy lists them here)."""
    policy = ampkit.load_policy("torch_default").with_ops(
        "cpu", fp32_output=["sum", "cumsum", "softmax"])
    x = torch.randn(6, 4).to(torch.bfloat16)
    with ampkit.autocast("cpu", policy=policy):
        got, want = by_keyword(x), positional(x)
    assert want.dtype == got.dtype == torch.float32
    assert torch.equal(got, want)


def test_composite_bodies_see_a_module_patched_after_their_first_region(monkeypatch):
    """ampkit runs F.multi_head_attention_forward's body through a clone; a later patch of
    F.linear must reach that clone as it reaches the function natively."""
    mha = torch.nn.MultiheadAttention(8, 2)
    q = torch.randn(3, 2, 8)
    with ampkit.autocast("cpu"):
        mha(q, q, q)  # the clone exists now
    calls = []
    real = F.linear

    def spy(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(F, "linear", spy)
    mha(q, q, q)
    native = len(calls)
    calls.clear()
    with ampkit.autocast("cpu"):
        mha(q, q, q)
    assert native > 0 and len(calls) == native


def test_unlisted_user_op_body_is_seen():
    x, w = torch.randn(2, 4), torch.randn(3, 4)
    with ampkit.autocast("cpu"):
        assert _scale(x, w).dtype == BF16  # the linear inside is cast
    policy = ampkit.load_policy("torch_default").with_ops("cpu", fp32=["my_scale"])
    with ampkit.autocast("cpu", policy=policy):
        assert _scale(x.to(BF16), w.to(BF16)).dtype == F32
    with ampkit.autocast("cpu", enabled=False):
        assert torch.equal(_scale(x, w), F.linear(x, w) * 2)


def test_user_op_bad_registration():
    with pytest.raises(ValueError, match="already names a torch op"):
        ampkit.op(lambda x: x, name="linear")
    with pytest.raises(ValueError, match="identifier"):
        ampkit.op(lambda x: x, name="not a name")
    with pytest.raises(TypeError, match="expected a function"):
        ampkit.op(3, name="three")


# --------------------------------------------------------------------- bad arguments
@pytest.mark.parametrize(
    "kwargs,exc,match",
    [
        (dict(device_type="tpu"), ValueError, "device type 'tpu' is not supported.*cpu, cuda"),
        (dict(device_type=0), ValueError, "device_type must be a string"),
        (dict(device_type="cpu", dtype=torch.float32), ValueError, "not a lower-precision dtype"),
        (dict(device_type="cpu", dtype="bfloat16"), ValueError, "not a lower-precision dtype"),
        (dict(device_type="cpu", enabled="yes"), ValueError, "enabled must be True or False"),
        (dict(device_type="cpu", cache_enabled=1), ValueError, "cache_enabled must be"),
        (dict(device_type="cpu", policy="no_such_policy"), ampkit.PolicyError, "no shipped policy named 'no_such_policy'"),
    ],
)
def test_bad_arguments(kwargs, exc, match):
    with pytest.raises(exc, match=match):
        ampkit.autocast(**kwargs)
    assert modes() == 0 or not ampkit.is_autocast_enabled("cpu")


@pytest.mark.parametrize("bad", [dict(enabled="yes"), dict(enabled=1), dict(cache_enabled=1), dict(cache_enabled="no")])
def test_bad_arguments_are_refused_after_the_same_region_was_entered(bad):
    """A region entered again skips the checks its arguments passed: not those of another."""
    for policy in (None, ampkit.load_policy("torch_default")):
        with ampkit.autocast("cpu", policy=policy):
            pass
        with pytest.raises(ValueError, match="must be True(,| or) False"):
            ampkit.autocast("cpu", policy=policy, **bad)


def test_a_region_keeps_the_policy_object_it_was_given():
    policy = ampkit.load_policy("torch_default").with_ops("cpu", fp32=["mm"])
    twin = ampkit.load_policy("torch_default").with_ops("cpu", fp32=["mm"])
    assert twin == policy and twin is not policy
    for p in (policy, twin, policy):
        region = ampkit.autocast("cpu", policy=p)
        with region:
            assert torch.mm(torch.ones(2, 2), torch.ones(2, 2)).dtype == F32
        assert region.policy is p


def test_bad_custom_fwd_device():
    with pytest.raises(ValueError, match="device_type must be a string"):
        ampkit.custom_fwd(device_type=None)


# --------------------------------------------------------------------- enter/exit misuse
def _region_state():
    eng = _engine.thread_engine()
    return (torch.is_autocast_enabled("cpu"), torch.get_autocast_dtype("cpu"), eng.depth,
            modes(), eng.mode_pushed)


def _regions_still_work():
    """Every kind of later region in this thread behaves as torch.autocast does."""
    policy = ampkit.load_policy("torch_default").with_ops("cpu", fp32=["linear"])
    with torch.autocast("cpu", dtype=BF16):
        want = lin().dtype
    with ampkit.autocast("cpu", dtype=BF16):
        assert lin().dtype == want
        with ampkit.autocast("cpu", enabled=False):
            assert lin().dtype == F32
    with ampkit.autocast("cpu", policy=policy):
        assert lin().dtype == F32
    assert _region_state() == (False, BF16, 0, 0, False)


@pytest.mark.parametrize("inside", [False, True], ids=["outside", "inside-a-region"])
def test_exit_without_enter_raises_and_changes_nothing(inside):
    stray = ampkit.autocast("cpu", dtype=F16)
    with contextlib.ExitStack() as stack:
        if inside:
            stack.enter_context(ampkit.autocast("cpu", dtype=BF16))
        before = _region_state()
        with pytest.raises(RuntimeError, match=r"__exit__\(\) called, but this region was never entered"):
            stray.__exit__(None, None, None)
        assert _region_state() == before
        if inside:
            assert lin().dtype == BF16
    _regions_still_work()


def test_exit_twice_raises_the_second_time_and_changes_nothing():
    region = ampkit.autocast("cpu")
    with region:
        pass
    with pytest.raises(RuntimeError, match="never entered"):
        region.__exit__(None, None, None)
    _regions_still_work()
    with region:  # a finished region can be entered again
        assert lin().dtype == BF16


def test_entering_an_active_region_again_raises_and_changes_nothing():
    region = ampkit.autocast("cpu", dtype=BF16)
    with region:
        before = _region_state()
        with pytest.raises(RuntimeError, match="already active.*new ampkit.autocast"):
            region.__enter__()
        assert _region_state() == before
        assert lin().dtype == BF16
    _regions_still_work()


def test_exit_in_another_thread_raises_and_changes_nothing():
    region = ampkit.autocast("cpu")
    region.__enter__()
    errors = []

    def other():
        try:
            region.__exit__(None, None, None)
        except RuntimeError as e:
            errors.append(str(e))

    t = threading.Thread(target=other)
    t.start()
    t.join()
    assert errors and "entered in another thread" in errors[0]
    assert torch.is_autocast_enabled("cpu")
    region.__exit__(None, None, None)
    _regions_still_work()


@pytest.mark.parametrize("query", ["is_autocast_enabled", "get_autocast_dtype"])
def test_unknown_device_types_raise_like_torch_naming_the_value(query):
    for bad in ("tpu", "CPU"):
        with pytest.raises(RuntimeError) as native:
            getattr(torch, query)(bad)
        with pytest.raises(RuntimeError, match=rf"device_type '{bad}' is not a device type.*'cpu' and 'cuda'") as ours:
            getattr(ampkit, query)(bad)
        assert str(native.value) in str(ours.value)  # torch's list of device types
    with pytest.raises(TypeError, match=r"device_type must be a string.*got 3"):
        getattr(ampkit, query)(3)
    assert getattr(ampkit, query)("cpu") == getattr(torch, query)("cpu")


# --------------------------------------------------------------------- re-registering an op
def _double_linear(x, w):
    return F.linear(x, w) * 2


def _triple_linear(x, w):
    return F.linear(x, w) * 3


def test_a_taken_op_name_is_refused_and_the_first_wrapper_keeps_being_cast():
    first = ampkit.op(_double_linear, name="robust_scaled_linear")
    policy = ampkit.load_policy("torch_default").with_ops("cpu", fp32=["robust_scaled_linear"])
    x, w = torch.randn(2, 4).to(BF16), torch.randn(3, 4).to(BF16)
    with pytest.raises(ValueError, match=r"'robust_scaled_linear' is already registered for .*_double_linear.*replace=True"):
        ampkit.op(_triple_linear, name="robust_scaled_linear")
    assert ampkit.op(_double_linear, name="robust_scaled_linear") is first  # same function: a no-op
    with ampkit.autocast("cpu", policy=policy):
        assert first(x, w).dtype == F32  # still listed, still cast
    with pytest.raises(TypeError, match="replace must be True or False, got 'yes'"):
        ampkit.op(_triple_linear, name="robust_scaled_linear", replace="yes")


def test_replace_true_registers_the_new_function_in_place_of_the_first():
    first = ampkit.op(_double_linear, name="robust_replaced_linear")
    second = ampkit.op(_triple_linear, name="robust_replaced_linear", replace=True)
    policy = ampkit.load_policy("torch_default").with_ops("cpu", fp32=["robust_replaced_linear"])
    x, w = torch.randn(2, 4).to(BF16), torch.randn(3, 4).to(BF16)
    with ampkit.autocast("cpu", policy=policy):
        assert second(x, w).dtype == F32
        assert first(x, w).dtype == BF16  # now an unlisted op: its body runs in the region
    assert torch.equal(second(x, w), F.linear(x, w) * 3)
