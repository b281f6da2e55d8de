"""The fidelity harness: its statistics against a hand computation, the paired data, the
schema block and the report. CPU only, tiny profile."""

from __future__ import annotations

import copy
import math
import random
import statistics
import sys
from pathlib import Path

import pytest
import torch

import ampkit
from ampkit import bench

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "benchmarks"))
import fidelity as fidelity_py  # noqa: E402  (benchmarks/fidelity.py)
import report  # noqa: E402


def synthetic(seeds: int, steps: int, offset: float, rng: random.Random) -> list:
    """Decaying noisy loss curves, one per seed, ``offset`` added to every step."""
    return [[2.0 * math.exp(-t / 7.0) + 0.5 + offset + rng.gauss(0.0, 0.05) for t in range(steps)]
            for _ in range(seeds)]


def hand_gap(losses, ref, window):
    """The module docstring's formulas, written out step by step with the statistics module."""
    def smoothed(c, t):
        part = c[max(0, t - window + 1): t + 1]
        return sum(part) / len(part)
    out = []
    for t in range(len(ref[0])):
        m = statistics.mean(smoothed(c, t) for c in losses)
        rm = statistics.mean(smoothed(c, t) for c in ref)
        sd = statistics.stdev(smoothed(c, t) for c in ref)
        out.append((abs(m - rm) / sd, (m - rm) / abs(rm), m, rm, sd))
    return out


@pytest.mark.parametrize("window", [1, 3, 8])
def test_compare_matches_the_hand_computation_at_every_step(window):
    rng = random.Random(window)
    ref, var = synthetic(4, 30, 0.0, rng), synthetic(3, 30, 0.01, rng)
    gap = bench.fidelity_compare(var, ref, window)
    hand = hand_gap(var, ref, window)
    assert gap.gap_std == pytest.approx([h[0] for h in hand], rel=1e-12)
    assert gap.rel_gap == pytest.approx([h[1] for h in hand], rel=1e-12)
    assert gap.mean == pytest.approx([h[2] for h in hand], rel=1e-12)
    assert gap.ref_std == pytest.approx([h[4] for h in hand], rel=1e-12)
    assert gap.final_gap_std == pytest.approx(hand[-1][0]) and gap.final_rel_gap == pytest.approx(hand[-1][1])
    assert gap.max_gap_std == pytest.approx(max(h[0] for h in hand))
    steps = [math.ceil(f * 30) for f in bench.CHECKPOINTS]
    assert [c["step"] for c in gap.checkpoints] == steps
    assert [c["gap_std"] for c in gap.checkpoints] == pytest.approx([hand[s - 1][0] for s in steps])
    assert [c["rel_gap"] for c in gap.checkpoints] == pytest.approx([hand[s - 1][1] for s in steps])


@pytest.mark.parametrize("k, verdict", [(1.5, "same"), (1.99, "same"), (2.01, "different"), (2.5, "different")])
def test_the_verdict_is_same_inside_two_reference_std_at_the_last_step(k, verdict):
    rng = random.Random(7)
    ref = synthetic(5, 20, 0.0, rng)
    window = 4
    sd = hand_gap(ref, ref, window)[-1][4]
    var = [[x + k * sd for x in c] for c in ref]  # the same curves, shifted by k final std
    gap = bench.fidelity_compare(var, ref, window)
    assert gap.final_gap_std == pytest.approx(k, rel=1e-9)
    assert gap.verdict == verdict


