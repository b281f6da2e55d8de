"""Where the shared specs are: the one place that finds policies and benchmark cases.

The YAML specs live once, in the repository's ``shared_specs/`` (both languages read
them there). A wheel ships the same folder inside the package, as
``ampkit/shared_specs`` (pyproject.toml maps it in at build time; git holds one copy).
:func:`specs_root` looks in this order:

1. ``ampkit/shared_specs`` beside this file (an installed wheel);
2. ``shared_specs`` in a folder above this file (a checkout, an editable install);
3. ``$AMPKIT_REPO/shared_specs`` (a checkout named by the environment).

``$AMPKIT_BENCH_SPECS`` names another folder of benchmark cases (for
:func:`bench_dir` only).

>>> (specs_root() / "policies" / "torch_default.yaml").is_file()
True
>>> sorted(p.name for p in bench_dir().glob("seed_*.yaml"))
['seed_mlp.yaml']
"""

from __future__ import annotations

import os
from pathlib import Path

SPECS_FOLDER = "shared_specs"
_HERE = Path(__file__).resolve().parent


class SpecsNotFoundError(FileNotFoundError):
    """Neither the installed package nor a checkout holds ``shared_specs``."""


def _candidates() -> list:
    out = [_HERE / SPECS_FOLDER]
    out += [parent / SPECS_FOLDER for parent in _HERE.parents]
    repo = os.environ.get("AMPKIT_REPO")
    if repo:
        out.append(Path(repo) / SPECS_FOLDER)
    return out


def specs_root() -> Path:
    """The ``shared_specs`` folder this ampkit reads (see the module's docstring for the order)."""
    tried = _candidates()
    for cand in tried:
        if (cand / "policies").is_dir():
            return cand
    raise SpecsNotFoundError(
        "cannot find ampkit's shared_specs (policies and benchmark cases); looked in "
        + ", ".join(str(c) for c in tried[:3]) + (" and above" if len(tried) > 3 else "")
        + ". Reinstall ampkit (`pip install ampkit` ships them) or set AMPKIT_REPO to a checkout")


def policy_dir() -> Path:
    """The folder of shipped cast policies (``shared_specs/policies``)."""
    return specs_root() / "policies"


def bench_dir() -> Path:
    """The folder of benchmark cases: ``$AMPKIT_BENCH_SPECS`` when set, else ``shared_specs/benchmarks``."""
    env = os.environ.get("AMPKIT_BENCH_SPECS")
    if env:
        return Path(env)
    return specs_root() / "benchmarks"
