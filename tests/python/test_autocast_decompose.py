"""Ops under a policy's ``decompose`` list: ampkit runs their ATen decomposition in Python.

Outside a region each decomposition must give the op's own values bit for bit
(it runs the same kernels in the same order). In a region its parts are cast by
their own rules: on cuda that is what native autocast does (compared with
``torch.autocast`` on a GPU); on cpu, where torch lists cross_entropy as fp32,
a policy that decomposes it is compared with the casts written out by hand.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import contextlib

import ampkit
from ampkit import _autocast
from ampkit import _decompositions as D

pytestmark = pytest.mark.usefixtures("ampkit_quiet")


def ce_cases(device, dtype):
    """(id, args, kwargs) of F.cross_entropy: every branch of ATen's cross_entropy_loss."""
    g = torch.Generator().manual_seed(0)

    def t(*shape):
        return torch.randn(*shape, generator=g).to(device=device, dtype=dtype)

    def probs(*shape):
        return torch.softmax(torch.randn(*shape, generator=g), 1).to(device=device, dtype=dtype)

    def idx(high, *shape):
        return torch.randint(0, high, shape, generator=g).to(device)

    x, x3, x1 = t(8, 5), t(2, 5, 3), t(5)
    tgt = idx(5, 8)
    tgt_ign = tgt.clone()
    tgt_ign[[1, 6]] = -100
    w = (torch.rand(5, generator=g) + 0.5).to(device)
    out = []
    for red in ("mean", "sum", "none"):
        out += [
            (f"index-{red}", (x, tgt), {"reduction": red}),
            (f"index-weight-{red}", (x, tgt, w), {"reduction": red}),
            (f"index-ignore-{red}", (x, tgt_ign), {"reduction": red}),
            (f"index-ignore3-weight-{red}", (x, tgt, w), {"reduction": red, "ignore_index": 3}),
            (f"index-3d-{red}", (x3, idx(5, 2, 3)), {"reduction": red}),
            (f"smoothing-{red}", (x, tgt_ign), {"reduction": red, "label_smoothing": 0.1}),
            (f"smoothing-weight-{red}", (x, tgt_ign, w), {"reduction": red, "label_smoothing": 0.2}),
            (f"smoothing-1d-{red}", (x1, idx(5)), {"reduction": red, "label_smoothing": 0.3}),
            (f"probs-{red}", (x, probs(8, 5)), {"reduction": red}),
            (f"probs-weight-smoothing-{red}", (x, probs(8, 5), w), {"reduction": red, "label_smoothing": 0.1}),
            (f"probs-3d-{red}", (x3, probs(2, 5, 3)), {"reduction": red}),
        ]
    out.append(("legacy-size_average", (x, tgt), {"size_average": False}))
    return out


def _aten_call(args, kw):
    red = {"none": 0, "mean": 1, "sum": 2}[kw.get("reduction", "mean")]
    w = args[2] if len(args) > 2 else None
    return (args[0], args[1], w, red, kw.get("ignore_index", -100), kw.get("label_smoothing", 0.0))


CE_IDS = [c[0] for c in ce_cases("cpu", torch.float32)]


# ------------------------------------------------------------------ exact outside a region
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16], ids=str)
def test_cross_entropy_decomposition_is_atens_bit_for_bit(dtype):
    for name, args, kw in ce_cases("cpu", dtype):
        args = tuple(a.to(dtype) if a.is_floating_point() else a for a in args)  # outside a region: one dtype
        want = F.cross_entropy(*args, **kw)
        got = D._cross_entropy_functional(*args, **kw)
        assert got.dtype == want.dtype and torch.equal(got, want), name
        a = _aten_call(args, kw)
        assert torch.equal(D._cross_entropy_aten(*a), torch._C._nn.cross_entropy_loss(*a)), name


def test_cross_entropy_decomposition_gradients_are_atens():
    for name, args, kw in ce_cases("cpu", torch.float32):
        grads = []
        for fn in (F.cross_entropy, D._cross_entropy_functional):
            x = args[0].detach().clone().requires_grad_(True)
            out = fn(x, *args[1:], **kw)
            (out * torch.linspace(-1, 1, out.numel()).reshape(out.shape)).sum().backward()
            grads.append(x.grad)
        assert torch.equal(*grads), name


