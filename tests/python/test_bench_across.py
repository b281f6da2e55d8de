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
    # Interleaved by default: per engine configuration the two variants in turn, 3 rounds
    # (the tiny profile's 1 repeat, raised to MIN_ROUNDS), round r starting at variant r mod 2.
    for (engine, opts, variant, world), r in got.items():
        assert len(r["samples"]) == r["repeats"] == bench.MIN_ROUNDS
        assert r["interleaved"] == {"group": ["torch_amp", "ampkit_step"], "rounds": 3,
                                    "positions": [[0, 1, 0], [1, 0, 1]][variant == "ampkit_step"]}
        assert (r["time_vs_torch_amp"] or {}).get("interleaved") is (None if variant == "torch_amp" else True)
        assert "interleaved" not in (r["scaling_efficiency"] or {})  # two launches: never together
    starts = [json.loads(line) for line in (tmp_path / "events-x2.jsonl").read_text().splitlines()
              if '"start"' in line]
    assert [ev["items"] for ev in starts] == [[0], [1], [2, 3], [4, 5], [6, 7]]  # 2 checks, then 3 groups
    assert starts[2]["item"] == "text_classifier / ddp / torch_amp, ampkit_step interleaved"
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
    assert md.count("| interleaved, 3 rounds |") == 12
    assert "### make_train_step captured against eager" in md
    assert "| text_classifier | fsdp2 | 2 | no (autocast device_type is 'cpu'" in md
    assert "| case | variant | lang |" not in md  # no single-process table without such records
    # progress while it runs: each group as it starts, each finished run, with the time left
    assert "[ranks x2  7/8, ~" in p.stderr and "[ranks x1 6/6]" in p.stderr.replace("  ", " ")
    assert "[ranks x2] text_classifier / fsdp2: torch_amp, ampkit_step, 3 rounds in turn" in p.stderr


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
    # A limit no run can meet: the watchdog stops the interleaved group of the two runs
    # (its first piece); both are recorded as failed, and a new launch would start after
    # them (the plan has nothing after them: one launch, one process). With --sequential
    # each run is stopped and recorded alone, one launch each.
    p = _run_py("--device", "cpu", "--gpus", "1", "--profile", "tiny", "--cases", "seed_mlp", "--engines", "ddp",
                "--variants", "torch_amp,ampkit_amp", "--run-timeout", "0.01", "--out", str(tmp_path))
    assert p.returncode == 0, p.stderr[-3000:]
    recs = bench.read_document(tmp_path / "results.json")["records"]
    assert [(r["variant"], r["status"]) for r in recs] == [("torch_amp", "failed"), ("ampkit_amp", "failed")]
    for r in recs:
        assert "did not finish" in r["error"] and "--run-timeout" in r["error"] and r["samples"] == []
        assert "(2 runs interleaved: torch_amp, ampkit_amp;" in r["error"]
    assert "Timeout (0:00:00" in (tmp_path / "launch-x1.log").read_text()  # the watchdog's stack dump
    assert p.stderr.count("== launch:") == 1
    report = (tmp_path / "report.md").read_text()
    assert "2 run(s) failed: seed_mlp/torch_amp/python/ddp/x1" in report
    # a record without samples was not timed, interleaved or alone
    rows = [line for line in report.splitlines() if line.startswith("| seed_mlp | ddp |")]
    assert len(rows) == 2 and all(row.rstrip(" |").endswith("| -") for row in rows), rows


def test_a_launch_past_its_limit_is_killed_with_the_processes_it_started_in_their_own_sessions(tmp_path):
    """torchrun starts its workers in sessions of their own: killing the launch's process
    group alone left them running, and the launcher waiting on their output."""
    import time

    import across

    child = tmp_path / "child.pid"
    t0 = time.monotonic()
    rc, tail = across.launch(["bash", "-c", "setsid sleep 120 & echo $! > %s; wait" % child], dict(os.environ),
                             tmp_path / "launch.log", 2)
    took = time.monotonic() - t0
    assert rc != 0 and tail[-1] == "the launch was killed after 2 s"
    assert took < 60, took  # not the 120 s the worker would have run
    pid = int(child.read_text())

    def gone():  # killed: it may still be exiting (its output closes before it is gone)
        try:
            return "zombie" in Path("/proc/%d/status" % pid).read_text().lower()
        except OSError:
            return True
    for _ in range(100):
        if gone():
            break
        time.sleep(0.05)
    assert gone(), "the worker %d is still running" % pid


