"""A region's policy changes run as kernels at torch's Autocast key (ampkit._kernels).

Oracle: the same region with the kernel route off (every change through the handler mode,
whose results the table tests prove against hand-made expectations), and torch.autocast
for everything the region does not change. Dtypes exactly, values bitwise.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import threading

import pytest
import torch
import torch.nn.functional as F

import ampkit
import ampkit._kernels as kernels
from ampkit._engine import thread_engine
from ampkit.testing import op_sample
from conftest import bits_equal, compiles_correctly_here

BASE = ampkit.load_policy("torch_default")
CPU = BASE.rules("cpu")


def same(a, b):
    """Bitwise equal tensors (conftest.bits_equal), also inside tuples and lists."""
    if isinstance(a, (tuple, list)):
        return type(a) is type(b) and len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    if isinstance(a, torch.Tensor):
        return bits_equal(a, b)
    return a == b


@pytest.fixture(autouse=True)
def no_compiled_code():
    """The route runs while torch.compile holds no compiled code (other tests compile)."""
    torch._dynamo.reset()
    assert not kernels.dynamo_used()
    yield
    kernels.drop_idle()


@pytest.fixture
def route():
    """route(on): run with the kernel route on or off, restored afterwards."""
    before = kernels.ENABLED[0]

    def set_route(on):
        kernels.ENABLED[0] = on

    yield set_route
    kernels.ENABLED[0] = before


def _moves(dev):
    """(op, target category) for every op of ``dev`` that can run as a kernel, moved to a
    category other than its own (lower_precision_fp <-> fp32; others to fp32)."""
    out = []
    rules = BASE.rules(dev)
    for cat in ("lower_precision_fp", "fp32", "promote"):
        for op in rules.ops(cat):
            if kernels.overloads(op):
                out.append((op, "fp32" if cat != "fp32" else "lower_precision_fp"))
    return out


MOVES = [("cpu", op, to) for op, to in _moves("cpu")] + [
    pytest.param("cuda", op, to, marks=pytest.mark.cuda, id=f"cuda-{op}->{to}") for op, to in _moves("cuda")]


def test_some_ops_of_each_category_run_as_kernels():
    cpu = _moves("cpu")
    cats = {BASE.category("cpu", op) for op, _ in cpu}
    assert {"lower_precision_fp", "fp32", "promote"} <= cats
    assert len(cpu) > 40 and len(_moves("cuda")) > 40


@pytest.mark.parametrize("dev,op,to", MOVES)
def test_a_moved_op_gives_the_handlers_result(dev, op, to, route):
    policy = BASE.with_ops(dev, **{to: [op]})
    try:
        sample = op_sample(op, dev)
    except KeyError:
        pytest.skip(f"no sample for {op}")
    outs = []
    for on in (True, False):
        route(on)
        with ampkit.autocast(dev, policy=policy):
            pushed = thread_engine().mode_pushed
            try:
                outs.append((sample.fn(*sample.args, **sample.kwargs), None))
            except Exception as e:  # the handler must raise the same way
                outs.append((None, f"{type(e).__name__}: {e}"))
        if on:
            assert not pushed, "a change that runs as a kernel needs no handler mode"
    (got, got_err), (want, want_err) = outs
    assert got_err == want_err
    if want_err is None:
        assert same(got, want)
    assert kernels.held() == {}


def test_kernels_are_held_while_regions_need_them_then_idle_with_natives_handling():
    policy = BASE.with_ops("cpu", fp32=["linear"])
    lin, x = torch.nn.Linear(4, 3), torch.randn(2, 4)
    key = (torch.ops.aten.linear.default, "cpu")

    def holders():
        return kernels.held().get(key, 0)

    with torch.autocast("cpu"):
        native = lin(x)
    with ampkit.autocast("cpu", policy=policy):
        with ampkit.autocast("cpu", policy=policy):
            assert holders() == 2
        assert holders() == 1
        assert lin(x).dtype == torch.float32
    assert holders() == 0 and key in kernels.registered()  # kept, idle: no re-registration
    with torch.autocast("cpu"):
        assert same(lin(x), native)  # ...doing what torch's own kernel does
    kernels.drop_idle()
    assert kernels.registered() == frozenset()
    with torch.autocast("cpu"):
        assert same(lin(x), native)  # torch's own kernel is back
    with ampkit.autocast("cpu", policy=policy):  # the same region again registers it again
        assert holders() == 1 and lin(x).dtype == torch.float32
        kernels.drop_idle()  # a held kernel stays
        assert holders() == 1 and lin(x).dtype == torch.float32
    assert holders() == 0 and key in kernels.registered()


def test_an_idle_kernel_gives_torch_autocast_its_values_but_not_its_cast_cache():
    """The one difference an idle kernel makes outside ampkit's regions (documented): the
    values are native's, but two uses of a weight get two casts (native shares one)."""
    w = torch.nn.Parameter(torch.randn(3, 4))
    a, b = torch.randn(2, 4), torch.randn(2, 4)
    with torch.autocast("cpu"):
        native = (F.linear(a, w), F.linear(b, w))
    with ampkit.autocast("cpu", policy=BASE.with_ops("cpu", fp32=["linear"])):
        pass
    with torch.autocast("cpu"):
        idle = (F.linear(a, w), F.linear(b, w))
    assert same(idle, native)

    def casts(y):  # the cast nodes (ToCopyBackward) in y's graph
        out, todo = set(), [y.grad_fn]
        while todo:
            n = todo.pop()
            if n is not None:
                if "ToCopy" in n.name():
                    out.add(n)
                todo.extend(m for m, _ in n.next_functions)
        return out

    assert casts(native[0]) & casts(native[1])  # one shared cast of w
    assert not casts(idle[0]) & casts(idle[1])  # a cast of w per use