@pytest.mark.parametrize(
    "call",
    [
        pytest.param(lambda f: f(torch.randn(3, 4), torch.rand(3, 4), ignore_index=1), id="ignore_index_with_probs"),
        pytest.param(lambda f: f(torch.randn(3, 4), torch.zeros(3, 4, dtype=torch.long)), id="integer_probs"),
        pytest.param(lambda f: f(torch.randn(3, 4), torch.tensor([0, 1, 2]), label_smoothing=1.5), id="smoothing_above_1"),
        pytest.param(lambda f: f(torch.randn(3, 4), torch.rand(3, 4), label_smoothing=1.5), id="smoothing_above_1_probs"),
        pytest.param(lambda f: f(torch.randn(3, 4), torch.rand(3, 4), torch.rand(3)), id="probs_weight_shape"),
        pytest.param(lambda f: f(torch.randn(3, 4), torch.tensor([0, 1, 2]), reduction="avg"), id="bad_reduction"),
        pytest.param(lambda f: f(torch.randn(3, 4), torch.tensor([0, 1])), id="batch_mismatch"),
    ],
)
def test_cross_entropy_decomposition_raises_as_aten(call):
    with pytest.raises(Exception) as native:
        call(F.cross_entropy)
    with pytest.raises(type(native.value)) as ours:
        call(D._cross_entropy_functional)
    assert str(ours.value).splitlines()[0] == str(native.value).splitlines()[0]


def test_pairwise_distance_and_trace_decompositions_are_atens():
    g = torch.Generator().manual_seed(0)
    for dtype in (torch.float32, torch.bfloat16):
        a, b = torch.randn(4, 7, generator=g).to(dtype), torch.randn(4, 7, generator=g).to(dtype)
        for kw in ({}, {"p": 1.0}, {"keepdim": True}, {"p": 3.0, "eps": 1e-3}):
            assert torch.equal(D.pairwise_distance(a, b, **kw), F.pairwise_distance(a, b, **kw)), (dtype, kw)
        assert torch.equal(D.pairwise_distance(a, b[0]), F.pairwise_distance(a, b[0]))  # broadcast
    m = torch.randint(-5, 5, (5, 5), generator=g).float()  # integers: exact in any summation order
    assert torch.equal(D.trace(m), torch.trace(m))
    with pytest.raises(RuntimeError, match="expected a matrix"):
        D.trace(torch.randn(2, 2, 2))


# ------------------------------------------------------------------ in a region (cpu)
# cuda's rules for the parts, on cpu: log_softmax and sum get a float32 output, nll_loss is fp32.
CUDA_LIKE = ampkit.load_policy("torch_default").with_ops(
    "cpu", decompose=["cross_entropy", "pairwise_distance"], fp32_output=["log_softmax", "sum", "norm"]
)


def test_cross_entropy_parts_are_cast_by_their_own_rules_on_cpu():
    x, tgt = torch.randn(6, 5).bfloat16(), torch.tensor([0, 3, 1, 4, 2, 1])
    with ampkit.trace() as tr, ampkit.autocast("cpu", policy=CUDA_LIKE):
        got = F.cross_entropy(x, tgt)
        module = torch.nn.CrossEntropyLoss()(x, tgt)
    # the control: native cuda's casts written out (log-probs in bf16, nll_loss in float32)
    want = F.nll_loss(torch.log_softmax(x, 1, dtype=x.dtype).float(), tgt)
    assert got.dtype == torch.float32 and torch.equal(got, want) and torch.equal(module, want)
    rows = [(r.op, r.rule, r.output_dtype) for r in tr.records]
    assert rows[:3] == [
        ("log_softmax", "fp32_output", "bfloat16"),  # dtype given: kept
        ("nll_loss", "fp32", "float32"),
        ("cross_entropy", "decompose", "float32"),  # recorded after its parts
    ]
    with ampkit.autocast("cpu", policy=CUDA_LIKE, enabled=False):
        assert torch.equal(F.cross_entropy(x, tgt), torch.nn.functional.cross_entropy(x, tgt))


def test_label_smoothing_sums_get_a_float32_output_on_cpu():
    x, tgt = torch.randn(6, 5).bfloat16(), torch.tensor([0, 3, 1, 4, 2, 1])
    with ampkit.autocast("cpu", policy=CUDA_LIKE):
        got = F.cross_entropy(x, tgt, label_smoothing=0.1)
    logp = torch.log_softmax(x, 1, dtype=x.dtype)
    smooth = -logp.sum(1, dtype=torch.float32)
    want = F.nll_loss(logp.float(), tgt) * 0.9 + smooth.sum() / 6 * (0.1 / 5)
    assert got.dtype == torch.float32 and torch.equal(got, want)


def test_pairwise_distance_difference_stays_in_the_input_dtype_on_cpu():
    a, b = torch.randn(4, 7).bfloat16(), torch.randn(4, 7).bfloat16()
    with ampkit.autocast("cpu", policy=CUDA_LIKE):
        got = F.pairwise_distance(a, b)
    want = torch.linalg.vector_norm(a - b + 1e-6, 2, -1, dtype=torch.float32)
    assert got.dtype == torch.float32 and torch.equal(got, want)


