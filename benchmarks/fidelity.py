"""Fidelity: every variant's loss curve against the reference precision's, in the reference's own noise.

    python benchmarks/fidelity.py --profile tiny --steps 40 --seeds 3 --out benchmarks/results/fidelity
    python benchmarks/fidelity.py --profile full --steps 500 --seeds 5 --device cuda \
        [--cases seed_mlp,transformer] [--variants fp32,ampkit_amp] [--reference ampkit_bf16] \
        [--data stream] --out DIR
    python benchmarks/fidelity.py --from A/results.json B/results.json --reference ampkit_bf16 --out DIR

For each case and variant, seeds 0..N-1 (the model's init and the data's; seed s of every
variant trains on the same batches in the same order), `--steps` steps each, every step's
loss kept. Each variant's smoothed mean curve is compared with the reference's (fp32 by
default; `--reference` takes any variant) in units of the reference's seed-to-seed std, and
as a relative gap at 25/50/75/100% of the steps; verdict "same" when the final gap is inside
2 std (ampkit.bench's _fidelity module says how, step by step). ampkit's fp8 variant
(ampkit_fp8) runs on any device: where fp8 matmuls do not run (the CPU, CUDA under
capability 8.9) through ampkit's emulation, which quantizes exactly as the _scaled_mm path
(the report says so); ampkit_fp8_auto only where fp8 runs. `--data stream` (token cases)
trains on a fresh batch a step from a token map whose entropy is the loss's floor, instead of
the case's few batches, which the models memorise (a loss near 0 makes relative gaps say
little). Compiled variants are left
out unless named in --variants or --compiled is given (each seed compiles again). Writes
DIR/results.json (no timing records, a `fidelity` block), DIR/report.md and
DIR/fidelity.png; prints the tables. `make fidelity` runs the short CPU pass.

`--from` trains nothing: it reads the curves of earlier runs (one or several results.json
made with the same settings, e.g. one process per variant, each its own reference) and
compares every variant with `--reference`, writing the same three files.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "python"))
sys.path.insert(0, str(REPO / "benchmarks"))


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--profile", default="tiny", help="the cases' sizes and batches: tiny, cpu or full")
    p.add_argument("--cases", default="", help="comma-separated case names (default: all)")
    p.add_argument("--variants", default="", help="comma-separated variant names (default: every one not compiled)")
    p.add_argument("--compiled", action="store_true", help="with the default variants: the compiled ones too")
    p.add_argument("--reference", default="fp32", help="the variant the others are compared with (default fp32)")
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--seeds", type=int, default=3, help="seeds 0..N-1 per variant (at least 2)")
    p.add_argument("--window", type=int, default=None,
                   help="trailing mean over this many steps before comparing (default: steps / 20, at least 1)")
    p.add_argument("--data", default="case",
                   help="case: the case's own batches, taken epoch after epoch (default); stream: token "
                        "cases only, a fresh batch a step from a token map with a known entropy floor, "
                        "which no run can memorise (ampkit.bench.TokenStream)")
    p.add_argument("--device", default="auto", help="auto, cpu or cuda")
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: 1 on the CPU)")
    p.add_argument("--out", default=str(REPO / "benchmarks" / "results" / "fidelity"), help="output folder")
    p.add_argument("--from", dest="sources", nargs="+", default=None, metavar="RESULTS_JSON",
                   help="train nothing: compare the curves these results files hold (same settings) with "
                        "--reference")
    return p.parse_args(argv)


def from_files(a) -> int:
    """--from: the curves of earlier runs, compared anew with --reference."""
    from ampkit import bench
    import report

    try:
        docs = [bench.read_document(f) for f in a.sources]
        missing = [f for f, d in zip(a.sources, docs) if not d.get("fidelity")]
        if missing:
            raise ValueError("no fidelity block in %s: give results.json files written by benchmarks/fidelity.py"
                             % ", ".join(missing))
        section = bench.fidelity_recompare([d["fidelity"] for d in docs], a.reference)
    except (OSError, ValueError) as e:
        print("error: %s" % e, file=sys.stderr)
        return 2
    doc = bench.write_document(Path(a.out) / "results.json", docs[0]["context"], [], section)
    md = report.write(doc, a.out)
    print(report.fidelity(doc))
    print("\nreport: %s" % md)
    return 0


def main(argv=None) -> int:
    a = parse_args(argv)
    if a.sources:
        return from_files(a)
    import torch

    from ampkit import bench
    import report

    try:
        device = bench.resolve_device(a.device)
        cases, variants = bench.plan(a.profile, a.cases, a.variants)
        all_variants = bench.load_variants()
        if a.reference not in all_variants:
            raise ValueError("unknown --reference %r; valid variants: %s" % (a.reference, ", ".join(all_variants)))
        if not a.variants and not a.compiled:
            variants = [v for v in variants if v.compile == "none"]
        if a.seeds < 2 or a.steps < 1:
            raise ValueError("--seeds must be >= 2 (the reference's spread) and --steps >= 1; got %d and %d"
                             % (a.seeds, a.steps))
        bench.check_fidelity_data(a.data, [c.name for c in cases])
        window = bench.default_window(a.steps) if a.window is None else a.window
        if window < 1:
            raise ValueError("--window must be >= 1, got %d" % window)
    except ValueError as e:
        print("error: %s" % e, file=sys.stderr)
        return 2
    reference = all_variants[a.reference]
    torch.set_num_threads(a.threads or (1 if device == "cpu" else torch.get_num_threads()))
    runnable = [v for v in [reference] + [v for v in variants if v.name != reference.name]
                if not v.skip_reason(device, numerics=True)]
    tick = bench.FidelityProgress(len(cases) * len(runnable) * a.seeds)
    records = []
    for case in cases:
        records += bench.fidelity_records(case.name, variants, reference, a.profile, a.seeds, a.steps, device,
                                          window, on_curve=lambda v, s, c=case.name: tick(c, v, s), data=a.data)
    out = Path(a.out)
    section = bench.fidelity_section(records, reference=reference.name, profile=a.profile, device=device,
                                     seeds=a.seeds, steps=a.steps, window=window, data=a.data)
    doc = bench.write_document(out / "results.json", bench.context(a.profile, device, "python"), [], section)
    md = report.write(doc, out)
    print(report.fidelity(doc))
    print("\nreport: %s" % md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
