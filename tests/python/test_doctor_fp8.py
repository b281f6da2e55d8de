"""The doctor in fp8: per module and operand, amax, saturated and flushed fractions, the scale.

The oracle is docs/doctor.md's definition written again with plain torch ops, from the
operands the test captures itself (the input and weight it passed, the output gradient a
hook on the module's output sees): per cast of ``x`` with scale ``s`` to fp8 ``dt``::

    q         = (x.float() * s).clamp(-max, max).to(dt)
    overflow  = mean(|x.float() * s| > limit)   # limit: max plus half the grid's step there,
                                                # from the dtype's 256 bit patterns
    underflow = mean(x != 0 and q == 0)
"""

from __future__ import annotations

import pytest
import torch

import ampkit
from ampkit._listeners import fp8_quantized

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
FP8 = ampkit.load_policy("fp8")


# ------------------------------------------------------------------ the oracle
def limit(dt):
    """Halfway from max to the next step of the fp8 grid above it (the grid's step at max is
    the one below it: max and its neighbour share a binade), from the dtype's 256 values."""
    vals = torch.arange(256, dtype=torch.uint8).view(dt).float()
    top = vals[torch.isfinite(vals)].unique().sort().values[-2:]
    return float(top[1] + (top[1] - top[0]) / 2)


def expected(x, s, dt):
    x = x.detach()
    m = torch.finfo(dt).max
    xs = x.float() * s
    q = xs.clamp(-m, m).to(dt).float()
    n = x.numel()
    return {"amax": float(x.abs().max()), "overflow": int((xs.abs() > limit(dt)).sum()) / n,
            "underflow": int(((x != 0) & (q == 0)).sum()) / n, "scale": float(s.min()), "elements": n}


def tensor_scale(t, dt):
    return torch.finfo(dt).max / t.detach().abs().amax().float().clamp(min=1e-12)


class Two(torch.nn.Module):
    """Two branches, each one fp8 Linear: ``clean(x) + hurt(z)``."""

    def __init__(self):
        super().__init__()
        self.clean = torch.nn.Linear(32, 16)
        self.hurt = torch.nn.Linear(32, 16)
        with torch.no_grad():
            for p in self.parameters():
                p.normal_()

    def forward(self, x, z):
        return self.clean(x) + self.hurt(z)


def capture_grads(model):
    """{module name: its output's gradient}, filled by the backward."""
    got = {}

    def hook(name):
        def fwd(module, args, out):
            out.register_hook(lambda g: got.__setitem__(name, g.detach().clone()))
        return fwd

    handles = [getattr(model, n).register_forward_hook(hook(n)) for n in ("clean", "hurt")]
    return got, handles


def step(model, policy, x, z):
    with ampkit.autocast("cpu", policy=policy):
        out = model(x, z)
    out.float().sum().backward()
    model.zero_grad()


def by_key(rows, step_):
    return {(r["module"], r["operand"]): r for r in rows if r["step"] == step_}


def check_row(row, want):
    for k, v in want.items():
        assert row[k] == v, (row["module"], row["operand"], k, row[k], v)


def test_the_saturation_limit_is_the_documented_one():
    assert (limit(E4M3), limit(E5M2)) == (464.0, 61440.0)


# ------------------------------------------------------------------ outliers flush an input
def test_planted_outliers_flush_the_input_and_suggest_moves_only_that_module():
    torch.manual_seed(0)
    model = Two()
    x, z = torch.randn(64, 32), torch.randn(64, 32)
    z[3, 5], z[40, 1] = 1e6, -2e6  # the scale 448 / 2e6 flushes ordinary values to zero
    grads, handles = capture_grads(model)
    with ampkit.doctor(model, every=1, policy=FP8) as doc:
        step(model, FP8, x, z)
        rows = doc.fp8_stats()
        fix = doc.suggest()
        shown = str(doc)
    for h in handles:
        h.remove()
    got = by_key(rows, 0)
    assert set(got) == {(m, o) for m in ("clean", "hurt") for o in ("input", "weight", "grad_output")}
    assert len(rows) == 6
    for mod, inp in (("clean", x), ("hurt", z)):
        w = getattr(model, mod).weight
        g = grads[mod]
        check_row(got[(mod, "input")], expected(inp, tensor_scale(inp, E4M3), E4M3) | {"dtype": "float8_e4m3fn"})
        check_row(got[(mod, "weight")], expected(w, tensor_scale(w, E4M3), E4M3))
        check_row(got[(mod, "grad_output")], expected(g, tensor_scale(g, E5M2), E5M2) | {"dtype": "float8_e5m2"})
        assert all(got[(mod, o)]["ops"] == "linear" and got[(mod, o)]["casts"] == 1
                   for o in ("input", "weight", "grad_output"))
    assert got[("hurt", "input")]["underflow"] > 0.5  # the outliers did flush most of z
    assert got[("clean", "input")]["underflow"] < 0.01
    assert "hurt    input" in shown and "fp8 casts" in shown
    assert [(m.pattern, m.to_dict()) for m in fix.modules] == [("hurt", {"lower_precision_fp": ["linear"]})]
    assert "hurt back from fp8" in fix.description and "input underflow" in fix.description
    assert_moved_back(model, fix, x, z)


