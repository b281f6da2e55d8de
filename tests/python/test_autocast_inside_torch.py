"""An ampkit region is a torch autocast region as far as torch can tell.

Each test runs the same code under ``torch.autocast`` (the oracle) and under
``ampkit.autocast``: torch's own state, activation checkpointing (both kinds),
third-party ``torch.amp.custom_fwd``, nesting either way, ``torch.compile``.
With a changed policy the expected result is computed independently: the
inputs are cast by hand as the policy says and the op is called with autocast
off, inside an otherwise native ``torch.autocast`` region. Every test runs on
the CPU (bfloat16) and, marked ``cuda``, on a GPU (float16).
"""

from __future__ import annotations


import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
import torch.utils.checkpoint as ckpt

import ampkit
from conftest import TORCH_BEFORE_2_5, bits_equal, compiles_correctly_here

pytestmark = pytest.mark.usefixtures("ampkit_quiet")
BF16, F16, F32 = torch.bfloat16, torch.float16, torch.float32
LOW = {"cpu": BF16, "cuda": F16}  # each device's default region dtype
# linear moves from lower_precision_fp to fp32, layer_norm (natively unlisted on cpu,
# fp32 on cuda) into lower_precision_fp: two ops whose handling differs from torch's.
CHANGED = ampkit.load_policy("torch_default").with_ops(fp32=["linear"], lower_precision_fp=["layer_norm"])


@pytest.fixture(params=["cpu", pytest.param("cuda", marks=pytest.mark.cuda)])
def dev(request):
    torch._dynamo.reset()
    yield request.param
    torch._dynamo.reset()


class Block(nn.Module):
    def __init__(self, dev, width=16):
        super().__init__()
        self.dev, self.low = dev, LOW[dev]
        self.fc1 = nn.Linear(width, 2 * width)
        self.norm = nn.LayerNorm(2 * width)
        self.fc2 = nn.Linear(2 * width, width)
        self.to(dev)

    def forward(self, x):
        return self.stages(x)[-1]

    def stages(self, x):
        """Every intermediate: their dtypes show which rule each op followed."""
        a = self.fc1(x)
        b = self.norm(a)
        c = self.fc2(F.gelu(b))
        return a, b, c, c + x

    def forward_as_changed(self, x):
        """``forward`` under CHANGED, written out by hand for a native region."""
        return self.stages_as_changed(x)[-1]

    def stages_as_changed(self, x):
        a = self._fp32_linear(x, self.fc1)
        with torch.autocast(self.dev, enabled=False):
            b = F.layer_norm(a.to(self.low), self.norm.normalized_shape, self.norm.weight.to(self.low),
                             self.norm.bias.to(self.low), self.norm.eps)
        c = self._fp32_linear(F.gelu(b), self.fc2)
        return a, b, c, c + x

    def _fp32_linear(self, x, lin):
        with torch.autocast(self.dev, enabled=False):
            return F.linear(x.float(), lin.weight, lin.bias)


def fresh(dev, seed=0):
    torch.manual_seed(seed)
    return Block(dev), torch.randn(8, 16, device=dev)


def grads_of(dev, run, seed=0):
    """Run ``run(block, x)`` on fresh copies; the output and every gradient."""
    block, x = fresh(dev, seed)
    x.requires_grad_(True)
    out = run(block, x)
    (out.float() * torch.linspace(-1, 1, out.numel(), device=dev).reshape(out.shape)).sum().backward()
    return [out.detach(), x.grad] + [p.grad for p in block.parameters()]


def same_all(a, b):
    return len(a) == len(b) and all(bits_equal(u, v) for u, v in zip(a, b))


def torch_state(dev):
    return torch.is_autocast_enabled(dev), torch.get_autocast_dtype(dev), torch.is_autocast_cache_enabled()


# --------------------------------------------------------------------- torch's state
def test_torch_sees_the_region_and_restores_it_after_an_exception(dev):
    before = torch_state(dev)
    depth = torch._C._len_torch_function_stack()
    other = F16 if LOW[dev] is BF16 else BF16
    for policy in (None, CHANGED):
        with pytest.raises(ZeroDivisionError):
            with ampkit.autocast(dev, dtype=other, cache_enabled=False, policy=policy):
                assert torch_state(dev) == (True, other, False)
                1 / 0
        assert torch_state(dev) == before
        assert torch._C._len_torch_function_stack() == depth