def test_smooth_is_a_trailing_mean_and_the_window_defaults_to_a_twentieth():
    curve = [float(x * x) for x in range(9)]
    assert bench.smooth(curve, 3) == pytest.approx([statistics.mean(curve[max(0, t - 2): t + 1]) for t in range(9)])
    assert bench.smooth(curve, 1) == curve
    assert [bench.default_window(n) for n in (500, 40, 19)] == [500 // 20, 40 // 20, 1]


def test_one_reference_seed_is_refused_naming_the_fix():
    with pytest.raises(ValueError, match="--seeds 2 or more"):
        bench.fidelity_compare([[1.0, 2.0]], [[1.0, 2.0]], 1)


def test_batch_order_is_one_permutation_an_epoch_the_same_for_a_seed_different_across_seeds():
    a0, b0, a1 = bench.batch_order(5, 23, 0), bench.batch_order(5, 23, 0), bench.batch_order(5, 23, 1)
    assert a0 == b0 and a0 != a1
    for order in (a0, a1):
        assert all(sorted(order[e: e + 5]) == list(range(5)) for e in range(0, 20, 5))


def hand_train(built, batches, dtype) -> list:
    """The oracle's loop: the built case's model trained by hand on ``batches``, under
    ampkit.autocast when ``dtype`` is given; the losses."""
    model = built.new_model()
    opt = built.new_optimizer(model)
    out = []
    for x, y in batches:
        if dtype is None:
            loss = built.loss_fn(model(x), y)
        else:
            with ampkit.autocast("cpu", dtype=dtype):
                loss = built.loss_fn(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        out.append(float(loss.detach().double()))
    return out


def hand_curve(seed: int, steps: int, dtype):
    """The oracle: seed_mlp's tiny model and batches built from ``seed``, trained by hand in the
    batch order of that seed."""
    built = bench.build_case("seed_mlp", "tiny", seed=seed, device="cpu")
    return hand_train(built, (built.batches[i] for i in bench.batch_order(built.num_batches, steps, seed)), dtype)


def test_every_variant_of_a_seed_trains_on_that_seeds_batches_in_its_order():
    variants = bench.load_variants()
    recs = bench.fidelity_records("seed_mlp", [variants["ampkit_bf16"]], variants["fp32"], "tiny", seeds=2,
                                  steps=6, device="cpu", window=2)
    by = {r["variant"]: r for r in recs}
    assert [r["variant"] for r in recs] == ["fp32", "ampkit_bf16"] and by["fp32"]["verdict"] == "reference"
    for s in range(2):
        assert by["fp32"]["losses"][s] == hand_curve(s, 6, None)  # bitwise: the same kernels run
        assert by["ampkit_bf16"]["losses"][s] == hand_curve(s, 6, torch.bfloat16)
    assert by["fp32"]["losses"][0] != by["fp32"]["losses"][1]  # another seed: other weights and data
    b0 = bench.build_case("seed_mlp", "tiny", seed=0, device="cpu").batches
    b1 = bench.build_case("seed_mlp", "tiny", seed=1, device="cpu").batches
    assert not torch.equal(b0[0][0], b1[0][0])


def test_a_variant_that_cannot_run_here_is_skipped_and_the_document_validates(tmp_path):
    variants = bench.load_variants()
    recs = bench.fidelity_records("seed_mlp", [variants["fp32_tf32"], variants["torch_amp"]], variants["fp32"],
                                  "tiny", seeds=2, steps=4, device="cpu", window=1)
    assert [(r["variant"], r["status"]) for r in recs] == [("fp32", "ok"), ("fp32_tf32", "skipped"),
                                                           ("torch_amp", "ok")]
    assert "cuda" in recs[1]["reason"] and recs[2]["verdict"] in ("same", "different")
    section = bench.fidelity_section(recs, reference="fp32", profile="tiny", device="cpu", seeds=2, steps=4,
                                     window=1)
    doc = bench.write_document(tmp_path / "r.json", bench.context("tiny", "cpu"), [], section)
    assert bench.read_document(tmp_path / "r.json") == doc
    bad = copy.deepcopy(doc)
    del bad["fidelity"]["records"][0]["verdict"]
    assert any("verdict" in e for e in bench.validate(bad))
    bad = copy.deepcopy(doc)
    bad["fidelity"]["seeds"] = 1
    assert any("minimum" in e for e in bench.validate(bad))
    assert bench.validate({"context": doc["context"], "records": []}) == []  # without the block: valid


def fake_section(case: str, steps: int = 8, seeds: int = 3):
    rng = random.Random(case)
    ref, var = synthetic(seeds, steps, 0.0, rng), synthetic(seeds, steps, 0.02, rng)
    recs = []
    for name, losses in (("fp32", ref), ("ampkit_amp", var)):
        gap = bench.fidelity_compare(losses, ref, 2)
        recs.append(dict(case=case, variant=name, language="python", dtype=None if name == "fp32" else "bfloat16",
                         reference="fp32", status="ok", reason=None, error=None, seeds=list(range(seeds)),
                         losses=losses, checkpoints=gap.checkpoints, final_loss=gap.mean[-1], final_spread=0.01,
                         final_rel_gap=gap.final_rel_gap, final_gap_std=gap.final_gap_std,
                         max_gap_std=gap.max_gap_std, verdict="reference" if name == "fp32" else gap.verdict))
    return bench.fidelity_section(recs, reference="fp32", profile="tiny", device="cpu", seeds=seeds, steps=steps,
                                  window=2), recs[1]


def test_merge_keeps_both_fidelity_blocks_and_refuses_different_settings():
    ctx = bench.context("tiny", "cpu")
    a, _ = fake_section("seed_mlp")
    b, _ = fake_section("convnet")
    merged = bench.merge([{"context": ctx, "records": [], "fidelity": a}, {"context": ctx, "records": [], "fidelity": b}])
    assert [r["case"] for r in merged["fidelity"]["records"]] == ["seed_mlp"] * 2 + ["convnet"] * 2
    c, _ = fake_section("convnet", steps=9)
    with pytest.raises(ValueError, match="different steps"):
        bench.merge([{"context": ctx, "records": [], "fidelity": a}, {"context": ctx, "records": [], "fidelity": c}])
    assert "fidelity" not in bench.merge([{"context": ctx, "records": []}])


def test_the_report_has_a_table_per_case_with_the_gaps_and_verdict(tmp_path):
    sec, var = fake_section("seed_mlp")
    doc = bench.check({"context": bench.context("tiny", "cpu"), "records": [], "fidelity": sec})
    text = report.fidelity(doc)
    assert "### seed_mlp" in text
    row = next(line for line in text.splitlines() if line.startswith("| ampkit_amp |"))
    cells = [c.strip() for c in row.strip("|").split("|")]
    assert cells[5] == " / ".join("%+.3f%%" % (100 * c["rel_gap"]) for c in var["checkpoints"])
    assert cells[6] == "%.2f (%.2f)" % (var["final_gap_std"], var["max_gap_std"]) and cells[7] == var["verdict"]
    md = report.markdown(doc)
    assert "## Fidelity" in md and "## Goals" not in md  # no timing records, no goals on them
    pytest.importorskip("matplotlib")
    assert report.fidelity_chart(doc, tmp_path / "f.png") and (tmp_path / "f.png").stat().st_size > 0


def test_the_cli_writes_the_document_and_refuses_one_seed(tmp_path, capsys):
    assert fidelity_py.main(["--cases", "seed_mlp", "--variants", "fp32,ampkit_amp", "--seeds", "1",
                             "--out", str(tmp_path)]) == 2
    assert "--seeds must be >= 2" in capsys.readouterr().err
    assert fidelity_py.main(["--cases", "seed_mlp", "--variants", "ampkit_amp", "--reference", "ampkit_bf16",
                             "--seeds", "2", "--steps", "5", "--device", "cpu", "--out", str(tmp_path)]) == 0
    doc = bench.read_document(tmp_path / "results.json")
    f = doc["fidelity"]
    assert (f["reference"], f["steps"], f["seeds"], f["window"]) == ("ampkit_bf16", 5, 2, 1)
    assert [r["variant"] for r in f["records"]] == ["ampkit_bf16", "ampkit_amp"]
    assert all(len(c) == 5 for r in f["records"] for c in r["losses"])
    assert (tmp_path / "report.md").exists()
    assert "[fidelity 4/4]" in capsys.readouterr().err


# --- data "stream": a fresh batch a step from a token map with a known entropy floor ----------

def test_the_stream_targets_are_the_inputs_successors_drawn_with_q_and_its_floor_is_their_entropy():
    s = bench.TokenStream(vocab=300, batch_size=64, seq_len=128, seed=3, device="cpu", successors=5, inputs=40)
    assert s.successors.shape == (40, 5)
    assert all(len(set(row.tolist())) == 5 for row in s.successors)  # distinct successors per input
    ids, targets = s.batch()
    assert ids.dtype == targets.dtype == torch.int64 and int(ids.max()) < 40 and int(targets.max()) < 300
    # which successor each target is: its frequencies follow q (binomial 4-sigma bounds)
    j = (targets.unsqueeze(-1) == s.successors[ids]).float().argmax(-1)
    assert bool((targets == s.successors[ids, j]).all())
    n = ids.numel()
    for k in range(5):
        p = float(s.q[k])
        assert abs(float((j == k).float().mean()) - p) <= 4 * math.sqrt(p * (1 - p) / n)
    # the floor: the best predictor (log q on each input's successors) averages the entropy
    per_token = -s.q.log()[j]
    mean, sd = float(per_token.mean()), float(per_token.std())
    assert abs(mean - s.floor) <= 4 * sd / math.sqrt(n)
    assert s.floor == pytest.approx(-sum(q * math.log(q) for q in s.q.tolist()), rel=1e-12)


def test_the_stream_is_the_same_for_a_seed_and_one_language_for_every_seed():
    a, b, c = (bench.TokenStream(64, 4, 8, seed=s, device="cpu") for s in (0, 0, 1))
    assert torch.equal(a.successors, c.successors)  # one language
    for _ in range(3):
        (ia, ta), (ib, tb), (ic, _) = a.batch(), b.batch(), c.batch()
        assert torch.equal(ia, ib) and torch.equal(ta, tb)  # paired: seed s of every variant
    assert not torch.equal(ia, ic)  # another seed, other batches
    first = a.batch()
    assert not torch.equal(first[0], ia)  # fresh every step


def hand_stream_curve(case: str, seed: int, steps: int, dtype):
    """The oracle: the case's tiny model from ``seed`` trained by hand on the seed's stream."""
    built = bench.build_case(case, "tiny", seed=seed, device="cpu")
    z = built.sizes
    stream = bench.TokenStream(z["vocab"], z["batch_size"], z["seq_len"], seed, "cpu")
    return hand_train(built, (stream.batch() for _ in range(steps)), dtype)


def test_stream_curves_train_on_the_seeds_stream_and_the_section_says_so(tmp_path):
    variants = bench.load_variants()
    recs = bench.fidelity_records("transformer", [variants["ampkit_amp"]], variants["ampkit_bf16"], "tiny",
                                  seeds=2, steps=5, device="cpu", window=1, data="stream")
    by = {r["variant"]: r for r in recs}
    for s in range(2):
        assert by["ampkit_bf16"]["losses"][s] == hand_stream_curve("transformer", s, 5, torch.bfloat16)
    section = bench.fidelity_section(recs, reference="ampkit_bf16", profile="tiny", device="cpu", seeds=2,
                                     steps=5, window=1, data="stream")
    assert section["data"] == "stream" and section["floor"] == bench.TokenStream(64, 1, 1, 0, "cpu").floor
    doc = bench.write_document(tmp_path / "r.json", bench.context("tiny", "cpu"), [], section)
    assert bench.validate(doc) == []
    assert "%.4f nats" % section["floor"] in report.fidelity(doc)
    case_doc = {"context": doc["context"], "records": [], "fidelity": dict(section, data="case", floor=None)}
    with pytest.raises(ValueError, match="different data"):
        bench.merge([doc, case_doc])
    old = dict(section, records=[])
    del old["data"], old["floor"]  # a document from before the field: its data were the case's
    assert bench.merge([dict(case_doc, fidelity=dict(case_doc["fidelity"], records=[])),
                        dict(case_doc, fidelity=old)])["fidelity"]["data"] == "case"


def test_stream_data_is_refused_for_a_case_without_tokens_and_an_unknown_source(tmp_path, capsys):
    variants = bench.load_variants()
    with pytest.raises(ValueError, match=r"data 'stream' needs a case whose data are tokens \(.*transformer.*\), "
                                         r"not seed_mlp"):
        bench.fidelity_records("seed_mlp", [], variants["fp32"], "tiny", seeds=2, steps=2, device="cpu",
                               window=1, data="stream")
    with pytest.raises(ValueError, match="unknown data source 'shuffled'; valid: case, stream"):
        bench.fidelity_section([], reference="fp32", profile="tiny", device="cpu", seeds=2, steps=2, window=1,
                               data="shuffled")
    assert fidelity_py.main(["--cases", "seed_mlp,transformer", "--data", "stream", "--out", str(tmp_path)]) == 2
    assert "not seed_mlp" in capsys.readouterr().err
    assert not (tmp_path / "results.json").exists()


# --- --from: curves of separate runs compared anew -------------------------------------------

def one_variant_run(variant: str, steps: int = 4) -> dict:
    """A fidelity block of one variant trained alone (its own reference), as a process of the
    GPU script's pool makes it."""
    v = bench.load_variants()[variant]
    recs = bench.fidelity_records("seed_mlp", [v], v, "tiny", seeds=2, steps=steps, device="cpu", window=2)
    return bench.fidelity_section(recs, reference=variant, profile="tiny", device="cpu", seeds=2, steps=steps,
                                  window=2)


@pytest.mark.parametrize("reference", ["fp32", "ampkit_bf16"])
def test_recompare_of_runs_made_apart_equals_one_run_of_both(reference):
    variants = bench.load_variants()
    other = "ampkit_bf16" if reference == "fp32" else "fp32"
    together = bench.fidelity_records("seed_mlp", [variants[other]], variants[reference], "tiny", seeds=2, steps=4,
                                      device="cpu", window=2)
    apart = bench.fidelity_recompare([one_variant_run(other), one_variant_run(reference)], reference)
    assert apart["reference"] == reference and apart["steps"] == 4
    assert apart["records"] == together  # every field: losses bitwise (the same kernels), gaps, verdicts


def test_recompare_refuses_other_settings_a_record_twice_and_a_missing_reference():
    a, b = one_variant_run("fp32"), one_variant_run("ampkit_amp")
    with pytest.raises(ValueError, match="different steps"):
        bench.fidelity_recompare([a, one_variant_run("ampkit_bf16", steps=5)], "fp32")
    with pytest.raises(ValueError, match="seed_mlp / fp32 / python is in two"):
        bench.fidelity_recompare([a, b, a], "fp32")
    with pytest.raises(ValueError, match=r"no curves of the reference 'torch_amp'; variants with curves: fp32, "
                                         r"ampkit_amp"):
        bench.fidelity_recompare([a, b], "torch_amp")


def test_the_cli_from_compares_saved_curves_and_names_a_file_without_curves(tmp_path, capsys):
    for name in ("fp32", "ampkit_amp"):
        sec = one_variant_run(name)
        bench.write_document(tmp_path / name / "results.json", bench.context("tiny", "cpu"), [], sec)
    files = [str(tmp_path / n / "results.json") for n in ("ampkit_amp", "fp32")]
    assert fidelity_py.main(["--from", *files, "--reference", "fp32", "--out", str(tmp_path / "both")]) == 0
    f = bench.read_document(tmp_path / "both" / "results.json")["fidelity"]
    assert [(r["variant"], r["reference"], r["verdict"] != "reference") for r in f["records"]] == [
        ("fp32", "fp32", False), ("ampkit_amp", "fp32", True)]
    assert "| ampkit_amp |" in capsys.readouterr().out and (tmp_path / "both" / "report.md").exists()
    bench.write_document(tmp_path / "timing.json", bench.context("tiny", "cpu"), [])
    assert fidelity_py.main(["--from", str(tmp_path / "timing.json"), "--out", str(tmp_path / "x")]) == 2
    assert "no fidelity block in %s" % (tmp_path / "timing.json") in capsys.readouterr().err

