"""Shared by test_bench.py and test_bench_r.py: the Python runner's tiny-profile records.

Every case x variant at the tiny profile, computed once per test session (the compiled
variants compile each case's model: seconds apiece, so both modules share one run) and
handed out as deep copies (`bench.derive` fills records in place).
"""

from __future__ import annotations

import copy
import functools

from ampkit import bench


@functools.lru_cache(maxsize=None)
def _tiny_python_records() -> tuple:
    recs = []
    for name in sorted(bench.load_cases()):
        built = bench.build_case(name, "tiny", seed=0, device="cpu")
        recs += [bench.run_variant(built, v) for v in bench.load_variants().values() if "python" in v.languages]
    return tuple(recs)


def tiny_python_records() -> list:
    """Python records of every case x variant (tiny profile, seed 0, CPU), not yet derived."""
    return copy.deepcopy(list(_tiny_python_records()))
