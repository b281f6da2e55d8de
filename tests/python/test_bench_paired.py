"""A variant paired with its control (variants.yaml's paired_with: ampkit_step_eager with
ampkit_amp_fused) is timed against it step by step on the CPU, trains as it does alone,
and its record's summary is the median of the recorded per-pair ratios."""

from __future__ import annotations

import statistics
import sys
from pathlib import Path

import pytest
import torch
import yaml

from ampkit import bench

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "benchmarks"))
import report  # noqa: E402

PAIR = ["ampkit_amp_fused", "ampkit_step_eager"]  # the control first: the group's order in variants.yaml
ROUNDS = 3


# --- the spec ---------------------------------------------------------------------------------

def test_only_the_eager_step_is_paired_and_with_its_hand_written_control():
    v = bench.load_variants()
    assert v["ampkit_step_eager"].paired_with == "ampkit_amp_fused"
    assert {n for n, x in v.items() if x.paired_with is not None} == {"ampkit_step_eager"}


def _variants_file(tmp_path, **eager):
    doc = yaml.safe_load((bench.spec_dir() / "variants" / "variants.yaml").read_text())
    doc["variants"]["ampkit_step_eager"].update(eager)
    path = tmp_path / "variants.yaml"
    path.write_text(yaml.safe_dump(doc, sort_keys=False))
    return path, list(doc["variants"])


def test_an_unknown_control_is_named_with_the_valid_names(tmp_path):
    path, names = _variants_file(tmp_path, paired_with="ampkit_amp_fusd")
    with pytest.raises(bench.BenchSpecError) as e:
        bench.load_variants(path)
    msg = str(e.value)
    assert "variants.ampkit_step_eager.paired_with" in msg and "'ampkit_amp_fusd'" in msg
    assert ", ".join(n for n in names if n != "ampkit_step_eager") in msg


def test_a_variant_paired_with_itself_is_refused(tmp_path):
    path, _ = _variants_file(tmp_path, paired_with="ampkit_step_eager")
    with pytest.raises(bench.BenchSpecError, match="cannot be paired with itself .'ampkit_step_eager'.; name its "
                                                   "control, one of: fp32, "):
        bench.load_variants(path)


# --- the runner -------------------------------------------------------------------------------

def _run(monkeypatch, case, names, rounds=ROUNDS, pairs=True):
    """Records of ``names`` run as one group (``pairs=False``: each alone), and per variant its
    parameters at the end and the (batch, variant) order of the timed steps."""
    v = bench.load_variants()
    params, order = {}, []
    close, timed_step = bench.VariantRun.close, bench.VariantRun.timed_step

    def keep_params(run):
        if run.model is not None:
            params[run.variant.name] = [p.detach().clone() for p in run.model.parameters()]
        close(run)

    def log_step(run, i):
        order.append((i, run.variant.name))
        timed_step(run, i)

    monkeypatch.setattr(bench.VariantRun, "close", keep_params)
    monkeypatch.setattr(bench.VariantRun, "timed_step", log_step)
    built = bench.build_case(case, "tiny", seed=0, device="cpu", repeats=rounds)
    if pairs:
        recs = bench.run_interleaved(built, [v[n] for n in names])
    else:
        recs = [bench.run_variant(built, v[n]) for n in names]
    return {r["variant"]: r for r in recs}, params, order, built


@pytest.fixture(scope="module")
def paired():
    mp = pytest.MonkeyPatch()
    try:
        yield _run(mp, "text_classifier", ["fp32"] + PAIR)
    finally:
        mp.undo()


def test_the_pair_alternates_single_steps_in_the_runners_rotation(paired):
    """Each round the pair is one unit at the control's place (the rotation of 2 units); within
    it, batch i of round r runs the two in the order round_order(2, i + r) (``rotation``)."""
    recs, _, order, built = paired
    n = built.num_batches
    rot = bench.rotation(2, n + ROUNDS)
    expected = [(i, PAIR[k]) for rnd in range(ROUNDS) for i in range(n) for k in rot[i + rnd]]
    assert order == expected
    assert order[:2] != order[2 * n:2 * n + 2]  # round 1 starts with the other one
    places = [row.index(1) for row in bench.rotation(2, ROUNDS)]  # the pair is the second unit
    for name in PAIR:
        assert recs[name]["interleaved"]["positions"] == places
        assert recs[name]["interleaved"]["group"] == ["fp32"] + PAIR
    assert "paired" not in recs["fp32"] and "paired" not in recs["ampkit_amp_fused"]
    assert bench.validate({"context": bench.context("tiny", "cpu"), "records": list(recs.values())}) == []


