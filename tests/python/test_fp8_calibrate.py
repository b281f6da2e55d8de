"""fp8 auto: ampkit.calibrate_fp8 against an oracle written from its documented definition.

The error oracle captures each Linear's input under torch.autocast (which ampkit's
torch_default region equals bit for bit), quantizes input and weight by hand as the fp8
docs say, and takes ||fp8 - bf16|| / ||bf16|| of the two outputs. Timings come from an
injected timer, so every decision is derived here and the test cannot pass by luck.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

import ampkit

E4M3 = torch.float8_e4m3fn


class Spike(torch.nn.Module):
    """Multiplies feature 0 by 1e6: its amax sets the tensorwise fp8 scale, so every other
    feature of the next Linear's input rounds to zero (and that Linear ignores feature 0)."""

    def forward(self, x):
        scale = torch.ones(x.shape[-1], dtype=x.dtype)
        scale[0] = 1e6
        return x * scale


def make_model():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 64),
                                Spike(), torch.nn.Linear(64, 16))
    with torch.no_grad():
        model[4].weight[:, 0] = 0
    return model


X = torch.randn(8, 32, generator=torch.Generator().manual_seed(1))


def qdq(t, dt=E4M3):
    scale = torch.finfo(dt).max / t.detach().abs().amax().float().clamp(min=1e-12)
    m = torch.finfo(dt).max
    return (t.float() * scale).clamp(-m, m).to(dt).float() / scale


def oracle_errors(model, x, dtype=torch.bfloat16):
    """{name: relative error of the fp8 linear against the region-dtype linear} by definition."""
    inputs = {}
    hooks = [m.register_forward_pre_hook(lambda mod, a, n=n: inputs.__setitem__(n, a[0].detach()))
             for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)]
    with torch.no_grad(), torch.autocast("cpu", dtype=dtype):
        model(x)
    for h in hooks:
        h.remove()
    out = {}
    for n, xin in inputs.items():
        lin = model.get_submodule(n)
        with torch.no_grad():
            ref = F.linear(xin.to(dtype), lin.weight.to(dtype), lin.bias.to(dtype)).float()
            fp8 = F.linear(qdq(xin).to(dtype), qdq(lin.weight).to(dtype), lin.bias.to(dtype)).float()
        out[n] = (torch.linalg.vector_norm(fp8 - ref) / torch.linalg.vector_norm(ref)).item()
    return out


def timer_where_fp8_is_faster_in(names):
    calls = []

    def timer(name, precision, run):
        calls.append((name, precision))
        run()  # the run must work, though its time is not what counts here
        if precision == "fp8":
            return 1.0 if name in names else 3.0
        return 2.0

    timer.calls = calls
    return timer


def test_exactly_the_fast_modules_under_the_error_threshold_get_fp8():
    model = make_model()
    errors = oracle_errors(model, X)
    assert errors["0"] < 0.1 and errors["2"] < 0.1 and errors["4"] > 0.1  # the case can fail
    timer = timer_where_fp8_is_faster_in({"0", "4"})
    result = ampkit.calibrate_fp8(model, X, timer=timer, max_error=0.1)
    got = {r.module: r for r in result.report}
    assert list(got) == ["0", "2", "4"]
    want_fp8 = {n for n in got if n in {"0", "4"} and errors[n] <= 0.1}
    assert {n for n, r in got.items() if r.precision == "fp8"} == want_fp8 == {"0"}
    assert got["2"].precision == got["4"].precision == "bfloat16"
    assert "slower" in got["2"].reason and "error" in got["4"].reason and "max_error 0.1" in got["4"].reason
    assert (got["0"].fp8_ms, got["0"].ref_ms, got["0"].speedup) == (1.0, 2.0, 2.0)
    assert got["2"].speedup == 2.0 / 3.0
    assert sorted(timer.calls) == sorted((n, p) for n in ("0", "2", "4") for p in ("fp8", "bfloat16"))
    assert [m.pattern for m in result.policy.modules] == ["0"]
    assert result.policy.modules[0].ops == (("linear", "fp8"),)


def test_the_measured_error_is_the_documented_relative_norm():
    model = make_model()
    errors = oracle_errors(model, X)
    result = ampkit.calibrate_fp8(model, X, timer=timer_where_fp8_is_faster_in(set()))
    for r in result.report:
        assert r.error == pytest.approx(errors[r.module], rel=1e-6, abs=0), r.module
    assert [r.shapes for r in result.report] == [((8, 32),), ((8, 64),), ((8, 64),)]


