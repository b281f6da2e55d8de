"""Fit a benchmark run into a time budget, by what this machine can do.

A profile's run lengths are written for a CPU with bf16 arithmetic. Where bf16 is emulated
(an AVX2-only CPU: a bf16 step can take 20x the float32 one), the same lengths take many
times longer. Every variant still runs: instead, each case is calibrated (one float32 step
and one bf16 autocast step, timed after a warm-up step), the whole run is estimated from
that, and while the estimate exceeds the budget the case where a cut saves most is cut one notch:
fewer repeats (down to 3), fewer batches a repeat (down to 2), one warm-up step, 2
repeats, then half the batch size (down to 2). The lengths used are in every record
(``num_batches``, ``repeats``, ``warmup_steps``, ``sizes``) and the cut in the report.

>>> cost = StepCost(fp32_ms=100.0, low_ms=2000.0, batch_size=8)
>>> full = RunLength(num_batches=8, repeats=5, warmup_steps=2, batch_size=8)
>>> list(notches(full))[:3]
[RunLength(num_batches=8, repeats=4, warmup_steps=2, batch_size=8), RunLength(num_batches=8, repeats=3, warmup_steps=2, batch_size=8), RunLength(num_batches=7, repeats=3, warmup_steps=2, batch_size=8)]
"""

from __future__ import annotations

import dataclasses
import time

# Rough fixed costs (seconds) the estimate adds to the measured steps.
PROCESS_S = {"python": 4.0, "r": 10.0}  # a runner's start (imports, R, reticulate), per case
RUN_S = 0.5  # a variant's fresh model, optimizer and clean-up
# torch.compile's first step on a CPU, on average: a case compiles two graphs (~20 s each, the
# default and reduce-overhead modes), and its other compiled runs (R's too) hit inductor's cache.
COMPILE_S = 8.0
MIN_REPEATS, MIN_BATCHES = 2, 2
MIN_BATCH_SIZE = 2  # batch norm needs two samples a batch


@dataclasses.dataclass(frozen=True)
class RunLength:
    """How long one case runs: batches a repeat, timed repeats, untimed warm-up steps, batch size."""

    num_batches: int
    repeats: int
    warmup_steps: int
    batch_size: int

    @classmethod
    def of(cls, case, profile: str, repeats=None) -> "RunLength":
        """The lengths the case's profile writes (``repeats`` overrides the profile's)."""
        p = case.profile(profile)
        return cls(num_batches=p["num_batches"], repeats=int(repeats or p["repeats"]),
                   warmup_steps=p["warmup_steps"], batch_size=int(p["sizes"]["batch_size"]))


@dataclasses.dataclass(frozen=True)
class StepCost:
    """One case's measured ms per training step at ``batch_size``: float32, and bf16 autocast."""

    fp32_ms: float
    low_ms: float
    batch_size: int

    def step_s(self, variant, batch_size: int) -> float:
        ms = self.fp32_ms if variant.dtype == "none" else self.low_ms
        return ms / 1000.0 * max(batch_size, 1) / self.batch_size  # a step's work grows with the batch


