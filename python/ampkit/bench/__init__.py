"""ampkit.bench: the shared pieces of the cross-language benchmark suite.

Cases and variants are YAML data (shared_specs/benchmarks); `build_case` makes the same
seeded model and data for the Python runner (`python -m ampkit.bench`) and the R runner
(benchmarks/run.R, through reticulate); `make_record`, `derive` and `write_document`
write the one results schema (shared_specs/benchmarks/schema.json) for both.

>>> import ampkit.bench as bench
>>> b = bench.build_case("seed_mlp", "tiny", seed=0, device="cpu")
>>> rec = bench.run_variant(b, bench.load_variants()["fp32"])
>>> rec["status"], rec["unit"], len(rec["samples"]) == b.repeats
('ok', 'ms/step', True)
"""

from ampkit.bench._spec import BenchSpecError
from ampkit.bench._spec import Case
from ampkit.bench._spec import PROFILES
from ampkit.bench._spec import Variant
from ampkit.bench._spec import load_case
from ampkit.bench._spec import load_cases
from ampkit.bench._spec import load_variants
from ampkit.bench._spec import plan
from ampkit.bench._spec import select
from ampkit.bench._spec import spec_dir
from ampkit.bench._build import BuiltCase
from ampkit.bench._build import build_case
from ampkit.bench._build import resolve_device
from ampkit.bench._resolved import ResolvedRun
from ampkit.bench._resolved import resolve_run
from ampkit.bench._results import COMPILED_RIVALS, RIVALS
from ampkit.bench._results import SCHEMA_VERSION
from ampkit.bench._results import check
from ampkit.bench._results import context
from ampkit.bench._results import derive
from ampkit.bench._results import finalize_json
from ampkit.bench._results import make_record
from ampkit.bench._results import merge
from ampkit.bench._results import merge_fidelity
from ampkit.bench._results import read_document
from ampkit.bench._results import time_ratio
from ampkit.bench._results import validate
from ampkit.bench._results import write_document
from ampkit.bench._machine import CpuCapability
from ampkit.bench._machine import capability_from
from ampkit.bench._machine import compile_reason
from ampkit.bench._machine import cpu_capability
from ampkit.bench._budget import COMPILE_S
from ampkit.bench._budget import RunLength
from ampkit.bench._budget import StepCost
from ampkit.bench._budget import calibrate
from ampkit.bench._budget import estimate_s
from ampkit.bench._budget import fit as fit_budget
from ampkit.bench._budget import notches
from ampkit.bench._budget import write_sized_cases
from ampkit.bench._engines import DDP_OPTIONS
from ampkit.bench._engines import ENGINES
from ampkit.bench._engines import Engine
from ampkit.bench._engines import Placement
from ampkit.bench._engines import check_capture
from ampkit.bench._engines import parse_engines
from ampkit.bench._engines import MIN_ROUNDS
from ampkit.bench._engines import plan_groups
from ampkit.bench._engines import plan_runs
from ampkit.bench._engines import read_events
from ampkit.bench._engines import repeats_for
from ampkit.bench._engines import run_items
from ampkit.bench._results import placement_key
from ampkit.bench._runner import GROWTH_INTERVAL
from ampkit.bench._runner import INIT_SCALE
from ampkit.bench._float8 import convert_float8
from ampkit.bench._float8 import float8_layers
from ampkit.bench._float8 import float8_reason
from ampkit.bench._fp8_tier import Fp8Setup
from ampkit.bench._fp8_tier import emulation_note
from ampkit.bench._fp8_tier import fp8_base_policy
from ampkit.bench._fp8_tier import fp8_reason
from ampkit.bench._fp8_tier import setup_fp8
from ampkit.bench._runner import RECOMPILE_LIMIT
from ampkit.bench._runner import compile_counts
from ampkit.bench._runner import compile_model
from ampkit.bench._runner import compile_note
from ampkit.bench._runner import compiling_group
from ampkit.bench._runner import loop_step
from ampkit.bench._runner import peak_memory
from ampkit.bench._runner import precision_flags
from ampkit.bench._runner import progress
from ampkit.bench._runner import reset_peak_memory
from ampkit.bench._runner import TurnMemory
from ampkit.bench._runner import VariantRun
from ampkit.bench._runner import rotation
from ampkit.bench._runner import run_interleaved
from ampkit.bench._pairing import pair_groups
from ampkit.bench._pairing import pair_order
from ampkit.bench._pairing import pair_summary
from ampkit.bench._pairing import pair_unit
from ampkit.bench._runner import run_variant
from ampkit.bench._runner import skipped_from_scale
from ampkit.bench._runner import step_compile
from ampkit.bench._runner import synchronize
from ampkit.bench._runner import train_step_note
from ampkit.bench._fidelity import CHECKPOINTS
from ampkit.bench._fidelity import DATA_SOURCES as FIDELITY_DATA
from ampkit.bench._fidelity import THRESHOLD_STD
from ampkit.bench._fidelity import Gap
from ampkit.bench._fidelity import Progress as FidelityProgress
from ampkit.bench._fidelity import batch_order
from ampkit.bench._fidelity import check_data as check_fidelity_data
from ampkit.bench._fidelity import checkpoint_steps
from ampkit.bench._fidelity import compare as fidelity_compare
from ampkit.bench._fidelity import default_window
from ampkit.bench._fidelity import fidelity_records
from ampkit.bench._fidelity import fidelity_section
from ampkit.bench._fidelity import recompare as fidelity_recompare
from ampkit.bench._fidelity import smooth
from ampkit.bench._fidelity import train_curve
from ampkit.bench._stream import TokenStream

