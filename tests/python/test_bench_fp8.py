"""ampkit's fp8 tier as benchmark variants (ampkit_fp8, ampkit_fp8_auto) and bf16 + compile
(torch_compile_bf16): what they train, where they run, what the fidelity harness and the
report's goals make of them. The semantics run on the CPU through ampkit's emulation; the
timings are CUDA >= 8.9 only, so here the runner records them as skipped, with the reason."""

from __future__ import annotations

import dataclasses
import re
import sys
from pathlib import Path

import pytest
import torch

import ampkit
from ampkit import bench

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "benchmarks"))
import report  # noqa: E402

VARIANTS = bench.load_variants()
NEW = ("torch_compile_bf16", "ampkit_fp8", "ampkit_fp8_auto")
BF16 = torch.bfloat16


def test_the_variants_are_data_as_the_brief_of_each_says():
    base, fp8, auto = (VARIANTS[n] for n in NEW)
    for v in (base, fp8, auto):
        assert (v.dtype, v.scaler, v.compile, v.fused_optimizer, v.runner, v.devices) == \
            ("bfloat16", "none", "default", True, "loop", ("cuda",))
        assert v.languages == ("python", "r")
    assert (base.autocast, base.fp8, base.float8) == ("torch", "none", "none")
    assert (fp8.autocast, fp8.fp8) == ("ampkit", "policy") and (auto.autocast, auto.fp8) == ("ampkit", "auto")
    # the torchao rivals have the same baseline: bf16 autocast, compiled, no scaler
    for name in ("torchao_float8", "torchao_float8_rowwise"):
        ao = VARIANTS[name]
        assert (ao.autocast, ao.dtype, ao.scaler, ao.compile) == (base.autocast, base.dtype, base.scaler, base.compile)


def test_an_fp8_key_outside_the_ampkit_loop_is_refused_naming_the_fix(tmp_path):
    path = tmp_path / "variants.yaml"
    path.write_text("schema_version: 1\nvariants:\n  x:\n    description: d\n    autocast: torch\n"
                    "    dtype: bfloat16\n    fp8: policy\n")
    with pytest.raises(bench.BenchSpecError, match=r"variants\.x\.fp8.*autocast: ampkit"):
        bench.load_variants(path)
    path.write_text("schema_version: 1\nvariants:\n  x:\n    description: d\n    autocast: ampkit\n"
                    "    dtype: bfloat16\n    fp8: rowwise\n")
    with pytest.raises(bench.BenchSpecError, match=r"got 'rowwise'; valid: none, policy, auto"):
        bench.load_variants(path)


def test_on_the_cpu_the_runner_records_them_skipped_with_the_reason():
    built = bench.build_case("transformer", "tiny", seed=0, device="cpu")
    recs = bench.run_interleaved(built, [VARIANTS[n] for n in NEW])
    assert [(r["variant"], r["status"]) for r in recs] == [(n, "skipped") for n in NEW]
    assert all(r["reason"] == "%s runs only on cuda; this run is on cpu" % r["variant"] for r in recs)
    assert [r.get("fp8") for r in recs] == [None, "policy", "auto"]  # a field, never parsed from the name
    assert bench.validate({"context": bench.context("tiny", "cpu"), "records": bench.derive(recs)}) == []
    assert "capability >= 8.9" in bench.fp8_reason("cpu")


@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability() >= (8, 9),
                    reason="needs a CUDA GPU without fp8 (capability < 8.9)")
def test_on_a_card_without_fp8_they_are_skipped_saying_so():
    assert "capability >= 8.9" in VARIANTS["ampkit_fp8"].skip_reason("cuda")
    assert VARIANTS["torch_compile_bf16"].skip_reason("cuda") is None


def eager(name):
    """The variant uncompiled: its step, and what it installs, run eagerly on the CPU (the
    compiled region runs fp8 as the eager one: tests/python/test_fp8_compile.py)."""
    return dataclasses.replace(VARIANTS[name], compile="none")


