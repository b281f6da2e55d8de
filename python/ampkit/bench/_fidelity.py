"""Fidelity: does a variant train like the reference precision, within the reference's own noise?

For each case, every variant trains from N seeds (model init seed s = 0..N-1) for a fixed
number of steps, and each step's loss is kept. The data are paired: seed s of every variant
trains on the same batches in the same order (``batch_order``), so that two variants of one
seed differ only in their arithmetic. Then, per variant, against the reference (fp32 by
default; any variant, e.g. a bfloat16 one for an fp8 comparison):

    smooth each seed's curve:   S[s, t] = mean(loss[s, max(1, t-w+1) .. t])    (trailing, w steps)
    mean curve:                 M[t]    = mean over seeds of S[s, t]
    reference spread:           sd[t]   = std over the reference's seeds of S_ref[s, t]  (n-1)
    gap in std:                 g[t]    = |M[t] - M_ref[t]| / sd[t]
    relative gap:               r[t]    = (M[t] - M_ref[t]) / |M_ref[t]|
    verdict:                    "same" when g[T] <= 2 (the final step's gap is inside the
                                reference's own seed-to-seed noise), else "different"

The checkpoints are the steps at 25, 50, 75 and 100% of the run (rounded up). DeepSeek-V3's
"fp8 within 0.25% relative loss of bf16" is r[T]; a gap inside the reference's own noise is
the honest "same".

>>> ref = [[1.0, 0.8, 0.6], [1.2, 1.0, 0.8]]         # two seeds, three steps
>>> var = [[1.2, 1.0, 0.8], [1.2, 1.0, 0.8]]         # 0.1 above the reference's mean
>>> gap = compare(var, ref, window=1)
>>> round(gap.final_rel_gap, 4), round(gap.final_gap_std, 4), gap.verdict   # 0.1 / 0.7, 0.1 / 0.1414
(0.1429, 0.7071, 'same')
"""

from __future__ import annotations

import dataclasses
import math
import sys
import time

import torch

from ampkit.bench._build import build_case
from ampkit.bench._fp8_tier import emulation_note
from ampkit.bench._runner import VariantRun, precision_flags
from ampkit.bench._spec import Variant, load_cases, load_variants
from ampkit.bench._stream import TokenStream
from ampkit.bench._stream import floor as stream_floor

CHECKPOINTS = (0.25, 0.5, 0.75, 1.0)
THRESHOLD_STD = 2.0
DATA_SOURCES = ("case", "stream")  # the case's own batches, or a fresh TokenStream batch a step


