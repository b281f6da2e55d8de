"""The benchmark across processes (benchmarks/run.py --gpus N), on the CPU over gloo."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from ampkit import bench

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "benchmarks"))

import report  # noqa: E402
import run as run_py  # noqa: E402  (benchmarks/run.py)

dist = pytest.importorskip("torch.distributed")
if not dist.is_available() or not dist.is_gloo_available():
    pytest.skip("torch.distributed with gloo is not available", allow_module_level=True)

# The bound on one end-to-end launch (subprocess timeout): a hang fails the test, a slow
# machine does not (timings gate no test; about 25-45 s on the 2-core VM)
END_TO_END_TIMEOUT_S = 180
FSDP2_ON_CPU = pytest.mark.skipif(
    tuple(int(v) for v in __import__("torch").__version__.split("+")[0].split(".")[:2]) < (2, 5),
    reason="FSDP2 (fully_shard) runs on CUDA only in torch < 2.5 (the runner says so and stops)")


def _run_py(*args, timeout=END_TO_END_TIMEOUT_S):
    return subprocess.run([sys.executable, str(REPO / "benchmarks" / "run.py"), *args], capture_output=True,
                          text=True, cwd=REPO, timeout=timeout)


@FSDP2_ON_CPU
def test_two_gloo_processes_write_schema_records_checks_and_the_report_section(tmp_path):
    # ampkit_amp left out to keep it short: its loop is torch_amp's with ampkit's region and scaler
    p = _run_py("--device", "cpu", "--gpus", "2", "--profile", "tiny", "--cases", "text_classifier",
                "--variants", "torch_amp,ampkit_step",
                "--ddp-options", "default", "--ddp-options", "gradient_as_bucket_view=true", "--check",
                "--out", str(tmp_path))
    assert p.returncode == 0, p.stderr[-3000:]
    doc = bench.read_document(tmp_path / "results.json")  # validated against the schema
    recs = doc["records"]
    got = {(r["engine"], json.dumps(r["engine_options"]), r["variant"], r["world_size"]): r for r in recs}
    engines = [("ddp", "{}"), ("ddp", '{"gradient_as_bucket_view": true}'), ("fsdp2", "{}")]
    assert set(got) == {e + (v, n) for e in engines for v in ("torch_amp", "ampkit_step") for n in (1, 2)}
    for (engine, opts, variant, world), r in got.items():
        assert r["status"] == "ok", r["error"]
        assert r["samples_per_s"] == pytest.approx(world * r["sizes"]["batch_size"] * 1000 / r["median"])
        one = got[(engine, opts, variant, 1)]
        if world == 1:
            assert r["scaling_efficiency"] is None
        else:  # the 1-process time over this one: N-process throughput / (N x 1-process throughput)
            assert r["scaling_efficiency"]["value"] == pytest.approx(one["median"] / r["median"])
        rival = got[(engine, opts, "torch_amp", world)]
        assert (r["time_vs_torch_amp"] is None) == (variant == "torch_amp")
        if variant != "torch_amp":
            assert r["time_vs_torch_amp"]["value"] == pytest.approx(r["median"] / rival["median"])
    # FSDP2 with the one-output head leaves rank 1 empty shards; the fused step ran there.
    assert got[("fsdp2", "{}", "ampkit_step", 2)]["final_loss"] > 0
    checks = doc["context"]["distributed_checks"]
    # one check per engine (its first configuration), with 2 processes only
    assert [(c["engine"], c["engine_options"], c["world_size"]) for c in checks] == [("ddp", {}, 2), ("fsdp2", {}, 2)]
    for c in checks:
        assert "error" not in c and c["all_ranks_equal"] and c["eager_repeatable"] and not c["captured"]
    md = (tmp_path / "report.md").read_text()
    assert "## Across GPUs" in md and "scaling efficiency" in md
    assert "| text_classifier | ddp (gradient_as_bucket_view) | ampkit_step (eager) | 2 |" in md
    assert "### make_train_step captured against eager" in md
    assert "| text_classifier | fsdp2 | 2 | no (autocast device_type is 'cpu'" in md
    assert "| case | variant | lang |" not in md  # no single-process table without such records
    # progress while it runs: each finished run, with the time left
    assert "[ranks x2  7/8, ~" in p.stderr and "[ranks x1 6/6]" in p.stderr.replace("  ", " ")


@pytest.mark.parametrize("args, message", [
    (["--gpus", "0"], "--gpus must be >= 1, got 0"),
    (["--gpus", str((os.cpu_count() or 1) + 1), "--device", "cpu"], "gloo processes, but this machine has"),
    (["--gpus", "1", "--engines", "ddp,horovod"], "unknown engine 'horovod'; valid engines: ddp, fsdp2"),
    (["--gpus", "1", "--ddp-options", "bucket_cap=5"],
     "DDP option 'bucket_cap=5' in 'bucket_cap=5': expected key=value with a key among gradient_as_bucket_view"),
    (["--gpus", "1", "--ddp-options", "bucket_cap_mb=-1"], "got '-1', expected a positive number"),
    (["--gpus", "1", "--langs", "python,r"], "--gpus runs the Python runner only"),
    (["--gpus", "1", "--variants", "fp8"], "unknown variant 'fp8'"),
    (["--gpus", "1", "--run-timeout", "0"], "--run-timeout must be > 0"),
])
def test_bad_input_is_refused_before_anything_runs(tmp_path, capsys, args, message):
    assert run_py.main(["--out", str(tmp_path), "--device", "cpu", *args]) == 2
    assert message in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []


@FSDP2_ON_CPU
def test_a_stalled_run_fails_with_its_stack_and_the_launch_goes_on(tmp_path):
    # A limit no run can meet: the watchdog stops each run; each is recorded as failed
    # and the next launch starts after it (two launches, one process each).
    p = _run_py("--device", "cpu", "--gpus", "1", "--profile", "tiny", "--cases", "seed_mlp", "--engines", "ddp",
                "--variants", "torch_amp,ampkit_amp", "--run-timeout", "0.01", "--out", str(tmp_path))
    assert p.returncode == 0, p.stderr[-3000:]
    recs = bench.read_document(tmp_path / "results.json")["records"]
    assert [(r["variant"], r["status"]) for r in recs] == [("torch_amp", "failed"), ("ampkit_amp", "failed")]
    for r in recs:
        assert "did not finish" in r["error"] and "--run-timeout" in r["error"] and r["samples"] == []
    assert "Timeout (0:00:00" in (tmp_path / "launch-x1.log").read_text()  # the watchdog's stack dump
    assert p.stderr.count("== launch:") == 2
    assert "2 run(s) failed: seed_mlp/torch_amp/python/ddp/x1" in (tmp_path / "report.md").read_text()


def test_runs_the_budget_cannot_start_are_skipped_with_the_reason(tmp_path):
    p = _run_py("--device", "cpu", "--gpus", "1", "--profile", "tiny", "--cases", "seed_mlp", "--engines", "ddp",
                "--variants", "torch_amp", "--budget", "0.5", "--out", str(tmp_path))
    assert p.returncode == 0, p.stderr[-3000:]
    (rec,) = bench.read_document(tmp_path / "results.json")["records"]
    assert rec["status"] == "skipped" and "the time budget (--budget) ran out" in rec["reason"]
    assert rec["world_size"] == 1 and rec["engine"] == "ddp"


def _record(variant, world, ms, engine=bench.Engine("ddp")):
    run = bench.resolve_run(bench.load_cases()["transformer"], bench.load_variants()[variant], "python", "full",
                            "cpu", placement=bench.Placement(engine, "cpu", world_size=world))
    return bench.make_record(run, samples_ms=[ms], final_loss=1.0, torch_threads=1)


def test_derive_compares_only_within_a_placement_and_the_goals_are_inclusive():
    single = bench.make_record(bench.resolve_run(bench.load_cases()["transformer"], bench.load_variants()["torch_amp"],
                                                 "python", "full", "cpu"), samples_ms=[1.0], final_loss=1.0,
                               torch_threads=1)
    recs = bench.derive([single, _record("torch_amp", 1, 10.0), _record("torch_amp", 2, 10.5),
                         _record("ampkit_step", 1, 8.0), _record("ampkit_step", 2, 8.75),
                         _record("ampkit_step", 2, 8.0, bench.Engine.parse("ddp", "static_graph=true"))])
    assert "world_size" not in single and single["time_vs_torch_amp"] is None
    step2 = recs[4]
    assert step2["time_vs_torch_amp"]["value"] == pytest.approx(8.75 / 10.5)  # not the single process's
    assert step2["scaling_efficiency"]["value"] == pytest.approx(8.0 / 8.75)
    assert recs[5]["time_vs_torch_amp"] is None and recs[5]["scaling_efficiency"] is None  # no rival, no 1-process run
    doc = bench.check({"context": bench.context("full", "cpu"), "records": recs})
    lines = report.goals(doc).splitlines()
    assert "- met ampkit_step >= 1.2x torch_amp's throughput (transformer, ddp, 2 processes): 1.20x" in lines[0]
    assert lines[1] == ("- NOT met ampkit_step's scaling efficiency >= torch_amp's (transformer, ddp, 2 processes): "
                        "0.914 vs 0.952")
    assert "| transformer | ddp (static_graph) | ampkit_step | 2 | 8.00 [8.00, 8.00] | 8000.0 | - | - |" \
        in report.across(doc)


def test_engine_options_are_parsed_into_values_with_errors_that_name_them():
    assert bench.parse_engines("ddp,fsdp2", ["default", "static_graph=1,bucket_cap_mb=100"]) == [
        bench.Engine("ddp"), bench.Engine("ddp", (("bucket_cap_mb", 100.0), ("static_graph", True))),
        bench.Engine("fsdp2")]
    with pytest.raises(ValueError, match="engine options are for ddp only"):
        bench.Engine.parse("fsdp2", "static_graph=true")
    with pytest.raises(ValueError, match="'static_graph' in 'static_graph=maybe': got 'maybe', expected true or false"):
        bench.Engine.parse("ddp", "static_graph=maybe")
