"""What each rank runs in test_bench_across.py's interleaved-group test (spawned processes
import this module).

On the tiny text_classifier (its dropout draws from the random state, so a variant trains
the same only if interleaving leaves each variant its own random stream), DDP over gloo,
every rank runs the same three variants:

- ``sequential``: each alone through ``run_variant`` (the timing before interleaving);
- ``interleaved``: the three through ``run_interleaved`` (3 rounds, the order rotating);
- ``failing``: the same group, where ampkit_amp's build raises on rank 1 only (after DDP is
  built: no collective is pending) and ampkit_step's step raises on every rank at the first
  step of its second epoch.

Each rank pickles its records to ``out_dir/rank<r>.pkl`` (gloo_ranks.run_rank).
"""

from __future__ import annotations

import ampkit
from ampkit import bench
from gloo_ranks import run_rank

VARIANTS = ("torch_amp", "ampkit_amp", "ampkit_step")
ROUNDS = 3


def _failing(rank: int):
    """Patch the build (ampkit_amp, rank 1) and the captured step (ampkit_step, its 3rd call:
    the tiny profile has no warm-up and 2 batches an epoch); returns the undo."""
    build, make_train_step = bench.VariantRun.build, ampkit.make_train_step

    def broken_build(self):
        build(self)
        if self.variant.name == "ampkit_amp" and rank == 1:
            raise RuntimeError("ampkit_amp's build broke on rank 1")

    def broken_make_train_step(*args, **kwargs):
        step, calls = make_train_step(*args, **kwargs), [0]

        def wrapped(x, y):
            calls[0] += 1
            if calls[0] == 3:
                raise RuntimeError("ampkit_step's second epoch broke")
            return step(x, y)
        return wrapped

    bench.VariantRun.build, ampkit.make_train_step = broken_build, broken_make_train_step

    def undo():
        bench.VariantRun.build, ampkit.make_train_step = build, make_train_step
    return undo


def _body(rank: int) -> dict:
    built = bench.build_case("text_classifier", "tiny", seed=0, device="cpu", repeats=ROUNDS)
    variants = [bench.load_variants()[v] for v in VARIANTS]
    placement = bench.Placement(bench.Engine("ddp"), "cpu")
    result = {"sequential": [bench.run_variant(built, v, placement=placement) for v in variants],
              "interleaved": bench.run_interleaved(built, variants, placement=placement)}
    undo = _failing(rank)
    try:
        result["failing"] = bench.run_interleaved(built, variants, placement=placement)
    finally:
        undo()
    return result


def run(rank: int, world: int, port: int, out_dir: str) -> None:
    run_rank(rank, world, port, out_dir, _body)
