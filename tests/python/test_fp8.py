"""The fp8 category: policy values, and the semantics of each scaling recipe on the CPU.

The oracle is the definition written again here with plain torch ops (``ref_*``): quantize
as ``(t * scale).clamp(-max, max).to(fp8)``, dequantize in float32, matmul in the region's
dtype. Forward and gradients must equal it bit for bit; ops outside the category must
equal ``torch.autocast`` bit for bit.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

import ampkit
from conftest import compiles_correctly_here, cpu_scaled_mm_on

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
FP8 = ampkit.load_policy("fp8")
DEFAULT = ampkit.load_policy("torch_default")


# ------------------------------------------------------------------ the oracle
def qdq(t, scale, dt):
    m = torch.finfo(dt).max
    return (t.float() * scale).clamp(-m, m).to(dt).float() / scale


def tensor_scale(t, dt):
    return torch.finfo(dt).max / t.detach().abs().amax().float().clamp(min=1e-12)


def row_scale(t, dt):
    return torch.finfo(dt).max / t.detach().abs().amax(dim=-1, keepdim=True).float().clamp(min=1e-12)


def history_scale(amaxes, dt):
    """Delayed: max / max(earlier amaxes kept), 1 while none is kept (or all are zero)."""
    m = torch.tensor(max(amaxes, default=0.0), dtype=torch.float32)
    return torch.finfo(dt).max / m if m > 0 else torch.tensor(1.0)


def ref_linear(x, w, b, g, dt, bwd, scales):
    """(output, grad_x, grad_w, grad_b) of the fp8 linear by definition; ``scales(t, fp8
    dtype, operand)`` gives each operand's scale."""
    k, n = x.shape[-1], w.shape[0]
    x2, g2 = x.detach().reshape(-1, k), g.reshape(-1, n)
    xd = qdq(x2, scales(x2, E4M3, "input"), E4M3).to(dt)
    wd = qdq(w.detach(), scales(w.detach(), E4M3, "weight"), E4M3).to(dt)
    out = F.linear(xd, wd, None if b is None else b.detach().to(dt)).reshape(*x.shape[:-1], n)
    gd = qdq(g2, scales(g2, bwd, "grad_output"), bwd).to(dt)
    gx = (gd @ wd).reshape(x.shape).to(x.dtype)
    gw = (gd.t() @ xd).to(w.dtype)
    gb = None if b is None else g2.sum(0).to(b.dtype)
    return out, gx, gw, gb


def run_linear(policy, x, w, b, g, dtype=torch.bfloat16):
    x, w = x.clone().requires_grad_(), w.clone().requires_grad_()
    b = None if b is None else b.clone().requires_grad_()
    with ampkit.trace() as tr:
        with ampkit.autocast("cpu", dtype=dtype, policy=policy):
            y = F.linear(x, w, b)
        y.backward(g)
    return y, x.grad, w.grad, None if b is None else b.grad, tr


def data(seed=0, lead=(2, 3), k=32, n=16):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(*lead, k, generator=gen) * 3
    w = torch.randn(n, k, generator=gen) * 0.1
    b = torch.randn(n, generator=gen)
    g = torch.randn(*lead, n, generator=gen)
    return x, w, b, g


def assert_same(got, want):
    assert got.dtype == want.dtype, (got.dtype, want.dtype)
    assert torch.equal(got, want), (got - want).abs().max()


# ------------------------------------------------------------------ policy values
def test_shipped_fp8_policy_is_torch_default_with_linear_in_fp8():
    assert FP8.devices == DEFAULT.with_ops(fp8=["linear"]).devices
    for dev in ("cpu", "cuda"):
        assert DEFAULT.rules(dev).fp8 == ()
        assert FP8.category(dev, "linear") == "fp8"
        r = FP8.rules(dev).fp8_recipe
        assert (r.scaling, r.forward_dtype, r.backward_dtype, r.amax_history) == (
            "tensorwise", "float8_e4m3fn", "float8_e5m2", None)


def test_recipe_is_part_of_the_value(tmp_path):
    a = FP8.with_fp8_recipe(scaling="delayed", amax_history=8)
    b = FP8.with_fp8_recipe(scaling="delayed", amax_history=8)
    assert a == b and hash(a) == hash(b)
    assert a != FP8 and a != FP8.with_fp8_recipe(scaling="delayed", amax_history=4)
    assert FP8.rules("cpu").fp8_recipe.scaling == "tensorwise"  # unchanged
    path = tmp_path / "a.yaml"
    path.write_text(a.to_yaml())
    assert ampkit.load_policy(path) == a  # the recipe survives the YAML round trip
    a = FP8.with_fp8_recipe(scaling="rowwise")
    assert "with_fp8_recipe(scaling='rowwise')" in str(a).splitlines()[0]