@pytest.mark.parametrize("sequential", [False, True])
def test_runs_the_budget_cannot_start_are_skipped_with_the_reason(tmp_path, sequential):
    p = _run_py("--device", "cpu", "--gpus", "1", "--profile", "tiny", "--cases", "seed_mlp", "--engines", "ddp",
                "--variants", "torch_amp", "--budget", "0.5", "--out", str(tmp_path),
                *(["--sequential"] if sequential else []))
    assert p.returncode == 0, p.stderr[-3000:]
    (rec,) = bench.read_document(tmp_path / "results.json")["records"]
    assert rec["status"] == "skipped" and "the time budget (--budget) ran out" in rec["reason"]
    assert rec["world_size"] == 1 and rec["engine"] == "ddp"
    # the epochs it would have timed: the profile's 1 alone, at least 3 rounds interleaved
    assert rec["repeats"] == (1 if sequential else bench.MIN_ROUNDS)
    assert ("--sequential" in p.stderr) == sequential  # the launch's command line


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


# --- interleaved groups --------------------------------------------------------------------

def test_rounds_rotate_and_the_plan_groups_the_variants_of_each_engine_configuration():
    assert bench.rotation(3, 4) == [[0, 1, 2], [1, 2, 0], [2, 0, 1], [0, 1, 2]]  # round r starts at r mod k
    assert bench.rotation(2, 3) == [[0, 1], [1, 0], [0, 1]]
    variants = bench.load_variants()
    ddp, view = bench.Engine("ddp"), bench.Engine.parse("ddp", "gradient_as_bucket_view=true")
    items = bench.plan_runs(["seed_mlp", "transformer"], [ddp, view],
                            ["torch_amp", "ampkit_amp", "ampkit_step", "torch_compile_amp"], check=True)
    assert bench.plan_groups(items, 0, True, variants) == [
        [0], [1, 2, 3], [4], [5, 6, 7], [8],  # seed_mlp: its check, then per configuration the group
        [9], [10, 11, 12], [13], [14, 15, 16], [17]]  # and the compiled variant alone
    assert bench.plan_groups(items, 11, True, variants)[:2] == [[11, 12], [13]]  # resumed mid-group
    assert bench.plan_groups(items, 15, False, variants) == [[15], [16], [17]]  # --sequential
    assert bench.repeats_for("transformer", "full") == max(3, bench.MIN_ROUNDS)
    assert bench.repeats_for("transformer", "full", 7) == 7 and bench.repeats_for("seed_mlp", "tiny", 2) == 2


def test_run_interleaved_takes_variants_only():
    built = bench.build_case("seed_mlp", "tiny", seed=0, device="cpu")
    v = bench.load_variants()
    with pytest.raises(TypeError, match=r"run_interleaved\(built, variant\): variant must be an ampkit.bench.Variant"):
        bench.run_interleaved(built, [v["torch_amp"], "ampkit_amp"])


GROUP_TIMEOUT_S = 180


def test_an_interleaved_group_on_two_gloo_ranks_trains_as_alone_and_a_failure_stays_its_own(tmp_path):
    """Two gloo processes, DDP, tiny text_classifier (with dropout), three variants: alone,
    interleaved, and interleaved with ampkit_amp's build failing on rank 1 only and
    ampkit_step's second epoch failing on both (bench_group_workers.py)."""
    import bench_group_workers as workers
    from gloo_ranks import spawn_ranks

    results = spawn_ranks(workers.run, tmp_path, GROUP_TIMEOUT_S)
    names, rounds = list(workers.VARIANTS), workers.ROUNDS
    for result in results:
        for alone, together in zip(result["sequential"], result["interleaved"]):
            assert alone["status"] == together["status"] == "ok", (alone["error"], together["error"])
            # the same data and steps: bitwise the same losses (dropout included) and scale
            assert together["final_loss"] == alone["final_loss"]
            assert together["final_scale"] == alone["final_scale"]
            assert len(together["samples"]) == together["repeats"] == rounds and together["world_size"] == 2
            k = names.index(together["variant"])
            assert together["interleaved"] == {"group": names, "rounds": rounds,
                                               "positions": [o.index(k) for o in bench.rotation(3, rounds)]}
            assert "interleaved" not in alone
        torch_amp, amp, step = result["failing"]
        assert torch_amp["status"] == "ok" and torch_amp["final_loss"] == result["sequential"][0]["final_loss"]
        # rounds [torch_amp, ampkit_step], [ampkit_step, torch_amp], [torch_amp]: ampkit_amp never
        # built, ampkit_step failed first in round 1
        assert torch_amp["interleaved"]["positions"] == [0, 1, 0] and len(torch_amp["samples"]) == rounds
        assert amp["status"] == "failed" and amp["error"] == "rank 1: RuntimeError: ampkit_amp's build broke on rank 1"
        assert step["status"] == "failed" and step["error"] == "rank 0: RuntimeError: ampkit_step's second epoch broke"
        for r in (amp, step):
            assert r["samples"] == []
        # rotated over the variants still running: ampkit_amp, never built, is not in the group
        assert "interleaved" not in amp
        assert step["interleaved"] == {"group": ["torch_amp", "ampkit_step"], "rounds": rounds, "positions": [1]}
        assert bench.validate({"context": bench.context("tiny", "cpu"),
                               "records": [r for recs in result.values() for r in recs]}) == []
    for key in results[0]:  # every rank recorded the same: statuses, errors and the slowest rank's samples
        assert [(r["status"], r["error"], r["samples"], r.get("interleaved")) for r in results[0][key]] == \
            [(r["status"], r["error"], r["samples"], r.get("interleaved")) for r in results[1][key]]


