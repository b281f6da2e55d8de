"""Sample calls for every op of the shipped specs (tests, drift check, R tests).

``op_sample(op, device, dtype)`` returns an :class:`OpSample`: a callable and
fresh inputs (floating tensors in ``dtype``, the same values on every call for
the same op), so the same call can run under ``torch.autocast`` and under
``ampkit.autocast`` and be compared.

>>> import torch
>>> from ampkit.testing import op_sample
>>> s = op_sample("linear", "cpu")
>>> s().shape
torch.Size([2, 3])
>>> torch.equal(s(), op_sample("linear", "cpu")())
True
"""

from __future__ import annotations

import dataclasses
import zlib

import torch
import torch.nn.functional as F


@dataclasses.dataclass
class OpSample:
    """``fn(*args, **kwargs)`` is one call of op ``op``."""

    op: str
    fn: object
    args: tuple
    kwargs: dict

    def __call__(self):
        return self.fn(*self.args, **self.kwargs)

    def tensors(self):
        """The floating tensor inputs (also inside lists), in order."""
        out = []
        for a in list(self.args) + list(self.kwargs.values()):
            for t in a if isinstance(a, (list, tuple)) else (a,):
                if isinstance(t, torch.Tensor) and t.is_floating_point():
                    out.append(t)
        return out


class _Maker:
    """Deterministic small inputs for one op."""

    def __init__(self, op, device, dtype):
        self.g = torch.Generator().manual_seed(zlib.crc32(op.encode()))
        self.device, self.dtype = device, dtype

    def _fin(self, t, dtype=None):
        return t.to(device=self.device, dtype=dtype or self.dtype)

    def t(self, *shape):  # standard normal
        return self._fin(torch.randn(*shape, generator=self.g))

    def u(self, *shape, lo=0.1, hi=0.9):  # uniform in (lo, hi)
        return self._fin(torch.rand(*shape, generator=self.g) * (hi - lo) + lo)

    def pos(self, *shape):
        return self.u(*shape, lo=0.5, hi=2.0)

    def spd(self, n, batch=()):
        a = torch.randn(*batch, n, n, generator=self.g)
        return self._fin(a @ a.transpose(-1, -2) + n * torch.eye(n))

    def sign(self, *shape):
        return self._fin(torch.randint(0, 2, shape, generator=self.g) * 2 - 1)

    def i(self, high, *shape):
        return torch.randint(0, high, shape, generator=self.g).to(self.device)

    def c(self, values):  # an integer constant on the device
        return torch.tensor(values).to(self.device)

    def f32(self, *shape):  # always float32 (e.g. a grid)
        return self._fin(torch.rand(*shape, generator=self.g) * 2 - 1, torch.float32)


def _m(fn, *args, **kwargs):
    return fn, args, kwargs