__all__ = [
    "BenchSpecError",
    "BuiltCase",
    "Case",
    "COMPILE_S",
    "CpuCapability",
    "DDP_OPTIONS",
    "ENGINES",
    "Engine",
    "GROWTH_INTERVAL",
    "INIT_SCALE",
    "MIN_ROUNDS",
    "PROFILES",
    "RECOMPILE_LIMIT",
    "Placement",
    "COMPILED_RIVALS",
    "RIVALS",
    "ResolvedRun",
    "RunLength",
    "SCHEMA_VERSION",
    "StepCost",
    "Variant",
    "TurnMemory",
    "VariantRun",
    "build_case",
    "calibrate",
    "capability_from",
    "check",
    "check_capture",
    "compile_counts",
    "compile_model",
    "compile_note",
    "compiling_group",
    "convert_float8",
    "compile_reason",
    "context",
    "cpu_capability",
    "derive",
    "estimate_s",
    "finalize_json",
    "float8_layers",
    "float8_reason",
    "Fp8Setup",
    "emulation_note",
    "fp8_base_policy",
    "fp8_reason",
    "setup_fp8",
    "fit_budget",
    "load_case",
    "load_cases",
    "load_variants",
    "loop_step",
    "make_record",
    "merge",
    "notches",
    "parse_engines",
    "placement_key",
    "plan_groups",
    "plan_runs",
    "peak_memory",
    "plan",
    "precision_flags",
    "progress",
    "read_document",
    "read_events",
    "repeats_for",
    "reset_peak_memory",
    "resolve_device",
    "rotation",
    "run_interleaved",
    "pair_groups",
    "pair_order",
    "pair_summary",
    "pair_unit",
    "run_items",
    "run_variant",
    "resolve_run",
    "select",
    "skipped_from_scale",
    "spec_dir",
    "step_compile",
    "synchronize",
    "time_ratio",
    "train_step_note",
    "validate",
    "write_document",
    "write_sized_cases",
    "CHECKPOINTS",
    "FidelityProgress",
    "Gap",
    "THRESHOLD_STD",
    "batch_order",
    "checkpoint_steps",
    "default_window",
    "FIDELITY_DATA",
    "TokenStream",
    "check_fidelity_data",
    "fidelity_compare",
    "fidelity_records",
    "fidelity_section",
    "fidelity_recompare",
    "merge_fidelity",
    "smooth",
    "train_curve",
]
