"""torchao's float8 training, an optional rival of the benchmark (variants with ``float8:``).

A float8 variant converts the case's model with torchao's ``convert_to_float8_training``
(``Float8LinearConfig.from_recipe_name(recipe)``: "tensorwise", dynamic per-tensor scales
and cuBLAS's kernel; "rowwise", per-row scales and CUTLASS's kernel) before its optimizer
is built, then trains it as ``torch_compile_amp`` does, compiled, under bfloat16 autocast.
Every ``nn.Linear`` is converted but the model's head (its last ``nn.Linear``, which
torchao's own example keeps in high precision) and those whose dimensions are not
multiples of 16 (float8 GEMMs need them). torchao is never a requirement of ampkit: where
it cannot be imported the variant is recorded as skipped, with ``float8_reason()``.

>>> import torch
>>> model = torch.nn.Sequential(torch.nn.Linear(32, 32), torch.nn.ReLU(), torch.nn.Linear(32, 24),
...                             torch.nn.Linear(24, 8))
>>> float8_layers(model)
(['0'], {'head': '3', 'not multiples of 16': ['2']})
"""

from __future__ import annotations

import torch

RECIPES = ("tensorwise", "rowwise")
GEMM_MULTIPLE = 16


def float8_reason():
    """Why a float8 variant cannot run here (None when torchao's float8 training imports)."""
    try:
        import torchao.float8  # noqa: F401
    except Exception as e:  # noqa: BLE001 - any import failure is a reason to skip, never a failure
        return ("torchao is not importable (%s: %s): the float8 rival is optional (pip install torchao "
                "to run it; ampkit never needs it)" % (type(e).__name__, e))
    return None


def float8_layers(model: torch.nn.Module):
    """(the names of the ``nn.Linear`` layers to convert, {'head': the last one's name, 'not
    multiples of 16': [names]}) for ``model``."""
    linears = [(name, m) for name, m in model.named_modules() if isinstance(m, torch.nn.Linear)]
    head = linears[-1][0] if linears else None
    odd = [name for name, m in linears[:-1]
           if m.in_features % GEMM_MULTIPLE or m.out_features % GEMM_MULTIPLE]
    chosen = [name for name, _ in linears[:-1] if name not in odd]
    return chosen, {"head": head, "not multiples of 16": odd}


def convert_float8(model: torch.nn.Module, recipe: str):
    """``model`` with its ``float8_layers`` swapped by torchao's ``convert_to_float8_training``
    for ``recipe`` (in place: the parameters stay the same objects), and a note for the
    record saying what was converted. Raises when none of its layers can be."""
    if recipe not in RECIPES:
        raise ValueError("float8 recipe %r; valid: %s" % (recipe, ", ".join(RECIPES)))
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    chosen, left = float8_layers(model)
    if not chosen:
        raise ValueError("no nn.Linear of this model can go to float8 (head %r, not multiples of %d: %s): the "
                         "variant has nothing to measure" % (left["head"], GEMM_MULTIPLE,
                                                              left["not multiples of 16"] or "none"))
    names = set(chosen)
    model = convert_to_float8_training(model, config=Float8LinearConfig.from_recipe_name(recipe),
                                       module_filter_fn=lambda mod, fqn: fqn in names)
    note = "torchao float8 (%s recipe): %d nn.Linear converted, not the head (%s)%s" % (
        recipe, len(chosen), left["head"], "" if not left["not multiples of 16"] else
        " nor %d whose dimensions are not multiples of %d" % (len(left["not multiples of 16"]), GEMM_MULTIPLE))
    return model, note
