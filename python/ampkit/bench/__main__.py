"""The Python runner: python -m ampkit.bench --profile cpu --out raw-python.json [options].

benchmarks/run.py (make bench) calls this and benchmarks/run.R, then merges and reports.
With --engines it runs across processes, under torchrun (benchmarks/run.py --gpus N
launches it): python -m torch.distributed.run --nproc-per-node N -m ampkit.bench
--engines ddp,fsdp2 [--ddp-options SPEC ...] [--check] [--sequential] [--from-item K] --out events.jsonl
(see ampkit/bench/_engines.py); --out is then a JSON-lines log that rank 0 appends to.
There the variants of each case and engine configuration are timed interleaved (rounds
of one epoch each, the order rotating; --repeats rounds, by default the profile's
repeats and at least 3); --sequential times each variant alone, its epochs in a row.

In one process (no --engines) the variants of each case are timed interleaved too, the
compiled ones included (run_interleaved: --repeats rounds, by default the profile's
repeats): on the CPU all of a case's variants in one group, on CUDA the eager ones and the
compiled ones in two (interleave_groups: GPU memory); --sequential times each alone.
"""

from __future__ import annotations

import argparse
import sys

import torch

from ampkit.bench import _spec
from ampkit.bench._build import build_case, resolve_device
from ampkit.bench._engines import DDP_OPTIONS, ENGINES, parse_engines, plan_runs, run_items
from ampkit.bench._results import context, write_document
from ampkit.bench._pairing import pair_groups, pair_unit
from ampkit.bench._runner import progress, run_interleaved, run_variant


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
    p.add_argument("--engines", default=None,
                   help="across processes, under torchrun: comma-separated engines (%s)" % ", ".join(ENGINES))
    p.add_argument("--ddp-options", action="append", default=None, metavar="SPEC",
                   help="a DDP configuration to run ('default' or key=value,... among %s); repeat "
                        "for several" % ", ".join(DDP_OPTIONS))
    p.add_argument("--check", action="store_true", help="with --engines: also check captured against eager steps")
    p.add_argument("--sequential", action="store_true",
                   help="time each variant alone, its epochs in a row, instead of the variants of each case (with "
                        "--engines: of each case and engine configuration) interleaved, round by round")
    p.add_argument("--from-item", type=int, default=0, help="with --engines: the first item of the plan to run")
    p.add_argument("--run-timeout", type=float, default=300.0,
                   help="with --engines: seconds one item may take before the process ends with its stack")
    p.add_argument("--deadline", type=float, default=None,
                   help="with --engines: a Unix time after which the items left are recorded as skipped")
    return p.parse_args(argv)


def interleave_groups(variants, device: str) -> list:
    """The groups timed interleaved in one process, in the variants' order: on CUDA the
    eager variants and the compiled ones apart (every variant of a group is alive at once,
    and the captured and reduce-overhead ones keep their graphs' memory: two groups halve
    what a large case holds; the compiled rivals still share their window), on the CPU one.

    >>> class V:
    ...     def __init__(self, name, compile): self.name, self.compile = name, compile
    >>> vs = [V("fp32", "none"), V("torch_compile_ro", "reduce-overhead"), V("ampkit_step", "none")]
    >>> [[v.name for v in g] for g in interleave_groups(vs, "cuda")]
    [['fp32', 'ampkit_step'], ['torch_compile_ro']]
    >>> [[v.name for v in g] for g in interleave_groups(vs, "cpu")]
    [['fp32', 'torch_compile_ro', 'ampkit_step']]
    """
    if device != "cuda":
        return [list(variants)]
    eager = [v for v in variants if v.compile == "none"]
    compiled = [v for v in variants if v.compile != "none"]
    return [g for g in (eager, compiled) if g]


def main(argv=None) -> int:
    a = parse_args(argv)
    try:
        cases, variants = _spec.plan(a.profile, a.cases, a.variants)
        device = resolve_device(a.device)
        if a.repeats is not None and a.repeats < 1:
            raise ValueError("--repeats must be >= 1, got %d" % a.repeats)
        engines = parse_engines(a.engines, a.ddp_options) if a.engines is not None else None
    except ValueError as e:
        print("error: %s" % e, file=sys.stderr)
        return 2
    if a.threads:
        torch.set_num_threads(a.threads)
    if engines is not None:
        items = plan_runs([c.name for c in cases], engines, [v.name for v in variants], a.check)
        run_items(items, a.from_item, profile=a.profile, device=device, seed=a.seed, repeats=a.repeats,
                  out=a.out, run_timeout=a.run_timeout, deadline=a.deadline, interleave=not a.sequential)
        return 0
    variants = [v for v in variants if "python" in v.languages]
    total, records = len(cases) * len(variants), []
    for case in cases:
        built = build_case(case, a.profile, seed=a.seed, device=device, repeats=a.repeats)
        if a.sequential:
            for v in variants:
                rec = run_variant(built, v, language="python")
                records.append(rec)
                progress("python", len(records), total, rec)
        else:
            for group in interleave_groups(variants, device):
                pairs = ["%s paired with %s: a %s of each in turn" % (
                    ((group[j].name, group[i].name) if group[j].paired_with == group[i].name
                     else (group[i].name, group[j].name)) + (pair_unit(device),))
                    for i, j in (u for u in pair_groups(group) if len(u) == 2)]
                print("[python] %s: %s, %d round(s) in turn%s" % (
                    case.name, ", ".join(v.name for v in group), built.repeats,
                    "".join("; " + p for p in pairs)), file=sys.stderr, flush=True)
                for rec in run_interleaved(built, group, language="python"):
                    records.append(rec)
                    progress("python", len(records), total, rec)
        del built
    write_document(a.out, context(a.profile, device, "python", seed=a.seed), records)
    return 0


if __name__ == "__main__":
    sys.exit(main())