# --------------------------------------------------------------------- checkpointing
@pytest.mark.parametrize("reentrant", [False, True], ids=["non_reentrant", "reentrant"])
def test_checkpoint_gives_torch_autocasts_gradients(dev, reentrant):
    def run(region):
        def go(block, x):
            with region(dev):
                return ckpt.checkpoint(block, x, use_reentrant=reentrant)
        return go

    native = grads_of(dev, run(torch.autocast))
    ours = grads_of(dev, run(ampkit.autocast))
    assert native[0].dtype == F32  # (the residual add promotes the low-precision fc2 output)
    assert same_all(ours, native)


@pytest.mark.parametrize("reentrant", [False, True], ids=["non_reentrant", "reentrant"])
def test_plain_checkpoint_with_a_changed_policy_raises_and_names_the_remedy(dev, reentrant):
    block, x = fresh(dev)
    x.requires_grad_(True)
    with pytest.raises(RuntimeError, match=r"ampkit\.checkpoint\(function"):
        with ampkit.autocast(dev, policy=CHANGED):
            out = ckpt.checkpoint(block, x, use_reentrant=reentrant)
            out.sum().backward()


@pytest.mark.parametrize("reentrant", [False, True], ids=["non_reentrant", "reentrant"])
def test_ampkit_checkpoint_with_a_changed_policy_gives_the_policys_gradients(dev, reentrant):
    def plain(block, x):
        with ampkit.autocast(dev, policy=CHANGED):
            return block(x)

    def checkpointed(block, x):
        with ampkit.autocast(dev, policy=CHANGED):
            return ampkit.checkpoint(block, x, use_reentrant=reentrant)

    def by_hand(block, x):
        with torch.autocast(dev):
            return block.forward_as_changed(x)

    want = grads_of(dev, by_hand)
    assert want[0].dtype == F32 and want[1].dtype == F32
    assert same_all(grads_of(dev, plain), want)
    assert same_all(grads_of(dev, checkpointed), want)


def test_ampkit_checkpoint_with_the_default_policy_is_torchs(dev):
    def ours(block, x):
        with ampkit.autocast(dev):
            return ampkit.checkpoint(block, x, use_reentrant=False)

    def native(block, x):
        with torch.autocast(dev):
            return ckpt.checkpoint(block, x, use_reentrant=False)

    assert same_all(grads_of(dev, ours), grads_of(dev, native))
    with pytest.raises(TypeError, match="function must be callable"):
        ampkit.checkpoint(3, torch.randn(2), use_reentrant=False)


@pytest.mark.parametrize("reentrant", [False, True], ids=["non_reentrant", "reentrant"])
def test_ampkit_checkpoint_leaves_torchs_own_state_to_torch(dev, reentrant):
    """Only the policy is replayed: a torch.autocast nested in the region decides as under
    torch's checkpoint."""
    other = F16 if LOW[dev] is BF16 else BF16

    def run(ckpt_fn, inner):
        block, x = fresh(dev)
        x.requires_grad_(True)
        with ampkit.autocast(dev), inner:
            return ckpt_fn(block.fc1, x, use_reentrant=reentrant).dtype

    for inner in (lambda: torch.autocast(dev, enabled=False), lambda: torch.autocast(dev, dtype=other)):
        assert run(ampkit.checkpoint, inner()) == run(ckpt.checkpoint, inner())
    assert run(ampkit.checkpoint, torch.autocast(dev, enabled=False)) == F32


@pytest.mark.parametrize("reentrant", [False, True], ids=["non_reentrant", "reentrant"])
def test_a_changed_region_inside_the_checkpointed_function_needs_no_remedy(dev, reentrant):
    """The recomputation enters that region again: plain torch checkpoint is exact."""
    def inside(block, x):
        def body(a):
            with ampkit.autocast(dev, policy=CHANGED):
                return block(a)
        return ckpt.checkpoint(body, x, use_reentrant=reentrant)

    def plain(block, x):
        with ampkit.autocast(dev, policy=CHANGED):
            return block(x)

    assert same_all(grads_of(dev, inside), grads_of(dev, plain))


def test_a_plain_checkpoint_nested_in_ampkit_checkpoint_still_raises(dev):
    block, x = fresh(dev)
    x.requires_grad_(True)

    def outer(a):
        return ckpt.checkpoint(block, a, use_reentrant=False)

    with pytest.raises(RuntimeError, match=r"ampkit\.checkpoint\(function"):
        with ampkit.autocast(dev, policy=CHANGED):
            ampkit.checkpoint(outer, x, use_reentrant=False).sum().backward()


