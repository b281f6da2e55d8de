"""Seeded model, data, loss and optimizer builders for the benchmark cases.

Each builder is named in a case file (shared_specs/benchmarks/*.yaml) and takes the
profile's sizes by keyword. Models are built with torch.manual_seed(seed) on the
target device and data with its own seeded generator, so the Python and the R
runner, which both call these functions, train the same weights on the same data.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


# --- models -------------------------------------------------------------------------

def mlp(in_size: int, out_size: int, num_layers: int) -> nn.Module:
    """The seeds' make_model: (num_layers - 1) x [Linear(in, in), ReLU] then Linear(in, out)."""
    layers = []
    for _ in range(num_layers - 1):
        layers += [nn.Linear(in_size, in_size), nn.ReLU()]
    layers.append(nn.Linear(in_size, out_size))
    return nn.Sequential(*layers)


class EncoderLayer(nn.Module):
    """A pre-LayerNorm transformer encoder layer written with plain ops (linear, sdpa,
    layer_norm, gelu) so that every op an autocast engine sees is a public one."""

    def __init__(self, d_model: int, n_heads: int, d_ff: int):
        super().__init__()
        self.n_heads = n_heads
        self.ln1 = nn.LayerNorm(d_model)
        self.qkv = nn.Linear(d_model, 3 * d_model)
        self.proj = nn.Linear(d_model, d_model)
        self.ln2 = nn.LayerNorm(d_model)
        self.fc1 = nn.Linear(d_model, d_ff)
        self.fc2 = nn.Linear(d_ff, d_model)

    def forward(self, x):
        b, s, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, s, 3, self.n_heads, d // self.n_heads).permute(2, 0, 3, 1, 4)
        a = F.scaled_dot_product_attention(q, k, v)
        x = x + self.proj(a.transpose(1, 2).reshape(b, s, d))
        return x + self.fc2(F.gelu(self.fc1(self.ln2(x))))


class Encoder(nn.Module):
    """Token + learned position embeddings, a stack of EncoderLayer, a final LayerNorm."""

    def __init__(self, vocab: int, d_model: int, n_heads: int, n_layers: int, d_ff: int, seq_len: int):
        super().__init__()
        self.tok = nn.Embedding(vocab, d_model)
        self.pos = nn.Embedding(seq_len, d_model)
        self.layers = nn.ModuleList(EncoderLayer(d_model, n_heads, d_ff) for _ in range(n_layers))
        self.ln = nn.LayerNorm(d_model)

    def forward(self, ids):
        x = self.tok(ids) + self.pos.weight[: ids.shape[1]]
        for layer in self.layers:
            x = layer(x)
        return self.ln(x)


class TokenModel(nn.Module):
    """Encoder stack with a vocabulary head: logits (batch, seq, vocab)."""

    def __init__(self, vocab, d_model, n_heads, n_layers, d_ff, seq_len):
        super().__init__()
        self.encoder = Encoder(vocab, d_model, n_heads, n_layers, d_ff, seq_len)
        self.head = nn.Linear(d_model, vocab)

    def forward(self, ids):
        return self.head(self.encoder(ids))


def transformer(vocab: int, d_model: int, n_heads: int, n_layers: int, d_ff: int, seq_len: int) -> nn.Module:
    return TokenModel(vocab, d_model, n_heads, n_layers, d_ff, seq_len)


class Classifier(nn.Module):
    """BERT-style: encoder, the first ([CLS]) token, dropout, Linear(d_model, 1) logits."""

    def __init__(self, vocab, d_model, n_heads, n_layers, d_ff, seq_len, dropout):
        super().__init__()
        self.encoder = Encoder(vocab, d_model, n_heads, n_layers, d_ff, seq_len)
        self.dropout = nn.Dropout(dropout)
        self.fc = nn.Linear(d_model, 1)

    def forward(self, ids):
        return self.fc(self.dropout(self.encoder(ids)[:, 0, :]))


def text_classifier(vocab: int, d_model: int, n_heads: int, n_layers: int, d_ff: int, seq_len: int,
                    dropout: float = 0.1) -> nn.Module:
    return Classifier(vocab, d_model, n_heads, n_layers, d_ff, seq_len, dropout)


class DecoderLayer(EncoderLayer):
    """A GPT-2 block: EncoderLayer's pre-LN layout and weights, with causal attention
    (sdpa's is_causal=True, no mask tensor) and GPT-2's tanh-approximated GELU."""

    def forward(self, x):
        b, s, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, s, 3, self.n_heads, d // self.n_heads).permute(2, 0, 3, 1, 4)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(a.transpose(1, 2).reshape(b, s, d))
        return x + self.fc2(F.gelu(self.fc1(self.ln2(x)), approximate="tanh"))


