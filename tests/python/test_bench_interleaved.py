"""The one-process runner times a case's variants interleaved, compiled ones included, and
torchao's float8 rival is skipped cleanly where torchao cannot be imported (CPU, tiny)."""

from __future__ import annotations

import dataclasses
import json
import sys
import types

import pytest
import torch

from ampkit import bench
from ampkit.bench import __main__ as bench_main

# fp32 and torch_amp eager; torch_compile_amp and ampkit_step_compiled compiled (both run on
# the CPU); torchao_float8 CUDA only: skipped here, and left out of the group.
GROUP = ["fp32", "torch_amp", "torch_compile_amp", "ampkit_step_compiled"]
ROUNDS = 3


def _limit():
    name = "recompile_limit" if hasattr(torch._dynamo.config, "recompile_limit") else "cache_size_limit"
    return getattr(torch._dynamo.config, name)


def _run_main(tmp_path, name, *extra):
    out = tmp_path / name
    argv = ["--profile", "tiny", "--cases", "seed_mlp", "--variants", ",".join(GROUP + ["torchao_float8"]),
            "--repeats", str(ROUNDS), "--device", "cpu", "--out", str(out), *extra]
    assert bench_main.main(argv) == 0
    doc = json.loads(out.read_text())
    assert bench.validate(doc) == []
    return {r["variant"]: r for r in doc["records"]}


@pytest.fixture(scope="module")
def both(tmp_path_factory):
    if bench.compile_reason():
        pytest.skip(bench.compile_reason())
    tmp = tmp_path_factory.mktemp("interleaved")
    limit = _limit()
    interleaved = _run_main(tmp, "interleaved.json")
    assert _limit() == limit  # the group's raised recompile limit is restored
    return interleaved, _run_main(tmp, "sequential.json", "--sequential")


def test_the_one_process_runner_rotates_the_variants_of_a_case_round_by_round(both):
    recs, _ = both
    for j, name in enumerate(GROUP):
        r = recs[name]
        assert r["status"] == "ok", r["error"]
        assert r["interleaved"]["group"] == GROUP and r["interleaved"]["rounds"] == ROUNDS
        # round r starts at variant r mod k: variant j is then (j - r) mod k-th
        assert r["interleaved"]["positions"] == [(j - rnd) % len(GROUP) for rnd in range(ROUNDS)]
        assert len(r["samples"]) == ROUNDS and all(s > 0 for s in r["samples"])
        assert r["final_loss"] is not None and r["wall_s"] > 0


def test_compiled_variants_share_the_group_with_their_compile_time(both):
    recs, _ = both
    for name in GROUP:
        r = recs[name]
        if bench.load_variants()[name].compile == "none":
            assert r["compile_s"] is None and r["compile"] == "none"
        else:  # the first warm-up step, timed apart; nothing recompiled in the variant's own epochs
            assert r["compile_s"] > 0 and r["warmup_steps"] == 1
            assert "untimed warm-up step" in r["reason"] and r["reason"].endswith("; none in the timed steps")


def test_a_variant_trains_the_same_interleaved_as_alone(both):
    """Each variant keeps its own random state and (compiled) graphs: on the CPU its losses are
    bitwise those of the same run timed alone (--sequential)."""
    interleaved, alone = both
    for name in GROUP:
        assert "interleaved" not in alone[name]
        assert interleaved[name]["final_loss"] == alone[name]["final_loss"], name
        assert interleaved[name]["final_scale"] == alone[name]["final_scale"], name


def test_the_float8_rival_is_skipped_on_the_cpu_and_left_out_of_the_group(both):
    for recs in both:
        r = recs["torchao_float8"]
        assert r["status"] == "skipped" and r["reason"] == bench.load_variants()["torchao_float8"].skip_reason("cpu")
        assert r["float8"] == "tensorwise" and "interleaved" not in r


