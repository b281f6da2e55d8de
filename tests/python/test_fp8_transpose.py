"""torch.ops.ampkit.transposed (ampkit._fp8_transpose): the transposed copy the fp8 backward feeds
_scaled_mm, checked byte for byte against ``t.t().contiguous()`` (the oracle), eagerly, under
torch.compile (on CUDA a kernel of its own that inductor launches, not a store fused into the
producer's kernel) and, on CUDA, through its Triton kernel at shapes that are not multiples of its tile."""
from __future__ import annotations

import pytest
import torch

import ampkit  # noqa: F401  (registers the operator)
from conftest import compiles_correctly_here

transposed = torch.ops.ampkit.transposed

FP8 = (torch.float8_e4m3fn, torch.float8_e5m2)


def same_bytes(a, b):
    assert a.shape == b.shape and a.dtype == b.dtype and a.is_contiguous()
    return torch.equal(a.view(torch.uint8), b.view(torch.uint8)) if a.element_size() == 1 else torch.equal(a, b)


@pytest.mark.parametrize("dtype", [*FP8, torch.bfloat16, torch.float32], ids=str)
@pytest.mark.parametrize("shape", [(5, 3), (1, 7), (7, 1), (64, 130)])
def test_transposed_is_the_contiguous_transpose(dtype, shape):
    t = (torch.randn(shape) * 50).to(dtype)
    got = transposed(t)
    assert same_bytes(got, t.t().contiguous())
    assert got.data_ptr() != t.data_ptr()  # a copy even where t.t() is already contiguous


def _cast_and_transpose(x):
    q = (x * 3).clamp(-448, 448).to(torch.float8_e4m3fn)
    return q, transposed(q)


TRITON_OP = hasattr(torch.library, "triton_op")


def test_a_compiled_graph_gives_the_same_bytes():
    """Under torch.compile the copy has the eager bytes (where torch has
    ``torch.library.triton_op``, inductor traces into its body: on the CPU the plain
    transpose; on CUDA the test below checks that its kernel stays a kernel of its own)."""
    compiles_correctly_here("cpu")
    x = torch.randn(48, 32)
    q, qt = torch.compile(_cast_and_transpose)(x)
    assert same_bytes(qt, q.t().contiguous())
    assert same_bytes(q, _cast_and_transpose(x)[0])


def test_bad_input_is_a_clear_error():
    with pytest.raises(ValueError, match=r"ampkit.transposed takes a 2-D tensor, got 3-D of shape \(2, 3, 4\)"):
        transposed(torch.zeros(2, 3, 4))


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("dtype", [*FP8, torch.bfloat16], ids=str)
@pytest.mark.parametrize("shape", [(1, 1), (63, 65), (8192, 2048), (2048, 8192 + 16)])
def test_the_triton_kernel_moves_the_same_bytes(dtype, shape):
    t = (torch.randn(shape, device="cuda") * 50).to(dtype)
    assert same_bytes(transposed(t), t.t().contiguous())


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_inductor_launches_the_triton_kernel_as_a_kernel_of_its_own():
    """On CUDA (torch >= 2.6) the compiled code launches transpose_tiles itself, as a kernel
    of its own: no trip through the operator (its host cost), no store fused into the cast."""
    from torch._inductor.utils import run_and_get_code
    if not TRITON_OP:
        pytest.skip("torch %s has no torch.library.triton_op: the op stays opaque" % torch.__version__)
    x = torch.randn(256, 192, device="cuda")
    (q, qt), codes = run_and_get_code(torch.compile(_cast_and_transpose), x)
    assert same_bytes(qt, q.t().contiguous())
    code = "\n".join(codes)
    assert "transpose_tiles" in code and "torch.ops.ampkit.transposed" not in code
