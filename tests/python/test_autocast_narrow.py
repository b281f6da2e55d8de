"""Narrow casts: nll_loss on a large input casts only the elements it reads.

The oracle is torch.autocast on the same inputs: the loss and the gradient of
the input must be the same bit for bit, on the paths that narrow and on those
that do not. A spy on ``ampkit._narrow_casts.nll_loss`` shows which path ran,
so a test of the narrow path cannot pass by falling back to the full cast.

Narrowing happens where ampkit's handler runs: a region whose policy changes
something that needs the handler (here ``norm``, a Python function of torch, moves to
lower_precision_fp, an op these tests never call; a change that runs as a kernel at the
Autocast key pushes no handler),
the trace and the reference engine. A region whose policy equals torch's is
torch's autocast alone; the last test shows that it leaves nll_loss to torch.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import ampkit
from ampkit import _narrow_casts as N
from conftest import needs_no_declared_differences

pytestmark = pytest.mark.usefixtures("ampkit_quiet")

ROWS, CLASSES = 512, 300  # 153600 elements >= N.MIN_ELEMENTS


@pytest.fixture
def narrowed(monkeypatch):
    """A list that gets True for each nll_loss call that narrowed, False for each that tried and did not."""
    seen = []
    real = N.NARROWED["nll_loss"]

    def spy(func, args, kwargs):
        out = real.run(func, args, kwargs)
        seen.append(out is not N.NOT_NARROWED)
        return out

    monkeypatch.setitem(N.NARROWED, "nll_loss", N.Narrowing(real.pays, spy))
    return seen


# a policy whose delta over native is one op these tests never call and that cannot run as
# a kernel at torch's Autocast key (norm: a Python function of torch): its region runs
# ampkit's handler, which narrows nll_loss
CHANGED = ampkit.load_policy("torch_default").with_ops("cpu", lower_precision_fp=["norm"]).with_ops(
    "cuda", lower_precision_fp=["norm"])


def _region(engine, device, dtype):
    if engine == "torch":
        return torch.autocast(device, dtype=dtype)
    return ampkit.autocast(device, dtype=dtype, policy=CHANGED)


def _run(engine, device, dtype, x, call):
    """call(h) -> loss, where h is log-probabilities in the region dtype; returns (loss, x.grad)."""
    x = x.detach().clone().requires_grad_(True)
    with _region(engine, device, dtype):
        h = torch.log_softmax(x.to(dtype), 1, dtype=dtype)
        loss = call(h)
    (loss.sum() if loss.dim() else loss).backward()
    return loss.detach(), x.grad


def _targets(device, rows, classes, ignore_index, seed=0):
    g = torch.Generator().manual_seed(seed)
    t = torch.randint(0, classes, (rows,), generator=g)
    t[::7] = ignore_index  # every seventh row ignored (or, for ignore_index >= 0, that class)
    return t.to(device)


def _check(device, dtype, call, x, narrowed, expect_narrow):
    want, want_grad = _run("torch", device, dtype, x, call)
    narrowed.clear()
    got, got_grad = _run("ampkit", device, dtype, x, call)
    # (below MIN_ELEMENTS the narrowing's pays() is False and run() is not called: no entry)
    assert (narrowed and all(narrowed)) if expect_narrow else not any(narrowed), narrowed
    assert got.dtype == want.dtype == torch.float32
    assert torch.equal(got, want), (got, want)
    assert got_grad.dtype == want_grad.dtype and torch.equal(got_grad, want_grad)


CALLS = {
    "F-mean": lambda t, ii: lambda h: F.nll_loss(h, t, ignore_index=ii),
    "F-sum": lambda t, ii: lambda h: F.nll_loss(h, t, ignore_index=ii, reduction="sum"),
    "F-none": lambda t, ii: lambda h: F.nll_loss(h, t, ignore_index=ii, reduction="none"),
    "F-legacy-size_average": lambda t, ii: lambda h: F.nll_loss(h, t, size_average=False, ignore_index=ii),
    "aten-mean": lambda t, ii: lambda h: torch._C._nn.nll_loss(h, t, None, 1, ii),
    "aten-none-kw": lambda t, ii: lambda h: torch._C._nn.nll_loss(h, t, reduction=0, ignore_index=ii),
}


@pytest.mark.parametrize("ignore_index", [-100, 0, 5])
@pytest.mark.parametrize("call", sorted(CALLS))
def test_narrow_nll_loss_equals_native_autocast_cpu(call, ignore_index, narrowed):
    x = torch.randn(ROWS, CLASSES, generator=torch.Generator().manual_seed(1))
    t = _targets("cpu", ROWS, CLASSES, ignore_index)
    _check("cpu", torch.bfloat16, CALLS[call](t, ignore_index), x, narrowed, expect_narrow=True)


@pytest.mark.parametrize("case", ["small", "weight", "byte-target", "3d"])
def test_cases_that_do_not_narrow_still_equal_native_autocast(case, narrowed):
    g = torch.Generator().manual_seed(2)
    rows = 8 if case == "small" else ROWS
    x = torch.randn(rows, CLASSES, generator=g)
    t = _targets("cpu", rows, CLASSES, -100)
    if case == "weight":
        w = torch.rand(CLASSES, generator=g) + 0.5
        call = lambda h: F.nll_loss(h, t, w)  # noqa: E731
    elif case == "byte-target":
        t = (t.clamp(min=0) % 200).to(torch.uint8)  # nll_loss takes Long or Byte targets
        call = lambda h: F.nll_loss(h[:, :200], t)  # noqa: E731
    elif case == "3d":
        call = lambda h: F.nll_loss(h.view(2, rows // 2, CLASSES).transpose(1, 2),  # noqa: E731
                                    t.clamp(min=0).view(2, rows // 2))
    else:
        call = lambda h: F.nll_loss(h, t)  # noqa: E731
    _check("cpu", torch.bfloat16, call, x, narrowed, expect_narrow=False)


def test_out_of_range_target_raises_the_native_error(narrowed):
    x = torch.randn(ROWS, CLASSES)
    t = _targets("cpu", ROWS, CLASSES, -100)
    t[3] = CLASSES + 4
    errors = []
    for engine in ("torch", "ampkit"):
        with pytest.raises(Exception) as info:
            _run(engine, "cpu", torch.bfloat16, x, lambda h: F.nll_loss(h, t))
        errors.append((type(info.value), str(info.value)))
    assert errors[0] == errors[1]
    assert f"Target {CLASSES + 4} is out of bounds" in errors[1][1]


def test_narrow_path_is_only_taken_at_min_elements(narrowed, monkeypatch):
    x = torch.randn(ROWS, CLASSES)
    t = _targets("cpu", ROWS, CLASSES, -100)
    monkeypatch.setattr(N, "MIN_ELEMENTS", ROWS * CLASSES + 1)
    _check("cpu", torch.bfloat16, lambda h: F.nll_loss(h, t), x, narrowed, expect_narrow=False)
    monkeypatch.setattr(N, "MIN_ELEMENTS", ROWS * CLASSES)
    _check("cpu", torch.bfloat16, lambda h: F.nll_loss(h, t), x, narrowed, expect_narrow=True)


def test_trace_records_nll_loss_as_fp32_with_float32_output():
    h = torch.randn(ROWS, CLASSES).log_softmax(1).to(torch.bfloat16)
    with ampkit.trace() as tr, ampkit.autocast("cpu"):
        F.nll_loss(h, _targets("cpu", ROWS, CLASSES, -100))
    rec = [r for r in tr.records if r.op == "nll_loss"]
    assert [(r.rule, r.input_dtypes[0], r.output_dtype) for r in rec] == [("fp32", "bfloat16", "float32")]


# ------------------------------------------------------------------ cuda: cross_entropy's nll_loss
@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("ignore_index", [-100, 3])
def test_cross_entropy_on_cuda_narrows_and_equals_native_autocast(dtype, reduction, ignore_index, narrowed):
    """cross_entropy is decomposed on cuda: log_softmax in the input dtype, then nll_loss (narrowed)."""
    rows, classes = 2048, 4096
    g = torch.Generator().manual_seed(3)
    x = torch.randn(rows, classes, generator=g).cuda()
    t = _targets("cuda", rows, classes, ignore_index)
    call = lambda h: F.cross_entropy(h, t, reduction=reduction, ignore_index=ignore_index)  # noqa: E731

    def run(engine):
        xx = x.clone().requires_grad_(True)
        with _region(engine, "cuda", dtype):
            logits = xx.to(dtype) * 1.5
            loss = call(logits)
        (loss.sum() if loss.dim() else loss).backward()
        return loss.detach(), xx.grad

    want, want_grad = run("torch")
    narrowed.clear()
    got, got_grad = run("ampkit")
    assert narrowed == [True]
    assert got.dtype == want.dtype and torch.equal(got, want)
    assert torch.equal(got_grad, want_grad)


@pytest.mark.cuda
def test_narrow_nll_loss_equals_native_autocast_cuda(narrowed):
    x = torch.randn(ROWS, CLASSES, generator=torch.Generator().manual_seed(4)).cuda()
    t = _targets("cuda", ROWS, CLASSES, -100)
    _check("cuda", torch.float16, lambda h: F.nll_loss(h, t), x, narrowed, expect_narrow=True)


@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_every_row_ignored_gives_the_native_result(reduction, narrowed):
    """Natively a mean over no rows is NaN (0 / 0) and a sum is 0; the narrow path keeps both."""
    x = torch.randn(ROWS, CLASSES, generator=torch.Generator().manual_seed(5))
    t = torch.full((ROWS,), -100)
    call = lambda h: F.nll_loss(h, t, reduction=reduction)  # noqa: E731
    want, want_grad = _run("torch", "cpu", torch.bfloat16, x, call)
    narrowed.clear()
    got, got_grad = _run("ampkit", "cpu", torch.bfloat16, x, call)
    assert narrowed == [True]
    assert want.isnan().item() == (reduction == "mean")
    assert torch.equal(got, want) or (got.isnan().item() and want.isnan().item())
    assert torch.equal(got_grad, want_grad)


@needs_no_declared_differences
def test_default_policy_leaves_nll_loss_to_torch(narrowed):
    x = torch.randn(ROWS, CLASSES, generator=torch.Generator().manual_seed(1))
    t = _targets("cpu", ROWS, CLASSES, -100)
    with ampkit.autocast("cpu"):
        h = torch.log_softmax(x.to(torch.bfloat16), 1)
        loss = F.nll_loss(h, t)
    with torch.autocast("cpu"):
        want = F.nll_loss(torch.log_softmax(x.to(torch.bfloat16), 1), t)
    assert narrowed == [] and torch.equal(loss, want)
