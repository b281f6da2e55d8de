"""The R runner (benchmarks/run.R) against the Python runner: same cases, same fields, same losses.

Skipped, saying what is missing, when R or the ampkit R package is not installed.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from ampkit import bench
from bench_helpers import tiny_python_records

REPO = Path(__file__).resolve().parents[2]


def _env():
    env = dict(os.environ)
    env.setdefault("RETICULATE_PYTHON", sys.executable)
    env.setdefault("R_LIBS", str(REPO / ".rlib"))
    env["OMP_NUM_THREADS"] = "1"
    return env


def _r_ready():
    if shutil.which("Rscript") is None:
        return "Rscript is not installed (make setup-r)"
    p = subprocess.run(["Rscript", "-e", "library(ampkit); library(reticulate)"], env=_env(),
                       capture_output=True, text=True, timeout=120)
    if p.returncode != 0:
        return "the ampkit R package is not installed in R_LIBS (make setup-r): " + p.stderr.strip()[-200:]
    return None


_MISSING = _r_ready()
pytestmark = pytest.mark.skipif(_MISSING is not None, reason=str(_MISSING))


def run_r(*args):
    return subprocess.run(["Rscript", str(REPO / "benchmarks" / "run.R"), *args], env=_env(), cwd=REPO,
                          capture_output=True, text=True, timeout=600)


# The compiled variants from R on one case: R's side of them (calling the compiled model
# in R's loop) is the same on every case, and compiling costs seconds a case, tens of
# seconds on a cold inductor cache (from R it was ~70 s for the four tiny cases).
# test_bench.py compiles every case from Python; `make bench` every case from both.
COMPILED = [n for n, v in bench.load_variants().items() if v.compile != "none" and "r" in v.languages]
EAGER = [n for n, v in bench.load_variants().items() if v.compile == "none" and "r" in v.languages]
COMPILED_CASES = ["seed_mlp"]


@pytest.fixture(scope="module")
def both(tmp_path_factory):
    """Every case x eager variant, and the compiled variants on COMPILED_CASES, at the tiny
    size, from R and from Python, on the same seeds."""
    out = tmp_path_factory.mktemp("bench_r")
    docs, log = [], ""
    for name, args in (("eager", ["--variants", ",".join(EAGER)]),
                       ("compiled", ["--variants", ",".join(COMPILED), "--cases", ",".join(COMPILED_CASES)])):
        p = run_r("--profile", "tiny", "--device", "cpu", "--threads", "1", "--out", str(out / (name + ".json")), *args)
        assert p.returncode == 0, p.stdout + p.stderr
        docs.append(bench.read_document(out / (name + ".json")))  # validates against the schema
        log += p.stderr
    return bench.merge(docs), bench.derive(tiny_python_records()), log


def test_the_r_runner_runs_every_case_and_variant(both):
    r_doc, py, _ = both
    expected = {(c, v) for c in bench.load_cases() for v in EAGER} | {(c, v) for c in COMPILED_CASES for v in COMPILED}
    assert COMPILED == ["torch_compile_amp", "torch_compile_ro", "ampkit_compile_amp", "torch_compile_mat",
                        "ampkit_step_compiled", "torch_compile_bf16", "ampkit_fp8", "ampkit_fp8_auto"]
    assert {(r["case"], r["variant"]) for r in r_doc["records"]} == expected
    assert all(r["language"] == "r" for r in r_doc["records"])
    not_runnable = bench.compile_reason()  # torch.compile under a capped CPU capability
    for r in r_doc["records"]:
        if bench.load_variants()[r["variant"]].devices == ("cuda",):  # fp32_tf32, torch_compile_mat, the fp8 ones
            assert r["status"] == "skipped" and "cuda" in r["reason"]
        elif r["compile"] != "none" and not_runnable:
            assert r["status"] == "skipped" and r["reason"] == not_runnable, (r["case"], r["variant"])
        else:
            assert r["status"] == "ok", (r["case"], r["variant"], r["error"])
            assert len(r["samples"]) == r["repeats"]
        if r["compile"] != "none" and r["status"] == "ok":  # compiled in warm-up, timed apart
            assert r["compile_s"] > 0 and r["warmup_steps"] == 1, (r["case"], r["variant"])
            assert r["reason"].endswith("; none in the timed steps"), r["reason"]
    c = r_doc["context"]
    assert c["languages"] == ["r"] and c["r_version"].startswith("4.") and c["reticulate_version"]


def test_python_and_r_records_carry_the_same_fields(both):
    r_doc, py, _ = both
    by_key = {(r["case"], r["variant"]): r for r in py}
    for r in r_doc["records"]:
        p = by_key[(r["case"], r["variant"])]
        # the Python records here ran alone; R's ampkit_step_eager ran paired with its control
        assert [k for k in r if k != "paired"] == list(p)
        for field in ("profile", "device", "status", "autocast", "scaler", "dtype", "tf32", "runner", "compile",
                      "graph_captured", "sizes",
                      "num_batches", "warmup_steps", "repeats", "unit", "skipped_steps"):
            assert r[field] == p[field], field
        if r["runner"] == "train_step":  # why it ran eagerly: the CPU, or capture: false passed through
            # (a compiled one's compile note follows: its inductor cache counts differ by run)
            assert r["reason"].split("; torch.compile")[0] == p["reason"].split("; torch.compile")[0], \
                (r["case"], r["variant"])


def test_r_trains_the_same_seeded_model_on_the_same_data_as_python(both):
    """The golden values come from the Python runner in this test: R's loop, driving the same
    torch through reticulate, must reach the same final loss."""
    r_doc, py, _ = both
    by_key = {(r["case"], r["variant"]): r for r in py}
    for r in r_doc["records"]:
        p = by_key[(r["case"], r["variant"])]
        if r["status"] == "ok":
            assert r["final_loss"] == pytest.approx(p["final_loss"], rel=1e-6), (r["case"], r["variant"])


def test_r_times_the_eager_step_against_its_control_step_by_step(both):
    """On every case R ran ampkit_step_eager with ampkit_amp_fused a step of each in turn:
    the record's summary is the median of its recorded per-pair ratios, its samples the
    rounds' step times / num_batches (the losses still Python's alone: the test above)."""
    import statistics
    r_doc, _, _ = both
    recs = {(r["case"], r["variant"]): r for r in r_doc["records"]}
    for case in bench.load_cases():
        e, h = recs[(case, "ampkit_step_eager")], recs[(case, "ampkit_amp_fused")]
        p, n = e["paired"], e["num_batches"]
        assert "paired" not in h and (p["with"], p["unit"], p["n"]) == ("ampkit_amp_fused", "step", e["repeats"] * n)
        assert p["ratio"] == statistics.median([a / b for a, b in zip(p["this_ms"], p["control_ms"])])
        for rec, times in ((e, p["this_ms"]), (h, p["control_ms"])):
            assert rec["samples"] == pytest.approx([sum(times[k * n:(k + 1) * n]) / n for k in range(rec["repeats"])])


@pytest.mark.parametrize("variant", ["ampkit_fp8", "ampkit_fp8_auto"])
def test_r_trains_an_fp8_variant_as_python_does(tmp_path, variant):
    """run.R's own build and step for the fp8 variant (uncompiled, on the CPU: the emulation,
    auto's calibration), the region taking the policy's own tables: the same losses, bit
    for bit, as the Python runner's, and the same note."""
    out = tmp_path / "losses.txt"
    p = subprocess.run(["Rscript", str(REPO / "tests" / "python" / "r_fp8_losses.R"), "transformer", variant,
                        str(out)], env=_env(), cwd=REPO, capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stdout + p.stderr
    note, *r_losses = out.read_text().splitlines()
    built = bench.build_case("transformer", "tiny", seed=0, device="cpu")
    run = bench.VariantRun(built, dataclasses.replace(bench.load_variants()[variant], compile="none"), "python",
                           None, 0)
    run.build()
    py_losses = [run.step(x, y).item() for _ in range(2) for x, y in built.batches]
    py_note = run.model_note
    run.close()
    assert [float(x) for x in r_losses] == py_losses
    calibrated = " s (in the build)"  # auto's note carries its own calibration time
    assert note.split("calibrated in")[0] == py_note.split("calibrated in")[0]
    assert (calibrated in note) == (calibrated in py_note) == (variant == "ampkit_fp8_auto")


def test_the_r_runner_shows_progress(both):
    assert "[r       1/" in both[2]


@pytest.mark.parametrize("args, message", [
    (["--variants", "fp8"], "unknown variant 'fp8'; valid variants: fp32, fp32_tf32, torch_amp"),
    (["--cases", "mnist"], "unknown case 'mnist'; valid cases: convnet, gpt2_small, seed_mlp"),
    (["--profile", "gpu"], "unknown profile 'gpu'; valid profiles: tiny, cpu, full"),
    (["--colour", "red"], "unknown or incomplete argument '--colour'"),
])
def test_the_r_runner_rejects_bad_input_with_the_valid_names(tmp_path, args, message):
    p = run_r("--out", str(tmp_path / "x.json"), *args)
    assert p.returncode == 2 and message in p.stderr