# --------------------------------------------------------------------- custom_fwd
def third_party(dev):
    """A library's function written for torch.autocast, knowing nothing of ampkit."""
    seen = []

    class ThirdParty(torch.autograd.Function):
        @staticmethod
        @torch.amp.custom_fwd(device_type=dev, cast_inputs=torch.float32)
        def forward(ctx, a, b):
            ctx.save_for_backward(a, b)
            seen.append((a.dtype, b.dtype, torch.is_autocast_enabled(dev)))
            return F.linear(a, b)

        @staticmethod
        @torch.amp.custom_bwd(device_type=dev)
        def backward(ctx, g):
            a, b = ctx.saved_tensors
            seen.append((g.dtype, torch.is_autocast_enabled(dev)))
            return g.mm(b), g.t().mm(a)

    return ThirdParty, seen


@pytest.mark.parametrize("policy", [None, CHANGED], ids=["default", "changed"])
def test_third_party_custom_fwd_behaves_as_under_torch_autocast(dev, policy):
    def go(region):
        fn, seen = third_party(dev)
        torch.manual_seed(0)
        a = torch.randn(4, 6, device=dev, dtype=LOW[dev], requires_grad=True)
        b = torch.randn(3, 6, device=dev, requires_grad=True)
        with region:
            out = fn.apply(a, b)
        out.sum().backward()
        return seen, out.dtype, a.grad.dtype, out.detach()

    native = go(torch.autocast(dev))
    ours = go(ampkit.autocast(dev, policy=policy))
    assert native[0][0] == (F32, F32, False) and native[1] == F32
    assert ours[:3] == native[:3] and bits_equal(ours[3], native[3])


# --------------------------------------------------------------------- nesting
def _ops_dtypes(x, w, norm):
    return F.linear(x, w).dtype, F.layer_norm(x, (x.shape[-1],), norm, norm).dtype, torch.mm(x, w.t()).dtype


def _operands(dev):
    return torch.randn(4, 8, device=dev), torch.randn(3, 8, device=dev), torch.ones(8, device=dev)


@pytest.mark.parametrize("inner", ["torch", "ampkit"])
@pytest.mark.parametrize("outer", ["torch", "ampkit"])
def test_nesting_either_way_is_nesting_two_torch_autocasts(dev, outer, inner):
    regions = {"torch": torch.autocast, "ampkit": ampkit.autocast}
    x, w, norm = _operands(dev)

    def walk(o, i):
        seen = []
        with o(dev, dtype=BF16):
            seen.append(_ops_dtypes(x, w, norm))
            with i(dev, enabled=False):
                seen.append(_ops_dtypes(x, w, norm))
                with o(dev, dtype=F16):
                    seen.append(_ops_dtypes(x, w, norm))
            seen.append((torch.is_autocast_enabled(dev), torch.get_autocast_dtype(dev)))
        return seen

    assert walk(regions[outer], regions[inner]) == walk(torch.autocast, torch.autocast)


@pytest.mark.parametrize("inner", ["torch", "ampkit"])
@pytest.mark.parametrize("outer", ["torch", "ampkit"])
def test_an_inner_region_without_a_dtype_takes_the_enclosing_regions(dev, outer, inner):
    regions = {"torch": torch.autocast, "ampkit": ampkit.autocast}
    x, w, norm = _operands(dev)
    other = F16 if LOW[dev] is BF16 else BF16

    def walk(o, i):
        with o(dev, dtype=other):
            with i(dev):
                return _ops_dtypes(x, w, norm), torch.get_autocast_dtype(dev)

    assert walk(regions[outer], regions[inner]) == walk(torch.autocast, torch.autocast)
    assert walk(torch.autocast, torch.autocast)[1] == other


def test_torch_autocast_disabled_inside_a_changed_region_switches_the_policy_off_too(dev):
    x, w, norm = _operands(dev)
    low = LOW[dev]
    with ampkit.autocast(dev, policy=CHANGED):
        assert _ops_dtypes(x, w, norm) == (F32, low, low)  # linear fp32, layer_norm low, mm low
        with torch.autocast(dev, enabled=False):
            assert _ops_dtypes(x, w, norm) == (F32, F32, F32)
            assert F.linear(x.to(low), w.to(low)).dtype == low  # not cast to fp32 either
        other = F16 if low is BF16 else BF16
        with torch.autocast(dev, dtype=other):  # torch's dtype, the region's policy
            assert _ops_dtypes(x, w, norm) == (F32, other, other)


