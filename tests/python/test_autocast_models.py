"""Reference models: outputs and parameter gradients under ampkit match torch.autocast.

The same model (same seed) runs once under each; the forward output dtype must
match exactly and the values and every parameter gradient bit for bit, except
where native casts inside a C++ composite that a per-op policy cannot see
(GRUCell: the output dtype still matches, values agree to bfloat16 round-off).
Each model is repeated with ``enabled=False`` against a plain float32 run.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import ampkit
from conftest import TORCH_BEFORE_2_5

pytestmark = pytest.mark.usefixtures("ampkit_quiet")


def mlp():
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 16), nn.GELU(), nn.Linear(16, 4))


def convnet():
    return nn.Sequential(
        nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.ReLU(), nn.MaxPool2d(2), nn.Flatten(), nn.Linear(4 * 3 * 3, 3)
    )


class EmbedNorm(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb, self.norm, self.head = nn.Embedding(10, 8), nn.LayerNorm(8), nn.Linear(8, 3)

    def forward(self, ids):
        return self.head(self.norm(self.emb(ids)))


class Cell(nn.Module):
    def __init__(self):
        super().__init__()
        self.cell = nn.GRUCell(4, 6)

    def forward(self, x):
        h = None
        for t in range(x.shape[0]):
            h = self.cell(x[t], h)
        return h


CASES = {
    # name: (model factory, input factory, train, grad, bitwise)
    "mlp": (mlp, lambda: torch.randn(5, 8), True, True, True),
    "conv_batchnorm": (convnet, lambda: torch.randn(2, 3, 8, 8), True, True, True),
    "conv_batchnorm_eval": (convnet, lambda: torch.randn(2, 3, 8, 8), False, True, True),
    "multihead_attention": (
        lambda: nn.MultiheadAttention(8, 2, batch_first=True), lambda: (torch.randn(2, 5, 8),) * 3, True, True, True
    ),
    "multihead_attention_eval_nograd": (
        lambda: nn.MultiheadAttention(8, 2, batch_first=True), lambda: (torch.randn(2, 5, 8),) * 3, False, False, True
    ),
    "transformer_encoder_layer_train": (
        lambda: nn.TransformerEncoderLayer(8, 2, 16, dropout=0.0, batch_first=True), lambda: torch.randn(2, 5, 8), True, True, True
    ),
    "transformer_encoder_layer_eval": (
        lambda: nn.TransformerEncoderLayer(8, 2, 16, dropout=0.0, batch_first=True), lambda: torch.randn(2, 5, 8), False, True, True
    ),
    "lstm": (lambda: nn.LSTM(4, 6, batch_first=True), lambda: torch.randn(2, 3, 4), True, True, True),
    "lstm_two_layers": (lambda: nn.LSTM(4, 6, num_layers=2), lambda: torch.randn(3, 2, 4), True, True, True),
    # bitwise: a default region is torch's autocast, which casts only the cell's inner
    # linear layers (C++); ampkit's tables leave the cell unlisted (docs/autocast.md)
    "gru_cell": (Cell, lambda: torch.randn(3, 2, 4), True, True, True),
    "embedding_layernorm": (EmbedNorm, lambda: torch.randint(0, 10, (2, 5)), True, True, True),
}


def run_model(factory, inputs, train, grad, region):
    torch.manual_seed(1)
    model = factory()
    model.train(train)
    x = inputs
    with torch.set_grad_enabled(grad):
        with region:
            y = model(*x) if isinstance(x, tuple) else model(x)
        y = y[0] if isinstance(y, tuple) else y
        if grad:
            (y.float() * torch.linspace(-1, 1, y.numel()).reshape(y.shape)).sum().backward()
    return y.detach(), [p.grad for p in model.parameters()]


def assert_match(a, b, bitwise, what):
    assert a.dtype == b.dtype, f"{what}: dtype {a.dtype} vs {b.dtype}"
    if bitwise:
        assert torch.equal(a, b), f"{what}: max diff {(a.float() - b.float()).abs().max()}"
    else:
        torch.testing.assert_close(a.float(), b.float(), rtol=2e-2, atol=2e-2, msg=what)


@pytest.mark.parametrize("name", list(CASES))
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bfloat16", "float16"])
def test_model_matches_native(name, dtype):
    factory, inputs, train, grad, bitwise = CASES[name]
    torch.manual_seed(0)
    x = inputs()
    try:
        ny, ng = run_model(factory, x, train, grad, torch.autocast("cpu", dtype=dtype))
    except RuntimeError as e:  # e.g. oneDNN's LSTM without a float16 (or, on AVX2, bf16) kernel
        with pytest.raises(RuntimeError) as ours:
            run_model(factory, x, train, grad, ampkit.autocast("cpu", dtype=dtype))
        assert str(ours.value) == str(e)  # the region is torch's: the same error
        return
    ay, ag = run_model(factory, x, train, grad, ampkit.autocast("cpu", dtype=dtype))
    assert_match(ay, ny, bitwise, f"{name} output")
    for i, (a, n) in enumerate(zip(ag, ng)):
        assert (a is None) == (n is None)
        if n is not None:
            assert a.dtype == torch.float32  # gradients of fp32 parameters stay fp32
            assert_match(a, n, bitwise, f"{name} grad of parameter {i}")


@pytest.mark.parametrize("name", list(CASES))
def test_model_disabled_region_is_plain_float32(name):
    factory, inputs, train, grad, _ = CASES[name]
    torch.manual_seed(0)
    x = inputs()
    py, pg = run_model(factory, x, train, grad, torch.autocast("cpu", enabled=False))
    ay, ag = run_model(factory, x, train, grad, ampkit.autocast("cpu", enabled=False))
    assert ay.dtype == torch.float32
    assert torch.equal(ay, py)
    for a, p in zip(ag, pg):
        assert (a is None and p is None) or torch.equal(a, p)


@pytest.mark.skipif(TORCH_BEFORE_2_5, reason=(
    "torch < 2.5: native autocast itself raises in TransformerEncoderLayer's fast path "
    "('mat1 and mat2 must have the same dtype', pytorch/pytorch#132613)"))
def test_transformer_encoder_layer_eval_nograd_fast_path():
    """In eval mode without grad, native takes TransformerEncoderLayer's C++ fast path
    (bfloat16 out). A default ampkit region pushes no torch-function mode, so torch
    takes that path too: the same dtype and values."""
    factory = lambda: nn.TransformerEncoderLayer(8, 2, 16, dropout=0.0, batch_first=True)  # noqa: E731
    x = torch.randn(2, 5, 8)
    ny, _ = run_model(factory, x, False, False, torch.autocast("cpu"))
    ay, _ = run_model(factory, x, False, False, ampkit.autocast("cpu"))
    assert ay.dtype == ny.dtype == torch.bfloat16
    assert torch.equal(ay, ny)
