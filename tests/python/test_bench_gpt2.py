"""The gpt2_small case: GPT-2 small's shape, against a decoder written out by hand."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
import torch.nn.functional as F

from ampkit import bench

CASE = bench.load_cases()["gpt2_small"]
FULL = CASE.profile("full")["sizes"]
# GPT-2 small as published (Hugging Face's "gpt2"): 50257 tokens, 1024 positions, tied head.
GPT2_SMALL_PARAMS = 124_439_808


def _built(profile="tiny", **sizes):
    """The case built at a profile, its sizes changed as given (the data stay the profile's)."""
    b = bench.build_case(CASE, profile, seed=0, device="cpu")
    return dataclasses.replace(b, sizes=dict(b.sizes, **sizes))


def test_the_full_profile_has_gpt2_smalls_shape_and_training_recipe():
    assert FULL == {"batch_size": 16, "seq_len": 512, "vocab": 50257, "vocab_multiple": 64, "d_model": 768,
                    "n_heads": 12, "n_layers": 12, "d_ff": 4 * 768}
    assert (CASE.model, CASE.data, CASE.loss) == ("gpt2", "tokens", "cross_entropy")
    assert CASE.optimizer["name"] == "adamw"
    model = dataclasses.replace(_built(), sizes=FULL, device="meta").new_model()
    assert model.tok.weight.shape == (50304, 768)  # 50257 rounded up to a multiple of 64
    assert model.head.weight is model.tok.weight  # tied
    assert [type(m).__name__ for m in model.layers] == ["DecoderLayer"] * 12
    # GPT-2 small's count, with the 47 padding rows more and 512 positions fewer (seq 512)
    n = sum(p.numel() for p in model.parameters())
    assert n == GPT2_SMALL_PARAMS + 47 * 768 - 512 * 768 == 124_082_688


def _reference(model, ids):
    """The decoder written out with an explicit causal mask, tanh GELU and the tied head,
    from the model's own weights."""
    s = ids.shape[1]
    x = model.tok.weight[ids] + model.pos.weight[:s]
    mask = torch.ones(s, s, dtype=torch.bool).triu(1)
    for layer in model.layers:
        h = F.layer_norm(x, x.shape[-1:], layer.ln1.weight, layer.ln1.bias)
        b, _, d = h.shape
        nh = layer.n_heads
        q, k, v = (h @ layer.qkv.weight.T + layer.qkv.bias).split(d, dim=-1)
        q, k, v = (t.reshape(b, s, nh, d // nh).transpose(1, 2) for t in (q, k, v))
        att = (q @ k.transpose(-1, -2) / math.sqrt(d // nh)).masked_fill(mask, float("-inf")).softmax(-1)
        a = (att @ v).transpose(1, 2).reshape(b, s, d)
        x = x + a @ layer.proj.weight.T + layer.proj.bias
        h = F.layer_norm(x, x.shape[-1:], layer.ln2.weight, layer.ln2.bias) @ layer.fc1.weight.T + layer.fc1.bias
        h = 0.5 * h * (1 + torch.tanh(math.sqrt(2 / math.pi) * (h + 0.044715 * h ** 3)))
        x = x + h @ layer.fc2.weight.T + layer.fc2.bias
    return F.layer_norm(x, x.shape[-1:], model.ln.weight, model.ln.bias) @ model.tok.weight.T


def test_the_decoder_equals_one_written_out_with_a_causal_mask():
    built = _built(n_layers=2)
    model = built.new_model().double()
    with torch.no_grad():  # weights far from the init, so that erf and tanh GELU differ
        for p in model.parameters():
            p.normal_(0.0, 0.5)
    ids = built.batches[0][0]
    got = model(ids)
    assert got.shape == (*ids.shape, 64)  # vocab 61, rows rounded up to a multiple of 8
    torch.testing.assert_close(got, _reference(model, ids), rtol=1e-10, atol=1e-10)
    later = ids.clone()
    later[:, -1] = (later[:, -1] + 1) % 61  # the last token changes only the last position
    moved = model(later)
    torch.testing.assert_close(moved[:, :-1], got[:, :-1], rtol=0, atol=0)
    assert not torch.equal(moved[:, -1], got[:, -1])


def test_the_tied_weight_gets_one_gradient_from_the_embedding_and_the_head():
    built = _built()
    model = built.new_model()
    x, y = built.batches[0]
    built.loss_fn(model(x), y).backward()
    grad = model.tok.weight.grad.clone()
    assert model.head.weight.grad is model.tok.weight.grad
    # the same loss through an untied copy: the tied gradient is the sum of the two
    untied = built.new_model()
    untied.head.weight = torch.nn.Parameter(untied.tok.weight.detach().clone())
    built.loss_fn(untied(x), y).backward()
    torch.testing.assert_close(grad, untied.tok.weight.grad + untied.head.weight.grad)


def test_weights_start_as_gpt2s_with_the_residual_projections_scaled_down():
    model = _built("cpu", **CASE.profile("cpu")["sizes"]).new_model()
    n_layers = CASE.profile("cpu")["sizes"]["n_layers"]
    for name, p in model.named_parameters():
        if name.endswith("bias"):
            assert torch.count_nonzero(p) == 0, name
        elif p.dim() == 1:  # LayerNorm
            assert torch.equal(p, torch.ones_like(p)), name
        else:
            std = 0.02 / math.sqrt(2 * n_layers) if name.endswith(("proj.weight", "fc2.weight")) else 0.02
            assert p.std().item() == pytest.approx(std, rel=0.05), name


@pytest.fixture
def world_of_one():
    import torch.distributed as dist
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def test_fsdp2_shards_each_decoder_layer_and_trains_as_the_plain_model(world_of_one):
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:
        pytest.skip("torch %s has no torch.distributed.fsdp.FSDPModule (FSDP2 on the CPU needs 2.6)"
                    % torch.__version__)

    built = _built(n_layers=3)
    model = bench.Placement(bench.Engine("fsdp2"), "cpu").wrap(built.new_model())
    sharded = [n for n, m in model.named_modules() if isinstance(m, FSDPModule)]
    assert sharded == ["", "layers.0", "layers.1", "layers.2"]
    assert model.head.weight is model.tok.weight
    plain = built.new_model()
    for m in (model, plain):
        opt = built.new_optimizer(m)
        for x, y in built.batches:
            opt.zero_grad()
            built.loss_fn(m(x), y).backward()
            opt.step()
    for (name, p), q in zip(model.named_parameters(), plain.parameters()):
        torch.testing.assert_close(p.full_tensor(), q, rtol=0, atol=0, msg=name)
