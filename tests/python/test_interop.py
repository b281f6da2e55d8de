"""ampkit's scaler inside libraries that take a torch.amp.GradScaler (not dependencies:
each test runs only where its library is installed)."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.skipif(importlib.util.find_spec("lightning") is None, reason="PyTorch Lightning is not installed")
def test_lightning_mixed_precision_drives_ampkit_scaler_as_torch_scaler():
    p = subprocess.run([sys.executable, str(REPO / "benchmarks" / "interop" / "lightning_scaler.py")],
                       capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-2000:]
    assert "inf batch 1 skipped by ampkit: True; scale 1024 -> 512" in p.stdout
    assert "ampkit's scaler in Lightning's MixedPrecision: same as torch's" in p.stdout
