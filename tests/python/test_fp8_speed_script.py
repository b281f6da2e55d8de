"""benchmarks/gpu/fp8_speed.py's --smoke mode (tiny sizes, the CPU, aot_eager) runs every arm
(make_train_step's included, eager on the CPU) on both shapes, with --breakdown, and writes
its results, so the GPU script cannot rot between GPU runs. Its timings mean nothing here;
the losses are checked against the bf16 arm, and the breakdown's kinds against its own top
kernels."""

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
        "ampkit_fp8_delayed", "ampkit_fp8_auto", "torchao_tensorwise", "torchao_rowwise",
        "ampkit_bf16_step", "ampkit_fp8_step", "ampkit_fp8_delayed_step", "ampkit_fp8_tensorwise_fast",
        "ampkit_fp8_delayed_fast", "ampkit_fp8_delayed_fast_step")


def test_smoke_run_times_every_arm_of_both_shapes(tmp_path):
    out = tmp_path / "fp8.json"
    env = dict(os.environ, PYTHONPATH=str(REPO / "python"), OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, str(SCRIPT), "--smoke", "--breakdown", "--arms", ",".join(ARMS), "--out", str(out)],
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
        # the step arms' own ratio, on every arm; what each arm holds (nothing on the CPU)
        assert arms["ampkit_bf16_step"]["vs_bf16_step"] == 1.0
        step = arms["ampkit_fp8_step"]
        assert step["vs_bf16_step"] == arms["ampkit_bf16_step"]["median_ms"] / step["median_ms"]
        assert all(rec["held_mib"] == 0 for rec in arms.values() if rec["status"] == "ok")
        for name, rec in arms.items():
            if rec["status"] == "ok":
                check_breakdown(name, rec["breakdown"], proc.stdout)


KINDS = ["fp8_gemm", "gemm", "attention", "optimizer", "triton", "other"]


def check_breakdown(name, bd, stdout):
    """Every kind is reported; the top kernels are the largest, each counted in its kind, and
    together no more than the total; a model of linears spends time in matrix multiplies."""
    assert bd["device"] == "cpu" and bd["steps"] == 3
    assert list(bd["kinds_ms"]) == KINDS and all(v >= 0 for v in bd["kinds_ms"].values())
    assert math.isclose(bd["total_ms"], sum(bd["kinds_ms"].values()))
    top = bd["top"]
    assert len(top) == 15 and [k["ms"] for k in top] == sorted((k["ms"] for k in top), reverse=True)
    for kind in KINDS:
        assert sum(k["ms"] for k in top if k["kind"] == kind) <= bd["kinds_ms"][kind] + 1e-9, (name, kind)
    assert all(k["count"] > 0 for k in top)
    assert bd["kinds_ms"]["gemm"] > 0, (name, bd)
    assert any(line.split()[:2] == [line.split()[0], name] and "device ms a step" in line
               for line in stdout.splitlines()), name


def test_kernel_kinds_name_the_gpu_kernels_each_kind_holds():
    """The categoriser both GPU scripts share, on kernel names of an H100 step: inductor's
    kernels by prefix, fp8 GEMMs by name or by having been launched by aten::_scaled_mm
    (an nvjet name says nothing of fp8), the rest by cuBLAS / attention / optimizer names."""
    sys.path.insert(0, str(REPO / "benchmarks" / "gpu"))
    try:
        from kernel_kinds import KINDS, kernel_kind
    finally:
        sys.path.pop(0)
    launched_by_scaled_mm = frozenset({"nvjet_qqtst_128x128_128x6_1x2_h_bz_coopA_TNT"})
    cases = {
        "triton_red_fused__to_copy_abs_amax_0": "triton",
        "triton_poi_fused_add_gelu_view_3": "triton",
        "sm90_xmma_gemm_e4m3bf16_e4m3f32_f32_tn_n_tilesize128x128x128_cga1x2x1": "fp8_gemm",
        "nvjet_qqtst_128x128_128x6_1x2_h_bz_coopA_TNT": "fp8_gemm",
        "nvjet_tst_128x256_64x4_1x2_h_bz_coopA_NTT": "gemm",
        "sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x256x64": "gemm",
        "pytorch_flash::flash_fwd_kernel<Flash_fwd_kernel_traits<128, 128, 64, 4>>": "attention",
        # cuDNN's sdpa kernels (the H100 run at 93f01db) say sm90_ and wgmma: attention all the same
        "cudnn_generated_fort_native_sdpa_sm90_flash_bprop_wgmma_f16_knob_26_64x64x128_1x4x1": "attention",
        "sm90_xmma_fprop_implicit_gemm_f16f16_f16f32_f32_nhwckrsc_nhwc_tilesize128x128x64": "gemm",
        "void at::native::(anonymous namespace)::fused_adamw_kernel<float>": "optimizer",
        "void at::native::vectorized_elementwise_kernel<4, at::native::FillFunctor<float>>": "other",
    }
    got = {name: kernel_kind(name, launched_by_scaled_mm) for name in cases}
    assert got == cases
    assert kernel_kind("nvjet_qqtst_128x128_128x6_1x2_h_bz_coopA_TNT") == "gemm"  # (not launched by it)
    assert set(cases.values()) == set(KINDS)
