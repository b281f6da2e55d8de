"""Shared test set-up for the Python suite.

- ``@pytest.mark.cuda`` tests are skipped cleanly without a CUDA GPU.
- ``ampkit_quiet``: one CPU thread (deterministic kernels) and no deprecation
  noise from sample ops; the autocast test modules opt in with
  ``pytestmark = pytest.mark.usefixtures("ampkit_quiet")``.
"""

from __future__ import annotations

import warnings

import pytest
import torch


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (run on the device machine: pytest -m cuda)")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)


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
