"""benchmarks/gpu/fp8_speed.py's --smoke mode (tiny sizes, the CPU, aot_eager) runs every arm
on both shapes and writes its results, so the GPU script cannot rot between GPU runs. Its
timings mean nothing here; the losses are checked against the bf16 arm."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

from ampkit.bench import float8_reason

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "benchmarks" / "gpu" / "fp8_speed.py"
ARMS = ("bf16_compile", "ampkit_bf16_compile", "ampkit_fp8_tensorwise", "ampkit_fp8_rowwise",
        "ampkit_fp8_delayed", "ampkit_fp8_auto", "torchao_tensorwise", "torchao_rowwise")


def test_smoke_run_times_every_arm_of_both_shapes(tmp_path):
    out = tmp_path / "fp8.json"
    env = dict(os.environ, PYTHONPATH=str(REPO / "python"), OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, str(SCRIPT), "--smoke", "--arms", ",".join(ARMS), "--out", str(out)],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    doc = json.loads(out.read_text())
    assert [r["shape"] for r in doc["results"]] == ["gpt2", "decoder16x2048"]
    no_torchao = float8_reason()
    for res in doc["results"]:
        arms = res["arms"]
        assert list(arms) == list(ARMS)
        ref = arms["bf16_compile"]["loss"]
        for name, rec in arms.items():
            if name.startswith("torchao_") and no_torchao:
                assert rec["status"] == "skipped" and "torchao" in rec["reason"]
                continue
            assert rec["status"] == "ok", (name, rec)
            assert len(rec["samples"]) == 2 and all(s > 0 for s in rec["samples"])
            assert rec["median_ms"] > 0 and rec["compile_s"] > 0
            # the same seeded weights and batches: fp8's rounding moves the loss a little, never far
            assert math.isfinite(rec["loss"]) and abs(rec["loss"] - ref) < 0.01 * abs(ref), (name, rec["loss"], ref)
            assert name in proc.stdout
        assert arms["bf16_compile"]["vs_bf16_compile"] == 1.0