def test_float16_regions_are_measured_against_float16():
    model = make_model()
    errors = oracle_errors(model, X, torch.float16)
    result = ampkit.calibrate_fp8(model, X, dtype=torch.float16, timer=timer_where_fp8_is_faster_in({"0"}))
    assert [r.precision for r in result.report] == ["fp8", "float16", "float16"]
    assert result.report[1].error == pytest.approx(errors["2"], rel=1e-6, abs=0)


def test_the_policy_round_trips_through_yaml_and_runs_fp8_exactly_in_the_chosen_modules(tmp_path):
    model = make_model()
    result = ampkit.calibrate_fp8(model, X, timer=timer_where_fp8_is_faster_in({"0", "2"}))
    chosen = {r.module for r in result.report if r.precision == "fp8"}
    assert chosen == {"0", "2"}
    path = tmp_path / "auto.yaml"
    path.write_text(result.policy.to_yaml())
    loaded = ampkit.load_policy(path)
    assert loaded == result.policy and loaded.name == "torch_default_fp8_auto"
    with loaded.apply(model), ampkit.trace() as tr, \
            ampkit.autocast("cpu", policy=loaded.without_modules()):
        model(X)
    rows = [r for r in tr.records if r.op == "linear"]
    assert [(r.rule, r.scope) for r in rows] == [("fp8", "0"), ("fp8", "2"), ("lower_precision_fp", "")]


def per_kept_module(base, result):
    """The oracle policy: the base plus a scope ``lower_precision_fp: [linear]`` on each module
    the report kept in the region dtype (the form calibrate_fp8 gives a base with linear in fp8
    when most modules get fp8)."""
    for r in result.report:
        if r.precision not in ("fp8", "(policy)"):
            base = base.with_module(r.module, lower_precision_fp=["linear"])
    return base


def run_traced(policy, model, x, extra=None):
    """Forward and backward under the policy (its scopes on the model, its region its own
    tables): the output, the parameters' gradients and (op, rule, output dtype) per call;
    ``extra``: a module name also called on the output (one the forward never calls)."""
    model.zero_grad(set_to_none=True)
    with policy.apply(model), ampkit.trace() as tr, ampkit.autocast("cpu", policy=policy.without_modules()):
        y = model(x)
        if extra is not None:
            y = model.get_submodule(extra)(y.float())
    y.float().square().sum().backward()
    grads = [p.grad.clone() for p in model.parameters() if p.grad is not None]
    return y, grads, [(r.op, r.rule, r.output_dtype) for r in tr.records]


def assert_decides_as(policy, oracle, model, x, extra=None):
    y, grads, rows = run_traced(policy, model, x, extra)
    want, want_grads, want_rows = run_traced(oracle, model, x, extra)
    assert rows == want_rows
    assert y.dtype == want.dtype and torch.equal(y, want)
    assert len(grads) == len(want_grads) and all(torch.equal(g, w) for g, w in zip(grads, want_grads))
    return rows


def test_a_base_with_linear_in_fp8_keeping_most_modules_moves_linear_out_and_scopes_the_fp8_ones():
    """Most modules kept: linear leaves the fp8 category on every device and only the fp8
    module gets a scope; each call decides as the one-scope-per-kept-module policy, with the
    same output and gradients bit for bit."""
    model = make_model()
    base = ampkit.load_policy("fp8")
    result = ampkit.calibrate_fp8(model, X, policy=base, timer=timer_where_fp8_is_faster_in({"2"}))
    assert [r.precision for r in result.report] == ["bfloat16", "fp8", "bfloat16"]
    assert [(m.pattern, m.ops) for m in result.policy.modules] == [("2", (("linear", "fp8"),))]
    assert [result.policy.category(d, "linear") for d in ("cpu", "cuda")] == ["lower_precision_fp"] * 2
    oracle = per_kept_module(base, result)
    assert [m.pattern for m in oracle.modules] == ["0", "4"]
    rows = assert_decides_as(result.policy, oracle, model, X)
    assert [rule for op, rule, _ in rows if op == "linear"] == ["lower_precision_fp", "fp8", "lower_precision_fp"]


class WithSpare(torch.nn.Module):
    """make_model()'s layers, a Linear the forward never calls (``spare``) and one the base
    policy scopes (``head``)."""

    def __init__(self):
        super().__init__()
        self.body = make_model()
        self.head = torch.nn.Linear(16, 16)
        self.spare = torch.nn.Linear(16, 16)

    def forward(self, x):
        return self.head(self.body(x))


