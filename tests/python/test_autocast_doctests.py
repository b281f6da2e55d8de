"""The runnable examples in the autocast modules' docstrings."""

from __future__ import annotations

import doctest

import pytest

import ampkit
from ampkit import _autocast, _decompositions, _ops, _policy, _trace, testing

pytestmark = pytest.mark.usefixtures("ampkit_quiet")


@pytest.mark.parametrize("module", [ampkit, _autocast, _decompositions, _ops, _policy, _trace, testing], ids=lambda m: m.__name__)
def test_docstring_examples(module):
    result = doctest.testmod(module, optionflags=doctest.ELLIPSIS)
    assert result.attempted > 0 and result.failed == 0
