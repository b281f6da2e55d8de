"""Shared test set-up for the Python suite.

- ``@pytest.mark.cuda`` tests are skipped cleanly without a CUDA GPU.
- ``ampkit_quiet``: one CPU thread (deterministic kernels) and no deprecation
  noise from sample ops; the autocast test modules opt in with
  ``pytestmark = pytest.mark.usefixtures("ampkit_quiet")``.
- Plain helpers the test modules import (``from conftest import bits_equal``):
  ``bits_equal`` (bitwise tensor equality) and ``SyncError`` (a CUDA host-device sync
  inside it raises); ``TORCH_BEFORE_2_5`` and ``needs_no_declared_differences`` for
  what differs on the oldest supported torch; ``compiles_correctly_here`` skips a
  torch.compile comparison under CPU-capability emulation (no oracle there);
  ``cpu_scaled_mm_on`` turns the fp8 tier's ``_scaled_mm`` path on for the CPU, or skips
  where this CPU cannot run torch's CPU ``_scaled_mm``.
"""

from __future__ import annotations

import os
import warnings

import pytest
import torch

from ampkit import _kernels, _native

# torch < 2.5 (the oldest torch ampkit supports is 2.4): what its dynamo cannot trace
TORCH_BEFORE_2_5 = _native.torch_version() < (2, 5)
# ops the installed torch is declared to handle otherwise than the shipped table
# (ampkit._native.NATIVE_DIFFERS): a default region then has a delta, and a handler
needs_no_declared_differences = pytest.mark.skipif(
    bool(_native.differs("cpu")),
    reason=f"torch {torch.__version__} differs from the shipped cpu table in {sorted(_native.differs('cpu'))} "
    "(ampkit._native.NATIVE_DIFFERS): the default policy has a delta on this torch",
)


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (run on the device machine: pytest -m cuda)")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def torch_autocast_as_shipped():
    """Each test starts with torch's own autocast kernels: a kernel that an earlier test's
    changed region left registered (idle, doing native's handling without native's cast
    cache, ampkit/_kernels.py) is given back after every test."""
    yield
    _kernels.drop_idle()


@pytest.fixture
def ampkit_quiet():
    """Deterministic CPU kernels and no deprecation noise from sample ops."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        warnings.simplefilter("ignore", FutureWarning)
        warnings.simplefilter("ignore", DeprecationWarning)
        yield
    torch.set_num_threads(n)


def bits_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bitwise equality (NaN payloads included); dtype and shape must match."""
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    return torch.equal(
        a.detach().contiguous().reshape(-1).view(torch.uint8),
        b.detach().contiguous().reshape(-1).view(torch.uint8),
    )


class SyncError:
    """``with SyncError(): ...``: any CUDA host-device sync inside raises a RuntimeError
    (``torch.cuda.set_sync_debug_mode("error")``, back to ``"default"`` on exit)."""

    def __enter__(self):
        torch.cuda.set_sync_debug_mode("error")
        return self

    def __exit__(self, *exc):
        torch.cuda.set_sync_debug_mode("default")
        return False


def compiles_correctly_here(dev):
    """torch.compile's CPU kernels ignore ATEN_CPU_CAPABILITY (the AVX2 emulation on an
    AVX-512 machine): under it even a float32 compiled Linear differs from eager (NaN), so
    there is no oracle to compare with."""
    if dev == "cpu" and os.environ.get("ATEN_CPU_CAPABILITY"):
        pytest.skip("torch.compile on the CPU under ATEN_CPU_CAPABILITY emulation gives wrong results "
                    "even without autocast; run on a machine whose CPU is that kind")


_CPU_SCALED_MM_ERROR = None  # None: not probed yet; "": it runs


def cpu_scaled_mm_on(monkeypatch):
    """Turn the fp8 tier's ``_scaled_mm`` path on for the CPU (``SCALED_MM_DEVICES``; shipped,
    the CPU runs the emulation), or skip where torch's CPU ``_scaled_mm`` cannot run: oneDNN
    has no fp8 matmul for an AVX2-only CPU ("could not create a primitive descriptor for the
    matmul primitive", seen under ONEDNN_MAX_CPU_ISA=AVX2)."""
    global _CPU_SCALED_MM_ERROR
    if _CPU_SCALED_MM_ERROR is None:
        a, one = torch.ones(16, 16).to(torch.float8_e4m3fn), torch.tensor(1.0)
        try:
            for out_dtype in (torch.bfloat16, torch.float32):  # the forward's and grad_w's
                torch._scaled_mm(a, a.t(), scale_a=one, scale_b=one, out_dtype=out_dtype)
            _CPU_SCALED_MM_ERROR = ""
        except (RuntimeError, NotImplementedError, AttributeError) as e:
            _CPU_SCALED_MM_ERROR = (str(e).split(". ")[0] or type(e).__name__).strip()
    if _CPU_SCALED_MM_ERROR:
        pytest.skip("torch's CPU _scaled_mm does not run on this CPU (%s); the emulated path's "
                    "tests still run" % _CPU_SCALED_MM_ERROR)
    from ampkit import _fp8
    monkeypatch.setattr(_fp8, "SCALED_MM_DEVICES", {"cuda", "cpu"})