@pytest.mark.parametrize("head_scope", [{"lower_precision_fp": ["linear"]}, {"pin": "float32"}])
def test_the_base_scopes_stay_and_a_candidate_never_called_keeps_the_base_fp8(head_scope):
    """None in fp8: the base's scope on the head stays (it decides linear itself), the spare
    Linear, never called while calibrating, gets a scope keeping the base's fp8, and every
    call (the spare's too, called after the forward) decides as the oracle policy."""
    torch.manual_seed(0)
    model = WithSpare()
    base = ampkit.load_policy("fp8").with_module("head", **head_scope)
    result = ampkit.calibrate_fp8(model, X, policy=base, timer=timer_where_fp8_is_faster_in(set()))
    assert [(r.module, r.precision) for r in result.report] == [
        ("body.0", "bfloat16"), ("body.2", "bfloat16"), ("body.4", "bfloat16"), ("head", "(policy)"),
        ("spare", "(policy)")]
    assert [m.pattern for m in result.policy.modules] == ["head", "spare"]
    assert result.policy.modules[0] == base.modules[0] and result.policy.modules[1].ops == (("linear", "fp8"),)
    rows = assert_decides_as(result.policy, per_kept_module(base, result), model, X, extra="spare")
    linear = [rule for op, rule, _ in rows if op == "linear"]
    assert linear[:3] == ["lower_precision_fp"] * 3 and linear[-1] == "fp8"


class FunctionalHead(torch.nn.Module):
    """A Linear and a functional linear outside any Linear module (not a candidate)."""

    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(32, 16)
        self.w = torch.nn.Parameter(torch.randn(8, 16))

    def forward(self, x):
        return F.linear(self.lin(x), self.w)


def _functional():
    torch.manual_seed(0)
    return FunctionalHead(), ampkit.load_policy("fp8"), set()


def _scope_leaving_linear_to_the_tables():
    return make_model(), ampkit.load_policy("fp8").with_module("3", fp32=["mul"]), set()


def _a_device_without_linear_in_fp8():
    return make_model(), ampkit.load_policy("fp8").with_ops("cuda", lower_precision_fp=["linear"]), set()


def _most_in_fp8():
    return make_model(), ampkit.load_policy("fp8"), {"0", "2"}


@pytest.mark.parametrize("make", [_functional, _scope_leaving_linear_to_the_tables, _a_device_without_linear_in_fp8,
                                  _most_in_fp8], ids=lambda f: f.__name__.strip("_"))
def test_where_the_move_would_change_a_decision_or_save_no_scope_each_kept_module_gets_a_scope(make):
    """A functional linear outside the candidates (the base's fp8 must still decide it), a
    base scope that leaves linear to the device tables, a device whose linear is not in fp8,
    and more modules in fp8 than kept: the one-scope-per-kept-module form, unchanged."""
    model, base, fast = make()
    result = ampkit.calibrate_fp8(model, X, policy=base, timer=timer_where_fp8_is_faster_in(fast))
    oracle = per_kept_module(base, result)
    assert result.policy.modules == oracle.modules and result.policy.devices == base.devices
    assert any(m.ops == (("linear", "lower_precision_fp"),) for m in result.policy.modules)
    rows = assert_decides_as(result.policy, oracle, model, X)
    if make is _functional:
        assert [rule for op, rule, _ in rows if op == "linear"] == ["lower_precision_fp", "fp8"]


def test_a_delayed_recipe_is_measured_once_its_history_holds_the_input():
    model = make_model()
    errors = oracle_errors(model, X)  # tensorwise: the scale a full history gives
    result = ampkit.calibrate_fp8(model, X, recipe={"scaling": "delayed", "amax_history": 4},
                                  timer=timer_where_fp8_is_faster_in({"0"}))
    for r in result.report:
        assert r.error == pytest.approx(errors[r.module], rel=1e-6, abs=0)
    recipe = result.policy.rules("cpu").fp8_recipe
    assert (recipe.scaling, recipe.amax_history) == ("delayed", 4)


def test_the_model_is_left_as_it_was():
    model = make_model()
    before = [p.detach().clone() for p in model.parameters()]
    ampkit.calibrate_fp8(model, X, timer=timer_where_fp8_is_faster_in({"0"}))
    assert all(torch.equal(p, q) and p.grad is None for p, q in zip(model.parameters(), before))
    assert not model._forward_pre_hooks and not model[0]._forward_pre_hooks and not model[0]._forward_hooks


def test_modules_the_base_policy_scopes_are_left_to_it():
    model = make_model()
    base = ampkit.load_policy("torch_default").with_module("2", pin="float32")
    result = ampkit.calibrate_fp8(model, X, policy=base, timer=timer_where_fp8_is_faster_in({"0", "2", "4"}))
    got = {r.module: r for r in result.report}
    assert got["2"].precision == "(policy)" and "'2'" in got["2"].reason and got["2"].error is None
    assert [m.pattern for m in result.policy.modules] == ["0", "2"]  # 4: the spike's error
    assert result.policy.modules[1].pin == "float32"


