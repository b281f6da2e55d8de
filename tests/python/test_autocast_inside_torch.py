"""An ampkit region is a torch autocast region as far as torch can tell.

Each test runs the same code under ``torch.autocast`` (the oracle) and under
``ampkit.autocast``: torch's own state, activation checkpointing (both kinds),
third-party ``torch.amp.custom_fwd``, nesting either way, ``torch.compile``.
With a changed policy the expected result is computed independently: the
inputs are cast by hand as the policy says and the op is called with autocast
off, inside an otherwise native ``torch.autocast`` region.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
import torch.utils.checkpoint as ckpt

import ampkit
from conftest import bits_equal

pytestmark = pytest.mark.usefixtures("ampkit_quiet")
BF16, F32 = torch.bfloat16, torch.float32
# linear moves from lower_precision_fp to fp32, layer_norm (natively unlisted on cpu)
# into lower_precision_fp: two ops whose handling differs from torch's.
CHANGED = ampkit.load_policy("torch_default").with_ops("cpu", fp32=["linear"], lower_precision_fp=["layer_norm"])


class Block(nn.Module):
    def __init__(self, width=16):
        super().__init__()
        self.fc1 = nn.Linear(width, 2 * width)
        self.norm = nn.LayerNorm(2 * width)
        self.fc2 = nn.Linear(2 * width, width)

    def forward(self, x):
        return self.stages(x)[-1]

    def stages(self, x):
        """Every intermediate: their dtypes show which rule each op followed."""
        a = self.fc1(x)
        b = self.norm(a)
        c = self.fc2(F.gelu(b))
        return a, b, c, c + x

    def forward_as_changed(self, x):
        """``forward`` under CHANGED, written out by hand for a native bfloat16 region."""
        return self.stages_as_changed(x)[-1]

    def stages_as_changed(self, x):
        a = _fp32_linear(x, self.fc1)
        with torch.autocast("cpu", enabled=False):
            b = F.layer_norm(a.to(BF16), self.norm.normalized_shape, self.norm.weight.to(BF16),
                             self.norm.bias.to(BF16), self.norm.eps)
        c = _fp32_linear(F.gelu(b), self.fc2)
        return a, b, c, c + x


def _fp32_linear(x, lin):
    with torch.autocast("cpu", enabled=False):
        return F.linear(x.float(), lin.weight, lin.bias)


def fresh(seed=0):
    torch.manual_seed(seed)
    return Block(), torch.randn(8, 16)


def grads_of(run, seed=0):
    """Run ``run(block, x)`` on fresh copies; the output and every gradient."""
    block, x = fresh(seed)
    x.requires_grad_(True)
    out = run(block, x)
    (out.float() * torch.linspace(-1, 1, out.numel()).reshape(out.shape)).sum().backward()
    return [out.detach(), x.grad] + [p.grad for p in block.parameters()]


def same_all(a, b):
    return len(a) == len(b) and all(bits_equal(u, v) for u, v in zip(a, b))


# --------------------------------------------------------------------- torch's state
def test_torch_sees_the_region_and_restores_it_after_an_exception():
    before = (torch.is_autocast_enabled("cpu"), torch.get_autocast_dtype("cpu"), torch.is_autocast_cache_enabled())
    depth = torch._C._len_torch_function_stack()
    for policy in (None, CHANGED):
        with pytest.raises(ZeroDivisionError):
            with ampkit.autocast("cpu", dtype=torch.float16, cache_enabled=False, policy=policy):
                assert torch.is_autocast_enabled("cpu") and torch.get_autocast_dtype("cpu") == torch.float16
                assert not torch.is_autocast_cache_enabled()
                1 / 0
        assert (torch.is_autocast_enabled("cpu"), torch.get_autocast_dtype("cpu"), torch.is_autocast_cache_enabled()) == before
        assert torch._C._len_torch_function_stack() == depth


# --------------------------------------------------------------------- checkpointing
@pytest.mark.parametrize("reentrant", [False, True], ids=["non_reentrant", "reentrant"])
def test_checkpoint_gives_torch_autocasts_gradients(reentrant):
    def run(region):
        def go(block, x):
            with region():
                return ckpt.checkpoint(block, x, use_reentrant=reentrant)
        return go

    native = grads_of(run(lambda: torch.autocast("cpu")))
    ours = grads_of(run(lambda: ampkit.autocast("cpu")))
    assert native[0].dtype == F32  # (the residual add promotes the bfloat16 fc2 output)
    assert same_all(ours, native)


@pytest.mark.parametrize("reentrant", [False, True], ids=["non_reentrant", "reentrant"])
def test_plain_checkpoint_with_a_changed_policy_raises_and_names_the_remedy(reentrant):
    block, x = fresh()
    x.requires_grad_(True)
    with pytest.raises(RuntimeError, match=r"ampkit\.checkpoint\(function"):
        with ampkit.autocast("cpu", policy=CHANGED):
            out = ckpt.checkpoint(block, x, use_reentrant=reentrant)
            out.sum().backward()


@pytest.mark.parametrize("reentrant", [False, True], ids=["non_reentrant", "reentrant"])
def test_ampkit_checkpoint_with_a_changed_policy_gives_the_policys_gradients(reentrant):
    def plain(block, x):
        with ampkit.autocast("cpu", policy=CHANGED):
            return block(x)

    def checkpointed(block, x):
        with ampkit.autocast("cpu", policy=CHANGED):
            return ampkit.checkpoint(block, x, use_reentrant=reentrant)

    def by_hand(block, x):
        with torch.autocast("cpu"):
            return block.forward_as_changed(x)

    want = grads_of(by_hand)
    assert want[0].dtype == F32 and want[1].dtype == F32
    assert same_all(grads_of(plain), want)
    assert same_all(grads_of(checkpointed), want)


def test_ampkit_checkpoint_with_the_default_policy_is_torchs():
    def ours(block, x):
        with ampkit.autocast("cpu"):
            return ampkit.checkpoint(block, x, use_reentrant=False)

    def native(block, x):
        with torch.autocast("cpu"):
            return ckpt.checkpoint(block, x, use_reentrant=False)

    assert same_all(grads_of(ours), grads_of(native))
    with pytest.raises(TypeError, match="function must be callable"):
        ampkit.checkpoint(3, torch.randn(2), use_reentrant=False)


# --------------------------------------------------------------------- custom_fwd
class ThirdParty(torch.autograd.Function):
    """A library's function written for torch.autocast, knowing nothing of ampkit."""

    seen: list = []

    @staticmethod
    @torch.amp.custom_fwd(device_type="cpu", cast_inputs=torch.float32)
    def forward(ctx, a, b):
        ctx.save_for_backward(a, b)
        ThirdParty.seen.append((a.dtype, b.dtype, torch.is_autocast_enabled("cpu")))
        return F.linear(a, b)

    @staticmethod
    @torch.amp.custom_bwd(device_type="cpu")
    def backward(ctx, g):
        a, b = ctx.saved_tensors
        ThirdParty.seen.append((g.dtype, torch.is_autocast_enabled("cpu")))
        return g.mm(b), g.t().mm(a)


