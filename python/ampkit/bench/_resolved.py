"""A run resolved once, as a value: which case, variant, language, where, at what sizes.

Both runners resolve each case x variant x language once (:func:`resolve_run`) and hand
the value to ``make_record``, which adds only what the run measured.

>>> from ampkit import bench
>>> run = resolve_run(bench.load_cases()["seed_mlp"], bench.load_variants()["torch_amp"], "python", "tiny", "cpu")
>>> run.case, run.variant.name, run.dtype, run.num_batches, run.repeats, run.warmup_steps
('seed_mlp', 'torch_amp', 'bfloat16', 2, 1, 0)
"""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping

from ampkit.bench._spec import Case, Variant


@dataclasses.dataclass(frozen=True)
class ResolvedRun:
    """One case x variant x language as it runs: the variant's dtype for the device, the
    profile's sizes and run lengths (``repeats`` after any override), the variant's warm-up;
    across processes also the world size and the engine with its options (else None)."""

    case: str
    variant: Variant
    language: str
    profile: str
    device: str
    dtype: str | None
    sizes: Mapping[str, Any]
    num_batches: int
    repeats: int
    warmup_steps: int
    world_size: int | None = None
    engine: str | None = None
    engine_options: Mapping[str, Any] | None = None


def resolve_run(case, variant: Variant, language: str, profile: str | None = None, device: str | None = None,
                repeats: int | None = None, placement=None) -> ResolvedRun:
    """Resolve a run of ``case`` (a BuiltCase, whose profile, device, sizes and repeats it
    takes, or a Case with ``profile`` and ``device``) under ``variant`` from ``language``;
    ``placement`` (a run across processes, ``ampkit.bench.Placement``) adds its world
    size, engine and options (the warm-up a train step needs there is known once it is
    built: ``Placement.warmup_steps``)."""
    if isinstance(case, Case):
        if profile is None or device is None:
            raise ValueError("resolve_run: a Case needs profile= and device= (a BuiltCase carries them)")
        prof = case.profile(profile)
        name, sizes, n, reps, warm = case.name, prof["sizes"], prof["num_batches"], prof["repeats"], prof["warmup_steps"]
    else:  # a BuiltCase
        profile, device = case.profile, case.device
        name, sizes, n, reps, warm = case.name, case.sizes, case.num_batches, case.repeats, case.warmup_steps
    spread = {} if placement is None else dict(
        world_size=placement.world_size, engine=placement.engine.name,
        engine_options=placement.engine.options_dict())
    return ResolvedRun(case=name, variant=variant, language=language, profile=profile, device=device,
                       dtype=variant.resolved_dtype(device), sizes=dict(sizes), num_batches=int(n),
                       repeats=int(repeats if repeats is not None else reps),
                       warmup_steps=variant.warmup_steps(warm), **spread)
