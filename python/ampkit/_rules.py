"""The rules of one device type: its default dtype and which ops fall in each category.

A policy (ampkit._policy) is a name and one :class:`DeviceRules` per device type; the
engine reads only these rules, and the native table (ampkit._native) is the shipped
policy's rules, so both stand on this module.

>>> r = parse_device("cpu", {"lower_precision_dtype": "bfloat16", "lower_precision_fp": ["mm"],
...                          "fp32": [], "fp32_output": [], "promote": [], "banned": {}}, lambda *p: "x")
>>> r.category("mm"), r.lower_precision_dtype
('lower_precision_fp', torch.bfloat16)
"""

from __future__ import annotations

import dataclasses

import torch

from ampkit import _decompositions, _ops
from ampkit._errors import PolicyError
from ampkit._fp8_recipe import DEFAULT_RECIPE, Fp8Recipe, check_fp8_op, parse_recipe

CATEGORIES = ("lower_precision_fp", "fp32", "fp32_output", "promote", "fp8", "banned")
DEVICES = ("cpu", "cuda")
DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16}
DTYPE_NAMES = {v: k for k, v in DTYPES.items()}
# required (fp8 is a category, optional so that files written before it still load)
DEVICE_KEYS = ("lower_precision_dtype",) + tuple(c for c in CATEGORIES if c != "fp8")
OPTIONAL_DEVICE_KEYS = ("fp8", "fp8_recipe", "decompose")  # [] / the default recipe / [] when absent
DEFAULT_BAN_MESSAGE = "{op} is banned in ampkit autocast regions by the active policy."


def dtype_of(value, where: str) -> torch.dtype:
    if isinstance(value, torch.dtype) and value in DTYPE_NAMES:
        return value
    if isinstance(value, str) and value in DTYPES:
        return DTYPES[value]
    raise PolicyError(f"{where}: unknown lower-precision dtype {value!r}; valid: {', '.join(DTYPES)}")


@dataclasses.dataclass(frozen=True)
class DeviceRules:
    """The rules of one device type: default dtype and the five op tables."""

    lower_precision_dtype: torch.dtype
    lower_precision_fp: tuple = ()
    fp32: tuple = ()
    fp32_output: tuple = ()
    promote: tuple = ()
    fp8: tuple = ()  # ops run with fp8 operands (ampkit._fp8), scaled as fp8_recipe says
    banned: tuple = ()  # ((op, message), ...)
    decompose: tuple = ()  # ops run through their ATen decomposition (not a category)
    fp8_recipe: Fp8Recipe = DEFAULT_RECIPE

    def ops(self, category: str) -> tuple:
        """Op names of ``category`` (sorted)."""
        check_category(category, "ops()")
        got = getattr(self, category)
        return tuple(n for n, _ in got) if category == "banned" else got

    def category(self, op: str):
        """The category of ``op`` or None when it is in no table."""
        for cat in CATEGORIES:
            if op in self.ops(cat):
                return cat
        return None

    def decomposes(self, op: str) -> bool:
        """Whether ``op`` is run through its decomposition (its parts cast by their own rules)."""
        return op in self.decompose

    def ban_message(self, op: str) -> str:
        return dict(self.banned)[op]

    def to_dict(self) -> dict:
        d = {"lower_precision_dtype": DTYPE_NAMES[self.lower_precision_dtype]}
        for cat in CATEGORIES[:-1]:
            d[cat] = list(getattr(self, cat))
        d["banned"] = dict(self.banned)
        d["decompose"] = list(self.decompose)
        if self.fp8 or self.fp8_recipe != DEFAULT_RECIPE:
            d["fp8_recipe"] = self.fp8_recipe.to_dict()
        return d


def check_category(cat, where):
    if cat not in CATEGORIES:
        raise PolicyError(f"{where}: unknown category {cat!r}; valid: {', '.join(CATEGORIES)}")


