"""Every op of the shipped table, ampkit vs torch.autocast on the same fresh inputs.

The ampkit side runs the reference engine (``ampkit._autocast.reference``: the
YAML tables alone decide, torch's autocast off underneath), so these tests prove
that the table equals native op by op: that proof is what lets a default region
hand the casting to torch's C++ autocast (``ampkit._native``).

One test per (device, category, op): three probes (all inputs float32, all in
the region dtype, the first float32 and the rest low), each compared with the
native result: output dtype exactly, values bit for bit (the same kernel runs
on the same cast inputs), and the gradients of every floating input. Each
probe is repeated with ``enabled=False`` against a plain call. Ops under a
device's ``decompose`` list run the same probes (their ATen decomposition must
give native's dtypes and values bit for bit). A probe that is a known gap must
still show the gap (native and ampkit disagree), so a torch release that closes
it fails here and the gap gets removed.
"""

from __future__ import annotations

import contextlib

import pytest
import torch

import ampkit
from ampkit import _autocast
from ampkit.drift import known_gap, oracle_cannot_run
from ampkit.testing import op_sample

pytestmark = pytest.mark.usefixtures("ampkit_quiet")

POLICY = ampkit.load_policy("torch_default")
PROBES = ("f32", "low", "mixed")
DEBUG = False
# Ops whose kernel is not bitwise reproducible from one call to the next (even
# natively): compared to float32 round-off instead.
NOT_BITWISE = {"linalg.lstsq"}
# CUDA backward kernels that accumulate with atomics (torch documents them as
# nondeterministic): their gradients are compared to low-precision round-off.
CUDA_NONDETERMINISTIC_GRAD = {
    "scatter_add", "index_put", "grid_sample", "grid_sampler", "scaled_dot_product_attention",
    "lstm", "gru", "rnn_tanh", "rnn_relu", "upsample_linear1d", "upsample_bilinear2d",
    "upsample_bicubic2d", "upsample_trilinear3d", "upsample_nearest1d", "upsample_nearest2d",
    "upsample_nearest3d", "_upsample_nearest_exact1d", "_upsample_nearest_exact2d",
    "_upsample_nearest_exact3d", "_upsample_bilinear2d_aa", "_upsample_bicubic2d_aa", "pdist", "cdist",
}


def table(device):
    rules = POLICY.rules(device)
    return [
        pytest.param(cat, op, id=f"{device}-{cat}-{op}")
        for cat in ampkit.CATEGORIES
        for op in rules.ops(cat)
    ] + [pytest.param("decompose", op, id=f"{device}-decompose-{op}") for op in rules.decompose]


def make(op, device, probe, low):
    """Fresh inputs for one probe; floating leaves require grad (for gradients)."""
    s = op_sample(op, device, low if probe == "low" else torch.float32)
    count = [0]

    def conv(x):
        if isinstance(x, torch.Tensor) and x.is_floating_point():
            count[0] += 1
            if probe == "mixed" and count[0] > 1:
                x = x.to(low)
            return x.detach().clone().requires_grad_(True)
        if isinstance(x, (list, tuple)):
            return type(x)(conv(v) for v in x)
        return x

    s.args = tuple(conv(a) for a in s.args)
    s.kwargs = {k: conv(v) for k, v in s.kwargs.items()}
    if probe == "mixed" and count[0] < 2:
        return None
    return s


def first_tensor(out):
    for t in out if isinstance(out, (tuple, list)) else (out,):
        if isinstance(t, torch.Tensor):
            return t
    return None


def run(op, device, probe, low, region, backward=True, region_is_native=False):
    """(output, input grads) or the exception type raised (``backward=False``: forward only)."""
    s = make(op, device, probe, low)
    if s is None:
        return None
    try:
        with region():
            out = s()
    except Exception as e:  # noqa: BLE001 - compared with the native outcome
        if DEBUG:
            print(op, probe, repr(e))
        if oracle_cannot_run(e) and region_is_native:
            pytest.skip(f"{op} [{probe}]: native autocast cannot run here ({str(e).splitlines()[0][:120]}); no oracle")
        return type(e)
    t = first_tensor(out)
    grads = None
    if backward and t is not None and t.requires_grad:
        try:
            r = torch.view_as_real(t) if t.is_complex() else t
            w = torch.linspace(-1, 1, r.numel(), device=r.device).reshape(r.shape)
            (r.double() * w.double()).sum().backward()
            grads = [x.grad for x in s.tensors()]
        except Exception as e:  # noqa: BLE001 - compared with the native outcome
            if DEBUG:
                print(op, probe, "backward", repr(e))
            if "derivative for" not in str(e) or "not implemented" not in str(e):
                return type(e)
            # an op without a derivative (_native_multi_head_attention): compare the forward only
    return t.detach() if t is not None else out, grads