@pytest.mark.parametrize("policy", [None, CHANGED], ids=["default", "changed"])
def test_third_party_custom_fwd_behaves_as_under_torch_autocast(policy):
    def go(region):
        ThirdParty.seen = []
        torch.manual_seed(0)
        a = torch.randn(4, 6, dtype=BF16, requires_grad=True)
        b = torch.randn(3, 6, requires_grad=True)
        with region:
            out = ThirdParty.apply(a, b)
        out.sum().backward()
        return ThirdParty.seen, out.dtype, a.grad.dtype, out.detach()

    native = go(torch.autocast("cpu"))
    ours = go(ampkit.autocast("cpu", policy=policy))
    assert native[0][0] == (F32, F32, False) and native[1] == F32
    assert ours[:3] == native[:3] and bits_equal(ours[3], native[3])


# --------------------------------------------------------------------- nesting
def _ops_dtypes(x, w, norm):
    return F.linear(x, w).dtype, F.layer_norm(x, (x.shape[-1],), norm, norm).dtype, torch.mm(x, w.t()).dtype


@pytest.mark.parametrize("inner", ["torch", "ampkit"])
@pytest.mark.parametrize("outer", ["torch", "ampkit"])
def test_nesting_either_way_is_nesting_two_torch_autocasts(outer, inner):
    regions = {"torch": torch.autocast, "ampkit": ampkit.autocast}
    x, w, norm = torch.randn(4, 8), torch.randn(3, 8), torch.ones(8)

    def walk(o, i):
        seen = []
        with o("cpu", dtype=BF16):
            seen.append(_ops_dtypes(x, w, norm))
            with i("cpu", enabled=False):
                seen.append(_ops_dtypes(x, w, norm))
                with o("cpu", dtype=torch.float16):
                    seen.append(_ops_dtypes(x, w, norm))
            seen.append((torch.is_autocast_enabled("cpu"), torch.get_autocast_dtype("cpu")))
        return seen

    assert walk(regions[outer], regions[inner]) == walk(torch.autocast, torch.autocast)