# --------------------------------------------------------------------- torch.compile
def _graphs(fn, *args):
    torch._dynamo.reset()
    ex = torch._dynamo.explain(fn)(*args)
    return ex.graph_count, ex.graph_break_count


def in_region(region, body):
    """body run inside a fresh region (made inside the function, as a user writes it)."""
    def run(x):
        with region():
            return body(x)
    return run


# torch 2.4's dynamo cannot trace a user-defined context manager in a with statement
# (nor torch._C._is_autocast_available in torch.amp.autocast.__init__): there a region
# inside compiled code breaks the graph; compiled models called inside regions work.
needs_dynamo_2_5 = pytest.mark.skipif(
    TORCH_BEFORE_2_5, reason="torch < 2.5: a region inside compiled code breaks the graph (docs/autocast.md)")


def regions(dev):
    return (lambda: torch.autocast(dev), lambda: ampkit.autocast(dev),
            lambda: ampkit.autocast(dev, policy=CHANGED))


@needs_dynamo_2_5
def test_a_region_inside_a_compiled_function_needs_the_graphs_torch_needs(dev):
    block, x = fresh(dev)
    native, ours, changed = regions(dev)
    assert _graphs(in_region(native, block), x) == (1, 0)
    assert _graphs(in_region(ours, block), x) == (1, 0)
    assert _graphs(in_region(changed, block), x) == (1, 0)


@pytest.mark.parametrize("fullgraph", [False, pytest.param(True, marks=needs_dynamo_2_5)],
                         ids=["graph_breaks_allowed", "fullgraph"])
def test_a_region_inside_a_compiled_function_equals_torch_autocast(dev, fullgraph):
    compiles_correctly_here(dev)
    block, x = fresh(dev)
    native, ours, _ = regions(dev)
    want = torch.compile(in_region(native, block), fullgraph=fullgraph)(x)
    torch._dynamo.reset()
    got = torch.compile(in_region(ours, block), fullgraph=fullgraph)(x)
    assert got.dtype == want.dtype == F32 and bits_equal(got, want)


def assert_stages_as_changed(got, want, low):
    """linear in float32, layer_norm in low precision, as CHANGED says; values to low-precision
    round-off (inductor fuses differently around the hand-written casts)."""
    assert [t.dtype for t in got] == [t.dtype for t in want] == [F32, low, F32, F32]
    for g, w in zip(got, want):
        assert torch.allclose(g.float(), w.float(), rtol=1e-2, atol=1e-2)


@needs_dynamo_2_5
def test_a_changed_policy_is_honoured_inside_a_compiled_function(dev):
    compiles_correctly_here(dev)
    block, x = fresh(dev)
    native, _, changed = regions(dev)
    want = torch.compile(in_region(native, block.stages_as_changed), fullgraph=True)(x)
    torch._dynamo.reset()
    got = torch.compile(in_region(changed, block.stages), fullgraph=True)(x)
    assert_stages_as_changed(got, want, LOW[dev])


def test_a_compiled_model_called_inside_a_region_equals_torch_autocast(dev):
    compiles_correctly_here(dev)
    block, x = fresh(dev)
    compiled = torch.compile(block)
    with torch.autocast(dev):
        want = compiled(x)
    with ampkit.autocast(dev):
        got = compiled(x)
    assert got.dtype == want.dtype == F32 and bits_equal(got, want)
    stages = torch.compile(block.stages)
    with ampkit.autocast(dev, policy=CHANGED):  # a changed policy: dynamo recompiles for its mode
        changed = stages(x)
    with torch.autocast(dev):
        by_hand = block.stages_as_changed(x)
    assert_stages_as_changed(changed, by_hand, LOW[dev])


def test_training_a_compiled_model_inside_a_region_matches_torch(dev):
    compiles_correctly_here(dev)
    block, x = fresh(dev)
    compiled = torch.compile(block)
    outs = []
    for region in (torch.autocast(dev), ampkit.autocast(dev)):
        block.zero_grad()
        with region:
            y = compiled(x)
        y.float().sum().backward()
        outs.append([y.detach()] + [p.grad.clone() for p in block.parameters()])
    assert same_all(outs[1], outs[0])
