"""Where a policy differs from torch's own autocast on the installed torch: its delta.

torch's C++ autocast executes every op whose handling in a policy equals
torch's; ampkit's Python engine executes only the delta. Native's table is the
shipped ``torch_default`` policy, which the drift check (``python -m
ampkit.drift check``, run by the test suite for each installed torch) proves
equal to ``torch.autocast`` op by op; ops where a torch release is known to
differ from that table are listed in ``NATIVE_DIFFERS`` and always run through
ampkit, so the YAML stays the only source of truth for what is cast.

>>> import ampkit
>>> p = ampkit.load_policy("torch_default")
>>> sorted(delta(p, "cpu") - set(differs("cpu")))   # differs(): none on torch >= 2.5
[]
>>> changed = p.with_ops("cpu", fp32=["linear"]).without_ops("mm", device="cpu")
>>> sorted(delta(changed, "cpu") - set(differs("cpu")))
['linear', 'mm']
"""

from __future__ import annotations

import torch
import yaml

from ampkit._bounded import BoundedCache
from ampkit._errors import PolicyError
from ampkit._rules import CATEGORIES, parse_device
from ampkit._specs import SpecsNotFoundError, policy_dir

NATIVE_POLICY = "torch_default"


def _read_native_rules() -> dict:
    """{device_type: DeviceRules} of the shipped ``torch_default`` file: torch's own table as
    data. Read once, at import: code that torch.compile traces cannot read files. (The file
    is the one ``load_policy("torch_default")`` reads; this module stands below the Policy
    type, whose ``apply`` drives the engine that reads these rules.)"""
    try:
        path = policy_dir() / f"{NATIVE_POLICY}.yaml"
    except SpecsNotFoundError as e:  # as load_policy says it
        raise PolicyError(f"load_policy: cannot look up the shipped policy {NATIVE_POLICY!r}: {e}") from e
    devices = yaml.safe_load(path.read_text(encoding="utf-8"))["devices"]

    def where(*keys):
        return f"{path}, key {'.'.join(str(k) for k in keys)!r}"

    return {dev: parse_device(dev, body, where) for dev, body in devices.items()}


NATIVE_RULES = _read_native_rules()


def torch_version() -> tuple:
    base = torch.__version__.split("+")[0]
    return tuple(int(p) for p in base.split(".")[:2] if p.isdigit())


# (device, first torch version where native equals the table, {op: the drift check's
# probes that show the difference}): on older torch these ops are executed by ampkit.
NATIVE_DIFFERS = (
    # torch 2.4's AutocastCPU does not list _addmm_activation: float32 in, float32 out;
    # mixed float32/low inputs raise there
    ("cpu", (2, 5), {"_addmm_activation": ("f32", "mixed")}),
)

_CACHE = BoundedCache(256)  # (policy, device_type) -> its delta


def differs(device_type: str) -> dict:
    """{op: probes} of the shipped table that the installed torch's autocast handles otherwise."""
    v = torch_version()
    out = {}
    for dev, fixed_in, ops in NATIVE_DIFFERS:
        if dev == device_type and v < fixed_in:
            out.update(ops)
    return out


def _handling(rules, name):
    cat = rules.category(name)
    if cat == "banned":
        return ("banned", rules.ban_message(name))
    if cat is None and rules.decomposes(name):
        return ("decompose", None)
    return (cat, None)


def delta(policy, device_type: str) -> frozenset:
    """Op names whose handling on ``device_type`` differs between ``policy`` and native.

    An op is in the delta when its category (or ban message, or ``decompose``)
    differs from the shipped native table, when it is a user op the policy lists,
    or when the installed torch is known to differ from the table for it.
    """
    key = (policy, device_type)
    hit = _CACHE.get(key)
    if hit is not None:
        return hit
    ours = policy.rules(device_type)
    theirs = NATIVE_RULES.get(device_type)  # None: a device torch's table does not cover, all ampkit's

    def listed(rules):
        return set(n for c in CATEGORIES for n in rules.ops(c)) | set(rules.decompose)

    names = listed(ours) | (listed(theirs) if theirs is not None else set())
    out = frozenset(
        n for n in names
        if theirs is None or _handling(ours, n) != _handling(theirs, n)
    ) | (set(differs(device_type)) & listed(ours))
    return _CACHE.put(key, out)


def forget() -> None:
    """Drop cached deltas (an ``ampkit.op`` registration can change what a name means)."""
    _CACHE.clear()