def runner_losses(built, variant):
    run = bench.VariantRun(built, variant, "python", None, 0)  # built as the fidelity harness builds it
    run.build()
    assert run.step is not None, run.skip
    losses = [run.step(x, y).detach().clone() for x, y in built.batches * 2]
    params = [p.detach().clone() for p in run.model.parameters()]
    note = run.model_note
    run.close()
    return losses, params, note


def hand_losses(built, policy, region_policy):
    """The loop written by hand: the policy's scopes on the model, the region naming its tables."""
    model = built.new_model()
    opt = built.new_optimizer(model, fused=True)
    handle = policy.apply(model) if policy is not None else None
    losses = []
    for x, y in built.batches * 2:
        with ampkit.autocast("cpu", dtype=BF16, policy=region_policy):
            loss = built.loss_fn(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.detach().clone())
    if handle is not None:
        handle.remove()
    return losses, [p.detach().clone() for p in model.parameters()]


def same(a, b):
    return all(torch.equal(x, y) for x, y in zip(a, b))


@pytest.mark.parametrize("case", ["transformer", "seed_mlp"])
def test_ampkit_fp8_trains_as_the_shipped_fp8_policy_with_its_head_kept_in_bf16(case):
    built = bench.build_case(case, "tiny", seed=0, device="cpu")
    losses, params, note = runner_losses(built, eager("ampkit_fp8"))
    head = bench.float8_layers(built.new_model())[1]["head"]
    policy = ampkit.load_policy("fp8").with_module(head, lower_precision_fp=["linear"])
    want_l, want_p = hand_losses(built, policy, "fp8")
    assert same(losses, want_l) and same(params, want_p)
    assert "kept in bfloat16 by module scopes (%s)" % head in note
    # the controls: fp8 is not bf16, and the head's scope changes what trains
    bf16_l, _ = hand_losses(built, None, "torch_default")
    head_fp8_l, _ = hand_losses(built, ampkit.load_policy("fp8"), "fp8")
    assert not same(losses, bf16_l) and not same(losses, head_fp8_l)


@pytest.mark.parametrize("case", ["transformer", "text_classifier"])
def test_ampkit_fp8_auto_calibrates_in_the_build_and_on_the_cpu_keeps_every_module_in_bf16(case):
    """The emulation is never faster than bf16, so calibrate_fp8 keeps every nn.Linear in the
    region dtype: the run trains as ampkit's bf16 loop does, bit for bit (text_classifier: its
    dropout masks too, the calibration's own draws put back)."""
    built = bench.build_case(case, "tiny", seed=0, device="cpu")
    losses, params, note = runner_losses(built, eager("ampkit_fp8_auto"))
    assert note.startswith("ampkit fp8 auto: calibrated in ") and "0 of " in note and "in fp8 (none)" in note
    # and what decided it: each measured module (an unscoped candidate the forward called) with
    # its time in bfloat16 over fp8's, in model order
    measured = note.split("; measured bfloat16 / fp8 time: ")[1].split(", ")
    names = [m.rsplit(" ", 1)[0] for m in measured]
    chosen = bench.float8_layers(built.new_model())[0]
    assert names and set(names) <= set(chosen) and names == sorted(names, key=chosen.index)
    assert all(re.fullmatch(r"\d+\.\d\dx", m.rsplit(" ", 1)[1]) for m in measured)
    want_l, want_p = hand_losses(built, None, "torch_default")
    assert same(losses, want_l) and same(params, want_p)


def test_a_model_without_a_linear_fp8_could_take_is_skipped_with_the_reason():
    built = bench.build_case("convnet", "tiny", seed=0, device="cpu")
    run = bench.VariantRun(built, eager("ampkit_fp8"), "python", None, 0)
    run.build()
    assert "no nn.Linear of convnet can go to fp8" in run.skip
    run.close()