def test_torch_autocast_disabled_inside_a_changed_region_switches_the_policy_off_too():
    x, w, norm = torch.randn(4, 8), torch.randn(3, 8), torch.ones(8)
    with ampkit.autocast("cpu", policy=CHANGED):
        assert _ops_dtypes(x, w, norm) == (F32, BF16, BF16)  # linear fp32, layer_norm low, mm low
        with torch.autocast("cpu", enabled=False):
            assert _ops_dtypes(x, w, norm) == (F32, F32, F32)
            xb = x.to(BF16)
            assert F.linear(xb, w.to(BF16)).dtype == BF16  # not cast to fp32 either
        with torch.autocast("cpu", dtype=torch.float16):  # torch's dtype, the region's policy
            assert _ops_dtypes(x, w, norm) == (F32, torch.float16, torch.float16)


# --------------------------------------------------------------------- torch.compile
def _graphs(fn, *args):
    torch._dynamo.reset()
    ex = torch._dynamo.explain(fn)(*args)
    return ex.graph_count, ex.graph_break_count


@pytest.fixture
def block_and_input():
    torch._dynamo.reset()
    torch.manual_seed(0)
    yield Block(), torch.randn(8, 16)
    torch._dynamo.reset()


def in_region(region, body):
    """body run inside a fresh region (made inside the function, as a user writes it)."""
    def run(x):
        with region():
            return body(x)
    return run


NATIVE = lambda: torch.autocast("cpu")  # noqa: E731
OURS = lambda: ampkit.autocast("cpu")  # noqa: E731
OURS_CHANGED = lambda: ampkit.autocast("cpu", policy=CHANGED)  # noqa: E731


def test_a_region_inside_a_compiled_function_needs_the_graphs_torch_needs(block_and_input):
    block, x = block_and_input
    assert _graphs(in_region(NATIVE, block), x) == (1, 0)
    assert _graphs(in_region(OURS, block), x) == (1, 0)
    assert _graphs(in_region(OURS_CHANGED, block), x) == (1, 0)


@pytest.mark.parametrize("fullgraph", [False, True], ids=["graph_breaks_allowed", "fullgraph"])
def test_a_region_inside_a_compiled_function_equals_torch_autocast(block_and_input, fullgraph):
    block, x = block_and_input
    want = torch.compile(in_region(NATIVE, block), fullgraph=fullgraph)(x)
    torch._dynamo.reset()
    got = torch.compile(in_region(OURS, block), fullgraph=fullgraph)(x)
    assert got.dtype == want.dtype == F32 and bits_equal(got, want)


def test_a_changed_policy_is_honoured_inside_a_compiled_function(block_and_input):
    block, x = block_and_input
    want = torch.compile(in_region(NATIVE, block.stages_as_changed), fullgraph=True)(x)
    torch._dynamo.reset()
    got = torch.compile(in_region(OURS_CHANGED, block.stages), fullgraph=True)(x)
    assert_stages_as_changed(got, want)


def assert_stages_as_changed(got, want):
    """linear in float32, layer_norm in bfloat16, as CHANGED says; values to bfloat16 round-off
    (inductor fuses differently around the hand-written casts)."""
    assert [t.dtype for t in got] == [t.dtype for t in want] == [F32, BF16, F32, F32]
    for g, w in zip(got, want):
        assert torch.allclose(g.float(), w.float(), rtol=1e-2, atol=1e-2)


def test_a_compiled_model_called_inside_a_region_equals_torch_autocast(block_and_input):
    block, x = block_and_input
    compiled = torch.compile(block)
    with torch.autocast("cpu"):
        want = compiled(x)
    with ampkit.autocast("cpu"):
        got = compiled(x)
    assert got.dtype == want.dtype == F32 and bits_equal(got, want)
    stages = torch.compile(block.stages)
    with ampkit.autocast("cpu", policy=CHANGED):  # a changed policy: dynamo recompiles for its mode
        changed = stages(x)
    with torch.autocast("cpu"):
        by_hand = block.stages_as_changed(x)
    assert_stages_as_changed(changed, by_hand)


def test_training_a_compiled_model_inside_a_region_matches_torch(block_and_input):
    block, x = block_and_input
    compiled = torch.compile(block)
    outs = []
    for region in (torch.autocast("cpu"), ampkit.autocast("cpu")):
        block.zero_grad()
        with region:
            y = compiled(x)
        y.float().sum().backward()
        outs.append([y.detach()] + [p.grad.clone() for p in block.parameters()])
    assert same_all(outs[1], outs[0])

