"""The transposed copies of fp8 operands that the backward's ``_scaled_mm`` needs.

Hopper's fp8 GEMM takes its first operand row-major and its second column-major, so the
backward of ``input @ weight.T`` needs the input's fp8 copy and the output gradient's fp8
copy transposed (ampkit._fp8). Written as ``t.t().contiguous()`` inside compiled code,
inductor fuses each transposed copy into the kernel that makes ``t`` (the producer's
reduction: the cast with its row maxima, after a GELU or a layer norm), where the
transposed store is strided: measured on the 16 x 2048 decoder (H100, fp8-speed-h100-e5b6a2f),
such kernels ran at ~1 TB/s. :func:`transposed` is an operator of its own
(``torch.ops.ampkit.transposed``) backed by a tiled Triton kernel on CUDA (loads and stores
both coalesced): the producer writes ``t`` once, row-major, and the copy reads it back in
tiles. On torch >= 2.6 it is a ``triton_op``, whose kernel inductor launches from its own
code as a kernel of its own (never fused); on older torch an opaque ``custom_op``, which
the compiled code calls. Off CUDA (or without Triton) its body
is ``t.t().contiguous()``. The values are the same bytes in every path.

>>> import torch
>>> t = torch.arange(6, dtype=torch.float32).reshape(2, 3)
>>> torch.equal(transposed(t), t.t().contiguous())
True
"""

from __future__ import annotations

import functools

import torch

TILE = 64  # a tile of TILE x TILE elements per Triton program


@functools.lru_cache(maxsize=None)
def _kernel():
    """The tiled transpose as a Triton kernel, or None where Triton cannot be imported."""
    try:
        import triton
        import triton.language as tl
    except ImportError:
        return None

    @triton.jit
    def transpose_tiles(src, dst, m, n, BLOCK: tl.constexpr):
        rm = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        rn = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        inside = (rm[:, None] < m) & (rn[None, :] < n)
        rm64, rn64 = rm.to(tl.int64), rn.to(tl.int64)  # (offsets past 2**31 elements)
        tile = tl.load(src + rm64[:, None] * n + rn64[None, :], mask=inside)  # src (m, n) row-major
        tl.store(dst + rn64[None, :] * m + rm64[:, None], tile, mask=inside)  # dst (n, m) row-major

    return transpose_tiles


# A Triton-backed operator (torch >= 2.6: ``torch.library.triton_op``) is one that inductor
# traces into: it launches the Triton kernel from its own generated code, as it launches its
# own kernels, and never fuses it with them. An opaque ``custom_op`` costs a trip through
# the dispatcher and the Python operator machinery each call: on an H200, at the GPT-2
# shape, its 144 calls a step took ~16 ms of the step's host time under the profiler,
# measured while ampkit's handler still saw every Python-level call of compiled graphs
# (ampkit._compiled_graphs), which inflated that figure by an amount not measured apart
# (benchmarks/results/gpu/fp8-host-h200-c846849/). Older torch keeps
# the opaque operator. (On a torch without Triton, the CPU builds, torch logs at import that
# it finds no Triton kernel in the body; the op is ``t.t().contiguous()`` there.)
_define = getattr(torch.library, "triton_op", None) or torch.library.custom_op
_launch = getattr(torch.library, "wrap_triton", lambda kernel: kernel)


def _transposed(t: torch.Tensor) -> torch.Tensor:
    """``t.t()`` as a new contiguous tensor (``t``: 2-D). One byte per element is what it
    is for (fp8), but any dtype works: the bytes are moved, never converted."""
    _check_2d(t)
    m, n = t.shape
    kernel = _kernel() if t.is_cuda and t.is_contiguous() and t.numel() > 0 else None
    if kernel is None:
        return t.t().clone(memory_format=torch.contiguous_format)
    out = torch.empty((n, m), dtype=t.dtype, device=t.device)
    src, dst = (t.view(torch.uint8), out.view(torch.uint8)) if t.element_size() == 1 else (t, out)
    grid = ((m + TILE - 1) // TILE, (n + TILE - 1) // TILE)
    with torch.cuda.device(t.device):
        _launch(kernel)[grid](src, dst, m, n, BLOCK=TILE)
    return out


transposed = _define("ampkit::transposed", _transposed, mutates_args=())
if _define is torch.library.custom_op:  # (a triton_op's fake is its own body, traced)
    @transposed.register_fake
    def _(t):
        _check_2d(t)
        return t.new_empty((t.shape[1], t.shape[0]))


def _check_2d(t):
    if t.dim() != 2:
        raise ValueError(f"ampkit.transposed takes a 2-D tensor, got {t.dim()}-D of shape {tuple(t.shape)}")