def test_fidelity_on_the_cpu_runs_ampkit_fp8_through_the_emulation_and_says_so(tmp_path):
    """ampkit_fp8 against ampkit_bf16 on the tiny profile: a table, the emulation named; auto
    is skipped (its choice on the CPU is not the GPU's), torch_compile_bf16 (timing only) too."""
    why = VARIANTS["ampkit_fp8"].skip_reason("cpu", numerics=True)
    if why is not None:  # e.g. torch.compile under ATEN_CPU_CAPABILITY=avx2 (bench.compile_reason)
        pytest.skip(why)
    ref = VARIANTS["ampkit_bf16"]
    recs = bench.fidelity_records("transformer", [VARIANTS[n] for n in NEW], ref, "tiny", seeds=2, steps=3,
                                  device="cpu", window=1)
    by = {r["variant"]: r for r in recs}
    assert by["ampkit_fp8"]["status"] == "ok" and by["ampkit_fp8"]["verdict"] in ("same", "different")
    # the emulation named, then what the build did to the model (the same note as the runner's record)
    setup = bench.setup_fp8("policy", bench.build_case("transformer", "tiny", seed=0, device="cpu").new_model(),
                            None, "cpu")
    assert by["ampkit_fp8"]["reason"] == bench.emulation_note("cpu") + "; " + setup.note
    assert by["ampkit_bf16"]["reason"] is None  # its build changes nothing in the model
    assert by["ampkit_fp8_auto"]["status"] == "skipped" and "not the GPU's" in by["ampkit_fp8_auto"]["reason"]
    assert by["torch_compile_bf16"]["status"] == "skipped" and "runs only on cuda" in by["torch_compile_bf16"]["reason"]
    # the curve is the runner's: fp8 differs from the bf16 reference
    assert by["ampkit_fp8"]["losses"] != by["ampkit_bf16"]["losses"]
    section = bench.fidelity_section(recs, reference=ref.name, profile="tiny", device="cpu", seeds=2, steps=3,
                                     window=1)
    doc = bench.write_document(tmp_path / "r.json", bench.context("tiny", "cpu"), [], section)
    text = report.fidelity(doc)
    assert any(line.startswith("| ampkit_fp8 | python | bfloat16 |") for line in text.splitlines())
    assert "- ampkit_fp8: " + bench.emulation_note("cpu") + "; " + setup.note in text


@pytest.mark.parametrize("reason", [None, "ampkit fp8 auto: calibrated in 0.31 s (in the build), 1 of 2 nn.Linear "
                                          "in fp8 (0)"])
def test_the_runners_progress_line_says_what_the_run_did_below_its_time(reason):
    """A run's note (fp8 auto's choice, the graphs compiled) is printed under its line, so a
    log says it where the results file did not come back."""
    import io
    rec = {"case": "seed_mlp", "variant": "ampkit_fp8_auto", "status": "ok", "median": 1.79, "min": 1.52,
           "max": 1.79, "samples": [1.79] * 3, "final_loss": 1.009, "wall_s": 2.0, "reason": reason}
    out = io.StringIO()
    bench.progress("python", 1, 1, rec, file=out)
    lines = out.getvalue().splitlines()
    assert lines[0] == "[python  1/1] seed_mlp / ampkit_fp8_auto: 1.79 ms/step (median of 3, 1.52-1.79), final loss 1.009"
    assert lines[1:] == ([] if reason is None else ["        note: " + reason])


def _doc(times, case="transformer", status=None):
    status = status or {}
    recs = [{"case": case, "variant": v, "language": "python", "status": status.get(v, "ok"), "dtype": "bfloat16",
             "median": ms, "min": ms, "max": ms, "final_loss": 1.0, "peak_memory_bytes": None}
            for v, ms in times.items()]
    return {"context": {"languages": ["python"]}, "records": bench.derive(recs)}


def _goal(doc, start):
    return next(line for line in report.goals(doc).splitlines() if start in line)


