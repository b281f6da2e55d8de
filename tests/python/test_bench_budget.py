"""The benchmark on any CPU: what the CPU can do, and fitting the cpu profile to a time budget.

Everything here is computed from given numbers (flags, environments, step costs): no test
depends on this machine's CPU, its load or a clock.
"""

from __future__ import annotations

import dataclasses

import pytest

from ampkit import bench

AVX512_BF16 = {"avx2", "avx512f", "avx512_bf16", "amx_bf16", "avx512_fp16"}
EMULATED_AVX2 = {"ONEDNN_MAX_CPU_ISA": "AVX2", "ATEN_CPU_CAPABILITY": "avx2"}


# --- the CPU's capability ------------------------------------------------------------------

def test_a_cpu_with_bf16_arithmetic_is_native_and_says_its_speedups_are_real():
    cap = bench.capability_from(flags=AVX512_BF16, isa="AVX512", model="Xeon", env={}, bf16_slowdown=0.4)
    assert (cap.native_bf16, cap.native_fp16, cap.slow_bf16, cap.emulated) == (True, True, False, None)
    text = cap.describe()
    assert text.startswith("Xeon: AVX-512 kernels, native bf16, native fp16")
    assert "what mixed precision gains on this CPU" in text
    assert cap.compile_reason is None


@pytest.mark.parametrize("flags, isa, env", [
    ({"avx2"}, "AVX2", {}),  # an AVX2-only CPU
    (AVX512_BF16, "AVX2", EMULATED_AVX2),  # an AVX-512 CPU made to behave as one
])
def test_a_cpu_without_bf16_arithmetic_says_what_that_means_for_the_figures(flags, isa, env):
    cap = bench.capability_from(flags=flags, isa=isa, model="EPYC", env=env, bf16_slowdown=40.0)
    assert (cap.native_bf16, cap.native_fp16, cap.slow_bf16) == (False, False, True)
    text = cap.describe()
    assert "EPYC: AVX2 kernels, no native bf16, no native fp16" in text
    assert "40x the float32 time" in text and "compare ampkit with torch_amp" in text
    assert cap.emulated == (" ".join("%s=%s" % kv for kv in env.items()) or None)
    assert cap.to_dict()["summary"] == text


def test_a_onednn_cap_alone_takes_bf16_away():
    cap = bench.capability_from(flags=AVX512_BF16, isa="AVX512", model="X",
                                   env={"ONEDNN_MAX_CPU_ISA": "AVX512_CORE"}, bf16_slowdown=30.0)
    assert not cap.native_bf16 and cap.compile_reason is None  # torch.compile's kernels are not capped


def test_compiled_variants_are_skipped_with_the_reason_only_under_aten_emulation(monkeypatch):
    v = bench.load_variants()
    monkeypatch.delenv("ATEN_CPU_CAPABILITY", raising=False)
    assert v["torch_compile_amp"].skip_reason("cpu") is None
    monkeypatch.setenv("ATEN_CPU_CAPABILITY", "avx2")
    reason = v["torch_compile_amp"].skip_reason("cpu")
    assert "ATEN_CPU_CAPABILITY=avx2" in reason and "not runnable here" in reason
    assert v["ampkit_compile_amp"].skip_reason("cpu") == reason
    assert v["torch_amp"].skip_reason("cpu") is None  # eager variants always run


# --- fitting the run to the budget -----------------------------------------------------------

FULL = bench.RunLength(num_batches=8, repeats=5, warmup_steps=2, batch_size=8)


def test_notches_shorten_one_step_at_a_time_down_to_the_floor():
    seq = [FULL] + list(bench.notches(FULL))
    assert seq[1] == dataclasses.replace(FULL, repeats=4) and seq[2] == dataclasses.replace(FULL, repeats=3)
    for a, b in zip(seq, seq[1:]):  # each notch changes one field, and only downwards
        diff = [f.name for f in dataclasses.fields(a) if getattr(a, f.name) != getattr(b, f.name)]
        assert len(diff) == 1 and getattr(b, diff[0]) < getattr(a, diff[0])
    assert seq[-1] == bench.RunLength(num_batches=2, repeats=2, warmup_steps=1, batch_size=2)
    assert len(seq) == len(set(seq))


