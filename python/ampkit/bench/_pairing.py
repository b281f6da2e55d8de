"""Paired timing: a variant timed against its control (``Variant.paired_with``) in turns.

A cost of a few percent (``ampkit_step_eager`` against ``ampkit_amp_fused``, the same step
written by hand) is lost in the swing of whole epochs on a shared machine. When a variant
and its control run in the same group (``run_interleaved``, and the R runner), each round
runs the two as one unit, at the place in the rotation of the first of them:

    on the CPU ("step"):  for each batch i, one step of each, each step timed alone by the
                          wall clock; the first of the two is pair_order(i, round)[0], so
                          the order alternates from batch to batch and from round to round
    on CUDA ("epoch"):    an epoch of each, adjacent, pair_order(0, round) (a per-step sync
                          would change what is measured)

Each timed pair gives a ratio this / control; ``pair_summary`` keeps the times and the
median and quartiles of those ratios. A round's sample of each variant stays its epoch's
ms/step (its step times of the round summed / num_batches), as for every other variant.

>>> [pair_order(i, 0) for i in range(3)], pair_order(0, 1)
([[0, 1], [1, 0], [0, 1]], [1, 0])
>>> s = pair_summary("ampkit_amp_fused", "step", [2.0, 3.0, 4.0], [2.0, 2.0, 4.0])
>>> s["n"], s["ratio"], s["q1"], s["q3"]
(3, 1.0, 1.0, 1.25)
"""

from __future__ import annotations

import statistics

UNITS = ("step", "epoch")


def pair_groups(variants) -> list:
    """The units of a group of variants, as lists of indices in the group's order: [i] for a
    variant alone, [i, j] (i < j) for a variant and its control (``paired_with``) that are
    both in the group, at the place of the first of them. A control pairs once (the first
    variant that names it). Works on anything with ``name`` and ``paired_with``.

    >>> from types import SimpleNamespace as V
    >>> vs = [V(name="a", paired_with=None), V(name="c", paired_with=None), V(name="b", paired_with=None),
    ...       V(name="e", paired_with="c")]
    >>> pair_groups(vs), pair_groups([vs[0], vs[2], vs[3]])
    ([[0], [1, 3], [2]], [[0], [1], [2]])
    """
    index = {v.name: i for i, v in enumerate(variants)}
    partner = {}
    for i, v in enumerate(variants):
        j = index.get(getattr(v, "paired_with", None))
        if j is not None and j != i and i not in partner and j not in partner:
            partner[i], partner[j] = j, i
    units, seen = [], set()
    for i in range(len(variants)):
        if i not in seen:
            unit = sorted([i, partner[i]]) if i in partner else [i]
            units.append(unit)
            seen.update(unit)
    return units


def pair_order(i: int, rnd: int) -> list:
    """The order of a pair's two members (0: the first of them in the group's order, 1: the
    other) at batch ``i`` of round ``rnd``: ``round_order(2, i + rnd)``, the runner's
    rotation of two, so that each goes first as often as the other, batch to batch and
    round to round (on CUDA, an epoch a unit: ``pair_order(0, rnd)``)."""
    from ampkit.bench._runner import round_order
    return round_order(2, int(i) + int(rnd))


def pair_unit(device: str, placement=None) -> str:
    """The grain of a pair's turns: "step" on the CPU in one process (no sync is needed to
    time a step), else "epoch" (on CUDA a per-step sync would change what is measured;
    across processes a barrier a step would too).

    >>> pair_unit("cpu"), pair_unit("cuda")
    ('step', 'epoch')
    """
    return "step" if device == "cpu" and placement is None else "epoch"


def pair_summary(with_: str, unit: str, this_ms, control_ms) -> dict:
    """The record's ``paired`` field: the control's name, the unit, the times of each pair
    (ms: a step's, or an epoch's ms/step), their count ``n`` and the median and quartiles
    (inclusive method) of the per-pair ratios this / control."""
    if unit not in UNITS:
        raise ValueError("unit must be one of %s, got %r" % (", ".join(UNITS), unit))
    this = [float(t) for t in this_ms]
    control = [float(t) for t in control_ms]
    if len(this) != len(control) or not this:
        raise ValueError("pair_summary needs as many times of the control as of the variant, at least one; "
                         "got %d and %d" % (len(this), len(control)))
    ratios = [a / b for a, b in zip(this, control)]
    q = statistics.quantiles(ratios, n=4, method="inclusive") if len(ratios) >= 2 else [ratios[0]] * 3
    return {"with": str(with_), "unit": unit, "n": len(ratios), "ratio": statistics.median(ratios),
            "q1": q[0], "q3": q[2], "this_ms": this, "control_ms": control}
