"""ampkit's fp8 tier as benchmark variants (variants with ``fp8:``): the policy a run trains under.

A variant with ``fp8: policy`` trains under ampkit's shipped fp8 policy
(shared_specs/policies/fp8.yaml: ``linear`` in fp8, tensorwise scales); ``fp8: auto``
under the policy ``ampkit.calibrate_fp8`` returns for the case's model at its real batch
(base: the ``policy`` one), calibrated when the run is built, its time part of the build
and written in the record's note. Both runners (Python and R) call :func:`setup_fp8` once
per run, before the model is compiled and its optimizer built:

    scopes   the base policy: the shipped "fp8" with a module scope keeping in the region
             dtype (``lower_precision_fp: [linear]``) the layers torchao's rival leaves out
             (``float8_layers``): the head (the model's last nn.Linear) and those whose
             dimensions are not multiples of 16 (fp8 GEMMs need them); auto's is what
             ``calibrate_fp8`` returns over it: one scope per module kept in the region
             dtype or, where most are kept, ``linear`` moved out of fp8 in the device tables
             and one scope per fp8 module (fewer scopes, each costing a compiled model
             guards on every call)
    install  ``policy.apply(model)``: the scopes as hooks on the matched modules (kept for
             the run's life: ``Fp8Setup.scopes``)
    region   the autocast region's policy is the scopes' tables, ``policy.without_modules()``
             (``Fp8Setup.region_policy``, a Policy): the shipped fp8 tables for ``policy``,
             auto's own for ``auto``; both runners pass that object,
             ``ampkit.autocast(device, dtype, policy=setup.region_policy)``, R's
             ``with_autocast(..., policy = setup$region_policy)``

Timing: fp8 matmuls run on CUDA at capability 8.9 or more (``fp8_reason``); elsewhere ampkit
runs its emulation, which quantizes exactly as the ``_scaled_mm`` path (the same fp8 codes
and scales: tests/python/test_fp8.py checks the emulation bit for bit against the
definition, and the ``_scaled_mm`` path, on the CPU and on CUDA, against the same
definition's quantized operands) but then multiplies in the region dtype: never faster,
so its time means nothing. The semantics (losses: the fidelity harness) may use it:
``numerics_stand_in``.

>>> import torch, ampkit
>>> model = torch.nn.Sequential(torch.nn.Linear(32, 32), torch.nn.ReLU(), torch.nn.Linear(32, 8))
>>> setup = setup_fp8("policy", model, None, "cpu")
>>> setup.region_policy == ampkit.load_policy("fp8"), [m.pattern for m in setup.policy.modules]
(True, ['2'])
>>> setup.scopes.remove()
"""

from __future__ import annotations

import dataclasses
import time

import torch

from ampkit.bench._float8 import float8_layers

KINDS = ("policy", "auto")
BASE_POLICY = "fp8"  # the shipped policy the base starts from
MIN_CAPABILITY = (8, 9)  # torch._scaled_mm's float8 GEMMs (Ada, Hopper and later)


def fp8_reason(device: str):
    """Why an fp8 variant's time means nothing on ``device`` (None where fp8 matmuls run)."""
    if device != "cuda":
        return ("fp8 matmuls need CUDA at capability >= %d.%d; on %s ampkit runs its emulation, "
                "whose time means nothing (the fidelity harness may use it for losses)" % (*MIN_CAPABILITY, device))
    cap = tuple(torch.cuda.get_device_capability())
    if cap < MIN_CAPABILITY:
        return ("fp8 matmuls need CUDA at capability >= %d.%d; this card (%s) is %d.%d: ampkit would run "
                "its emulation, whose time means nothing" % (*MIN_CAPABILITY, torch.cuda.get_device_name(), *cap))
    return None


def numerics_stand_in(kind: str, device: str):
    """Why an fp8 variant of ``kind`` cannot stand in for the GPU's numerics on ``device``
    (None when it can: where fp8 runs, or ``policy`` through the emulation, which quantizes
    as the ``_scaled_mm`` path does). ``auto`` cannot: its choice is made by timing fp8
    against the region dtype, and the emulation is never faster, so there it keeps every
    module in the region dtype, not what the GPU would choose.

    >>> numerics_stand_in("policy", "cpu") is None, numerics_stand_in("auto", "cpu")[:23]
    (True, 'fp8 auto chooses by tim')
    """
    if fp8_reason(device) is None or kind == "policy":
        return None
    return ("fp8 auto chooses by timing fp8 against the region dtype, and on %s the emulation is never "
            "faster: its policy there (every module in the region dtype) is not the GPU's" % device)