def default_window(steps: int) -> int:
    """The smoothing window: a twentieth of the steps, at least 1 (25 steps of 500).

    >>> default_window(500), default_window(40), default_window(5)
    (25, 2, 1)
    """
    return max(1, int(steps) // 20)


def checkpoint_steps(steps: int, fractions=CHECKPOINTS) -> list:
    """The 1-based steps at each fraction of the run, rounded up.

    >>> checkpoint_steps(500), checkpoint_steps(10)
    ([125, 250, 375, 500], [3, 5, 8, 10])
    """
    return [max(1, math.ceil(f * steps - 1e-9)) for f in fractions]


def batch_order(num_batches: int, steps: int, seed: int) -> list:
    """The index of the batch each step of seed ``seed`` trains on: one random permutation of
    the batches per epoch, from a generator of its own seeded with ``seed``. Every variant of
    a seed gets the same order (paired data); another seed another one.

    >>> batch_order(4, 6, 0) == batch_order(4, 6, 0), sorted(batch_order(4, 8, 1)[:4])
    (True, [0, 1, 2, 3])
    """
    gen = torch.Generator().manual_seed(int(seed))
    order = []
    while len(order) < steps:
        order += torch.randperm(num_batches, generator=gen).tolist()
    return order[:steps]


def smooth(curve, window: int) -> list:
    """Trailing mean over ``window`` steps (fewer at the start).

    >>> smooth([1.0, 3.0, 5.0, 7.0], 2)
    [1.0, 2.0, 4.0, 6.0]
    """
    out, total = [], 0.0
    for t, x in enumerate(curve):
        total += x
        if t >= window:
            total -= curve[t - window]
        out.append(total / min(t + 1, window))
    return out


def _mean_std(columns):
    n = len(columns)
    mean = sum(columns) / n
    std = math.sqrt(sum((x - mean) ** 2 for x in columns) / (n - 1)) if n > 1 else 0.0
    return mean, std


@dataclasses.dataclass(frozen=True)
class Gap:
    """A variant's curves against the reference's (see the module's docstring), per step
    (0-based lists) and at the checkpoints. ``gap_std`` (``rel_gap``) is None where the
    reference's spread (mean loss) is 0 and the means differ."""

    mean: list
    ref_mean: list
    ref_std: list
    gap_std: list
    rel_gap: list
    checkpoints: list
    final_rel_gap: float
    final_gap_std: float | None
    max_gap_std: float | None
    verdict: str


def compare(losses, ref_losses, window: int, fractions=CHECKPOINTS, threshold: float = THRESHOLD_STD) -> Gap:
    """``losses`` and ``ref_losses``: one list of per-step losses per seed (same steps)."""
    steps = len(ref_losses[0])
    if len(ref_losses) < 2:
        raise ValueError("fidelity needs at least 2 seeds of the reference for its spread, got %d; "
                         "pass --seeds 2 or more" % len(ref_losses))
    if any(len(c) != steps for c in list(losses) + list(ref_losses)):
        raise ValueError("every curve must have the reference's %d steps" % steps)
    sm = [smooth(c, window) for c in losses]
    ref_sm = [smooth(c, window) for c in ref_losses]
    mean = [_mean_std([c[t] for c in sm])[0] for t in range(steps)]
    ref = [_mean_std([c[t] for c in ref_sm]) for t in range(steps)]
    gap_std, rel_gap = [], []
    for m, (rm, sd) in zip(mean, ref):
        diff = m - rm
        gap_std.append(abs(diff) / sd if sd > 0 else (0.0 if diff == 0 else None))
        rel_gap.append(diff / abs(rm) if rm != 0 else (0.0 if diff == 0 else None))
    points = [dict(step=s, rel_gap=rel_gap[s - 1], gap_std=gap_std[s - 1]) for s in checkpoint_steps(steps, fractions)]
    final = gap_std[-1]
    defined = [g for g in gap_std if g is not None]
    max_gap = None if len(defined) < steps else max(defined)
    return Gap(mean=mean, ref_mean=[m for m, _ in ref], ref_std=[sd for _, sd in ref], gap_std=gap_std,
               rel_gap=rel_gap, checkpoints=points, final_rel_gap=rel_gap[-1], final_gap_std=final,
               max_gap_std=max_gap, verdict="same" if final is not None and final <= threshold else "different")


def train_curve(case, variant: Variant, profile: str, seed: int, steps: int, device: str,
                data: str = "case", notes: list | None = None) -> list:
    """The per-step training losses of one variant from one seed: the case's model built from
    ``seed``, its batches drawn from ``seed`` (``build_case``) and taken in ``batch_order``;
    with ``data="stream"`` (token cases) a fresh ``TokenStream`` batch of the case's sizes each
    step instead, drawn from ``seed``.
    The losses stay on the device until the end (one copy a step, no host sync). ``notes``, a
    list, gets what the build did to the model (an fp8 variant's policy, fp8 auto's choice),
    or None."""
    built = build_case(case, profile, seed=seed, device=device)
    if data == "stream":
        stream = token_stream(built, seed)
        batches = (stream.batch() for _ in range(steps))
    else:
        batches = (built.batches[i] for i in batch_order(built.num_batches, steps, seed))
    run = VariantRun(built, variant, "python", None, 0)
    run.build()
    if notes is not None:
        notes.append(run.model_note)
    curve = torch.empty(steps, dtype=torch.float64, device=device)
    with precision_flags(variant, device):
        for t, batch in enumerate(batches):
            curve[t] = run.step(*batch).detach()  # a copy: a captured step reuses its output
    out = curve.tolist()
    run.close()
    bad = next((t for t, x in enumerate(out) if not math.isfinite(x)), None)
    if bad is not None:
        raise FloatingPointError("loss not finite (%r) at step %d of seed %d" % (out[bad], bad + 1, seed))
    return out


def token_stream(built, seed: int) -> TokenStream:
    """The ``TokenStream`` of a built token case: its vocabulary, batch size and sequence length."""
    z = built.sizes
    return TokenStream(z["vocab"], z["batch_size"], z["seq_len"], seed, built.device)


def check_data(data: str, cases) -> None:
    """A ValueError naming the fix when ``data`` is not a source or ``stream`` meets a case
    whose data are not tokens (``cases``: names)."""
    if data not in DATA_SOURCES:
        raise ValueError("unknown data source %r; valid: %s" % (data, ", ".join(DATA_SOURCES)))
    if data == "stream":
        specs = load_cases()
        token_cases = [n for n, c in specs.items() if c.data == "tokens"]
        bad = [c for c in cases if c not in token_cases]
        if bad:
            raise ValueError("data 'stream' needs a case whose data are tokens (%s), not %s"
                             % (", ".join(token_cases), ", ".join(bad)))


def _record(case: str, variant: Variant, device: str, reference: str, seeds: list, status: str, **kw) -> dict:
    rec = dict(case=case, variant=variant.name, language="python", dtype=variant.resolved_dtype(device),
               reference=reference, status=status, reason=None, error=None, seeds=list(seeds), losses=[],
               checkpoints=[], final_loss=None, final_spread=None, final_rel_gap=None, final_gap_std=None,
               max_gap_std=None, verdict=None)
    rec.update(kw)
    return rec


def _compared(rec: dict, losses: list, ref_losses: list, window: int, is_reference: bool) -> dict:
    """``rec`` (a record without its comparison) with ``losses`` compared with the reference's."""
    gap = compare(losses, ref_losses, window)
    own_mean, own_sd = _mean_std([smooth(c, window)[-1] for c in losses])
    return dict(rec, status="ok", seeds=list(range(len(losses))), losses=losses, checkpoints=gap.checkpoints,
                final_loss=gap.mean[-1], final_spread=own_sd / abs(own_mean) if own_mean else None,
                final_rel_gap=gap.final_rel_gap, final_gap_std=gap.final_gap_std, max_gap_std=gap.max_gap_std,
                verdict="reference" if is_reference else gap.verdict)


def _build_notes(notes: list):
    """One line from each seed's build note: the note, or each seed's where they differ."""
    if len(set(notes)) <= 1:
        return notes[0] if notes else None
    return "; ".join("seed %d: %s" % (s, n) for s, n in enumerate(notes) if n)


def fidelity_records(case: str, variants: list, reference: Variant, profile: str, seeds: int, steps: int,
                     device: str, window: int, on_curve=None, data: str = "case") -> list:
    """Train every variant (the reference first) from ``seeds`` seeds for ``steps`` steps and
    compare each with the reference; one record per variant, the reference's included
    (verdict "reference"). An fp8 variant runs where its numerics stand in for the GPU's
    (``Variant.skip_reason(device, numerics=True)``), through ampkit's emulation where fp8
    matmuls do not run, its record's ``reason`` saying so (``emulation_note``). A variant
    that cannot run on the device is skipped, one whose
    loss is not finite or that raises is failed, with the error. ``on_curve(variant, seed)``
    is called after each curve (progress). ``data``: "case" (the case's batches in
    ``batch_order``) or "stream" (token cases: a fresh ``TokenStream`` batch a step; each
    section says so, with the stream's entropy floor)."""
    check_data(data, [case])
    if seeds < 2:
        raise ValueError("fidelity needs --seeds 2 or more (the reference's spread), got %d" % seeds)
    if steps < 1:
        raise ValueError("--steps must be >= 1, got %d" % steps)
    order = [reference] + [v for v in variants if v.name != reference.name]
    curves, notes, records = {}, {}, []
    for v in order:
        skip = v.skip_reason(device, numerics=True)  # fp8 may run through ampkit's emulation
        if skip:
            records.append(_record(case, v, device, reference.name, [], "skipped", reason=skip))
            continue
        try:
            curves[v.name], notes[v.name] = [], []
            for s in range(seeds):
                curves[v.name].append(train_curve(case, v, profile, s, steps, device, data, notes[v.name]))
                if on_curve:
                    on_curve(v, s)
        except Exception as e:  # noqa: BLE001 - a failure is a result, recorded with the error
            curves.pop(v.name, None)
            records.append(_record(case, v, device, reference.name, [], "failed",
                                   error=("%s: %s" % (type(e).__name__, e)).replace("\n", " ")[:600]))
    ref = curves.get(reference.name)
    out = []
    for rec_v in order:
        done = next((r for r in records if r["variant"] == rec_v.name), None)
        if done is not None:
            out.append(done)
            continue
        losses = curves[rec_v.name]
        emulated = emulation_note(device) if rec_v.fp8 != "none" else None
        reason = "; ".join(p for p in (emulated, _build_notes(notes[rec_v.name])) if p) or None
        if ref is None:
            out.append(_record(case, rec_v, device, reference.name, range(seeds), "ok", losses=losses,
                               reason="; ".join(p for p in ("the reference %s did not run: no comparison"
                                                            % reference.name, reason) if p)))
            continue
        out.append(_compared(_record(case, rec_v, device, reference.name, [], "ok", reason=reason),
                             losses, ref, window, rec_v.name == reference.name))
    return out


def recompare(sections: list, reference: str) -> dict:
    """One ``fidelity`` block from the curves of one or several (made with the same settings,
    each case x variant x language in one of them), every variant compared anew with
    ``reference``: so that variants trained in separate processes (each its own reference)
    are set against one, or one run is read against another reference, without training
    again. Records that did not run (skipped, failed) are kept as they are. ValueError when
    the settings differ, a record is in two, or a case has no curves of ``reference``.

    >>> rec = lambda v, c: dict(case="m", variant=v, language="python", dtype="float32", reference=v,
    ...                         status="ok", reason=None, losses=c)
    >>> a = dict(reference="fp32", profile="tiny", device="cpu", seeds=2, steps=2, window=1,
    ...          threshold_std=2.0, checkpoints=[1.0], data="case", records=[rec("fp32", [[1.0, 0.8], [1.2, 1.0]])])
    >>> b = dict(a, reference="ampkit_bf16", records=[rec("ampkit_bf16", [[1.2, 1.0], [1.2, 1.0]])])
    >>> out = recompare([a, b], "fp32")
    >>> [(r["variant"], r["verdict"], round(r["final_rel_gap"], 4)) for r in out["records"]]
    [('fp32', 'reference', 0.0), ('ampkit_bf16', 'same', 0.1111)]
    """
    from ampkit.bench._results import merge_fidelity
    # one block, as merging blocks of one reference would make it (the same settings, each record once)
    merged = merge_fidelity([dict(s, reference=reference) for s in sections if s])
    if merged is None:
        raise ValueError("no fidelity block to compare: give results.json files written by benchmarks/fidelity.py")
    cases = {}
    for r in merged["records"]:
        cases.setdefault(r["case"], []).append(r)
    known = list(load_variants())  # the variants' order in the spec, where a record's is one of them
    rank = lambda r: known.index(r["variant"]) if r["variant"] in known else len(known)  # noqa: E731
    out = []
    for case, recs in cases.items():
        ref = next((r for r in recs if r["variant"] == reference and r["status"] == "ok" and r.get("losses")), None)
        if ref is None:
            raise ValueError("case %s has no curves of the reference %r; variants with curves: %s" % (
                case, reference, ", ".join(r["variant"] for r in recs if r["status"] == "ok") or "none"))
        for r in [ref] + sorted((r for r in recs if r is not ref), key=rank):
            base = dict(r, reference=reference)
            if r["status"] != "ok" or not r.get("losses"):
                out.append(base)
                continue
            out.append(_compared(base, r["losses"], ref["losses"], merged["window"], r is ref))
    return dict(merged, records=out)


def fidelity_section(records: list, *, reference: str, profile: str, device: str, seeds: int, steps: int,
                     window: int, data: str = "case") -> dict:
    """The results document's ``fidelity`` block: how the curves were made and compared, and the
    records; ``data`` the curves' source and, for "stream", its entropy ``floor`` (nats)."""
    check_data(data, [])
    return dict(reference=reference, profile=profile, device=device, seeds=int(seeds), steps=int(steps),
                window=int(window), threshold_std=THRESHOLD_STD, checkpoints=list(CHECKPOINTS), data=data,
                floor=stream_floor() if data == "stream" else None, records=list(records))


class Progress:
    """One line per finished curve with the time left at the pace so far, on stderr:
    '[fidelity 7/60, ~1 min 10 s left] seed_mlp / torch_amp seed 1'."""

    def __init__(self, total: int, file=None):
        self.total, self.done, self.t0, self.file = total, 0, time.perf_counter(), file

    def __call__(self, case: str, variant: Variant, seed: int) -> None:
        self.done += 1
        left = (time.perf_counter() - self.t0) / self.done * (self.total - self.done)
        eta = "" if self.done >= self.total else ", ~%s left" % (
            "%d min %02d s" % divmod(int(left), 60) if left >= 60 else "%d s" % int(left))
        print("[fidelity %d/%d%s] %s / %s seed %d" % (self.done, self.total, eta, case, variant.name, seed),
              file=self.file or sys.stderr, flush=True)