def same(a, b, op=None, grad=False):
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    low = a.dtype in (torch.float16, torch.bfloat16)
    if a.is_complex():
        a, b = torch.view_as_real(a), torch.view_as_real(b)
    a, b = torch.nan_to_num(a.float(), 7.0), torch.nan_to_num(b.float(), 7.0)
    if op in NOT_BITWISE:
        return torch.allclose(a, b, rtol=1e-5, atol=1e-5)
    if grad and a.is_cuda and op in CUDA_NONDETERMINISTIC_GRAD:
        tol = 2e-2 if low else 1e-4
        return torch.allclose(a, b, rtol=tol, atol=tol)
    return torch.equal(a, b)


@contextlib.contextmanager
def reference_region(device, low, enabled=True):
    """An ampkit region run by the reference engine (the table alone)."""
    with _autocast.reference(), ampkit.autocast(device, dtype=low, enabled=enabled):
        yield


def check_probe(op, device, probe, low, ampkit_region, native_region):
    nat = run(op, device, probe, low, native_region, region_is_native=True)
    if nat is None:
        return
    amp = run(op, device, probe, low, ampkit_region)
    if isinstance(nat, type) or isinstance(amp, type):
        assert isinstance(nat, type) and isinstance(amp, type), f"{op} [{probe}]: native {nat!r} vs ampkit {amp!r}"
        return
    (n_out, n_grads), (a_out, a_grads) = nat, amp
    if not isinstance(n_out, torch.Tensor):
        assert n_out == a_out
        return
    assert a_out.dtype == n_out.dtype, f"{op} [{probe}]: dtype native {n_out.dtype} ampkit {a_out.dtype}"
    assert same(a_out, n_out, op), f"{op} [{probe}]: values differ (max {(a_out.float() - n_out.float()).abs().max()})"
    assert (n_grads is None) == (a_grads is None), f"{op} [{probe}]: one side has no gradient"
    for i, (gn, ga) in enumerate(zip(n_grads or (), a_grads or ())):
        assert (gn is None) == (ga is None), f"{op} [{probe}]: grad {i} missing on one side"
        if gn is not None:
            assert ga.dtype == gn.dtype, f"{op} [{probe}]: grad {i} dtype native {gn.dtype} ampkit {ga.dtype}"
            assert same(ga, gn, op, grad=True), f"{op} [{probe}]: grad {i} differs (max {(ga.float() - gn.float()).abs().max()})"


def check_gap(op, device, probe, low):
    """A known gap must still show: native and ampkit forward outcomes (raise, dtype) differ."""
    nat = run(op, device, probe, low, lambda: torch.autocast(device, dtype=low), backward=False,
              region_is_native=True)
    if nat is None:
        return
    amp = run(op, device, probe, low, lambda: reference_region(device, low), backward=False)
    kind = [x if isinstance(x, type) else getattr(x[0], "dtype", type(x[0])) for x in (nat, amp)]
    assert kind[0] != kind[1], (
        f"{op} [{probe}]: the known gap ({known_gap(op, device, low, probe)}) no longer shows "
        f"(both {kind[0]}); remove it from ampkit.drift's gap tables and check the op's category"
    )


def check_op(op, device, low):
    for probe in PROBES:
        if known_gap(op, device, low, probe):  # documented in docs/autocast.md
            check_gap(op, device, probe, low)
            continue
        check_probe(
            op, device, probe, low,
            lambda: reference_region(device, low),
            lambda: torch.autocast(device, dtype=low),
        )
        # enabled=False is a pure pass-through: identical to a plain call
        check_probe(
            op, device, probe, low,
            lambda: reference_region(device, low, enabled=False),
            lambda: torch.autocast(device, enabled=False),
        )


@pytest.mark.parametrize("category,op", table("cpu"))
def test_cpu_table_matches_native(category, op):
    assert POLICY.category("cpu", op) == category
    check_op(op, "cpu", torch.bfloat16)


@pytest.mark.parametrize("category,op", [p for p in table("cpu") if p.values[0] != "fp32"])
def test_cpu_table_matches_native_float16(category, op):
    check_op(op, "cpu", torch.float16)


@pytest.mark.cuda
@pytest.mark.parametrize("low", [torch.float16, torch.bfloat16], ids=["float16", "bfloat16"])
@pytest.mark.parametrize("category,op", table("cuda"))
def test_cuda_table_matches_native(category, op, low):
    if category == "banned":
        s = op_sample(op, "cuda")
        with pytest.raises(RuntimeError, match="unsafe to autocast"), torch.autocast("cuda", dtype=low):
            s()
        with pytest.raises(RuntimeError, match="unsafe to autocast"), reference_region("cuda", low):
            s()
        return
    check_op(op, "cuda", low)


@pytest.mark.parametrize("op", ["relu", "gelu", "softmax", "layer_norm", "add", "sum", "embedding", "dropout", "batch_norm"])
def test_unlisted_ops_match_native_on_cpu(op):
    """Ops in no CPU table run untouched, as natively."""
    assert POLICY.category("cpu", op) is None
    check_op(op, "cpu", torch.bfloat16)


def test_every_table_op_has_a_sample():
    for device in ("cpu", "cuda"):
        rules = POLICY.rules(device)
        for op in [o for cat in ampkit.CATEGORIES for o in rules.ops(cat)] + list(rules.decompose):
            op_sample(op, "cpu")
