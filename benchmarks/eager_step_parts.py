"""Where the eager train step's added host time goes, by switching its safety parts off
one at a time (issue 25): an A/B in one process, never a test.

    PYTHONPATH=$PWD/python OMP_NUM_THREADS=1 python3 benchmarks/eager_step_parts.py --cases seed_mlp
    PYTHONPATH=$PWD/python python3 benchmarks/eager_step_parts.py --device cuda --cases seed_mlp,convnet

The hand-written loop and ``make_train_step`` (benchmarks/eager_step_cost.py's pair: same
weights, optimizer, scaler) are timed in interleaved rounds, the order alternating, with
the step as shipped ("full") and with one part replaced by a no-op:

  no_why_copy     the verdict on the optimizer (rollback.why_copy: its key, its checks)
  no_hold         holding SIGINT/SIGTERM while the optimizer writes (HeldSignals)
  no_buffers      the model buffers' copy and the check that they are still the same
  no_step_copy    the step object's own attributes kept for a rollback
  none            all four off: what is left is the step's plain Python around the body

Switched-off steps are unsafe (a failed call is not undone): this script only measures.
Printed: per variant the median over rounds of this thread's CPU time and of the wall
time per step, and each one less the hand-written loop's.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "python"))

import torch  # noqa: E402

import ampkit.bench as bench  # noqa: E402
import eager_step_cost as esc  # noqa: E402
from ampkit import _train_step  # noqa: E402

VARIANTS = ("hand", "full", "no_why_copy", "no_hold", "no_buffers", "no_step_copy", "none")


class _NoHold:
    came = ()  # (the step reads which signals came while it held them: none)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False

    def deliver(self):
        pass


def _switch(step, variant, originals):
    """Put the step's parts back as shipped, then switch off what ``variant`` names."""
    _train_step.why_copy, _train_step.HeldSignals = originals["why_copy"], originals["held"]
    vars(step).pop("_save_for_rollback", None)
    vars(step._kept_buffers).pop("save", None)
    off = {"none": ("no_why_copy", "no_hold", "no_buffers", "no_step_copy")}.get(variant, (variant,))
    if "no_why_copy" in off:
        _train_step.why_copy = lambda *a: None
    if "no_hold" in off:
        _train_step.HeldSignals = _NoHold
    if "no_buffers" in off:
        step._kept_buffers.save = lambda: None
    if "no_step_copy" in off:
        step._save_for_rollback = lambda: ({}, [])


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    ap.add_argument("--cases", default="seed_mlp")
    ap.add_argument("--setting", default="fused", choices=("fused", "plain", "fallback"))
    ap.add_argument("--rounds", type=int, default=31)
    args = ap.parse_args(argv)
    dtype = torch.float16 if args.device == "cuda" else torch.bfloat16
    cases = bench.load_cases()
    print(f"{torch.cuda.get_device_name() if args.device == 'cuda' else 'cpu'}, torch {torch.__version__}, "
          f"{args.setting}, {args.rounds} rounds of "
          f"{'one epoch (full profile)' if args.device == 'cuda' else '20 steps (shrunk profile)'} each")
    for name in args.cases.split(","):
        if args.device == "cuda":
            built = bench.build_case(cases[name], "full", device="cuda")
        else:
            built = bench.build_case(esc.shrunk(cases[name]), "shrunk", seed=0, device="cpu")
        steps, batches = esc.make_pair(built, dtype, args.setting)
        if args.device == "cpu":
            batches = (batches * 20)[:20]
        eager = steps["eager"]
        step = eager
        originals = {"why_copy": _train_step.why_copy, "held": _train_step.HeldSignals}
        times = {v: [] for v in VARIANTS}
        try:
            for _ in range(2):
                for v in VARIANTS:
                    _switch(step, v, originals)
                    esc.time_ms(steps["hand"] if v == "hand" else eager, built, batches)
            for r in range(args.rounds):
                for v in (VARIANTS if r % 2 == 0 else VARIANTS[::-1]):
                    _switch(step, v, originals)
                    times[v].append(esc.time_ms(steps["hand"] if v == "hand" else eager, built, batches))
        finally:
            _switch(step, "full", originals)
        hand = [statistics.median(t[i] for t in times["hand"]) for i in (0, 1)]
        print(f"{name}: {'variant':14s} {'cpu us':>9s} {'added':>8s} {'wall us':>9s} {'added':>8s}")
        for v in VARIANTS:
            wall, cpu = (statistics.median(t[i] for t in times[v]) for i in (0, 1))
            print(f"{'':{len(name) + 2}s}{v:14s} {cpu * 1e3:9.1f} {(cpu - hand[1]) * 1e3:8.1f} "
                  f"{wall * 1e3:9.1f} {(wall - hand[0]) * 1e3:8.1f}")


if __name__ == "__main__":
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        main()