def test_inner_regions_and_torch_autocast_see_their_own_table():
    """A nested default region runs native's rule for the op; torch.autocast(enabled=False)
    switches the change off; both as with the handler."""
    policy = BASE.with_ops("cpu", fp32=["linear"])
    lin, x = torch.nn.Linear(4, 3), torch.randn(2, 4)
    with torch.autocast("cpu"):
        native = lin(x)
    with ampkit.autocast("cpu", policy=policy):
        with ampkit.autocast("cpu"):
            assert same(lin(x), native)
        with torch.autocast("cpu", enabled=False):
            assert lin(x).dtype == torch.float32
        assert lin(x).dtype == torch.float32


def test_another_thread_under_torch_autocast_gets_natives_result():
    policy = BASE.with_ops("cpu", fp32=["linear", "mm"], lower_precision_fp=["cdist"])
    a, b = torch.randn(6, 5), torch.randn(5, 4)
    lin = torch.nn.Linear(5, 3)
    with torch.autocast("cpu"):
        want = (lin(a), a @ b, torch.mm(a, b), torch.cdist(a, a))
    got = []
    ready, done = threading.Event(), threading.Event()

    def other():
        ready.wait()
        with torch.autocast("cpu"):  # kernels registered by the main thread's region
            got.append((lin(a), a @ b, torch.mm(a, b), torch.cdist(a, a)))
        done.set()

    t = threading.Thread(target=other)
    t.start()
    with ampkit.autocast("cpu", policy=policy):
        assert kernels.held()
        ready.set()
        done.wait(60)
        assert lin(a).dtype == torch.float32
    t.join()
    assert same(got[0], want)


def test_gradients_through_a_kernel_equal_the_handlers(route):
    policy = BASE.with_ops("cpu", fp32=["linear"], lower_precision_fp=["layer_norm"])
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.LayerNorm(8), torch.nn.Linear(8, 2))
    x = torch.randn(4, 8)
    grads = []
    for on in (True, False):
        route(on)
        model.zero_grad()
        with ampkit.autocast("cpu", policy=policy):
            y = model(x)
        y.float().sum().backward()
        grads.append([y.detach()] + [p.grad.clone() for p in model.parameters()])
    assert same(grads[0], grads[1])


def test_plain_checkpoint_of_a_kernel_change_still_raises_and_names_the_remedy():
    policy = BASE.with_ops("cpu", fp32=["linear"])
    lin = torch.nn.Linear(4, 4)
    x = torch.randn(2, 4, requires_grad=True)
    with ampkit.autocast("cpu", policy=policy):
        with pytest.raises(RuntimeError, match="ampkit.checkpoint"):
            torch.utils.checkpoint.checkpoint(lin, x, use_reentrant=False)
        y = ampkit.checkpoint(lin, x, use_reentrant=False)
    y.sum().backward()
    assert y.dtype == torch.float32 and kernels.held() == {}


def test_a_region_that_raises_drops_its_kernels():
    policy = BASE.with_ops("cpu", fp32=["linear"])
    with pytest.raises(ZeroDivisionError):
        with ampkit.autocast("cpu", policy=policy):
            1 / 0
    assert kernels.held() == {} and thread_engine().depth == 0


_FIRST_COMPILE = textwrap.dedent("""
    import torch, ampkit
    import ampkit._kernels as kernels
    torch.manual_seed(0)
    lin = torch.nn.Linear(8, 8)
    x = torch.randn(4, 8)
    f = torch.compile(lin)
    policy = ampkit.load_policy("torch_default").with_ops("cpu", fp32=["linear"])
    assert not kernels.dynamo_used()
    with ampkit.autocast("cpu", policy=policy):
        inside = f(x)
    with torch.autocast("cpu"):
        after = f(x)
        eager = lin(x)
    print(inside.dtype, after.dtype, eager.dtype, torch.equal(after, eager))
""")


def test_a_first_compile_inside_a_kernel_region_outlives_it_in_no_graph():
    """In a fresh process (torch.compile not used yet): a model first compiled inside a
    region whose change runs as a kernel honours the change, and once the region is gone
    the same compiled model under torch.autocast gives torch's result, not a stale graph."""
    if sys.platform != "linux":
        pytest.skip("compile test on linux only")
    compiles_correctly_here("cpu")
    out = subprocess.run([sys.executable, "-c", _FIRST_COMPILE], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    inside, after, eager, same = out.stdout.split()
    assert (inside, after, eager, same) == ("torch.float32", "torch.bfloat16", "torch.bfloat16", "True")


def test_while_torch_compile_holds_code_regions_use_the_handler():
    """dynamo guards compiled code on the mode stack, not on dispatcher registrations."""
    torch.compile(lambda t: t + 1)(torch.randn(2))
    assert kernels.dynamo_used()
    lin, x = torch.nn.Linear(4, 3), torch.randn(2, 4)
    with ampkit.autocast("cpu", policy=BASE.with_ops("cpu", fp32=["linear"])):
        assert thread_engine().mode_pushed and kernels.held() == {}
        assert lin(x).dtype == torch.float32
    torch._dynamo.reset()
    with ampkit.autocast("cpu", policy=BASE.with_ops("cpu", fp32=["linear"])):
        assert not thread_engine().mode_pushed and kernels.held()


def test_the_route_can_be_switched_off_from_the_environment():
    code = "import ampkit._kernels as k; print(k.ENABLED[0])"
    env = dict(os.environ, AMPKIT_AUTOCAST_KERNELS="0")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert out.stdout.strip() == "False", out.stderr[-2000:]