def notches(length: RunLength):
    """Every shorter RunLength, one notch at a time (see the module's docstring for the order)."""
    cur = length
    while True:
        if cur.repeats > 3:
            cur = dataclasses.replace(cur, repeats=cur.repeats - 1)
        elif cur.num_batches > MIN_BATCHES:
            cur = dataclasses.replace(cur, num_batches=cur.num_batches - 1)
        elif cur.warmup_steps > 1:
            cur = dataclasses.replace(cur, warmup_steps=1)
        elif cur.repeats > MIN_REPEATS:
            cur = dataclasses.replace(cur, repeats=cur.repeats - 1)
        elif cur.batch_size > MIN_BATCH_SIZE:
            cur = dataclasses.replace(cur, batch_size=max(cur.batch_size // 2, MIN_BATCH_SIZE))
        else:
            return
        yield cur


def estimate_s(length: RunLength, cost: StepCost, variants, languages, device: str,
               compile_s: float = COMPILE_S) -> float:
    """Seconds one case takes at ``length``: every variant each language runs, with fixed costs
    (``compile_s``: a compiled run's compilation, measured once a case has run)."""
    total = 0.0
    for lang in languages:
        total += PROCESS_S.get(lang, 5.0)
        for v in variants:
            if lang not in v.languages or v.skip_reason(device):
                continue
            steps = v.warmup_steps(length.warmup_steps) + length.repeats * length.num_batches
            total += RUN_S + steps * cost.step_s(v, length.batch_size) + (compile_s if v.compile != "none" else 0.0)
    return total


def fit(lengths: dict, costs: dict, variants, languages, device: str, budget_s: float, scale: float = 1.0,
        compile_s: float = COMPILE_S):
    """Cut the cases' lengths until the estimate (times ``scale``, the measured/estimated ratio
    so far) fits ``budget_s``; returns ({case: RunLength}, estimated seconds). Each cut is the
    notch that saves the most time; when nothing can be cut any further the estimate may
    stay over the budget (the fixed costs: starting runners, compiling)."""
    lengths = dict(lengths)

    def est(c, n):
        return scale * estimate_s(n, costs[c], variants, languages, device, compile_s)

    now = {c: est(c, lengths[c]) for c in lengths}
    nxt = {c: next(notches(lengths[c]), None) for c in lengths}
    while sum(now.values()) > budget_s:
        saving = {c: now[c] - est(c, n) for c, n in nxt.items() if n is not None}
        if not saving:
            break
        c = max(saving, key=saving.get)
        lengths[c] = nxt[c]
        now[c] -= saving[c]
        nxt[c] = next(notches(lengths[c]), None)
    return lengths, sum(now.values())


def calibrate(built, variants=None) -> StepCost:
    """Time one float32 step and one step under torch's autocast at the variants' dtype
    ('auto': bf16 on the CPU, fp16 on CUDA), each after one warm-up step, on ``built``."""
    import contextlib

    import torch

    from ampkit.bench._runner import loop_step, synchronize

    device = built.device
    low = getattr(torch, "float16" if device == "cuda" else "bfloat16")

    def one(region):
        model = built.new_model()
        step = loop_step(model, built.loss_fn, built.new_optimizer(model), region)
        step(*built.batches[0])
        synchronize(device)
        t0 = time.perf_counter()
        step(*built.batches[1 % built.num_batches])
        synchronize(device)
        return (time.perf_counter() - t0) * 1000.0

    fp32 = one(contextlib.nullcontext)
    amp = one(lambda: torch.autocast(device_type=device, dtype=low))
    return StepCost(fp32_ms=fp32, low_ms=amp, batch_size=int(built.sizes["batch_size"]))


def write_sized_cases(cases, lengths: dict, profile: str, folder) -> str:
    """Write the cases with their profile's lengths set to ``lengths`` (and the variants file)
    into ``folder``, for the runners to read through AMPKIT_BENCH_SPECS; returns the folder."""
    import shutil
    from pathlib import Path

    import yaml

    from ampkit.bench._spec import spec_dir

    folder = Path(folder)
    (folder / "variants").mkdir(parents=True, exist_ok=True)
    shutil.copyfile(spec_dir() / "variants" / "variants.yaml", folder / "variants" / "variants.yaml")
    for case in cases:
        with open(case.path, encoding="utf-8") as f:
            doc = yaml.safe_load(f)
        n = lengths[case.name]
        prof = doc["profiles"][profile]
        prof.update(num_batches=n.num_batches, repeats=n.repeats, warmup_steps=n.warmup_steps)
        prof["sizes"]["batch_size"] = n.batch_size
        with open(folder / ("%s.yaml" % case.name), "w", encoding="utf-8") as f:
            yaml.safe_dump(doc, f, sort_keys=False)
    return str(folder)
