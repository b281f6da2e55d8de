"""The doctor's verdicts: a backward overflow the scaler skipped and backed off from is
handled; a forward one, or one that recurs where the scaler cannot lower the scale, is
harmful. The oracle is what the scalers did: a ``torch.amp.GradScaler`` steps a copy of the
model side by side, and its own skips (found_inf, read per step) and scales decide."""

import copy

import pytest
import torch

import ampkit

HANDLED, HARMFUL = "handled", "harmful"


def _run(init_scale, xs, prepare=None, **scaler_kw):
    """Train a 2-layer model in float16 on batches ``xs``, with ampkit's scaler (doctor
    armed) and, on a copy, torch's scaler. Returns the doctor, ampkit's scaler and torch's
    per-step (skipped, scale before the step)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1))
    if prepare is not None:
        prepare(model)
    twin = copy.deepcopy(model)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    topt = torch.optim.SGD(twin.parameters(), lr=1e-3)
    scaler = ampkit.GradScaler("cpu", init_scale=init_scale, **scaler_kw)
    ref = torch.amp.GradScaler("cpu", init_scale=init_scale) if not scaler_kw else None
    y = torch.randn(xs[0].shape[0], 1)
    oracle = []
    doc = ampkit.doctor(model)
    for x in xs:
        for m, o, s in ((model, opt, scaler),) + (((twin, topt, ref),) if ref else ()):
            o.zero_grad()
            with ampkit.autocast("cpu", dtype=torch.float16):
                loss = torch.nn.functional.mse_loss(m(x).float(), y)
            s.scale(loss).backward()
            before = s.get_scale()
            s.step(o)
            if s is ref:
                skipped = sum(v.item() for v in s._per_optimizer_states[id(o)]["found_inf_per_device"].values()) > 0
                oracle.append((skipped, before))
            s.update()
    return doc, scaler, oracle


def _expected(oracle, phases, min_scale=None, max_run=16):
    """The verdicts by the documented rule, from the oracle scaler's skips and scales."""
    out, run = {}, 0
    for step, (skipped, before) in enumerate(oracle):
        run = run + 1 if skipped else 0
        if step not in phases:
            continue
        harmful = (phases[step] != "backward" or not skipped or run > max_run
                   or (min_scale is not None and before <= min_scale))
        out[step] = HARMFUL if harmful else HANDLED
    return out


def test_the_warm_up_backoffs_are_handled_and_the_outlier_batch_is_the_first_harmful():
    g = torch.Generator().manual_seed(1)
    xs = [torch.randn(16, 8, generator=g) for _ in range(12)]
    xs[8][1, 2] = 1e6  # the outlier: its cast to float16 in layer 0 overflows
    doc, scaler, oracle = _run(2.0 ** 40, xs)
    skips = [s for s, (skipped, _) in enumerate(oracle) if skipped]
    assert skips[0] == 0 and 8 in skips  # the scale starts too high, and the outlier is skipped too
    first = doc.first_nonfinite()
    assert (first.phase, first.step, first.verdict) == ("backward", 0, "")  # unchanged
    found = doc.findings(scaler)
    assert [f.step for f in found] == skips  # every step the oracle skipped, and only those
    assert {f.step: f.verdict for f in found} == _expected(oracle, {f.step: f.phase for f in found})
    harmful = doc.first_harmful(scaler)
    assert (harmful.op, harmful.module, harmful.phase, harmful.dtype, harmful.step) == \
        ("_to_copy", "0", "forward", "float16", 8)
    n_harmful = sum(f.verdict == HARMFUL for f in found)
    assert f"{len(found) - n_harmful} handled, {n_harmful} harmful" in repr(doc)
    assert [m.pattern for m in doc.suggest(scaler=scaler).modules] == ["0"]  # the outlier's module
    assert doc.suggest().modules == ()  # without the scaler: the first finding is backward
    doc.close()


def test_a_backward_overflow_that_recurs_at_the_minimum_scale_is_harmful():
    g = torch.Generator().manual_seed(2)
    xs = [torch.randn(16, 8, generator=g) for _ in range(6)]
    # min_scale too high for these gradients: after backing off to it, each step overflows again
    doc, scaler, _ = _run(2.0 ** 41, xs, min_scale=2.0 ** 40)
    found = doc.findings(scaler)
    scales = dict(zip(scaler.stats().history_steps, scaler.stats().history_scales))
    assert [f.step for f in found] == list(range(6))
    assert all(f.phase == "backward" for f in found)
    # step 0 backed off from 2**41 to the floor: handled; from there on the scale cannot go lower
    want = [HANDLED] + [HARMFUL if scales[s - 1] <= 2.0 ** 40 else HANDLED for s in range(1, 6)]
    assert [f.verdict for f in found] == want == [HANDLED] + [HARMFUL] * 5
    assert doc.first_harmful(scaler).step == 1
    doc.close()


def test_a_backward_overflow_past_the_backoffs_the_rule_allows_is_harmful():
    g = torch.Generator().manual_seed(3)
    xs = [torch.randn(16, 8, generator=g) for _ in range(20)]
    doc, scaler, oracle = _run(2.0 ** 60, xs)  # 2**60: more backoffs than 16 before the loss fits
    found = doc.findings(scaler)
    want = _expected(oracle, {f.step: f.phase for f in found})
    assert {f.step: f.verdict for f in found} == want
    assert want[15] == HANDLED and want[16] == HARMFUL  # the 17th consecutive skip: 16 backoffs did not fix it
    doc.close()


def test_a_sampled_finding_the_scaler_never_saw_is_harmful_and_the_first_bad_step_follows():
    def mask(model):  # row 0 of layer 0 overflows to -inf in float16 each step; the ReLU masks it
        with torch.no_grad():
            model[0].weight[0].fill_(-3e4)
            model[0].bias[0] = 0.0

    g = torch.Generator().manual_seed(4)
    xs = [torch.rand(16, 8, generator=g) + 1.0 for _ in range(6)]
    xs[3][1, 2] = 1e6
    doc, scaler, oracle = _run(1.0, xs, prepare=mask)
    assert [s for s, (skipped, _) in enumerate(oracle) if skipped] == [3]
    found = doc.findings(scaler)
    # step 0 was sampled (every=100): its masked -inf is a finding of a step no one skipped
    assert [(f.op, f.module, f.phase, f.step) for f in found] == [("addmm", "0", "forward", 0),
                                                                 ("_to_copy", "0", "forward", 3)]
    assert {f.step: f.verdict for f in found} == _expected(oracle, {f.step: f.phase for f in found})
    assert [f.verdict for f in found] == [HARMFUL, HARMFUL]
    doc.close()


def test_findings_wants_the_scaler():
    model = torch.nn.Linear(2, 2)
    with ampkit.doctor(model) as doc:
        with pytest.raises(TypeError, match="ampkit.GradScaler"):
            doc.findings(torch.amp.GradScaler("cpu"))
