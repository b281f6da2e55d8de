"""The runnable examples in every ampkit module's docstrings (docs that match the code)."""

from __future__ import annotations

import doctest
import importlib
import pkgutil

import pytest

import ampkit

pytestmark = pytest.mark.usefixtures("ampkit_quiet")

# Every module of the package except command-line entry points, found by walking it, so a
# new module's examples are checked without touching this file.
MODULES = ["ampkit"] + sorted(
    m.name for m in pkgutil.walk_packages(ampkit.__path__, "ampkit.") if not m.name.endswith("__main__")
)


@pytest.mark.parametrize("name", MODULES)
def test_docstring_examples(name):
    module = importlib.import_module(name)
    finder = doctest.DocTestFinder()
    if not any(t.examples for t in finder.find(module)):
        pytest.skip(f"{name} has no docstring examples")
    result = doctest.testmod(module, optionflags=doctest.ELLIPSIS)
    assert result.attempted > 0 and result.failed == 0