def test_with_ops_and_with_module_take_fp8():
    p = DEFAULT.with_ops("cpu", fp8=["mm", "matmul"])
    assert p.category("cpu", "mm") == "fp8" and p.category("cuda", "mm") == "lower_precision_fp"
    q = FP8.with_module("head", lower_precision_fp=["linear"]).with_module("body", fp8=["mm"])
    assert dict((m.pattern, m.ops) for m in q.modules) == {
        "head": (("linear", "lower_precision_fp"),), "body": (("mm", "fp8"),)}
    assert FP8.with_module("head", pin="float32").modules[0].pin == "float32"


YAML = """
schema_version: 1
name: mine
devices:
  cpu:
    lower_precision_dtype: bfloat16
    lower_precision_fp: []
    fp32: []
    fp32_output: []
    promote: []
    banned: {{}}
    fp8: [{ops}]
    fp8_recipe: {recipe}
"""


@pytest.mark.parametrize("ops, recipe, match", [
    ("linear", "{scaling: blockwise}",
     r"key 'devices.cpu.fp8_recipe'.*scaling 'blockwise' is not one of tensorwise, rowwise, delayed"),
    ("linear", "{forward_dtype: float8_e5m2}",
     r"forward_dtype 'float8_e5m2' is not one of float8_e4m3fn"),
    ("linear", "{backward_dtype: float16}",
     r"backward_dtype 'float16' is not one of float8_e5m2, float8_e4m3fn"),
    ("linear", "{scaling: delayed}", r"amax_history must be a whole number >= 1 for delayed scaling.*None"),
    ("linear", "{scaling: delayed, amax_history: 0}", r"amax_history must be a whole number >= 1.*got 0"),
    ("linear", "{scaling: rowwise, amax_history: 4}", r"amax_history is for delayed scaling only"),
    ("linear", "{scale: tensorwise}", r"unknown fp8_recipe key 'scale'; valid: scaling, forward_dtype"),
    ("linear", "{fast_accum: forward}", r"fast_accum must be true or false.*got 'forward'"),
    ("linear", "tensorwise", r"fp8_recipe must be a mapping"),
    ("conv2d", "{scaling: tensorwise}", r"line 12, key 'devices.cpu.fp8.conv2d': op 'conv2d' cannot run in fp8; the fp8 category takes linear, matmul, mm"),
], ids=["scaling", "forward", "backward", "no-history", "zero-history", "history-not-delayed",
        "unknown-key", "fast-accum", "not-a-mapping", "op"])
def test_bad_recipe_is_a_clear_error(tmp_path, ops, recipe, match):
    path = tmp_path / "mine.yaml"
    path.write_text(YAML.format(ops=ops, recipe=recipe))
    with pytest.raises(ampkit.PolicyError, match=match):
        ampkit.load_policy(path)


def test_bad_recipe_in_with_methods_is_a_clear_error():
    with pytest.raises(ampkit.PolicyError, match=r"with_fp8_recipe: fp8_recipe scaling 'per_block'"):
        FP8.with_fp8_recipe(scaling="per_block")
    with pytest.raises(ampkit.PolicyError, match=r"op 'conv2d' cannot run in fp8"):
        DEFAULT.with_ops(fp8=["conv2d"])
    with pytest.raises(ampkit.PolicyError, match=r"unknown category 'fp9'; valid: .*fp8"):
        DEFAULT.with_ops(fp9=["linear"])


# ------------------------------------------------------------------ semantics, per recipe
@pytest.mark.parametrize("bwd", [E5M2, E4M3], ids=["e5m2", "e4m3"])
@pytest.mark.parametrize("scaling", ["tensorwise", "rowwise"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "f16"])
def test_forward_and_gradients_equal_the_definition(scaling, bwd, dtype):
    policy = FP8.with_fp8_recipe(scaling=scaling, backward_dtype=str(bwd).replace("torch.", ""))
    x, w, b, g = data()
    y, gx, gw, gb, tr = run_linear(policy, x, w, b, g.to(dtype), dtype)
    scale = tensor_scale if scaling == "tensorwise" else row_scale
    want = ref_linear(x, w, b, g.to(dtype), dtype, bwd, lambda t, dt, _: scale(t, dt))
    for got, ref in zip((y, gx, gw, gb), want):
        assert_same(got, ref)
    assert y.dtype == dtype and (gx.dtype, gw.dtype, gb.dtype) == (torch.float32,) * 3
    # fp8 is not the region's lower-precision matmul: the test can tell them apart
    with torch.autocast("cpu", dtype=dtype):
        assert not torch.equal(F.linear(x, w, b), y)