def assert_moved_back(model, fix, x, z):
    """Under the suggested policy the hurt module runs in the region dtype: its linear is no
    fp8 trace row, and a doctor sees no fp8 cast of it."""
    with ampkit.trace() as tr, fix.apply(model), ampkit.autocast("cpu", policy=fix.without_modules()):
        model(x, z)
    linear = [(r.rule, r.scope) for r in tr.records if r.op == "linear"]
    assert linear == [("fp8", ""), ("lower_precision_fp", "hurt")]
    with ampkit.doctor(model, every=1, policy=fix) as doc, fix.apply(model):
        step(model, fix.without_modules(), x, z)
        mods = {r["module"] for r in doc.fp8_stats()}
    assert mods == {"clean"}


# ------------------------------------------------------------------ a stale history saturates
def test_a_stale_delayed_history_saturates_the_weight():
    torch.manual_seed(1)
    policy = FP8.with_fp8_recipe(scaling="delayed", amax_history=4)
    model = Two()
    x, z = torch.randn(64, 32), torch.randn(64, 32)
    grads, handles = capture_grads(model)
    w0 = {m: getattr(model, m).weight.detach().clone() for m in ("clean", "hurt")}
    with ampkit.doctor(model, every=1, policy=policy) as doc:
        step(model, policy, x, z)
        g0 = dict(grads)
        with torch.no_grad():
            model.hurt.weight.mul_(100.0)  # the history still holds the small amax
        step(model, policy, x, z)
        rows = doc.fp8_stats()
        fix = doc.suggest()
    for h in handles:
        h.remove()
    one = torch.tensor(1.0)
    for mod, inp in (("clean", x), ("hurt", z)):
        s0 = by_key(rows, 0)
        s1 = by_key(rows, 1)
        w1 = getattr(model, mod).weight
        # step 0: the histories are all zero, so every scale is 1
        check_row(s0[(mod, "input")], expected(inp, one, E4M3))
        check_row(s0[(mod, "weight")], expected(w0[mod], one, E4M3))
        check_row(s0[(mod, "grad_output")], expected(g0[mod], one, E5M2))
        # step 1: each scale is max / the amax step 0 left in the history
        check_row(s1[(mod, "input")], expected(inp, tensor_scale(inp, E4M3), E4M3))
        check_row(s1[(mod, "weight")], expected(w1, tensor_scale(w0[mod], E4M3), E4M3))
        check_row(s1[(mod, "grad_output")], expected(grads[mod], tensor_scale(g0[mod], E5M2), E5M2))
    assert by_key(rows, 1)[("hurt", "weight")]["overflow"] > 0.5
    assert by_key(rows, 1)[("clean", "weight")]["overflow"] == 0.0
    assert [(m.pattern, m.to_dict()) for m in fix.modules] == [("hurt", {"lower_precision_fp": ["linear"]})]
    assert "weight overflow" in fix.description and "at step 1" in fix.description


def test_thresholds_are_keyword_arguments():
    torch.manual_seed(0)
    model = Two()
    x, z = torch.randn(64, 32), torch.randn(64, 32)
    z[3, 5] = 1e6
    with ampkit.doctor(model, every=1, policy=FP8) as doc:
        step(model, FP8, x, z)
        under = by_key(doc.fp8_stats(), 0)[("hurt", "input")]["underflow"]
        assert doc.suggest(fp8_underflow=under).modules == ()  # not above it: no move
        assert [m.pattern for m in doc.suggest(fp8_underflow=under / 2).modules] == ["hurt"]
        with pytest.raises(ValueError, match="fp8_overflow must be a fraction in"):
            doc.suggest(fp8_overflow=2)


# ------------------------------------------------------------------ sampled steps only
def test_unsampled_steps_do_not_watch_fp8_casts():
    torch.manual_seed(0)
    model = Two()
    x, z = torch.randn(8, 32), torch.randn(8, 32)
    seen = []
    with ampkit.doctor(model, every=2, policy=FP8) as doc:
        for _ in range(3):
            with ampkit.autocast("cpu", policy=FP8):
                out = model(x, z)
                seen.append(len(fp8_quantized.listeners))
            out.float().sum().backward()
        rows = doc.fp8_stats()
    assert seen == [1, 0, 1]
    assert fp8_quantized.listeners == ()
    assert sorted({r["step"] for r in rows}) == [0, 2]
    assert doc.fp8_stats() == rows  # readable after close
    doc.reset()
    assert doc.fp8_stats() == []


# ------------------------------------------------------------------ no fp8 op: nothing changes
def test_no_fp8_op_gives_no_fp8_rows_and_the_same_statistics():
    def run(armed_policy):
        torch.manual_seed(0)
        model = Two()
        x, z = torch.randn(8, 32), torch.randn(8, 32)
        with ampkit.doctor(model, every=1, policy=armed_policy) as doc:
            with ampkit.autocast("cpu", dtype=torch.bfloat16):
                out = model(x, z)
            out.float().sum().backward()
            return doc, out, [p.grad.clone() for p in model.parameters()]

    doc, out, grads = run("torch_default")
    torch.manual_seed(0)
    ref_model = Two()
    x, z = torch.randn(8, 32), torch.randn(8, 32)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        ref = ref_model(x, z)
    ref.float().sum().backward()
    assert torch.equal(out, ref)
    assert all(torch.equal(g, p.grad) for g, p in zip(grads, ref_model.parameters()))
    assert doc.fp8_stats() == []
    assert str(doc) == repr(doc)
    assert doc.suggest() == doc.policy
    assert {r["module"] for r in doc.stats()} >= {"clean", "hurt"}
