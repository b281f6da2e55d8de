"""Cast policies: immutable values loaded from the shared YAML specs.

A policy says, per device type, which dtype an autocast region uses by default
and which ops fall in each of five categories (the design of torch's own
autocast, written as data):

=====================  ===================================================
``lower_precision_fp``  floating inputs are cast to the region's dtype
``fp32``                floating inputs are cast to float32
``fp32_output``         no input cast; the op is called with dtype=float32
``promote``             inputs are cast to the widest floating input dtype
``banned``              calling the op in a region raises (with a message)
=====================  ===================================================

Ops in no category run untouched. Besides the categories, a device may list
ops under ``decompose``: C++ composites that ampkit runs through their ATen
decomposition written in Python (``ampkit._decompositions``), so that each
part is cast by its own rule, as native autocast does (``cross_entropy`` on
cuda: log_softmax in the input's dtype, nll_loss in float32). ``decompose`` is
not a category: an op is either in one category or decomposed. Policies are values: comparable, hashable,
printable; ``with_*`` methods return changed copies.

>>> import ampkit
>>> p = ampkit.load_policy("torch_default")
>>> p.category("cpu", "linear")
'lower_precision_fp'
>>> q = p.with_ops(fp32=["linear"])
>>> q.category("cpu", "linear"), p.category("cpu", "linear")
('fp32', 'lower_precision_fp')
>>> q == p
False
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

import yaml

from ampkit import _module_policy, _ops
from ampkit._module_scopes import ModuleScopes
from ampkit._bounded import BoundedCache
from ampkit._errors import PolicyError
from ampkit._fp8_recipe import parse_recipe
from ampkit._rules import (CATEGORIES, DEFAULT_BAN_MESSAGE, DEVICES, DTYPE_NAMES, DeviceRules, check_category,
                           dtype_of, make_rules, parse_device)
from ampkit._specs import SpecsNotFoundError, policy_dir

SCHEMA_VERSION = 1
_TOP_KEYS = ("schema_version", "name", "description", "devices", "modules")  # modules: optional


def _check_op_name(op, where):
    if not isinstance(op, str):
        raise PolicyError(f"{where}: op must be an op name (a string), got {op!r}")


@dataclasses.dataclass(frozen=True)
class Policy:
    """An immutable cast policy: ``name``, ``description`` and per-device rules.

    Build one with :func:`load_policy` and change it with :meth:`with_ops`,
    :meth:`without_ops`, :meth:`with_dtype` or :meth:`with_name`.
    """

    name: str
    devices: tuple  # ((device_type, DeviceRules), ...) sorted by device type
    description: str = ""
    source: str = dataclasses.field(default="", compare=False)
    modules: tuple = ()  # (ModuleScope, ...) sorted by pattern: rules per module (_module_policy)
    # the with_* changes made since the policy got its name, as calls ("with_ops(fp32=['mm'])"):
    # printed after the name so that a changed policy does not pass for the one it came from
    derived: tuple = dataclasses.field(default=(), compare=False)

    def __post_init__(self):
        if not isinstance(self.name, str) or not self.name:
            raise PolicyError(f"Policy: name must be a non-empty string, got {self.name!r}")
        if not isinstance(self.description, str):
            raise PolicyError(f"Policy: description must be a string, got {self.description!r}")
        if not isinstance(self.devices, tuple) or not all(
                isinstance(d, tuple) and len(d) == 2 and isinstance(d[0], str)
                and isinstance(d[1], DeviceRules) for d in self.devices):
            raise PolicyError(
                f"Policy: devices must be a tuple of (device_type, DeviceRules) pairs, got "
                f"{self.devices!r:.80}; build a policy with ampkit.load_policy() and change it "
                "with its with_* methods")
        if not isinstance(self.modules, tuple) or not all(
                isinstance(m, _module_policy.ModuleScope) for m in self.modules):
            raise PolicyError(f"Policy: modules must be a tuple of ModuleScope, got {self.modules!r:.80}; "
                              "add scopes with policy.with_module()")
        if not isinstance(self.derived, tuple) or not all(isinstance(d, str) for d in self.derived):
            raise PolicyError(f"Policy: derived must be a tuple of strings, got {self.derived!r:.80}; "
                              "the with_* methods record it")

    def __hash__(self):  # cached: regions key their compiled tables by policy
        h = self.__dict__.get("_hash")
        if h is None:
            h = hash((self.name, self.devices, self.description, self.modules))
            object.__setattr__(self, "_hash", h)
        return h

    def __getstate__(self):  # string hashes differ between processes: never pickle the cache
        return {k: v for k, v in self.__dict__.items() if k != "_hash"}

    def __setstate__(self, state):
        for k, v in state.items():
            object.__setattr__(self, k, v)

    # -- reading --------------------------------------------------------------
    def device_types(self) -> tuple:
        return tuple(d for d, _ in self.devices)

    def rules(self, device_type: str) -> DeviceRules:
        """The :class:`DeviceRules` of ``device_type`` (ValueError if absent)."""
        for d, r in self.devices:
            if d == device_type:
                return r
        raise PolicyError(
            f"policy {self.name!r} has no rules for device type {device_type!r}; "
            f"it has: {', '.join(self.device_types())}"
        )

    def category(self, device_type: str, op: str):
        """The category of ``op`` on ``device_type`` or None when unlisted (or decomposed)."""
        _check_op_name(op, "category")
        return self.rules(device_type).category(op)

    def decomposes(self, device_type: str, op: str) -> bool:
        """Whether ``op`` on ``device_type`` runs through its ATen decomposition.

        >>> import ampkit
        >>> p = ampkit.load_policy("torch_default")
        >>> p.decomposes("cuda", "cross_entropy"), p.category("cuda", "cross_entropy")
        (True, None)
        """
        _check_op_name(op, "decomposes")
        return self.rules(device_type).decomposes(op)

    def to_dict(self) -> dict:
        """A plain dict in the YAML schema (``yaml.safe_dump`` writes it back)."""
        d = {
            "schema_version": SCHEMA_VERSION,
            "name": self.name,
            "description": self.description,
            "devices": {d: r.to_dict() for d, r in self.devices},
        }
        if self.modules:
            d["modules"] = {m.pattern: m.to_dict() for m in self.modules}
        return d

    def to_yaml(self) -> str:
        return yaml.safe_dump(self.to_dict(), sort_keys=False, default_flow_style=None, width=100)

    def _derive(self, step: str, **changes) -> "Policy":
        """A copy with ``changes``, remembering the call that made it (``str()`` shows it)."""
        return dataclasses.replace(self, source="", derived=self.derived + (step,), **changes)

    def __str__(self) -> str:
        """The rules as a table, headed by the name and the changes made since it was given.

        >>> import ampkit
        >>> p = ampkit.load_policy("torch_default")
        >>> str(p.with_ops("cpu", fp32=["linear"])).splitlines()[0]
        "Policy 'torch_default' + with_ops('cpu', fp32=['linear'])"
        >>> str(p.with_ops("cpu", fp32=["linear"]).with_name("fp32_linear")).splitlines()[0]
        "Policy 'fp32_linear'"
        """
        lines = [f"Policy {self.name!r}" + "".join(f" + {step}" for step in self.derived)
                 + (f" ({self.source})" if self.source else "")]
        for d, r in self.devices:
            lines.append(f"  {d}: lower_precision_dtype={DTYPE_NAMES[r.lower_precision_dtype]}")
            for cat in CATEGORIES:
                names = r.ops(cat)
                shown = ", ".join(names[:8]) + (f", ... ({len(names)} ops)" if len(names) > 8 else "")
                lines.append(f"    {cat:<18} {shown or '-'}")
            lines.append(f"    {'decompose':<18} {', '.join(r.decompose) or '-'}")
            if r.fp8:
                lines.append(f"    {'fp8_recipe':<18} {r.fp8_recipe.to_dict()}")
        for m in self.modules:
            lines.append(f"  module {m.pattern}: {m.to_dict()}")
        return "\n".join(lines)

    # -- changing -------------------------------------------------------------
    def _targets(self, device):
        if device is None:
            return self.device_types()
        if isinstance(device, str):
            device = (device,)
        if not isinstance(device, (list, tuple)):
            raise PolicyError(
                f"device must be a device type such as 'cpu', a list of them, or None for "
                f"all of {', '.join(self.device_types())}; got {device!r}")
        for d in device:
            self.rules(d)
        return tuple(device)

    def with_ops(self, device=None, **categories) -> "Policy":
        """A copy with ops moved into categories (out of their old one).

        ``device``: a device type, a sequence of them, or None for all.
        Each keyword is a category; its value a list of op names (for
        ``banned``: a list or a dict ``{op: message}``). ``decompose=[...]``
        moves ops out of their category to run through their ATen
        decomposition (only ops of ``ampkit._decompositions`` for the device).

        >>> import ampkit
        >>> p = ampkit.load_policy("torch_default").with_ops("cpu", fp32=["matmul"])
        >>> p.category("cpu", "matmul"), p.category("cuda", "matmul")
        ('fp32', 'lower_precision_fp')
        """
        moves = {}
        for cat, names in categories.items():
            if cat != "decompose":
                check_category(cat, "with_ops")
            if isinstance(names, str):
                raise PolicyError(f"with_ops: {cat}= must be a list of op names, got the string {names!r}")
            if not isinstance(names, (list, tuple, set, frozenset, dict)):
                raise PolicyError(
                    f"with_ops: {cat}= must be a list of op names"
                    f"{' (or a dict {op: message})' if cat == 'banned' else ''}, got {names!r}")
            if cat == "banned" and isinstance(names, dict):
                items = list(names.items())
            else:
                items = [(n, None) for n in names]
            for n, msg in items:
                _ops.check_name(n, f"with_ops({cat}=...)")
                if n in moves:
                    raise PolicyError(f"with_ops: op {n!r} given for both {moves[n][0]!r} and {cat!r}")
                if msg is not None and not isinstance(msg, str):
                    raise PolicyError(f"with_ops: banned message for {n!r} must be a string, got {msg!r}")
                moves[n] = (cat, msg)
        return self._edit(device, moves, _call("with_ops", device, categories))

    def without_ops(self, *names, device=None) -> "Policy":
        """A copy in which ``names`` are in no category (run untouched).

        Each name must be listed (in a category or under ``decompose``) on at least
        one of the devices: removing what is not there is most likely a typo.

        >>> import ampkit
        >>> ampkit.load_policy("torch_default").without_ops("mm", device="cpu").category("cpu", "mm")
        """
        targets = self._targets(device)
        for n in names:
            _ops.check_name(n, "without_ops")
            if not any(self.category(d, n) or self.decomposes(d, n) for d in targets):
                raise PolicyError(
                    f"without_ops: op {n!r} is in no category on {', '.join(targets)}, so there is "
                    "nothing to remove; `str(policy)` lists each device's ops")
        shown = ", ".join(repr(n) for n in names) + ("" if device is None else f", device={device!r}")
        return self._edit(device, {n: (None, None) for n in names}, f"without_ops({shown})")

    def _edit(self, device, moves, step) -> "Policy":
        targets = self._targets(device)
        out = []
        for d, r in self.devices:
            if d in targets:
                tables = {c: dict.fromkeys(r.ops(c)) for c in CATEGORIES}
                tables["banned"] = dict(r.banned)
                tables["decompose"] = dict.fromkeys(r.decompose)
                for n, (cat, msg) in moves.items():
                    for t in tables.values():
                        t.pop(n, None)
                    if cat is not None:
                        tables[cat][n] = (msg or DEFAULT_BAN_MESSAGE.format(op=n)) if cat == "banned" else None
                r = make_rules(r.lower_precision_dtype, tables, d, "with_ops", r.fp8_recipe)
            out.append((d, r))
        return self._derive(step, devices=tuple(out))

    def with_dtype(self, device: str, dtype) -> "Policy":
        """A copy whose ``device`` regions default to ``dtype``."""
        dt = dtype_of(dtype, f"with_dtype({device!r})")
        out = tuple((d, dataclasses.replace(r, lower_precision_dtype=dt) if d == device else r) for d, r in self.devices)
        self.rules(device)
        return self._derive(f"with_dtype({device!r}, {DTYPE_NAMES[dt]!r})", devices=out)

    def with_fp8_recipe(self, device=None, **recipe) -> "Policy":
        """A copy whose ``fp8`` category is scaled as ``recipe`` says on ``device`` (a device
        type, a list of them, or None for all): the keywords ``scaling``, ``forward_dtype``,
        ``backward_dtype``, ``amax_history`` of the recipe (docs/autocast.md, "fp8"); the
        keys not given keep their defaults.

        >>> import ampkit
        >>> p = ampkit.load_policy("fp8").with_fp8_recipe(scaling="delayed", amax_history=16)
        >>> p.rules("cpu").fp8_recipe.scaling, p.rules("cpu").fp8_recipe.amax_history
        ('delayed', 16)
        """
        value = parse_recipe(recipe, "with_fp8_recipe")
        targets = self._targets(device)
        out = tuple((d, dataclasses.replace(r, fp8_recipe=value) if d in targets else r) for d, r in self.devices)
        return self._derive(_call("with_fp8_recipe", device, recipe), devices=out)

    # -- module scopes (ampkit._module_policy) -----------------------------------
    def with_module(self, pattern: str, *, pin: str | None = None, **categories) -> "Policy":
        """A copy with a module scope: inside the modules whose qualified names match the
        glob ``pattern``, ``pin="float32"`` runs with autocast off, or each keyword (a
        category) moves its ops there. The innermost scoped module wins; a scope already
        present with other rules is a conflict (remove it with :meth:`without_module`).
        Takes effect through :meth:`apply`.

        >>> import ampkit
        >>> p = ampkit.load_policy("torch_default").with_module("blocks.*.attn", fp32=["softmax"])
        >>> [(m.pattern, m.ops) for m in p.modules]
        [('blocks.*.attn', (('softmax', 'fp32'),))]
        """
        scope = _module_policy.make_scope(pattern, pin, categories, "with_module")
        for m in self.modules:
            if m.pattern == scope.pattern:
                if m == scope:
                    return self
                raise PolicyError(
                    f"with_module: scope {pattern!r} is already in the policy with other rules "
                    f"({m.to_dict()}, now {scope.to_dict()}); two scopes on one glob conflict: "
                    f"call without_module({pattern!r}) first to replace it")
        mods = tuple(sorted(self.modules + (scope,), key=lambda m: m.pattern))
        rules = ({"pin": pin} if pin is not None else {}) | categories
        return self._derive(_call("with_module", pattern, rules), modules=mods)

    def without_module(self, pattern: str) -> "Policy":
        """A copy without the scope ``pattern`` (PolicyError listing the scopes if absent)."""
        if not any(m.pattern == pattern for m in self.modules):
            raise PolicyError(f"without_module: no scope {pattern!r} in policy {self.name!r}; its "
                              f"scopes: {', '.join(m.pattern for m in self.modules) or 'none'}")
        return self._derive(f"without_module({pattern!r})", modules=tuple(m for m in self.modules if m.pattern != pattern))

    def without_modules(self) -> "Policy":
        """A copy with no module scopes (the tables every scope starts from)."""
        return self if not self.modules else self._derive("without_modules()", modules=())

    def apply(self, model):
        """Install the module scopes on ``model``: returns a handle (a context manager;
        ``remove()`` takes the hooks off). Every scope must match a module of the model, and a
        module matched by two scopes must get the same rules from both; otherwise PolicyError,
        and nothing is installed. A policy without scopes installs nothing.

        >>> import torch, ampkit
        >>> m = torch.nn.Sequential(torch.nn.Linear(2, 2))
        >>> ampkit.load_policy("torch_default").with_module("1", pin="float32").apply(m)
        Traceback (most recent call last):
        ...
        ampkit._errors.PolicyError: module scope '1' matches no module of the Sequential; the model's modules include: 0
        """
        return ModuleScopes(self, model)

    def with_name(self, name: str, description: str | None = None) -> "Policy":
        if not isinstance(name, str) or not name:
            raise PolicyError(f"with_name: name must be a non-empty string, got {name!r}")
        return dataclasses.replace(self, name=name, description=self.description if description is None else description,
                                   derived=())


def _call(method, first, keywords) -> str:
    """``method(first, k=v, ...)`` as written (``first`` left out when None)."""
    args = ([] if first is None else [repr(first)]) + [f"{k}={v!r}" for k, v in keywords.items()]
    return f"{method}({', '.join(args)})"


# -- loading -----------------------------------------------------------------
def _lines(text):
    """(YAML key paths -> 1-based line numbers (best effort), [(path, first line, second
    line)] of the mapping keys written twice, which YAML would silently keep the last of)."""
    out, twice = {}, []
    try:
        root = yaml.compose(text, Loader=yaml.SafeLoader)
    except yaml.YAMLError:
        return out, twice

    def walk(node, path):
        if isinstance(node, yaml.MappingNode):
            for k, v in node.value:
                p = path + (getattr(k, "value", None),)
                line = k.start_mark.line + 1
                if p in out:
                    twice.append((p, out[p], line))
                else:
                    out[p] = line
                walk(v, p)
        elif isinstance(node, yaml.SequenceNode):
            for i, v in enumerate(node.value):
                out[path + (i,)] = v.start_mark.line + 1
                if isinstance(v, yaml.ScalarNode):
                    out[path + (v.value,)] = v.start_mark.line + 1

    if root is not None:
        walk(root, ())
    return out, twice


def load_policy(path_or_name) -> Policy:
    """Load a policy from a YAML file or a shipped spec name.

    ``path_or_name``: ``"torch_default"`` (a file of ``shared_specs/policies``),
    or a path to a YAML file in the schema in docs/autocast.md ("The policy"). Only safe YAML
    is read. Any problem raises :class:`PolicyError` naming the file, the key,
    the value and the line; nothing is half-loaded.

    >>> import ampkit, torch
    >>> ampkit.load_policy("torch_default").rules("cuda").lower_precision_dtype
    torch.float16
    """
    if isinstance(path_or_name, Policy):
        return path_or_name
    if not isinstance(path_or_name, (str, os.PathLike)):
        raise PolicyError(f"load_policy: expected a spec name or a path, got {path_or_name!r}")
    s = os.fspath(path_or_name)
    if os.sep not in s and "/" not in s and not s.endswith((".yaml", ".yml")):
        try:
            folder = policy_dir()
        except SpecsNotFoundError as e:
            raise PolicyError(f"load_policy: cannot look up the shipped policy {s!r}: {e}") from e
        path = folder / f"{s}.yaml"
        if not path.is_file():
            names = sorted(p.stem for p in folder.glob("*.yaml"))
            raise PolicyError(f"load_policy: no shipped policy named {s!r}; shipped: {', '.join(names) or 'none'} (in {folder})")
    else:
        path = Path(s)
    try:
        st = path.stat()
        key = (str(path.resolve()), st.st_mtime_ns, st.st_size)
        if key in _LOADED:
            return _LOADED[key]
        text = path.read_text(encoding="utf-8")
    except OSError as e:
        raise PolicyError(f"{path}: cannot read the policy file ({e.strerror or e})") from e
    except UnicodeDecodeError as e:
        line = path.read_bytes()[: e.start].count(b"\n") + 1
        raise PolicyError(
            f"{path}:{line}: the policy file is not UTF-8 text (byte {e.object[e.start:e.start + 1]!r} "
            f"at offset {e.start}); save it as UTF-8") from e
    policy = parse_policy(text, str(path))
    _LOADED.put(key, policy)  # policies are immutable: share one per unchanged file
    return policy


_LOADED = BoundedCache(32)


def parse_policy(text: str, source: str = "<string>") -> Policy:
    """Parse and validate YAML text in the policy schema."""
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None) or getattr(e, "context_mark", None)
        line = f", line {mark.line + 1}" if mark is not None else ""
        problem = getattr(e, "problem", None) or str(e).splitlines()[0]
        raise PolicyError(f"{source}{line}: malformed YAML ({problem}); only plain YAML is accepted (no Python tags)") from e
    lines, twice = _lines(text)
    for path, first, second in twice:
        key = ".".join(str(p) for p in path)
        raise PolicyError(
            f"{source}, line {second}, key {key!r}: written twice (lines {first} and {second}); YAML "
            "would keep the last one silently: merge the two into one"
            + (" (two scopes on one glob conflict)" if path[0] == "modules" else ""))

    def where(*path):
        ln = lines.get(tuple(path))
        key = ".".join(str(p) for p in path)
        return f"{source}{f', line {ln}' if ln else ''}, key {key!r}" if path else source

    if not isinstance(data, dict):
        raise PolicyError(f"{source}: a policy must be a YAML mapping with keys {', '.join(_TOP_KEYS)}, got {type(data).__name__}")
    for k in data:
        if k not in _TOP_KEYS:
            raise PolicyError(f"{where(k)}: unknown key {k!r}; valid: {', '.join(_TOP_KEYS)}")
    if data.get("schema_version") != SCHEMA_VERSION:
        raise PolicyError(f"{where('schema_version')}: schema_version must be {SCHEMA_VERSION}, got {data.get('schema_version')!r}")
    name = data.get("name")
    if not isinstance(name, str) or not name:
        raise PolicyError(f"{where('name')}: name must be a non-empty string, got {name!r}")
    desc = data.get("description", "") or ""
    if not isinstance(desc, str):
        raise PolicyError(f"{where('description')}: description must be a string, got {desc!r}")
    devs = data.get("devices")
    if not isinstance(devs, dict) or not devs:
        raise PolicyError(f"{where('devices')}: devices must be a mapping of device type to rules, got {devs!r}")
    out = []
    for dev, body in devs.items():
        if dev not in DEVICES:
            raise PolicyError(f"{where('devices', dev)}: unknown device type {dev!r}; valid: {', '.join(DEVICES)}")
        out.append((dev, parse_device(dev, body, where)))
    modules = _module_policy.parse_scopes(data.get("modules"), where)
    return Policy(name=name, devices=tuple(sorted(out, key=lambda x: x[0])), description=desc.strip(),
                  source=source, modules=modules)