def test_trace_shows_each_fp8_cast_with_its_dtype_and_scale():
    x, w, b, g = data()
    *_, tr = run_linear(FP8, x, w, b, g.to(torch.bfloat16))
    fwd, bwd = [r for r in tr.records if r.rule == "fp8"]
    assert (fwd.op, fwd.output_dtype, fwd.fp8_path) == ("linear", "bfloat16", "emulated")
    x2 = x.reshape(-1, 32)
    assert [(c.operand, c.dtype) for c in fwd.fp8_casts] == [("input", "float8_e4m3fn"), ("weight", "float8_e4m3fn")]
    assert fwd.fp8_casts[0].scale == tensor_scale(x2, E4M3).item()
    assert fwd.fp8_casts[1].scale == tensor_scale(w, E4M3).item()
    assert bwd.op == "linear.backward" and bwd.fp8_casts[0].operand == "grad_output"
    assert bwd.fp8_casts[0].dtype == "float8_e5m2"
    assert bwd.fp8_casts[0].scale == tensor_scale(g.to(torch.bfloat16).reshape(-1, 16), E5M2).item()
    assert "input:float8_e4m3fn*" in str(tr) and "fp8 path" in str(tr)
    rows = tr.as_rows()
    assert rows[0]["fp8_casts"].startswith("input:float8_e4m3fn*") and rows[0]["fp8_path"] == "emulated"


def test_rowwise_trace_scales_are_per_row():
    x, w, b, g = data()
    *_, tr = run_linear(FP8.with_fp8_recipe(scaling="rowwise"), x, w, b, g.to(torch.bfloat16))
    fwd = tr.records[0]
    assert fwd.fp8_casts[0].scale == tuple(row_scale(x.reshape(-1, 32), E4M3).flatten().tolist())
    assert len(fwd.fp8_casts[1].scale) == 16


def test_delayed_scaling_uses_the_history_of_earlier_calls():
    """amax_history=2: the scale of call k comes from the amaxes of calls k-1 and k-2 (1 at
    the first call); each call's amax enters the history after its cast."""
    policy = FP8.with_fp8_recipe(scaling="delayed", amax_history=2)
    lin = torch.nn.Linear(32, 16)
    seen = {"input": [], "weight": [], "grad_output": []}
    for step, mag in enumerate((4.0, 0.5, 0.25, 2.0)):
        x, _, _, g = data(seed=step)
        x, g = x * mag, (g * mag).to(torch.bfloat16)
        xin = x.clone().requires_grad_()
        with ampkit.trace() as tr:
            with ampkit.autocast("cpu", policy=policy):
                y = lin(xin)
            lin.weight.grad = lin.bias.grad = None
            y.backward(g)

        def scales(t, dt, operand):
            return history_scale(seen[operand][-2:], dt)

        want = ref_linear(x, lin.weight, lin.bias, g, torch.bfloat16, E5M2, scales)
        for got, ref in zip((y, xin.grad, lin.weight.grad, lin.bias.grad), want):
            assert_same(got, ref)
        fwd, bwd = tr.records[0], tr.records[-1]
        assert fwd.fp8_casts[0].scale == history_scale(seen["input"][-2:], E4M3).item()
        assert bwd.fp8_casts[0].scale == history_scale(seen["grad_output"][-2:], E5M2).item()
        seen["input"].append(x.abs().amax().item())
        seen["weight"].append(lin.weight.detach().abs().amax().item())
        seen["grad_output"].append(g.abs().amax().float().item())
    assert seen["input"][0] > seen["input"][2] * 8  # the first amax did leave the history


def test_delayed_scaling_needs_a_leaf_weight():
    policy = DEFAULT.with_ops("cpu", fp8=["mm"]).with_fp8_recipe(scaling="delayed", amax_history=4)
    a, b = torch.randn(4, 16), torch.randn(16, 8, requires_grad=True)
    with ampkit.autocast("cpu", policy=policy), pytest.raises(RuntimeError, match="not a leaf tensor"):
        torch.mm(a, b * 2)


