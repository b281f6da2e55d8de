"""The fp8 recipe of a device's rules: how the ops of the ``fp8`` category are scaled.

A policy's ``fp8`` category lists matmul-class ops that run with their operands cast to
8-bit floats (ampkit._fp8 runs them). The recipe, written per device under
``fp8_recipe``, says how:

=================  ===========================================================
``scaling``        ``tensorwise``: one scale per tensor, from its amax;
                   ``rowwise``: one scale per row along the contraction dim;
                   ``delayed``: one scale per tensor from the amax *history*
                   of earlier calls (no reduction before the cast)
``forward_dtype``  the dtype of input and weight: ``float8_e4m3fn``
``backward_dtype`` the dtype of the output's gradient: ``float8_e5m2`` (more
                   range) or ``float8_e4m3fn`` (more precision)
``amax_history``   delayed only: how many earlier amaxes the scale looks at
``fast_accum``     ``true``: the forward's fp8 GEMM (``_scaled_mm``, CUDA)
                   accumulates in the tensor cores' faster, less precise mode
                   (``use_fast_accum``), as torchao's float8 training does by
                   default; the gradients' GEMMs always accumulate precisely.
                   ``false`` (the default): every GEMM precise. The emulation
                   (CPU) has no such mode and ignores it
=================  ===========================================================

Absent, the recipe is :data:`DEFAULT_RECIPE` (tensorwise, e4m3fn forward, e5m2 backward).

>>> parse_recipe({"scaling": "delayed", "amax_history": 16}, "here")
Fp8Recipe(scaling='delayed', forward_dtype='float8_e4m3fn', backward_dtype='float8_e5m2', amax_history=16, fast_accum=False)
>>> parse_recipe({"scaling": "blockwise"}, "here")
Traceback (most recent call last):
...
ampkit._errors.PolicyError: here: fp8_recipe scaling 'blockwise' is not one of tensorwise, rowwise, delayed
"""

from __future__ import annotations

import dataclasses

from ampkit._errors import PolicyError

SCALINGS = ("tensorwise", "rowwise", "delayed")
FORWARD_DTYPES = ("float8_e4m3fn",)
BACKWARD_DTYPES = ("float8_e5m2", "float8_e4m3fn")
RECIPE_KEYS = ("scaling", "forward_dtype", "backward_dtype", "amax_history", "fast_accum")
#: The ops the fp8 category can hold (each runs as ``input @ weight.T``, ampkit._fp8).
FP8_OPS = ("linear", "matmul", "mm")


@dataclasses.dataclass(frozen=True)
class Fp8Recipe:
    """How the fp8 category scales its casts (a value: comparable, hashable)."""

    scaling: str = "tensorwise"
    forward_dtype: str = "float8_e4m3fn"
    backward_dtype: str = "float8_e5m2"
    amax_history: int | None = None  # delayed only
    fast_accum: bool = False  # the forward GEMM's use_fast_accum

    def __post_init__(self):
        check_recipe(self, "Fp8Recipe")

    def to_dict(self) -> dict:
        d = {"scaling": self.scaling, "forward_dtype": self.forward_dtype,
             "backward_dtype": self.backward_dtype}
        if self.amax_history is not None:
            d["amax_history"] = self.amax_history
        if self.fast_accum:
            d["fast_accum"] = True
        return d


def check_recipe(r, where) -> None:
    if r.scaling not in SCALINGS:
        raise PolicyError(f"{where}: fp8_recipe scaling {r.scaling!r} is not one of {', '.join(SCALINGS)}")
    if r.forward_dtype not in FORWARD_DTYPES:
        raise PolicyError(f"{where}: fp8_recipe forward_dtype {r.forward_dtype!r} is not one of "
                          f"{', '.join(FORWARD_DTYPES)}")
    if r.backward_dtype not in BACKWARD_DTYPES:
        raise PolicyError(f"{where}: fp8_recipe backward_dtype {r.backward_dtype!r} is not one of "
                          f"{', '.join(BACKWARD_DTYPES)}")
    if not isinstance(r.fast_accum, bool):
        raise PolicyError(f"{where}: fp8_recipe fast_accum must be true or false (whether the forward's "
                          f"fp8 GEMM accumulates in the faster, less precise mode), got {r.fast_accum!r}")
    if r.scaling == "delayed":
        n = r.amax_history
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise PolicyError(f"{where}: fp8_recipe amax_history must be a whole number >= 1 for "
                              f"delayed scaling (the earlier amaxes the scale looks at), got {n!r}")
    elif r.amax_history is not None:
        raise PolicyError(f"{where}: fp8_recipe amax_history is for delayed scaling only; scaling "
                          f"{r.scaling!r} computes its amax from the tensor: remove amax_history")


DEFAULT_RECIPE = Fp8Recipe()


def parse_recipe(body, where) -> Fp8Recipe:
    """A validated :class:`Fp8Recipe` from a mapping (the YAML ``fp8_recipe`` or keywords)."""
    if body is None:
        return DEFAULT_RECIPE
    if isinstance(body, Fp8Recipe):
        return body
    if not isinstance(body, dict):
        raise PolicyError(f"{where}: fp8_recipe must be a mapping with keys among "
                          f"{', '.join(RECIPE_KEYS)}, got {body!r}")
    for k in body:
        if k not in RECIPE_KEYS:
            raise PolicyError(f"{where}: unknown fp8_recipe key {k!r}; valid: {', '.join(RECIPE_KEYS)}")
    fields = {k: body[k] for k in RECIPE_KEYS if k in body}
    for k in ("scaling", "forward_dtype", "backward_dtype"):
        if k in fields and not isinstance(fields[k], str):
            fields[k] = str(fields[k]).replace("torch.", "")  # torch.float8_e5m2 given as a dtype
    try:
        return Fp8Recipe(**fields)
    except PolicyError as e:  # name the file and key, not the class
        raise PolicyError(str(e).replace("Fp8Recipe", where, 1)) from None


def check_fp8_op(op, where) -> None:
    if op not in FP8_OPS:
        raise PolicyError(f"{where}: op {op!r} cannot run in fp8; the fp8 category takes "
                          f"{', '.join(FP8_OPS)}")