def test_with_real_timings_each_module_gets_what_its_own_measurements_say():
    """On the CPU the fp8 emulation is usually slower than bfloat16, but not always: where
    bfloat16 itself is emulated (AVX2: ~20x slower than float32) the emulation can win.
    Whatever the machine measured, the choice and the words follow the report's own
    speedup and error (fp8 where speedup > 1 and error <= 0.1, the defaults)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.ReLU(), torch.nn.Linear(256, 256))
    result = ampkit.calibrate_fp8(model, torch.randn(64, 256), warmup=1, repeats=3)
    assert [r.module for r in result.report] == ["0", "2"]
    for r in result.report:
        pays = r.speedup > 1.0 and r.error <= 0.1
        assert r.precision == ("fp8" if pays else "bfloat16"), r
        assert ("slower" in r.reason) == (not pays and r.speedup < 1), r
    assert [m.pattern for m in result.policy.modules] == [r.module for r in result.report if r.precision == "fp8"]


def test_the_report_prints_as_a_table_and_as_rows():
    result = ampkit.calibrate_fp8(make_model(), X, timer=timer_where_fp8_is_faster_in({"0"}))
    rows = result.as_rows()
    assert rows[0] == {"module": "0", "shapes": "8x32", "fp8_ms": 1.0, "ref_ms": 2.0, "speedup": 2.0,
                       "error": result.report[0].error, "precision": "fp8", "reason": result.report[0].reason}
    lines = str(result).splitlines()
    assert lines[0].split()[:4] == ["module", "shapes", "fp8", "ms"] and len(lines) == 4
    assert lines[1].split()[:5] == ["0", "8x32", "1", "2", "2"]


@pytest.mark.parametrize("call, exc, match", [
    (lambda: ampkit.calibrate_fp8(make_model()(X), X), TypeError, r"model must be a torch.nn.Module, got Tensor"),
    (lambda: ampkit.calibrate_fp8(torch.nn.ReLU(), X), ValueError, r"the ReLU has no torch.nn.Linear"),
    (lambda: ampkit.calibrate_fp8(make_model(), X, max_error=0), ValueError, r"max_error must be a finite number > 0, got 0"),
    (lambda: ampkit.calibrate_fp8(make_model(), X, max_error=math.nan), ValueError, r"max_error .* got nan"),
    (lambda: ampkit.calibrate_fp8(make_model(), X, max_error="0.1"), ValueError, r"max_error .* got '0.1'"),
    (lambda: ampkit.calibrate_fp8(make_model(), X, min_speedup=-1), ValueError, r"min_speedup .* got -1"),
    (lambda: ampkit.calibrate_fp8(make_model(), X, repeats=0), ValueError, r"repeats must be a whole number >= 1, got 0"),
    (lambda: ampkit.calibrate_fp8(make_model(), X, warmup=1.5), ValueError, r"warmup must be a whole number >= 0, got 1.5"),
    (lambda: ampkit.calibrate_fp8(make_model(), X, device_type="tpu"), ValueError, r"device_type must be 'cpu' or 'cuda'.*'tpu'"),
    (lambda: ampkit.calibrate_fp8(make_model(), X, recipe="rowwise"), ValueError, r"recipe must be a dict.*'rowwise'"),
    (lambda: ampkit.calibrate_fp8(make_model(), X, recipe={"scaling": "blockwise"}), ampkit.PolicyError, r"'blockwise'"),
    (lambda: ampkit.calibrate_fp8(make_model(), X, timer=3), TypeError, r"timer must be a callable"),
    (lambda: ampkit.calibrate_fp8(make_model(), X, policy="nope"), ampkit.PolicyError, r"no shipped policy named 'nope'"),
], ids=["not-a-module", "no-linear", "max-error-0", "max-error-nan", "max-error-str",
        "min-speedup", "repeats", "warmup", "device", "recipe-str", "recipe-bad", "timer", "policy"])
def test_bad_arguments_are_clear_errors(call, exc, match):
    with pytest.raises(exc, match=match):
        call()


def test_a_linear_the_forward_never_calls_is_an_error_when_none_is_called():
    class Unused(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = torch.nn.Linear(4, 4)

        def forward(self, x):
            return x * 2

    with pytest.raises(ValueError, match=r"called none of the Unused's torch.nn.Linear modules \(fc\)"):
        ampkit.calibrate_fp8(Unused(), torch.randn(2, 4))