@pytest.mark.parametrize("spell", ["mm", "matmul", "operator", "rmatmul"])
def test_mm_and_matmul_run_as_linear_without_bias(spell):
    policy = DEFAULT.with_ops("cpu", fp8=["mm", "matmul"])
    x, w, _, g = data(lead=(6,))
    a, b = x.clone().requires_grad_(), w.t().clone().requires_grad_()  # (6, 32) @ (32, 16)
    call = {"mm": torch.mm, "matmul": torch.matmul, "operator": lambda p, q: p @ q,
            "rmatmul": lambda p, q: q.__rmatmul__(p)}[spell]
    with ampkit.autocast("cpu", policy=policy):
        y = call(a, b)
    y.backward(g.to(torch.bfloat16))
    out, ga, gw, _ = ref_linear(x, w, None, g.to(torch.bfloat16), torch.bfloat16, E5M2,
                                lambda t, dt, _: tensor_scale(t, dt))
    assert_same(y, out)
    assert_same(a.grad, ga)
    assert_same(b.grad, gw.t())


def test_calls_the_function_cannot_take_run_as_lower_precision():
    policy = DEFAULT.with_ops("cpu", fp8=["matmul"])
    a, b = torch.randn(3, 4, 8), torch.randn(3, 8, 5)  # batched second operand
    with ampkit.autocast("cpu", policy=policy):
        got = torch.matmul(a, b)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        want = torch.matmul(a, b)
    assert_same(got, want)


# ------------------------------------------------------------------ scopes, other ops, steps
def test_a_module_scope_keeps_the_head_in_bf16_while_the_body_runs_fp8():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    policy = FP8.with_module("2", lower_precision_fp=["linear"])
    x = torch.randn(8, 32)
    with policy.apply(model), ampkit.trace() as tr, ampkit.autocast("cpu", policy=policy.without_modules()):
        y = model(x)
    assert [r.rule for r in tr.records if r.op == "linear"] == ["fp8", "lower_precision_fp"]
    body, _, _, _ = ref_linear(x, model[0].weight, model[0].bias, torch.zeros(8, 16, dtype=torch.bfloat16),
                               torch.bfloat16, E5M2, lambda t, dt, _: tensor_scale(t, dt))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        want = model[2](torch.relu(body))
    assert_same(y, want)


def test_ops_outside_the_category_are_torch_autocast_bit_for_bit():
    torch.manual_seed(0)
    a, b = torch.randn(8, 16), torch.randn(16, 8)
    img, k = torch.randn(2, 3, 8, 8), torch.randn(4, 3, 3, 3)

    def ops():
        return (torch.mm(a, b), a @ b, F.conv2d(img, k), torch.softmax(a, -1), F.mse_loss(a, a.flip(0)),
                torch.bmm(a[None], b[None]), torch.cat([a, a.bfloat16()]))

    with ampkit.autocast("cpu", policy=FP8):
        got = ops()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        want = ops()
    for g, w in zip(got, want):
        assert_same(g, w)


@pytest.mark.parametrize("recipe", [{"scaling": "tensorwise"}, {"scaling": "rowwise"},
                                    {"scaling": "delayed", "amax_history": 2}], ids=lambda r: r["scaling"])
def test_compiled_region_runs_fp8_as_eager_does(recipe):
    """Outputs and gradients over three steps (delayed: the histories of both copies advance)."""
    compiles_correctly_here("cpu")
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    twin = copy.deepcopy(model)
    policy = FP8.with_fp8_recipe(**recipe)

    def f(m, x):
        with ampkit.autocast("cpu", policy=policy):
            return m(x)

    torch._dynamo.reset()
    compiled = torch.compile(f)
    for i in range(3):
        x = torch.randn(8, 32) * (i + 1)
        eager, got = f(model, x), compiled(twin, x)
        assert_same(got, eager)
        eager.float().sum().backward()
        got.float().sum().backward()
        for p, q in zip(model.parameters(), twin.parameters()):
            assert_same(q.grad, p.grad)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert not torch.equal(model(x), eager)  # eager ran fp8: the comparison can fail