def test_the_summary_is_the_median_of_the_recorded_step_ratios(paired):
    recs, _, _, built = paired
    p, n = recs["ampkit_step_eager"]["paired"], built.num_batches
    assert (p["with"], p["unit"], p["n"]) == ("ampkit_amp_fused", "step", ROUNDS * n)
    ratios = [a / b for a, b in zip(p["this_ms"], p["control_ms"])]
    q = statistics.quantiles(ratios, n=4, method="inclusive")
    assert (p["ratio"], p["q1"], p["q3"]) == (statistics.median(ratios), q[0], q[2])
    # each round's sample is the variant's step times of the round summed / num_batches
    for name, times in (("ampkit_step_eager", p["this_ms"]), ("ampkit_amp_fused", p["control_ms"])):
        assert recs[name]["samples"] == [sum(times[r * n:(r + 1) * n]) / n for r in range(ROUNDS)]


def test_a_paired_variant_trains_bitwise_as_alone(paired):
    """text_classifier has dropout: each step is a turn with the variant's own random state,
    so the losses, scale and parameters are those of each variant run alone."""
    recs, params, _, _ = paired
    mp = pytest.MonkeyPatch()
    try:
        alone, alone_params, order, _ = _run(mp, "text_classifier", PAIR, pairs=False)
    finally:
        mp.undo()
    assert order == []  # alone: whole epochs, no step alternation
    for name in PAIR:
        assert "interleaved" not in alone[name] and "paired" not in alone[name]
        assert recs[name]["final_loss"] == alone[name]["final_loss"], name
        assert recs[name]["final_scale"] == alone[name]["final_scale"], name
        assert len(params[name]) == len(alone_params[name]) > 0
        assert all(torch.equal(a, b) for a, b in zip(params[name], alone_params[name])), name


def test_without_its_control_the_variant_runs_its_epochs_unpaired(monkeypatch):
    recs, _, order, _ = _run(monkeypatch, "seed_mlp", ["fp32", "ampkit_step_eager"], rounds=2)
    assert order == [] and "paired" not in recs["ampkit_step_eager"]
    assert recs["ampkit_step_eager"]["interleaved"]["positions"] == [1, 0]


# --- the report -------------------------------------------------------------------------------

def _goal_doc(paired):
    recs = [{"case": "seed_mlp", "variant": v, "language": "python", "status": "ok", "dtype": "bfloat16",
             "median": ms, "min": ms, "max": ms, "final_loss": 1.0, "peak_memory_bytes": None,
             "graph_captured": None, "reason": None}
            for v, ms in (("ampkit_step_eager", 12.0), ("ampkit_amp_fused", 10.0))]
    if paired is not None:
        recs[0]["paired"] = paired
    return {"context": {"languages": ["python"]}, "records": bench.derive(recs)}


def _eager_goal(doc):
    return next(g for g in report.goals(doc).splitlines() if g.startswith("- ") and "ampkit_step_eager" in g)


def test_the_goal_reads_the_paired_ratio_where_the_record_has_one():
    """The epoch medians say 1.20 (NOT met); the paired step ratios, summarized from the
    times, say otherwise, and the line says how they were taken."""
    p = bench.pair_summary("ampkit_amp_fused", "step", [1.0, 1.02, 1.1, 0.99, 1.0], [1.0, 1.0, 1.0, 1.0, 1.0])
    line = _eager_goal(_goal_doc(p))
    assert line.startswith("- met ")
    assert "time ratio %.2f (median of 5 paired step ratios, IQR [%.2f, %.2f]" % (p["ratio"], p["q1"], p["q3"]) in line
    assert "one step of each in turn" in line
    assert report.paired_note(_goal_doc(p)).count("seed_mlp / ampkit_step_eager / python") == 1
    past = bench.pair_summary("ampkit_amp_fused", "epoch", [1.0504, 1.0504, 1.0504], [1.0, 1.0, 1.0])
    line = _eager_goal(_goal_doc(past))
    assert line.startswith("- NOT met ") and "time ratio 1.0504 (median of 3 paired epoch ratios" in line


def test_without_a_pairing_the_goal_falls_back_to_the_epoch_medians():
    line = _eager_goal(_goal_doc(None))
    assert line.startswith("- NOT met ") and "time ratio 1.20 [1.20, 1.20]" in line
    assert report.paired_note(_goal_doc(None)) == ""
