"""A float16 run that skips every step is repaired by doctor.suggest(): the script of
benchmarks/doctor_repair.py (the one docs/doctor.md shows), checked on the CPU."""

import importlib.util
from pathlib import Path

import pytest
import torch

pytestmark = [pytest.mark.usefixtures("ampkit_quiet"), pytest.mark.filterwarnings("ignore::UserWarning")]

_PATH = Path(__file__).resolve().parents[2] / "benchmarks" / "doctor_repair.py"


def _demo():
    spec = importlib.util.spec_from_file_location("doctor_repair", _PATH)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_suggest_repairs_a_run_that_skips_every_step():
    demo = _demo()
    r = demo.repair("cpu", steps=100, broken_steps=20)
    # default policy: boom's float16 output is inf, the loss NaN, every step skipped
    assert r["fp16_default"]["skipped"] == 20
    assert r["finding"]["op"] == "addmm" and r["finding"]["module"] == "boom"
    assert r["finding"]["phase"] == "forward" and r["finding"]["step"] == 0
    assert r["suggested_policy"] == {"boom": {"pin": "float32"}}
    # repaired: float32's held-out loss within 1%, no skips
    assert r["fp16_repaired"]["skipped"] == 0
    assert abs(r["loss_ratio"] - 1) <= 0.01, r["loss_ratio"]
    # matmul FLOPs of one step by hand: Linear(i, o) on n rows is 2 n i o per matmul; forward
    # one, backward two (weight grad, input grad) except `inp`, whose input needs no grad
    n, w = 2048, demo.WIDTH
    lin = lambda i, o, k=3: k * 2 * n * i * o  # noqa: E731
    low = lin(32, w, 2) + demo.DEPTH * lin(w, w) + lin(w, 1)
    fp32 = lin(w, w)
    assert r["fp16_repaired"]["low_precision_matmul_fraction"] == pytest.approx(low / (low + fp32))
    assert low / (low + fp32) >= 0.9


def test_the_suggested_policy_is_valid_yaml(tmp_path):
    import ampkit

    demo = _demo()
    torch.manual_seed(0)
    model = demo.RepairNet()
    x, _ = demo.data("cpu", n=8)
    with ampkit.doctor(model) as doc, ampkit.autocast("cpu", dtype=torch.float16):
        model(x)
    f = tmp_path / "fixed.yaml"
    f.write_text(doc.suggest().to_yaml())
    p = ampkit.load_policy(f)
    with p.apply(model), ampkit.autocast("cpu", dtype=torch.float16):
        assert torch.isfinite(model(x)).all()


def test_the_docs_example_runs_and_says_what_it_prints(capsys):
    text = (Path(__file__).resolve().parents[2] / "docs" / "doctor.md").read_text()
    code = text.split("```python\n", 1)[1].split("```", 1)[0]
    ns = {}
    exec(compile(code, "docs/doctor.md", "exec"), ns)
    out = capsys.readouterr().out.splitlines()
    assert out[0] == "nan 40"
    assert out[1] == "addmm boom forward float16 0"
    assert ns["skipped"] == 0 and abs(ns["fixed"] / ns["ref"] - 1) <= 0.01
    assert [(m.pattern, m.pin) for m in ns["fix"].modules] == [("boom", "float32")]