def test_make_train_step_runs_the_fp8_policy_as_an_eager_loop_does():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    twin = copy.deepcopy(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    opt_twin = torch.optim.SGD(twin.parameters(), lr=0.1)
    step = ampkit.make_train_step(model, F.mse_loss, opt, autocast={"device_type": "cpu", "policy": "fp8"},
                                  capture=False)
    for i in range(3):
        x, y = torch.randn(8, 32), torch.randn(8, 4)
        loss = step(x, y)
        opt_twin.zero_grad()
        with ampkit.autocast("cpu", policy=FP8):
            ref = F.mse_loss(twin(x), y)
        ref.backward()
        opt_twin.step()
        assert torch.equal(loss.detach(), ref.detach())
    for p, q in zip(model.parameters(), twin.parameters()):
        assert torch.equal(p, q)


# ------------------------------------------------------------------ the _scaled_mm path
def exact_linear(x, w, b, g, dt, bwd, scale, backward_scaled):
    """The _scaled_mm path by definition: the same fp8 operands, their products summed in
    float32 (no rounding of a dequantized operand to ``dt`` first), the bias (in ``dt``)
    added to those sums, then one rounding to ``dt``. Its backward so where ``backward_scaled`` (the weight's gradient
    written in the weight's float32, never rounded to ``dt``), else the emulation's."""
    k, n = x.shape[-1], w.shape[0]
    x2, g2 = x.detach().reshape(-1, k), g.reshape(-1, n)
    sx, sw, sg = scale(x2, E4M3), scale(w.detach(), E4M3), scale(g2, bwd)
    xe, we, ge = qdq(x2, sx, E4M3), qdq(w.detach(), sw, E4M3), qdq(g2, sg, bwd)
    out = ((xe @ we.t()) + b.detach().to(dt).float()).to(dt).reshape(*x.shape[:-1], n)
    if backward_scaled:
        gx, gw = (ge @ we).to(dt), (ge.t() @ xe).to(w.dtype)
    else:
        gx, gw = ge.to(dt) @ we.to(dt), ge.to(dt).t() @ xe.to(dt)
    return out, gx.reshape(x.shape).to(x.dtype), gw.to(w.dtype), g2.sum(0).to(b.dtype)


def _run(policy, x, w, b, g, device):
    x, w, b = (t.clone().requires_grad_() for t in (x, w, b))
    with ampkit.trace() as tr:
        with ampkit.autocast(device, dtype=torch.bfloat16, policy=policy):
            y = F.linear(x, w, b)
        y.backward(g.to(torch.bfloat16))
    return y, x.grad, w.grad, b.grad, tr


def _check_scaled_mm_path(scaling, device):
    policy = FP8.with_fp8_recipe(device, scaling=scaling)
    x, w, b, g = (t.to(device) for t in data(lead=(4, 16), k=64, n=32))
    y, gx, gw, gb, tr = _run(policy, x, w, b, g, device)
    fwd, bwd = tr.records[0], tr.records[-1]
    backward_scaled = scaling != "rowwise"  # (a row-wise scale lies along the backward's contraction)
    assert (fwd.fp8_path, bwd.op, bwd.fp8_path) == ("scaled_mm", "linear.backward",
                                                    "scaled_mm" if backward_scaled else "emulated")
    scale = tensor_scale if scaling == "tensorwise" else row_scale
    # the definition, in float32 on the CPU (no TF32, whatever the device)
    x32, w32, b32, g32 = (t.float().cpu() for t in (x, w, b, g))
    want = exact_linear(x32, w32, b32, g32.to(torch.bfloat16).float(), torch.bfloat16, E5M2, scale,
                        backward_scaled)
    for got, ref in zip((y, gx, gw, gb), want):
        assert got.dtype == ref.dtype
        # the same fp8 operands and scales; the kernels' summation order may differ
        torch.testing.assert_close(got.float().cpu(), ref.float(), rtol=2 ** -7, atol=2e-2)


@pytest.mark.parametrize("scaling", ["tensorwise", "rowwise"])
def test_the_scaled_mm_path_computes_its_definition_on_the_cpu(scaling, monkeypatch):
    """The GPU's path (layouts, scales, the backward's _scaled_mm) run by torch's CPU
    _scaled_mm, turned on for the test (shipped, the CPU runs the emulation)."""
    cpu_scaled_mm_on(monkeypatch)
    _check_scaled_mm_path(scaling, "cpu")


def test_the_scaled_mm_path_adds_the_bias_before_its_one_rounding(monkeypatch):
    """The output is _scaled_mm's with the bias in its epilogue, bit for bit: the bias added
    to the float32 sums, then one rounding to bfloat16 (as torch's addmm under autocast), not
    the product rounded and the bias added in bfloat16 after it."""
    cpu_scaled_mm_on(monkeypatch)
    policy = FP8.with_fp8_recipe("cpu", scaling="tensorwise")
    x, w, b, g = data(lead=(4, 16), k=64, n=32)
    y, _, _, _, _ = _run(policy, x, w, b, g, "cpu")
    x2 = x.reshape(-1, 64)
    sx, sw = tensor_scale(x2, E4M3), tensor_scale(w, E4M3)
    xq, wq = (x2 * sx).clamp(-448, 448).to(E4M3), (w * sw).clamp(-448, 448).to(E4M3)
    args = dict(scale_a=1 / sx, scale_b=1 / sw, out_dtype=torch.bfloat16)
    want = torch._scaled_mm(xq, wq.t(), bias=b.to(torch.bfloat16), **args)
    assert_same(y.reshape(-1, 32), want)
    rounded_twice = torch._scaled_mm(xq, wq.t(), **args) + b.to(torch.bfloat16)
    assert not torch.equal(y.reshape(-1, 32), rounded_twice)


@pytest.mark.parametrize("fast_accum", [False, True])
def test_fast_accum_reaches_the_forward_gemm_only(fast_accum, monkeypatch, tmp_path):
    """The recipe's fast_accum is the forward _scaled_mm's use_fast_accum; the two gradient
    GEMMs accumulate precisely whatever it says. The output is _scaled_mm's with that flag,
    bit for bit; the recipe round-trips through its dict (what a saved policy holds)."""
    cpu_scaled_mm_on(monkeypatch)
    seen, real = [], torch._scaled_mm

    def spy(*args, **kwargs):
        seen.append(kwargs.get("use_fast_accum", False))
        return real(*args, **kwargs)

    monkeypatch.setattr(torch, "_scaled_mm", spy)
    policy = FP8.with_fp8_recipe("cpu", scaling="tensorwise", fast_accum=fast_accum)
    recipe = policy.rules("cpu").fp8_recipe
    assert recipe.fast_accum is fast_accum
    saved = tmp_path / "saved.yaml"
    saved.write_text(policy.to_yaml())
    assert ampkit.load_policy(str(saved)).rules("cpu").fp8_recipe == recipe
    x, w, b, g = data(lead=(4, 16), k=64, n=32)
    y, _, _, _, _ = _run(policy, x, w, b, g, "cpu")
    assert seen == [fast_accum, False, False]  # forward, then grad_x and grad_w
    x2 = x.reshape(-1, 64)
    sx, sw = tensor_scale(x2, E4M3), tensor_scale(w, E4M3)
    xq, wq = (x2 * sx).clamp(-448, 448).to(E4M3), (w * sw).clamp(-448, 448).to(E4M3)
    want = real(xq, wq.t(), scale_a=1 / sx, scale_b=1 / sw, bias=b.to(torch.bfloat16),
                out_dtype=torch.bfloat16, use_fast_accum=fast_accum)
    assert_same(y.reshape(-1, 32), want)


def test_the_scaled_mm_path_writes_a_float32_weight_grad_once_unrounded(monkeypatch):
    """grad_w is the float32 output of the same _scaled_mm on the same fp8 operands, bit for
    bit, and not rounded to bfloat16 on the way (the emulation's bf16 product, widened, is
    not it); grad_x keeps the region's rounding, as torch.autocast's linear does."""
    cpu_scaled_mm_on(monkeypatch)
    policy = FP8.with_fp8_recipe("cpu", scaling="tensorwise")
    x, w, b, g = data(lead=(4, 16), k=64, n=32)
    _, gx, gw, _, _ = _run(policy, x, w, b, g, "cpu")
    x2, g2 = x.reshape(-1, 64), g.to(torch.bfloat16).reshape(-1, 32)
    sx, sg = tensor_scale(x2, E4M3), tensor_scale(g2, E5M2)
    xq = (x2 * sx).clamp(-448, 448).to(E4M3)
    gq = (g2.float() * sg).clamp(-57344, 57344).to(E5M2)
    want = torch._scaled_mm(gq.t().contiguous(), xq.t().contiguous().t(), scale_a=1 / sg, scale_b=1 / sx,
                            out_dtype=torch.float32)
    assert_same(gw, want)
    assert not torch.equal(gw, gw.to(torch.bfloat16).float())  # (a bf16 rounding on the way would show)
    assert torch.equal(gx, gx.to(torch.bfloat16).float())  # grad_x: rounded to bf16, then widened


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 9),
                    reason="needs a CUDA GPU with fp8 (capability >= 8.9)")
@pytest.mark.parametrize("scaling", ["tensorwise", "rowwise"])
def test_cuda_scaled_mm_computes_its_definition(scaling):
    _check_scaled_mm_path(scaling, "cuda")