def test_decomposed_op_on_another_device_or_float64_is_left_alone():
    x64, tgt = torch.randn(6, 5, dtype=torch.float64), torch.tensor([0, 3, 1, 4, 2, 1])
    with ampkit.autocast("cpu", policy=CUDA_LIKE):
        assert torch.equal(F.cross_entropy(x64, tgt), F.cross_entropy(x64, tgt))
    # a cuda-only region does not touch cpu tensors: cross_entropy runs as a plain call
    x = torch.randn(6, 5).bfloat16()
    with ampkit.trace() as tr, ampkit.autocast("cuda"):
        out = F.cross_entropy(x, tgt)
    assert out.dtype == torch.bfloat16 and [(r.op, r.rule) for r in tr.records] == [("cross_entropy", "none")]


# ------------------------------------------------------------------ cuda: against native autocast
LOWS = pytest.mark.parametrize("low", [torch.float16, torch.bfloat16], ids=["float16", "bfloat16"])


@contextlib.contextmanager
def _reference(low):
    """ampkit's reference engine: the decomposition runs in Python, torch's autocast off."""
    with _autocast.reference(), ampkit.autocast("cuda", dtype=low):
        yield


def _both(fn, args, kw, low):
    outs = []
    for region in (torch.autocast("cuda", dtype=low), _reference(low)):
        a = [args[0].detach().clone().requires_grad_(True), *args[1:]]  # the logits / first input
        with region:
            y = fn(*a, **kw)
        (y.float() * torch.linspace(-1, 1, y.numel(), device="cuda").reshape(y.shape)).sum().backward()
        outs.append((y.detach(), a[0].grad))
    return outs


@pytest.mark.cuda
@LOWS
@pytest.mark.parametrize("case", CE_IDS)
def test_cuda_cross_entropy_matches_native_bit_for_bit(case, low):
    for name, args, kw in ce_cases("cuda", low):
        if name == case:
            (ny, ng), (ay, ag) = _both(F.cross_entropy, args, kw, low)
            assert ay.dtype == ny.dtype == torch.float32 and torch.equal(ay, ny), f"{case}: {ay} vs {ny}"
            assert ag.dtype == ng.dtype and torch.equal(ag, ng), case


@pytest.mark.cuda
@LOWS
def test_cuda_pairwise_distance_and_trace_match_native_bit_for_bit(low):
    g = torch.Generator().manual_seed(0)
    a, b = (torch.randn(64, 300, generator=g).to("cuda", low) for _ in range(2))
    for kw in ({}, {"p": 1.0}, {"keepdim": True}):
        (ny, ng), (ay, ag) = _both(F.pairwise_distance, (a, b), kw, low)
        assert ay.dtype == ny.dtype == torch.float32 and torch.equal(ay, ny) and torch.equal(ag, ng), kw
    m = torch.randn(300, 300, generator=g).to("cuda", low)
    (ny, ng), (ay, ag) = _both(torch.trace, (m,), {}, low)
    assert ay.dtype == ny.dtype == torch.float32 and torch.equal(ay, ny) and torch.equal(ag, ng)


@pytest.mark.cuda
def test_cuda_cross_entropy_keeps_no_float32_copy_of_the_log_probs():
    """The log-probs stay float16; nll_loss casts only the elements it reads (narrow cast).

    Native autocast holds the float16 log-probs and a float32 copy of them for
    nll_loss; ampkit holds the float16 log-probs alone, plus small tensors. ampkit's
    handler runs in a region whose policy changes something that needs it (here: norm, a
    Python function of torch, moved to lower_precision_fp; a change that runs as a kernel at
    the Autocast key pushes no handler); with the default policy the region is torch's
    autocast alone.
    """
    changed = ampkit.load_policy("torch_default").with_ops("cuda", lower_precision_fp=["norm"])
    x = torch.randn(1024, 8192, device="cuda", dtype=torch.float16)
    tgt = torch.randint(0, 8192, (1024,), device="cuda")
    peaks = []
    for region in (torch.autocast("cuda"), ampkit.autocast("cuda", policy=changed)):
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        with region:
            F.cross_entropy(x, tgt)
        peaks.append(torch.cuda.max_memory_allocated() - base)
    fp16_logp, fp32_copy = x.numel() * 2, x.numel() * 4
    assert peaks[0] >= fp16_logp + fp32_copy, peaks  # the native baseline this saves
    assert fp16_logp <= peaks[1] < fp16_logp + (1 << 20), peaks
