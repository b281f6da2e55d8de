"""The wheel: what it holds, and that an installed ampkit finds its policies and cases.

The wheel is built from a copy of the sources with the installed setuptools (no network,
no build isolation); without a setuptools that reads pyproject.toml's license expression
the tests skip and say so.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SOURCES = ("pyproject.toml", "setup.py", "MANIFEST.in", "README.md", "LICENSE", "python", "shared_specs")


def _setuptools_version():
    try:
        import setuptools
    except ImportError:
        return None
    return tuple(int(x) for x in setuptools.__version__.split(".")[:2] if x.isdigit())


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    version = _setuptools_version()
    if version is None or version < (77, 0):
        pytest.skip("building the wheel needs setuptools >= 77 (the SPDX license expression); "
                    "have %s" % (".".join(map(str, version)) if version else "none"))
    src = tmp_path_factory.mktemp("src")
    for name in SOURCES:
        if (REPO / name).is_dir():
            shutil.copytree(REPO / name, src / name, ignore=shutil.ignore_patterns("__pycache__", "*.egg-info"))
        else:
            shutil.copy2(REPO / name, src / name)
    dist = tmp_path_factory.mktemp("dist")
    code = "import setuptools.build_meta as b, sys; print(b.build_wheel(sys.argv[1]))"
    p = subprocess.run([sys.executable, "-c", code, str(dist)], cwd=src, capture_output=True, text=True,
                       timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    return dist / p.stdout.strip().splitlines()[-1]


def _names(wheel):
    with zipfile.ZipFile(wheel) as z:
        return set(z.namelist())


def _read(wheel, suffix):
    with zipfile.ZipFile(wheel) as z:
        (name,) = [n for n in z.namelist() if n.endswith(suffix)]
        return z.read(name).decode()


def test_the_wheel_holds_the_package_the_specs_py_typed_and_the_license(wheel):
    names = _names(wheel)
    sources = {p.relative_to(REPO / "python").as_posix() for p in (REPO / "python" / "ampkit").rglob("*.py")}
    specs = {"ampkit/shared_specs/" + p.relative_to(REPO / "shared_specs").as_posix()
             for p in (REPO / "shared_specs").rglob("*") if p.is_file()}
    assert sources <= names, sorted(sources - names)
    assert specs <= names, sorted(specs - names)
    assert "ampkit/shared_specs/policies/torch_default.yaml" in specs  # the shipped policy ...
    assert "ampkit/shared_specs/benchmarks/variants/variants.yaml" in specs  # ... cases and variants
    assert "ampkit/py.typed" in names
    assert any(n.endswith(".dist-info/licenses/LICENSE") for n in names)
    dist_info = {n.split("/")[0] for n in names if ".dist-info/" in n}
    assert all(n.startswith("ampkit/") or n.split("/")[0] in dist_info for n in names), sorted(names)


def test_the_metadata_has_the_license_extras_and_honest_dependencies(wheel):
    meta = _read(wheel, ".dist-info/METADATA")
    lines = meta.splitlines()
    assert "License-Expression: MIT" in lines
    requires = [line.split(": ", 1)[1] for line in lines if line.startswith("Requires-Dist: ")]
    plain = [r for r in requires if ";" not in r]
    assert sorted(plain) == ["pyyaml>=6", "torch>=2.4"]  # never numpy: the package does not import it
    numpy = [r for r in requires if r.startswith("numpy")]
    assert numpy == ['numpy<2; extra == "r"']
    assert {"Provides-Extra: test", "Provides-Extra: bench", "Provides-Extra: r"} <= set(lines)
    assert any(line.startswith("Classifier: ") for line in lines)
    assert any(line.startswith("Project-URL: ") for line in lines)
    entry_points = _read(wheel, ".dist-info/entry_points.txt")
    assert "ampkit-bench = ampkit.bench.__main__:main" in entry_points
    assert "ampkit-drift = ampkit.drift:main" in entry_points


def test_the_python_package_never_imports_numpy():
    for path in (REPO / "python" / "ampkit").rglob("*.py"):
        text = path.read_text(encoding="utf-8")
        assert "import numpy" not in text and "from numpy" not in text, path


def test_the_doctor_runs_where_numpy_is_missing():
    # torch does not require numpy, and neither does ampkit: the doctor's verdict ring is read
    # through a plain buffer (it used tensor.numpy(), which raises without numpy). A run with
    # numpy blocked arms it, sends the flags around the ring (40 steps: one send of 32) and
    # names the step whose input holds an inf.
    code = (
        "import sys\n"
        "sys.modules['numpy'] = None\n"
        "import warnings\n"
        "warnings.simplefilter('ignore')\n"
        "import torch, ampkit\n"
        "torch.manual_seed(0)\n"
        "model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 1))\n"
        "opt = torch.optim.SGD(model.parameters(), lr=1e-3)\n"
        "scaler = ampkit.GradScaler('cpu')\n"
        "doc = ampkit.doctor(model, every=1000)\n"
        "for i in range(40):\n"
        "    x = torch.randn(2, 4)\n"
        "    if i == 37:\n"
        "        x[0, 0] = float('inf')\n"
        "    with ampkit.autocast('cpu', dtype=torch.bfloat16):\n"
        "        loss = model(x).float().sum()\n"
        "    scaler.scale(loss).backward()\n"
        "    scaler.step(opt)\n"
        "    scaler.update()\n"
        "    opt.zero_grad()\n"
        "f = doc.first_nonfinite()\n"
        "print(f.step, doc.host_verdict_steps)\n"
    )
    env = dict(os.environ, PYTHONPATH=str(REPO / "python"))
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    step, host = map(int, out.stdout.split())
    assert step == 37 and host >= 32  # (the host's verdicts: the ring was used)


def test_an_installed_ampkit_finds_its_policies_and_cases_away_from_the_repository(wheel, tmp_path):
    site = tmp_path / "site"
    with zipfile.ZipFile(wheel) as z:
        z.extractall(site)
    work = tmp_path / "elsewhere"
    work.mkdir()
    env = {k: v for k, v in os.environ.items() if k not in ("AMPKIT_REPO", "AMPKIT_BENCH_SPECS", "PYTHONPATH")}
    env["PYTHONPATH"] = str(site)
    code = (
        "import torch, ampkit\n"
        "from ampkit import bench\n"
        "assert ampkit.__file__.startswith(%r), ampkit.__file__\n"
        "with ampkit.autocast('cpu', dtype=torch.bfloat16):\n"
        "    y = torch.nn.functional.linear(torch.randn(2, 4), torch.randn(3, 4))\n"
        "assert y.dtype is torch.bfloat16\n"
        "print(ampkit.load_policy('torch_default').source)\n"
        "print(bench.spec_dir())\n"
        "print(sorted(bench.load_cases()))\n" % str(site))
    p = subprocess.run([sys.executable, "-c", code], cwd=work, env=env, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    policy, cases_dir, cases = p.stdout.strip().splitlines()
    assert policy == str(site / "ampkit" / "shared_specs" / "policies" / "torch_default.yaml")
    assert cases_dir == str(site / "ampkit" / "shared_specs" / "benchmarks")
    assert cases == str(sorted(p.stem for p in (REPO / "shared_specs" / "benchmarks").glob("*.yaml")))