# op name -> builder(maker) -> (fn, args, kwargs)
_SAMPLES = {
    # ---- matmul family
    "_addmm_activation": lambda m: _m(torch._addmm_activation, m.t(3), m.t(2, 4), m.t(4, 3)),
    "_convolution": lambda m: _m(torch._convolution, m.t(1, 2, 5, 5), m.t(3, 2, 3, 3), m.t(3), [1, 1], [0, 0], [1, 1], False, [0, 0], 1, False, False, True, True),
    "_native_multi_head_attention": lambda m: _m(
        torch._native_multi_head_attention, m.t(2, 3, 4), m.t(2, 3, 4), m.t(2, 3, 4), 4, 2, m.t(12, 4), m.t(12), m.t(4, 4), m.t(4)
    ),
    "addbmm": lambda m: _m(torch.addbmm, m.t(3, 5), m.t(4, 3, 2), m.t(4, 2, 5)),
    "addmm": lambda m: _m(torch.addmm, m.t(2, 3), m.t(2, 4), m.t(4, 3)),
    "addmv": lambda m: _m(torch.addmv, m.t(3), m.t(3, 4), m.t(4)),
    "addr": lambda m: _m(torch.addr, m.t(3, 4), m.t(3), m.t(4)),
    "baddbmm": lambda m: _m(torch.baddbmm, m.t(2, 3, 5), m.t(2, 3, 4), m.t(2, 4, 5)),
    "bmm": lambda m: _m(torch.bmm, m.t(2, 3, 4), m.t(2, 4, 5)),
    "chain_matmul": lambda m: _m(torch.chain_matmul, m.t(2, 3), m.t(3, 4), m.t(4, 2)),
    "linalg.multi_dot": lambda m: _m(torch.linalg.multi_dot, [m.t(2, 3), m.t(3, 4), m.t(4, 2)]),
    "linalg.matmul": lambda m: _m(torch.linalg.matmul, m.t(2, 3), m.t(3, 4)),
    "linalg.vecdot": lambda m: _m(torch.linalg.vecdot, m.t(3, 4), m.t(3, 4)),
    "linear": lambda m: _m(F.linear, m.t(2, 4), m.t(3, 4), m.t(3)),
    "matmul": lambda m: _m(torch.matmul, m.t(2, 3, 4), m.t(4, 5)),
    "mm": lambda m: _m(torch.mm, m.t(2, 4), m.t(4, 3)),
    "mv": lambda m: _m(torch.mv, m.t(3, 4), m.t(4)),
    "dot": lambda m: _m(torch.dot, m.t(5), m.t(5)),
    "vdot": lambda m: _m(torch.vdot, m.t(5), m.t(5)),
    "inner": lambda m: _m(torch.inner, m.t(3, 4), m.t(2, 4)),
    "outer": lambda m: _m(torch.outer, m.t(3), m.t(4)),
    "kron": lambda m: _m(torch.kron, m.t(2, 2), m.t(2, 3)),
    "einsum": lambda m: _m(torch.einsum, "bij,bjk->bik", m.t(2, 3, 4), m.t(2, 4, 5)),
    "tensordot": lambda m: _m(torch.tensordot, m.t(3, 4, 5), m.t(4, 5, 2), dims=2),
    "bilinear": lambda m: _m(F.bilinear, m.t(2, 3), m.t(2, 4), m.t(5, 3, 4), m.t(5)),
    "scaled_dot_product_attention": lambda m: _m(F.scaled_dot_product_attention, m.t(2, 2, 3, 4), m.t(2, 2, 3, 4), m.t(2, 2, 3, 4)),
    "multi_head_attention_forward": lambda m: _m(
        F.multi_head_attention_forward, m.t(3, 2, 4), m.t(3, 2, 4), m.t(3, 2, 4), 4, 2, m.t(12, 4), m.t(12),
        None, None, False, 0.0, m.t(4, 4), m.t(4), training=False,
    ),
    # ---- convolutions
    "conv1d": lambda m: _m(F.conv1d, m.t(1, 2, 7), m.t(3, 2, 3), m.t(3)),
    "conv2d": lambda m: _m(F.conv2d, m.t(1, 2, 5, 5), m.t(3, 2, 3, 3), m.t(3)),
    "conv3d": lambda m: _m(F.conv3d, m.t(1, 2, 4, 4, 4), m.t(3, 2, 2, 2, 2), m.t(3)),
    "conv_tbc": lambda m: _m(torch.conv_tbc, m.t(5, 2, 3), m.t(3, 3, 4), m.t(4), 1),
    "conv_transpose1d": lambda m: _m(F.conv_transpose1d, m.t(1, 2, 5), m.t(2, 3, 3), m.t(3)),
    "conv_transpose2d": lambda m: _m(F.conv_transpose2d, m.t(1, 2, 4, 4), m.t(2, 3, 3, 3), m.t(3)),
    "conv_transpose3d": lambda m: _m(F.conv_transpose3d, m.t(1, 2, 3, 3, 3), m.t(2, 3, 2, 2, 2), m.t(3)),
    "convolution": lambda m: _m(torch.convolution, m.t(1, 2, 5, 5), m.t(3, 2, 3, 3), m.t(3), [1, 1], [0, 0], [1, 1], False, [0, 0], 1),
    "prelu": lambda m: _m(F.prelu, m.t(2, 3, 4), m.pos(3)),
    # ---- recurrent
    "lstm_cell": lambda m: _m(torch.lstm_cell, m.t(2, 3), (m.t(2, 4), m.t(2, 4)), m.t(16, 3), m.t(16, 4), m.t(16), m.t(16)),
    "gru_cell": lambda m: _m(torch.gru_cell, m.t(2, 3), m.t(2, 4), m.t(12, 3), m.t(12, 4), m.t(12), m.t(12)),
    "rnn_tanh_cell": lambda m: _m(torch.rnn_tanh_cell, m.t(2, 3), m.t(2, 4), m.t(4, 3), m.t(4, 4), m.t(4), m.t(4)),
    "rnn_relu_cell": lambda m: _m(torch.rnn_relu_cell, m.t(2, 3), m.t(2, 4), m.t(4, 3), m.t(4, 4), m.t(4), m.t(4)),
    "lstm": lambda m: _m(torch.lstm, m.t(2, 3, 3), (m.t(1, 2, 4), m.t(1, 2, 4)), [m.t(16, 3), m.t(16, 4), m.t(16), m.t(16)], True, 1, 0.0, False, False, True),
    "gru": lambda m: _m(torch.gru, m.t(2, 3, 3), m.t(1, 2, 4), [m.t(12, 3), m.t(12, 4), m.t(12), m.t(12)], True, 1, 0.0, False, False, True),
    "rnn_tanh": lambda m: _m(torch.rnn_tanh, m.t(2, 3, 3), m.t(1, 2, 4), [m.t(4, 3), m.t(4, 4), m.t(4), m.t(4)], True, 1, 0.0, False, False, True),
    "rnn_relu": lambda m: _m(torch.rnn_relu, m.t(2, 3, 3), m.t(1, 2, 4), [m.t(4, 3), m.t(4, 4), m.t(4), m.t(4)], True, 1, 0.0, False, False, True),
    # ---- losses
    "binary_cross_entropy": lambda m: _m(F.binary_cross_entropy, m.u(3, 4), m.u(3, 4)),
    "binary_cross_entropy_with_logits": lambda m: _m(F.binary_cross_entropy_with_logits, m.t(3, 4), m.u(3, 4)),
    "cosine_embedding_loss": lambda m: _m(F.cosine_embedding_loss, m.t(3, 4), m.t(3, 4), m.sign(3)),
    "cross_entropy": lambda m: _m(F.cross_entropy, m.t(3, 5), m.i(5, 3)),
    "ctc_loss": lambda m: _m(
        F.ctc_loss, m.t(6, 2, 4).log_softmax(2), m.i(3, 2, 3) + 1, m.c([6, 6]), m.c([3, 2])
    ),
    "hinge_embedding_loss": lambda m: _m(F.hinge_embedding_loss, m.t(3, 4), m.sign(3, 4)),
    "huber_loss": lambda m: _m(F.huber_loss, m.t(3, 4), m.t(3, 4)),
    "kl_div": lambda m: _m(F.kl_div, m.t(3, 4).log_softmax(-1), m.u(3, 4), reduction="batchmean"),
    "l1_loss": lambda m: _m(F.l1_loss, m.t(3, 4), m.t(3, 4)),
    "margin_ranking_loss": lambda m: _m(F.margin_ranking_loss, m.t(5), m.t(5), m.sign(5)),
    "mse_loss": lambda m: _m(F.mse_loss, m.t(3, 4), m.t(3, 4)),
    "multi_margin_loss": lambda m: _m(F.multi_margin_loss, m.t(3, 5), m.i(5, 3)),
    "multilabel_margin_loss": lambda m: _m(F.multilabel_margin_loss, m.t(3, 4), m.c([[3, 0, -1, 1]] * 3)),
    "nll_loss": lambda m: _m(F.nll_loss, m.t(3, 5).log_softmax(-1), m.i(5, 3)),
    "nll_loss2d": lambda m: _m(torch._C._nn.nll_loss2d, m.t(2, 3, 2, 2).log_softmax(1), m.i(3, 2, 2, 2)),
    "poisson_nll_loss": lambda m: _m(F.poisson_nll_loss, m.t(3, 4), m.pos(3, 4)),
    "smooth_l1_loss": lambda m: _m(F.smooth_l1_loss, m.t(3, 4), m.t(3, 4)),
    "soft_margin_loss": lambda m: _m(F.soft_margin_loss, m.t(3, 4), m.sign(3, 4)),
    "triplet_margin_loss": lambda m: _m(F.triplet_margin_loss, m.t(3, 4), m.t(3, 4), m.t(3, 4)),
    "gaussian_nll_loss": lambda m: _m(F.gaussian_nll_loss, m.t(3, 4), m.t(3, 4), m.pos(3, 4)),
    # ---- pooling, padding, sampling
    "adaptive_avg_pool2d": lambda m: _m(F.adaptive_avg_pool2d, m.t(1, 2, 5, 5), 2),
    "adaptive_avg_pool3d": lambda m: _m(F.adaptive_avg_pool3d, m.t(1, 2, 4, 4, 4), 2),
    "adaptive_max_pool3d": lambda m: _m(F.adaptive_max_pool3d, m.t(1, 2, 4, 4, 4), 2),
    "avg_pool2d": lambda m: _m(F.avg_pool2d, m.t(1, 2, 4, 4), 2),
    "avg_pool3d": lambda m: _m(F.avg_pool3d, m.t(1, 2, 4, 4, 4), 2),
    "max_pool2d": lambda m: _m(F.max_pool2d, m.t(1, 2, 4, 4), 2),
    "max_pool3d": lambda m: _m(F.max_pool3d, m.t(1, 2, 4, 4, 4), 2),
    "max_unpool2d": lambda m: _m(F.max_unpool2d, *F.max_pool2d(m.t(1, 2, 4, 4), 2, return_indices=True), 2),
    "max_unpool3d": lambda m: _m(F.max_unpool3d, *F.max_pool3d(m.t(1, 2, 4, 4, 4), 2, return_indices=True), 2),
    "fractional_max_pool2d": lambda m: _m(F.fractional_max_pool2d, m.t(1, 2, 6, 6), 2, output_size=3, _random_samples=m.u(1, 2, 2)),
    "fractional_max_pool3d": lambda m: _m(F.fractional_max_pool3d, m.t(1, 2, 6, 6, 6), 2, output_size=3, _random_samples=m.u(1, 2, 3)),
    "reflection_pad1d": lambda m: _m(torch._C._nn.reflection_pad1d, m.t(1, 2, 5), [2, 2]),
    "reflection_pad2d": lambda m: _m(torch._C._nn.reflection_pad2d, m.t(1, 2, 5, 5), [1, 1, 1, 1]),
    "replication_pad1d": lambda m: _m(torch._C._nn.replication_pad1d, m.t(1, 2, 5), [2, 2]),
    "replication_pad2d": lambda m: _m(torch._C._nn.replication_pad2d, m.t(1, 2, 5, 5), [1, 1, 1, 1]),
    "replication_pad3d": lambda m: _m(torch._C._nn.replication_pad3d, m.t(1, 2, 3, 3, 3), [1, 1, 1, 1, 1, 1]),
    "pad": lambda m: _m(F.pad, m.t(1, 2, 5), (2, 2), mode="reflect"),
    "grid_sample": lambda m: _m(F.grid_sample, m.t(1, 2, 4, 4), m.f32(1, 3, 3, 2), align_corners=False),
    "grid_sampler": lambda m: _m(torch.grid_sampler, m.t(1, 2, 4, 4), m.f32(1, 3, 3, 2), 0, 0, False),
    "interpolate": lambda m: _m(F.interpolate, m.t(1, 2, 3, 3), scale_factor=2, mode="bilinear"),
    "upsample_nearest1d": lambda m: _m(torch._C._nn.upsample_nearest1d, m.t(1, 2, 3), [6]),
    "upsample_nearest2d": lambda m: _m(torch._C._nn.upsample_nearest2d, m.t(1, 2, 3, 3), [6, 6]),
    "upsample_nearest3d": lambda m: _m(torch._C._nn.upsample_nearest3d, m.t(1, 2, 2, 2, 2), [4, 4, 4]),
    "upsample_linear1d": lambda m: _m(torch._C._nn.upsample_linear1d, m.t(1, 2, 3), [6], False),
    "upsample_bilinear2d": lambda m: _m(torch._C._nn.upsample_bilinear2d, m.t(1, 2, 3, 3), [6, 6], False),
    "upsample_trilinear3d": lambda m: _m(torch._C._nn.upsample_trilinear3d, m.t(1, 2, 2, 2, 2), [4, 4, 4], False),
    "upsample_bicubic2d": lambda m: _m(torch._C._nn.upsample_bicubic2d, m.t(1, 2, 3, 3), [6, 6], False),
    "_upsample_nearest_exact1d": lambda m: _m(torch._C._nn._upsample_nearest_exact1d, m.t(1, 2, 3), [6]),
    "_upsample_nearest_exact2d": lambda m: _m(torch._C._nn._upsample_nearest_exact2d, m.t(1, 2, 3, 3), [6, 6]),
    "_upsample_nearest_exact3d": lambda m: _m(torch._C._nn._upsample_nearest_exact3d, m.t(1, 2, 2, 2, 2), [4, 4, 4]),
    "_upsample_bilinear2d_aa": lambda m: _m(torch._C._nn._upsample_bilinear2d_aa, m.t(1, 2, 6, 6), [3, 3], False),
    "_upsample_bicubic2d_aa": lambda m: _m(torch._C._nn._upsample_bicubic2d_aa, m.t(1, 2, 6, 6), [3, 3], False),
    # ---- normalisation and activations
    "layer_norm": lambda m: _m(F.layer_norm, m.t(2, 3, 4), (4,), m.t(4), m.t(4)),
    "native_layer_norm": lambda m: _m(torch.native_layer_norm, m.t(2, 3, 4), [4], m.t(4), m.t(4), 1e-5),
    "rms_norm": lambda m: _m(F.rms_norm, m.t(2, 3, 4), (4,), m.t(4)),
    "group_norm": lambda m: _m(F.group_norm, m.t(2, 4, 3), 2, m.t(4), m.t(4)),
    "batch_norm": lambda m: _m(F.batch_norm, m.t(3, 4), m.t(4), m.pos(4), m.t(4), m.t(4)),
    "normalize": lambda m: _m(F.normalize, m.t(3, 4)),
    "cosine_similarity": lambda m: _m(F.cosine_similarity, m.t(3, 4), m.t(3, 4)),
    "pairwise_distance": lambda m: _m(F.pairwise_distance, m.t(3, 4), m.t(3, 4)),
    "softplus": lambda m: _m(F.softplus, m.t(3, 4)),
    "relu": lambda m: _m(F.relu, m.t(3, 4)),
    "gelu": lambda m: _m(F.gelu, m.t(3, 4)),
    "silu": lambda m: _m(F.silu, m.t(3, 4)),
    "tanh": lambda m: _m(torch.tanh, m.t(3, 4)),
    "sigmoid": lambda m: _m(torch.sigmoid, m.t(3, 4)),
    "softmax": lambda m: _m(F.softmax, m.t(3, 4), -1),
    "log_softmax": lambda m: _m(F.log_softmax, m.t(3, 4), -1),
    "embedding": lambda m: _m(F.embedding, m.i(5, 3), m.t(5, 4)),
    "dropout": lambda m: _m(F.dropout, m.t(3, 4), 0.5, False),
    # ---- pointwise
    "acos": lambda m: _m(torch.acos, m.u(3, 4)),
    "asin": lambda m: _m(torch.asin, m.u(3, 4)),
    "cosh": lambda m: _m(torch.cosh, m.t(3, 4)),
    "sinh": lambda m: _m(torch.sinh, m.t(3, 4)),
    "tan": lambda m: _m(torch.tan, m.u(3, 4)),
    "erfinv": lambda m: _m(torch.erfinv, m.u(3, 4)),
    "exp": lambda m: _m(torch.exp, m.t(3, 4)),
    "expm1": lambda m: _m(torch.expm1, m.t(3, 4)),
    "log": lambda m: _m(torch.log, m.pos(3, 4)),
    "log10": lambda m: _m(torch.log10, m.pos(3, 4)),
    "log2": lambda m: _m(torch.log2, m.pos(3, 4)),
    "log1p": lambda m: _m(torch.log1p, m.pos(3, 4)),
    "reciprocal": lambda m: _m(torch.reciprocal, m.pos(3, 4)),
    "rsqrt": lambda m: _m(torch.rsqrt, m.pos(3, 4)),
    "pow": lambda m: _m(torch.pow, m.pos(3, 4), 2.5),
    "add": lambda m: _m(torch.add, m.t(3, 4), m.t(3, 4)),
    "mul": lambda m: _m(torch.mul, m.t(3, 4), m.t(3, 4)),
    "addcdiv": lambda m: _m(torch.addcdiv, m.t(3, 4), m.t(3, 4), m.pos(3, 4), value=0.5),
    "addcmul": lambda m: _m(torch.addcmul, m.t(3, 4), m.t(3, 4), m.t(3, 4), value=0.5),
    "atan2": lambda m: _m(torch.atan2, m.t(3, 4), m.t(3, 4)),
    "cross": lambda m: _m(torch.cross, m.t(4, 3), m.t(4, 3), dim=1),
    "polar": lambda m: _m(torch.polar, m.pos(3, 4), m.t(3, 4)),
    "view_as_complex": lambda m: _m(torch.view_as_complex, m.t(3, 4, 2)),
    "fake_quantize_per_tensor_affine": lambda m: _m(torch.fake_quantize_per_tensor_affine, m.t(3, 4), 0.1, 0, -128, 127),
    # ---- reductions
    "sum": lambda m: _m(torch.sum, m.t(3, 4)),
    "prod": lambda m: _m(torch.prod, m.pos(3, 4), 1),
    "cumsum": lambda m: _m(torch.cumsum, m.t(3, 4), 1),
    "cumprod": lambda m: _m(torch.cumprod, m.pos(3, 4), 1),
    "mean": lambda m: _m(torch.mean, m.t(3, 4)),
    "norm": lambda m: _m(torch.norm, m.t(3, 4)),
    "linalg.vector_norm": lambda m: _m(torch.linalg.vector_norm, m.t(3, 4)),
    "linalg.matrix_norm": lambda m: _m(torch.linalg.matrix_norm, m.t(3, 4)),
    "frobenius_norm": lambda m: _m(torch.frobenius_norm, m.t(3, 4), [0, 1]),
    "nuclear_norm": lambda m: _m(torch.nuclear_norm, m.t(3, 4)),
    "logsumexp": lambda m: _m(torch.logsumexp, m.t(3, 4), 1),
    "dist": lambda m: _m(torch.dist, m.t(3, 4), m.t(3, 4)),
    "pdist": lambda m: _m(F.pdist, m.t(4, 3)),
    "cdist": lambda m: _m(torch.cdist, m.t(3, 4), m.t(2, 4)),
    "renorm": lambda m: _m(torch.renorm, m.t(3, 4), 2, 0, 1.0),
    "quantile": lambda m: _m(torch.quantile, m.t(3, 4), 0.3, dim=1),
    "nanquantile": lambda m: _m(torch.nanquantile, m.t(3, 4), 0.3, dim=1),
    "trace": lambda m: _m(torch.trace, m.t(4, 4)),
    # ---- indexing, joining
    "cat": lambda m: _m(torch.cat, [m.t(2, 3), m.t(2, 3)]),
    "stack": lambda m: _m(torch.stack, [m.t(2, 3), m.t(2, 3)]),
    "index_copy": lambda m: _m(torch.index_copy, m.t(4, 3), 0, m.c([0, 2]), m.t(2, 3)),
    "index_put": lambda m: _m(torch.index_put, m.t(4, 3), (m.c([0, 2]),), m.t(2, 3)),
    "scatter_add": lambda m: _m(torch.scatter_add, m.t(3, 4), 1, m.i(4, 3, 2), m.t(3, 2)),
    # ---- spectral
    "stft": lambda m: _m(torch.stft, m.t(32), 8, window=m.f32(8).abs() + 0.5, return_complex=True),
    # (torch.fft's functions, each on one input of the shape named)
    **{f"fft.{name}": (lambda m, fn=getattr(torch.fft, name), shape=shape: _m(fn, m.t(*shape)))
       for name, shape in (("fft", (8,)), ("ifft", (8,)), ("fft2", (4, 4)), ("ifft2", (4, 4)),
                           ("fftn", (2, 4, 4)), ("ifftn", (2, 4, 4)), ("rfft", (8,)), ("irfft", (5,)),
                           ("rfft2", (4, 4)), ("irfft2", (4, 3)), ("rfftn", (2, 4, 4)),
                           ("irfftn", (2, 4, 3)), ("hfft", (5,)), ("ihfft", (8,)))},
    # ---- linear algebra
    "cholesky": lambda m: _m(torch.cholesky, m.spd(3)),
    "cholesky_inverse": lambda m: _m(torch.cholesky_inverse, torch.linalg.cholesky(m.spd(3).float()).to(m.dtype)),
    "cholesky_solve": lambda m: _m(torch.cholesky_solve, m.t(3, 2), torch.linalg.cholesky(m.spd(3).float()).to(m.dtype)),
    "inverse": lambda m: _m(torch.inverse, m.spd(3)),
    "pinverse": lambda m: _m(torch.pinverse, m.t(3, 4)),
    "lu": lambda m: _m(torch.lu, m.spd(3)),
    "lu_solve": lambda m: _m(torch.lu_solve, m.t(3, 2), *[x.to(m.dtype) if x.is_floating_point() else x for x in torch.linalg.lu_factor(m.spd(3).float())]),
    "geqrf": lambda m: _m(torch.geqrf, m.t(4, 3)),
    "orgqr": lambda m: _m(torch.orgqr, *torch.geqrf(m.t(4, 3).float())),
    "ormqr": lambda m: _m(torch.ormqr, *torch.geqrf(m.t(4, 3).float()), m.t(4, 2)),
    "qr": lambda m: _m(torch.qr, m.t(4, 3)),
    "svd": lambda m: _m(torch.svd, m.t(4, 3)),
    "triangular_solve": lambda m: _m(torch.triangular_solve, m.t(3, 2), m.spd(3)),
    "linalg.cholesky": lambda m: _m(torch.linalg.cholesky, m.spd(3)),
    "linalg.cholesky_ex": lambda m: _m(torch.linalg.cholesky_ex, m.spd(3)),
    "linalg.cond": lambda m: _m(torch.linalg.cond, m.spd(3)),
    "linalg.eig": lambda m: _m(torch.linalg.eig, m.spd(3)),
    "linalg.eigh": lambda m: _m(torch.linalg.eigh, m.spd(3)),
    "linalg.eigvals": lambda m: _m(torch.linalg.eigvals, m.spd(3)),
    "linalg.eigvalsh": lambda m: _m(torch.linalg.eigvalsh, m.spd(3)),
    "linalg.householder_product": lambda m: _m(torch.linalg.householder_product, *torch.geqrf(m.t(4, 3).float())),
    "linalg.inv": lambda m: _m(torch.linalg.inv, m.spd(3)),
    "linalg.inv_ex": lambda m: _m(torch.linalg.inv_ex, m.spd(3)),
    "linalg.lstsq": lambda m: _m(torch.linalg.lstsq, m.spd(3), m.t(3, 2)),
    "linalg.matrix_rank": lambda m: _m(torch.linalg.matrix_rank, m.spd(3)),
    "linalg.qr": lambda m: _m(torch.linalg.qr, m.t(4, 3)),
    "linalg.solve": lambda m: _m(torch.linalg.solve, m.spd(3), m.t(3, 2)),
    "linalg.svd": lambda m: _m(torch.linalg.svd, m.t(4, 3)),
    "linalg.svdvals": lambda m: _m(torch.linalg.svdvals, m.t(4, 3)),
    "linalg.tensorinv": lambda m: _m(torch.linalg.tensorinv, m.spd(4).reshape(4, 2, 2), ind=1),
    "linalg.tensorsolve": lambda m: _m(torch.linalg.tensorsolve, m.spd(4).reshape(2, 2, 4), m.t(2, 2)),
    "linalg.pinv": lambda m: _m(torch.linalg.pinv, m.t(3, 4)),
    "linalg.det": lambda m: _m(torch.linalg.det, m.spd(3)),
}

# Extra names the drift check probes beyond the spec's own ops.
CANDIDATES = tuple(sorted(_SAMPLES))


def op_sample(op: str, device="cpu", dtype=torch.float32) -> OpSample:
    """A call of ``op`` with fresh inputs: floating tensors in ``dtype`` on ``device``.

    The values depend only on ``op`` (not on the dtype or the device), so a
    float32 and a bfloat16 sample hold the same numbers up to rounding.
    Raises KeyError naming the known ops for an op without a sample.
    """
    if isinstance(device, torch.device):
        device = device.type
    try:
        build = _SAMPLES[op]
    except KeyError:
        raise KeyError(f"ampkit.testing.op_sample: no sample for op {op!r}; known: {', '.join(CANDIDATES)}") from None
    fn, args, kwargs = build(_Maker(op, device, dtype))
    return OpSample(op, fn, tuple(args), dict(kwargs))