def _costs(low_ms):
    return {"a": bench.StepCost(fp32_ms=50.0, low_ms=low_ms, batch_size=8),
            "b": bench.StepCost(fp32_ms=100.0, low_ms=low_ms * 2, batch_size=8)}


VARIANTS = [v for v in bench.load_variants().values() if v.name in ("fp32", "torch_amp", "ampkit_amp", "ampkit_step")]


def test_a_run_that_fits_keeps_the_profile():
    lengths = {"a": FULL, "b": FULL}
    est = sum(bench.estimate_s(FULL, c, VARIANTS, ["python", "r"], "cpu") for c in _costs(40.0).values())
    fitted, total = bench.fit_budget(lengths, _costs(40.0), VARIANTS, ["python", "r"], "cpu", budget_s=est + 1)
    assert fitted == lengths and total == pytest.approx(est)


def test_emulated_bf16_cuts_lengths_until_the_estimate_fits_and_keeps_every_variant():
    lengths = {"a": FULL, "b": FULL}
    slow = _costs(2000.0)  # bf16 steps 40x float32: an AVX2-only CPU
    before = sum(bench.estimate_s(FULL, c, VARIANTS, ["python", "r"], "cpu") for c in slow.values())
    fitted, total = bench.fit_budget(lengths, slow, VARIANTS, ["python", "r"], "cpu", budget_s=before / 4)
    assert total <= before / 4
    assert total == pytest.approx(sum(bench.estimate_s(fitted[k], slow[k], VARIANTS, ["python", "r"], "cpu")
                                      for k in fitted))
    for n in fitted.values():  # shorter, never below the floor
        assert n != FULL and n.repeats >= 2 and n.num_batches >= 2 and n.batch_size >= 2
    # the variants are not touched: a run's fixed costs (at zero step cost) stay those of all of them
    free = bench.StepCost(fp32_ms=0.0, low_ms=0.0, batch_size=8)
    fixed = bench.estimate_s(FULL, free, VARIANTS, ["python", "r"], "cpu")
    assert bench.estimate_s(fitted["a"], free, VARIANTS, ["python", "r"], "cpu") == fixed
    assert fixed > bench.estimate_s(FULL, free, VARIANTS[:-1], ["python", "r"], "cpu")


def test_a_budget_that_nothing_fits_stops_at_the_floor():
    fitted, total = bench.fit_budget({"a": FULL}, {"a": _costs(1e6)["a"]}, VARIANTS, ["python"], "cpu", budget_s=1)
    assert fitted["a"] == bench.RunLength(num_batches=2, repeats=2, warmup_steps=1, batch_size=2)
    assert total > 1


def test_sized_cases_load_with_the_lengths_and_keep_the_other_sizes(tmp_path, monkeypatch):
    cases = bench.load_cases()
    short = bench.RunLength(num_batches=3, repeats=2, warmup_steps=1, batch_size=4)
    folder = bench.write_sized_cases([cases["seed_mlp"]], {"seed_mlp": short}, "cpu", tmp_path / "sized")
    monkeypatch.setenv("AMPKIT_BENCH_SPECS", folder)
    sized = bench.load_cases()
    assert list(sized) == ["seed_mlp"] and list(bench.load_variants()) == list(bench.load_variants(
        cases["seed_mlp"].path.rsplit("/", 1)[0] + "/variants/variants.yaml"))
    assert bench.RunLength.of(sized["seed_mlp"], "cpu") == short
    was, now = cases["seed_mlp"].profile("cpu")["sizes"], sized["seed_mlp"].profile("cpu")["sizes"]
    assert now == dict(was, batch_size=4)
    assert sized["seed_mlp"].profile("full") == cases["seed_mlp"].profile("full")