def _in_group(rec, names, rounds=3):
    rec["interleaved"] = {"group": list(names), "rounds": rounds, "positions": [0] * rounds}
    return rec


def test_a_ratio_within_an_interleaved_group_says_so_in_the_records_and_the_report():
    names = ("torch_amp", "ampkit_step")
    recs = bench.derive([_in_group(_record("torch_amp", 1, 10.0), names), _in_group(_record("ampkit_step", 1, 8.0), names),
                         _in_group(_record("torch_amp", 2, 10.5), names), _in_group(_record("ampkit_step", 2, 8.4), names),
                         _record("torch_amp", 2, 10.5, bench.Engine.parse("ddp", "static_graph=true")),
                         _record("ampkit_step", 2, 8.0, bench.Engine.parse("ddp", "static_graph=true"))])
    assert recs[3]["time_vs_torch_amp"]["interleaved"] is True
    assert "interleaved" not in recs[3]["scaling_efficiency"]  # 1 against 2 processes: two launches
    assert "interleaved" not in recs[5]["time_vs_torch_amp"]  # timed one after the other
    doc = bench.check({"context": bench.context("full", "cpu"), "records": recs})
    lines = report.goals(doc).splitlines()
    assert lines[0] == ("- met ampkit_step >= 1.2x torch_amp's throughput (transformer, ddp, 2 processes): 1.25x "
                        "[1.25, 1.25] faster; interleaved: 3 rounds, one epoch of each of torch_amp, ampkit_step a round, "
                        "the order rotating")
    assert lines[2].endswith("1.31x [1.31, 1.31] faster; timed one after the other, not interleaved")
    table = report.across(doc)
    assert "| transformer | ddp | ampkit_step | 2 | 8.40 [8.40, 8.40] | 7619.0 | 1.25x [1.25, 1.25] faster | " \
           "0.952 [0.952, 0.952] | interleaved, 3 rounds |" in table
    assert "| transformer | ddp (static_graph) | ampkit_step | 2 | 8.00 [8.00, 8.00] | 8000.0 | 1.31x [1.31, 1.31] " \
           "faster | - | alone |" in table


def test_a_captured_train_step_on_cuda_warms_up_for_its_own_warmup_then_the_capture_and_a_replay():
    import warnings

    import torch

    import ampkit

    variants = bench.load_variants()
    model = torch.nn.Linear(4, 4)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ac = dict(device_type="cpu", dtype=torch.bfloat16)
    on_cuda = bench.Placement(bench.Engine("ddp"), "cuda", world_size=2)
    on_cpu = bench.Placement(bench.Engine("ddp"), "cpu", world_size=2)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # capture on a cpu region: it runs eagerly, said once
        for step in (ampkit.make_train_step(model, torch.nn.functional.mse_loss, opt, autocast=ac),
                     ampkit.make_train_step(model, torch.nn.functional.mse_loss, opt, autocast=ac, warmup=7)):
            # the step's own warm-up (make_train_step's choice), its capture, one replay
            assert on_cuda.warmup_steps(variants["ampkit_step"], 1, step) == step.warmup + 2
            assert on_cuda.warmup_steps(variants["ampkit_step"], 50, step) == 50  # the profile's, when more
            # no capture to wait for: the profile's (the variant's) warm-up alone
            for placement, name in ((on_cpu, "ampkit_step"), (on_cuda, "torch_amp"), (on_cuda, "ampkit_step_eager")):
                assert placement.warmup_steps(variants[name], 1, step) == variants[name].warmup_steps(1)
    # not built yet (the record of a run that never started): the variant's warm-up
    assert on_cuda.warmup_steps(variants["ampkit_step"], 1) == variants["ampkit_step"].warmup_steps(1)
