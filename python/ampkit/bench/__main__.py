"""The Python runner: python -m ampkit.bench --profile cpu --out raw-python.json [options].

benchmarks/run.py (make bench) calls this and benchmarks/run.R, then merges and reports.
"""

from __future__ import annotations

import argparse
import sys

import torch

from ampkit.bench import _spec
from ampkit.bench._build import build_case, resolve_device
from ampkit.bench._results import context, write_document
from ampkit.bench._runner import progress, run_variant


def parse_args(argv=None):
    p = argparse.ArgumentParser(prog="python -m ampkit.bench", description=__doc__)
    p.add_argument("--profile", default="cpu", help="one of: %s" % ", ".join(_spec.PROFILES))
    p.add_argument("--cases", default="", help="comma-separated case names (default: all)")
    p.add_argument("--variants", default="", help="comma-separated variant names (default: all)")
    p.add_argument("--repeats", type=int, default=None, help="timed repeats (default: the profile's)")
    p.add_argument("--device", default="auto", help="auto, cpu or cuda")
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", required=True, help="results JSON file to write")
    return p.parse_args(argv)


def main(argv=None) -> int:
    a = parse_args(argv)
    try:
        cases, variants = _spec.plan(a.profile, a.cases, a.variants)
        device = resolve_device(a.device)
        if a.repeats is not None and a.repeats < 1:
            raise ValueError("--repeats must be >= 1, got %d" % a.repeats)
    except ValueError as e:
        print("error: %s" % e, file=sys.stderr)
        return 2
    if a.threads:
        torch.set_num_threads(a.threads)
    variants = [v for v in variants if "python" in v.languages]
    total, records = len(cases) * len(variants), []
    for case in cases:
        built = build_case(case, a.profile, seed=a.seed, device=device, repeats=a.repeats)
        for v in variants:
            rec = run_variant(built, v, language="python")
            records.append(rec)
            progress("python", len(records), total, rec)
        del built
    write_document(a.out, context(a.profile, device, "python", seed=a.seed), records)
    return 0


if __name__ == "__main__":
    sys.exit(main())