def make_rules(dtype, tables, device, where, recipe=DEFAULT_RECIPE) -> DeviceRules:
    kw = {c: tuple(sorted(tables[c])) for c in CATEGORIES[:-1]}
    for n in kw["fp8"]:
        check_fp8_op(n, where)
    kw["banned"] = tuple(sorted(tables["banned"].items()))
    kw["decompose"] = tuple(sorted(tables.get("decompose", ())))
    for n in kw["decompose"]:
        check_decomposable(n, device, where)
    return DeviceRules(lower_precision_dtype=dtype, fp8_recipe=recipe, **kw)


def check_decomposable(op, device, where):
    known = _decompositions.known(device)
    if op not in known:
        d = _decompositions.DECOMPOSITIONS.get(op)
        why = f"its decomposition is ATen's only on {', '.join(d.devices)}" if d else "ampkit has no decomposition of it"
        raise PolicyError(
            f"{where}: op {op!r} cannot be decomposed on {device} ({why}); "
            f"decomposable on {device}: {', '.join(known) or 'none'}"
        )


def parse_device(dev, body, where) -> DeviceRules:
    if not isinstance(body, dict):
        raise PolicyError(f"{where('devices', dev)}: rules must be a mapping with keys {', '.join(DEVICE_KEYS)}, got {body!r}")
    for k in body:
        if k not in DEVICE_KEYS + OPTIONAL_DEVICE_KEYS:
            kind = "category" if k not in ("dtype",) else "key"
            raise PolicyError(
                f"{where('devices', dev, k)}: unknown {kind} {k!r}; valid: {', '.join(DEVICE_KEYS + OPTIONAL_DEVICE_KEYS)}"
            )
    for k in DEVICE_KEYS:
        if k not in body:
            raise PolicyError(f"{where('devices', dev)}: missing key {k!r} (write every category out, [] or {{}} when empty)")
    dtype = dtype_of(body["lower_precision_dtype"], where("devices", dev, "lower_precision_dtype"))
    tables, seen = {}, {}
    for cat in CATEGORIES:
        val = body.get(cat)  # (the required ones are there: checked above)
        if cat == "banned":
            if val is None:
                val = {}
            if not isinstance(val, dict):
                raise PolicyError(f"{where('devices', dev, cat)}: banned must be a mapping op: message, got {val!r}")
            items = list(val.items())
        else:
            if val is None:
                val = []
            if not isinstance(val, list):
                raise PolicyError(f"{where('devices', dev, cat)}: {cat} must be a list of op names, got {val!r}")
            items = [(n, None) for n in val]
        table = {}
        for n, msg in items:
            w = where("devices", dev, cat, n) if isinstance(n, str) else where("devices", dev, cat)
            _ops.check_name(n, w)
            if cat == "fp8":
                check_fp8_op(n, w)
            if n in seen:
                raise PolicyError(f"{w}: op {n!r} is listed in both {seen[n]!r} and {cat!r}; an op belongs to one category")
            if cat == "banned" and not isinstance(msg, str):
                raise PolicyError(f"{w}: the message of banned op {n!r} must be a string, got {msg!r}")
            seen[n] = cat
            table[n] = msg
        tables[cat] = table
    dec = body.get("decompose")
    dec = [] if dec is None else dec
    if not isinstance(dec, list):
        raise PolicyError(f"{where('devices', dev, 'decompose')}: decompose must be a list of op names, got {dec!r}")
    tables["decompose"] = {}
    for n in dec:
        w = where("devices", dev, "decompose", n) if isinstance(n, str) else where("devices", dev, "decompose")
        _ops.check_name(n, w)
        if n in seen:
            twice = "twice under decompose" if seen[n] == "decompose" else f"in {seen[n]!r} and under decompose"
            raise PolicyError(f"{w}: op {n!r} is listed {twice}; an op is either in one category or decomposed")
        seen[n] = "decompose"
        check_decomposable(n, dev, w)
        tables["decompose"][n] = None
    recipe = parse_recipe(body.get("fp8_recipe"), where("devices", dev, "fp8_recipe"))
    return make_rules(dtype, tables, dev, where("devices", dev), recipe)