class Decoder(nn.Module):
    """A GPT-2-shaped language model: token + learned position embeddings, a stack of
    DecoderLayer, a final LayerNorm, and a head tied to the token embedding (GPT-2's: the
    same weight, one gradient from both uses).

    The embedding has ``vocab`` rounded up to a multiple of ``vocab_multiple`` rows
    (nanoGPT's 50257 -> 50304 for 64), so that the head's matmuls have tensor-core-aligned
    shapes; the data never draws the extra ids, and training pushes their logits down.
    GPT-2's initialisation: weights N(0, 0.02), biases 0, the two projections into the
    residual stream (proj, fc2) N(0, 0.02 / sqrt(2 n_layers)).
    """

    def __init__(self, vocab, d_model, n_heads, n_layers, d_ff, seq_len, vocab_multiple=64):
        super().__init__()
        rows = -(-vocab // vocab_multiple) * vocab_multiple
        self.tok = nn.Embedding(rows, d_model)
        self.pos = nn.Embedding(seq_len, d_model)
        self.layers = nn.ModuleList(DecoderLayer(d_model, n_heads, d_ff) for _ in range(n_layers))
        self.ln = nn.LayerNorm(d_model)
        self.head = nn.Linear(d_model, rows, bias=False)
        self.head.weight = self.tok.weight
        for name, p in self.named_parameters():
            if name.endswith("bias"):
                nn.init.zeros_(p)
            elif p.dim() == 2:
                residual = name.endswith(("proj.weight", "fc2.weight"))
                nn.init.normal_(p, std=0.02 / ((2 * n_layers) ** 0.5 if residual else 1.0))

    def forward(self, ids):
        x = self.tok(ids) + self.pos.weight[: ids.shape[1]]
        for layer in self.layers:
            x = layer(x)
        return self.head(self.ln(x))


def gpt2(vocab: int, d_model: int, n_heads: int, n_layers: int, d_ff: int, seq_len: int,
         vocab_multiple: int = 64) -> nn.Module:
    return Decoder(vocab, d_model, n_heads, n_layers, d_ff, seq_len, vocab_multiple)


class BasicBlock(nn.Module):
    def __init__(self, cin: int, cout: int, stride: int):
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.short = nn.Sequential()
        if stride != 1 or cin != cout:
            self.short = nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))

    def forward(self, x):
        out = F.relu(self.bn1(self.conv1(x)))
        return F.relu(self.bn2(self.conv2(out)) + self.short(x))


def resnet(width: int, blocks: int, num_classes: int) -> nn.Module:
    """CIFAR-style ResNet: 3x3 stem, four stages of `blocks` BasicBlocks (width x 1, 2, 4, 8),
    global average pooling, Linear. width=64, blocks=2 is ResNet-18."""
    layers = [nn.Conv2d(3, width, 3, 1, 1, bias=False), nn.BatchNorm2d(width), nn.ReLU()]
    cin = width
    for i, mult in enumerate((1, 2, 4, 8)):
        for j in range(blocks):
            stride = 2 if (i > 0 and j == 0) else 1
            layers.append(BasicBlock(cin, width * mult, stride))
            cin = width * mult
    layers += [nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(cin, num_classes)]
    return nn.Sequential(*layers)


MODELS = {"mlp": mlp, "transformer": transformer, "text_classifier": text_classifier, "gpt2": gpt2,
          "resnet": resnet}


# --- data (lists of (inputs, targets) on the device) -----------------------------------

def regression(num_batches: int, batch_size: int, in_size: int, out_size: int, *, device, generator):
    """The seeds' data: standard normal inputs and targets."""
    return [(torch.randn(batch_size, in_size, device=device, generator=generator),
             torch.randn(batch_size, out_size, device=device, generator=generator))
            for _ in range(num_batches)]


def tokens(num_batches: int, batch_size: int, seq_len: int, vocab: int, *, device, generator):
    """Random token ids; the target of each token is the next id (learnable, so the loss falls)."""
    out = []
    for _ in range(num_batches):
        ids = torch.randint(0, vocab, (batch_size, seq_len), device=device, generator=generator)
        out.append((ids, (ids + 1) % vocab))
    return out


def token_labels(num_batches: int, batch_size: int, seq_len: int, vocab: int, *, device, generator):
    """Random token ids with a binary label (the parity of the second token), shape (batch, 1)."""
    out = []
    for _ in range(num_batches):
        ids = torch.randint(0, vocab, (batch_size, seq_len), device=device, generator=generator)
        out.append((ids, (ids[:, 1:2] % 2).float()))
    return out


def images(num_batches: int, batch_size: int, num_classes: int, image_size: int = 32, *, device, generator):
    """CIFAR-shaped synthetic images (batch, 3, 32, 32) and class labels."""
    return [(torch.randn(batch_size, 3, image_size, image_size, device=device, generator=generator),
             torch.randint(0, num_classes, (batch_size,), device=device, generator=generator))
            for _ in range(num_batches)]


DATA = {"regression": regression, "tokens": tokens, "token_labels": token_labels, "images": images}


# --- losses ---------------------------------------------------------------------------

def mse(output, target):
    return F.mse_loss(output, target)


def cross_entropy(output, target):
    """Class logits (batch, classes) or token logits (batch, seq, vocab)."""
    if output.dim() == 3:
        return F.cross_entropy(output.flatten(0, 1), target.flatten())
    return F.cross_entropy(output, target)


def bce_with_logits(output, target):
    return F.binary_cross_entropy_with_logits(output, target)


LOSSES = {"mse": mse, "cross_entropy": cross_entropy, "bce_with_logits": bce_with_logits}


# --- optimizers -----------------------------------------------------------------------

def sgd(params, lr: float, momentum: float = 0.0, weight_decay: float = 0.0, fused: bool = None):
    return torch.optim.SGD(params, lr=lr, momentum=momentum, weight_decay=weight_decay, fused=fused)


def adamw(params, lr: float, weight_decay: float = 0.01, betas: list = (0.9, 0.999), fused: bool = None):
    """fused=True also makes it capturable (what a CUDA-graph-captured step needs)."""
    return torch.optim.AdamW(params, lr=lr, weight_decay=weight_decay, betas=tuple(betas), fused=fused,
                             capturable=bool(fused))


OPTIMIZERS = {"sgd": sgd, "adamw": adamw}