def test_the_fp8_goals_compare_auto_with_bf16_compile_and_both_with_torchaos_fastest():
    times = {"torch_compile_bf16": 20.0, "ampkit_fp8": 16.0, "ampkit_fp8_auto": 20.0,
             "torchao_float8": 18.0, "torchao_float8_rowwise": 19.0}
    doc = _doc(times)
    line = _goal(doc, "ampkit_fp8_auto never slower than torch_compile_bf16 on transformer")
    assert line.startswith("- met ") and "time ratio 1.00" in line  # inclusive: equal is not slower
    line = _goal(doc, "ampkit_fp8 at least as fast as the fastest torchao float8 recipe (torchao_float8)")
    assert line.startswith("- met ") and "%.2fx" % (18.0 / 16.0) in line
    line = _goal(doc, "ampkit_fp8_auto at least as fast as the fastest torchao")
    assert line.startswith("- NOT met ") and "%.2fx" % (18.0 / 20.0) in line
    doc = _doc(dict(times, ampkit_fp8_auto=20.01))
    line = _goal(doc, "ampkit_fp8_auto never slower")
    assert line.startswith("- NOT met ") and "%.4f" % (20.01 / 20.0) in line
    # tensorwise failed: the fastest that ran is rowwise
    doc = _doc(times, status={"torchao_float8": "failed"})
    assert "(torchao_float8_rowwise)" in _goal(doc, "ampkit_fp8 at least as fast")


def test_the_fp8_goals_say_n_a_where_the_variants_did_not_run():
    built = bench.build_case("seed_mlp", "tiny", seed=0, device="cpu")
    doc = {"context": {"languages": ["python"]},
           "records": bench.derive(bench.run_interleaved(built, [VARIANTS[n] for n in NEW]))}
    lines = [g for g in report.goals(doc).splitlines() if "fp8" in g]
    assert len(lines) == 3 and all(g.startswith("- n/a ") for g in lines)
    assert "(none ran)" in _goal(doc, "ampkit_fp8 at least as fast")


def test_an_fp8_variants_record_says_how_many_of_its_linears_went_to_fp8(tmp_path):
    """Fp8Setup.modules, counted from the model (every nn.Linear, those fp8 GEMMs can take),
    becomes the record's fp8_modules, which the results schema accepts; other variants have none."""
    built = bench.build_case("transformer", "tiny", seed=0, device="cpu")
    model = built.new_model()
    linears = sum(isinstance(m, torch.nn.Linear) for m in model.modules())
    chosen = bench.float8_layers(model)[0]
    assert 0 < len(chosen) < linears  # (the head is kept: a count the policy could get wrong)
    policy = bench.setup_fp8("policy", model, None, "cpu")
    policy.scopes.remove()
    auto = bench.setup_fp8("auto", built.new_model(), (built.batches[0][0],), "cpu")  # the CPU: all kept in bf16
    auto.scopes.remove()
    assert policy.modules == (len(chosen), linears) and auto.modules == (0, linears)
    recs = [bench.make_record(bench.resolve_run(built, VARIANTS[name], "python"), samples_ms=[1.0],
                              final_loss=1.0, fp8_modules=modules)
            for name, modules in (("ampkit_fp8", policy.modules), ("ampkit_fp8_auto", auto.modules),
                                  ("ampkit_bf16", None))]
    doc = bench.write_document(tmp_path / "r.json", bench.context("tiny", "cpu"), recs)  # (checked: raises if invalid)
    by = {r["variant"]: r for r in doc["records"]}
    assert by["ampkit_fp8"]["fp8_modules"] == {"fp8": len(chosen), "linear": linears}
    assert by["ampkit_fp8_auto"]["fp8_modules"] == {"fp8": 0, "linear": linears}
    assert "fp8_modules" not in by["ampkit_bf16"]


def test_the_never_slower_goal_says_what_auto_put_in_fp8():
    times = {"torch_compile_bf16": 20.0, "ampkit_fp8": 16.0, "ampkit_fp8_auto": 20.2}
    for chose, says in (({"fp8": 0, "linear": 49}, "; auto put 0 of 49 nn.Linear in fp8 (every one in bf16, "
                                                      "as torch_compile_bf16)"),
                        ({"fp8": 3, "linear": 49}, "; auto put 3 of 49 nn.Linear in fp8"),
                        (None, None)):
        doc = _doc(times)
        for r in doc["records"]:
            if r["variant"] == "ampkit_fp8_auto" and chose is not None:
                r["fp8_modules"] = chose
        line = _goal(doc, "ampkit_fp8_auto never slower")
        assert line.startswith("- NOT met ")  # the verdict is the time ratio's, whatever auto chose
        if says is None:
            assert "auto put" not in line
        else:
            assert line.endswith(says)