def test_the_float8_rival_is_skipped_with_the_reason_without_torchao(monkeypatch):
    """Where torchao cannot be imported (here made so), a float8 variant that could otherwise
    run is a skipped record with the reason, never a failure, and the rest of its group runs."""
    monkeypatch.setitem(sys.modules, "torchao", None)  # import torchao now raises ImportError
    v = bench.load_variants()
    assert "torchao is not importable" in v["torchao_float8"].skip_reason("cuda")
    if bench.compile_reason():  # (the variant compiles: under the AVX2 emulation it is skipped for that first)
        pytest.skip(bench.compile_reason())
    anywhere = dataclasses.replace(v["torchao_float8_rowwise"], devices=("cpu", "cuda"))
    built = bench.build_case("seed_mlp", "tiny", seed=0, device="cpu")
    fp32, f8 = bench.run_interleaved(built, [v["fp32"], anywhere])
    assert (fp32["status"], f8["status"]) == ("ok", "skipped")
    assert f8["reason"].startswith("torchao is not importable") and f8["float8"] == "rowwise"
    assert bench.validate({"context": bench.context("tiny", "cpu", "python"), "records": [fp32, f8]}) == []


def _fake_torchao(monkeypatch, seen):
    """A stand-in torchao.float8 that records what it was given and converts nothing."""

    class Config:
        @staticmethod
        def from_recipe_name(name):
            return ("config", name)

    def convert(module, *, module_filter_fn=None, config=None):
        seen["config"] = config
        seen["swapped"] = [n for n, m in module.named_modules()
                           if isinstance(m, torch.nn.Linear) and module_filter_fn(m, n)]
        return module

    fake = types.ModuleType("torchao.float8")
    fake.Float8LinearConfig, fake.convert_to_float8_training = Config, convert
    monkeypatch.setitem(sys.modules, "torchao", types.ModuleType("torchao"))
    monkeypatch.setitem(sys.modules, "torchao.float8", fake)


def test_float8_converts_every_linear_but_the_head_through_torchao(monkeypatch):
    """convert_float8 hands torchao the recipe's config and a filter that takes the model's
    nn.Linear layers but the last one."""
    seen = {}
    _fake_torchao(monkeypatch, seen)
    model = bench.build_case("transformer", "tiny", seed=0, device="cpu").new_model()
    linears = [n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)]
    _, note = bench.convert_float8(model, "tensorwise")
    odd = [n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)
           and (m.in_features % 16 or m.out_features % 16)]
    assert seen["config"] == ("config", "tensorwise")
    assert seen["swapped"] == [n for n in linears[:-1] if n not in odd] and linears[-1] == "head"
    assert "head (head)" in note and ("%d nn.Linear converted" % len(seen["swapped"])) in note
    with pytest.raises(ValueError, match="float8 recipe 'columnwise'; valid: tensorwise, rowwise"):
        bench.convert_float8(model, "columnwise")


def test_a_float8_variant_with_no_layer_to_convert_is_skipped_and_the_group_goes_on(monkeypatch):
    """convnet's one nn.Linear is its head: with torchao importable, the float8 variant is
    skipped once built (nothing to measure), torchao is never called, the others run."""
    seen = {}
    _fake_torchao(monkeypatch, seen)
    v = bench.load_variants()
    if bench.compile_reason():
        pytest.skip(bench.compile_reason())
    anywhere = dataclasses.replace(v["torchao_float8"], devices=("cpu", "cuda"))
    assert anywhere.skip_reason("cpu") is None  # torchao "importable": it would run
    built = bench.build_case("convnet", "tiny", seed=0, device="cpu")
    fp32, torch_amp, f8 = bench.run_interleaved(built, [v["fp32"], v["torch_amp"], anywhere])
    assert (fp32["status"], torch_amp["status"], f8["status"]) == ("ok", "ok", "skipped")
    assert f8["reason"].endswith("nothing to measure") and "convnet" in f8["reason"] and seen == {}
    assert fp32["interleaved"]["group"] == ["fp32", "torch_amp"] and "interleaved" not in f8


def test_a_float8_variant_must_be_a_python_loop(tmp_path):
    spec = tmp_path / "variants.yaml"
    spec.write_text("schema_version: 1\nvariants:\n  f8:\n    description: d\n    autocast: torch\n"
                    "    dtype: bfloat16\n    float8: tensorwise\n")
    with pytest.raises(bench.BenchSpecError, match=r"variants\.f8\.float8.*languages: \[python\]"):
        bench.load_variants(spec)


def test_the_group_restores_the_recompile_limit_when_a_variant_raises():
    limit = _limit()
    with pytest.raises(RuntimeError, match="boom"):
        with bench.compiling_group(3):
            assert _limit() >= 64
            raise RuntimeError("boom")
    assert _limit() == limit