def emulation_note(device: str):
    """The fidelity report's word for an fp8 variant run where fp8 matmuls do not (None where they do)."""
    if fp8_reason(device) is None:
        return None
    return ("ran through ampkit's fp8 emulation on %s: the same fp8 codes and scales as the _scaled_mm path "
            "(checked bit for bit by tests/python/test_fp8.py), multiplied in the region dtype (the dequantized "
            "operands rounded to it; the weight's gradient rounded to it before float32), where _scaled_mm "
            "sums the fp8 products in float32" % device)


@dataclasses.dataclass
class Fp8Setup:
    """An fp8 variant's policy installed on a model: ``policy`` (its scopes, a value to read
    or keep as YAML), ``scopes`` (the installed hooks' handle), ``region_policy`` (the Policy
    the autocast region takes: ``policy.without_modules()``), ``note`` (for the record), ``calibrate_s`` (auto: seconds the
    calibration took, inside the build; else None), ``modules`` ((nn.Linear layers in fp8, nn.Linear layers of the
    model): what the record's ``fp8_modules`` says)."""

    policy: object
    scopes: object
    region_policy: object
    note: str
    calibrate_s: float | None = None
    modules: tuple = (0, 0)


def fp8_base_policy(model: torch.nn.Module, device: str):
    """The shipped fp8 policy with the layers ``float8_layers`` leaves out kept in the region
    dtype by module scopes; None when no layer is left in fp8 (nothing to measure)."""
    import ampkit
    chosen, left = float8_layers(model)
    if not chosen:
        return None
    policy = ampkit.load_policy(BASE_POLICY)
    for name in [left["head"]] + left["not multiples of 16"]:
        policy = policy.with_module(name, lower_precision_fp=["linear"])
    return policy


def setup_fp8(kind: str, model: torch.nn.Module, example_inputs, device: str, dtype=torch.bfloat16):
    """Install the ``kind`` ("policy" or "auto") fp8 policy on ``model`` (see the module's
    docstring); ``example_inputs``: the case's first batch's inputs (auto calibrates at them).
    None when the model has no layer fp8 could take."""
    if kind not in KINDS:
        raise ValueError("fp8 %r; valid: %s" % (kind, ", ".join(KINDS)))
    policy = fp8_base_policy(model, device)
    if policy is None:
        return None
    kept = len(policy.modules)
    linears = sum(1 for m in model.modules() if isinstance(m, torch.nn.Linear))
    in_fp8 = linears - kept
    note = "ampkit fp8 (policy %r, tensorwise): every nn.Linear but %d kept in %s by module scopes (%s)" % (
        BASE_POLICY, kept, str(dtype).replace("torch.", ""), ", ".join(m.pattern for m in policy.modules))
    seconds = None
    if kind == "auto":
        import ampkit
        t0 = time.perf_counter()
        # its forward draws dropout masks: the random state is put back, so that the run trains
        # from the same state as every other variant (the fidelity harness pairs them)
        with torch.random.fork_rng(devices=[torch.cuda.current_device()] if device == "cuda" else []):
            cal = ampkit.calibrate_fp8(model, example_inputs, policy=policy, device_type=device, dtype=dtype)
        if device == "cuda":
            torch.cuda.synchronize()
        seconds = time.perf_counter() - t0
        policy = cal.policy
        fp8 = [r.module for r in cal.report if r.precision == "fp8"]
        in_fp8 = len(fp8)
        measured = [r for r in cal.report if r.speedup is not None]
        note = "ampkit fp8 auto: calibrated in %.2f s (in the build), %d of %d nn.Linear in fp8 (%s)" % (
            seconds, len(fp8), len(cal.report), ", ".join(fp8[:6]) + (" ..." if len(fp8) > 6 else "") or "none")
        if measured:  # what decided it: each measured module's time in the region dtype over fp8's
            note += "; measured %s / fp8 time: %s" % (str(dtype).replace("torch.", ""), ", ".join(
                "%s %.2fx" % (r.module, r.speedup) for r in measured[:8]) + (" ..." if len(measured) > 8 else ""))
    return Fp8Setup(policy=policy, scopes=policy.apply(model), region_policy=policy.without_modules(), note=note,
                    calibrate_s=seconds, modules=(in_fp8, linears))
