"""No file reads another module's private names: each room has one public face.

An AST walk over python/, tests/python/ and benchmarks/. A name is private when it starts
with one underscore. A file breaks the rule when it

- imports a private name from another module (``from ampkit._scaler import _inf_norms``),
  or any name from a private module of ampkit when it is not part of the package itself
  (a test or a benchmark: ``from ampkit._scaler import HISTORY_SIZE``, ``import ampkit._ops``);
- reads a private attribute of an imported module (``_autocast._engine()``, ``bench._runner``);
- reads a private attribute, defined by an ampkit class, of an object other than ``self`` or
  ``cls`` in a file that does not define that attribute itself (``scaler._scale``).

Inside python/ampkit the private modules are the package's own structure: modules import
each other's public names (``from ampkit._policy import load_policy``), never their private
ones. What must stay is listed in ALLOWED with the reason; an entry that no longer occurs
fails too, so that the list only shrinks.
"""

from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
ROOTS = ("python", "tests/python", "benchmarks")
PACKAGE = "ampkit"

WHITE_BOX = "a white-box test of this private module's internals, which have no public face"
# (file, name read) -> why it stays.
ALLOWED = {
    ("tests/python/conftest.py", "ampkit._fp8"):
        "cpu_scaled_mm_on turns the fp8 tier's _scaled_mm path on for the CPU (SCALED_MM_DEVICES), "
        "so that the GPU's layouts, scales and backward run where CI can check them",
    ("tests/python/test_fp8_compile.py", "ampkit._fp8"):
        "the compiled-model tests trace the _scaled_mm path on the CPU too (SCALED_MM_DEVICES), "
        "so that a graph break in the GPU's path shows where CI runs, and compare the delayed "
        "histories (HISTORIES) the compiled graph writes in place with the eager model's",
    ("benchmarks/fp8_linear_graphs.py", "ampkit._fp8"):
        "prints the compiled graphs of the GPU's _scaled_mm path on the CPU (SCALED_MM_DEVICES), "
        "to count an fp8 linear's passes where no GPU is: a measurement, never a shipped path",
    ("benchmarks/eager_step_parts.py", "ampkit._train_step"):
        "a measurement that switches the eager step's safety parts off one at a time (why_copy, "
        "HeldSignals, the kept buffers, the attribute copy) to see what each costs: internals by "
        "purpose, never in a shipped path",
    ("benchmarks/probes/eager_instructions.py", "_keep_graph"):
        "the probe's fallback mode stands in a graph as a capture keeps one, so that callgrind counts "
        "the eager fallback of a captured step on the CPU (no CUDA graph there): a measurement",
    ("benchmarks/eager_step_parts.py", "_kept_buffers"):
        "the same measurement: it switches the kept buffers' copy off on the step object",
    ("tests/python/test_compiled_graphs.py", "ampkit._engine"):
        "counts the calls that reach the eager handler (Mode.__torch_function__) while a compiled "
        "graph runs: the second pass the module under test removes has no public face",
    ("tests/python/test_compiled_graphs.py", "ampkit._compiled_graphs"): WHITE_BOX,
    ("tests/python/conftest.py", "ampkit._kernels"):
        "each test starts with torch's own autocast kernels (drop_idle()): the kernel route's "
        "registrations have no public face",
    ("tests/python/conftest.py", "ampkit._native"):
        "the test suite skips where torch's table is known to differ from the shipped one "
        "(_native.differs, torch_version): internals of the engine's native path",
    ("tests/python/test_autocast_decompose.py", "ampkit._autocast"):
        "reference() runs the YAML-only engine, the oracle side of the table tests",
    ("tests/python/test_autocast_decompose.py", "ampkit._decompositions"): WHITE_BOX,
    ("tests/python/test_autocast_decompose.py", "_cross_entropy_functional"): WHITE_BOX,
    ("tests/python/test_autocast_decompose.py", "_cross_entropy_aten"): WHITE_BOX,
    ("tests/python/test_autocast_narrow.py", "ampkit._narrow_casts"): WHITE_BOX,
    ("tests/python/test_unchanged.py", "ampkit._unchanged"): WHITE_BOX,
    ("tests/python/test_unchanged.py", "ampkit._rollback"):
        "the eager step's fault tests run again with the change checks' Python fallbacks "
        "switched on (no torch guards, no dict versions), which CI's torch and Python never take",
    ("tests/python/test_doctor.py", "ampkit._listeners"):
        "the listener point make_train_step notifies before a CUDA graph capture, notified on the CPU",
    ("tests/python/test_doctor_fp8.py", "ampkit._listeners"):
        "the listener point the fp8 op notifies of each cast: subscribed in sampled steps only",
    ("tests/python/test_doctor.py", "ampkit._doctor._step_watch"):
        "the host's batch and queue sizes, set small to run the send and wait paths on a short run",
    ("tests/python/test_doctor_cuda.py", "ampkit._doctor._step_watch"):
        "the host's batch size, set small so that a send runs inside the no-sync check",
    ("tests/python/faults.py", "ampkit._doctor"):
        "the fault injector fires again in the doctor's replay of its step (replaying()): "
        "a test oracle's view of the doctor's internals, kept out of the package",
    ("tests/python/test_autocast_kernels.py", "ampkit._kernels"):
        "the kernel route's switch and its registrations (held()), which have no public face",
    ("tests/python/test_autocast_kernels.py", "ampkit._engine"):
        "whether a region pushed the handler mode (thread_engine()), which has no public face",
    ("tests/python/test_autocast_semantics.py", "ampkit._autocast"):
        "reference() runs the YAML-only engine, the oracle side of the cache and policy tests",
    ("tests/python/test_autocast_semantics.py", "ampkit._engine"):
        "the engine's cast cache and region depth (thread_engine()), which have no public face",
    ("tests/python/test_autocast_table.py", "ampkit._autocast"):
        "reference() runs the YAML-only engine, the oracle side of the table tests",
    ("tests/python/test_trace.py", "ampkit._engine"):
        "the engine's mode after a trace exits (thread_engine()), which has no public face",
    ("tests/python/test_policy.py", "ampkit._policy"):
        "parse_policy (a policy from YAML text) is the loader's internal step",
    ("tests/python/test_policy.py", "_outcome"):
        "the drift check's classification of one probe (oracle error or drift)",
    ("tests/python/test_scaler.py", "ampkit._scaler"):
        "HISTORY_SIZE, the length of the scale history the stats keep: the scaler's internals",
    ("tests/python/test_scaler.py", "ampkit._grad_check"):
        "the read-only check's probes (finite_probes), an internal of the scaler's gradient check",
    ("tests/python/test_scaler.py", "_scale"):
        "bitwise equality of the scale tensor with torch's GradScaler (scale_tensor is public; "
        "the scaler's tests are owned by the scaler's room)",
    ("tests/python/test_scaler.py", "_per_optimizer"):
        "the per-optimizer stage records, to prove no state changed after misuse",
    ("tests/python/test_scaler_cuda.py", "_scale"):
        "bitwise equality of the scale tensor with torch's GradScaler on the GPU",
    ("tests/python/test_scaler_cuda.py", "_per_optimizer"):
        "the per-optimizer found-inf flags the fused optimizer reads",
    ("tests/python/test_scaler_property.py", "ampkit._grad_check"): WHITE_BOX,
    ("tests/python/test_train_step.py", "ampkit._train_step"):
        "_optimizer_refusals: why an optimizer cannot be captured, an internal of the step",
    ("tests/python/test_train_step.py", "_optimizer_refusals"): WHITE_BOX,
    ("tests/python/test_train_step.py", "ampkit._scaler"):
        "the scaler's OptState through its module (now exported as ampkit.OptState)",
    ("tests/python/test_train_step.py", "_after_failed_capture"):
        "the step's recovery after a failed capture, driven directly (no CUDA graph on the CPU)",
    ("tests/python/test_train_step.py", "_eager"):
        "the eager fallback beside a captured graph (beside_graph), driven directly (no CUDA graph on the CPU)",
    ("tests/python/test_train_step.py", "_give_graph_its_grads"):
        "what a replay does first after an eager fallback, driven directly (no CUDA graph on the CPU)",
    ("tests/python/test_train_step.py", "_keep_graph"):
        "a stand-in graph kept as a capture keeps its graph, so that the batch checks of a captured "
        "step (replay or run beside it) run on the CPU (no CUDA graph there)",
}


def _files():
    for root in ROOTS:
        yield from sorted(p for p in (REPO / root).rglob("*.py") if ".venv" not in p.parts)


def _private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def _module_of(path: Path):
    rel = path.relative_to(REPO / "python") if path.is_relative_to(REPO / "python") else None
    if rel is None:
        return None
    parts = list(rel.with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _local_modules() -> set:
    return {p.stem for root in ROOTS[1:] for p in (REPO / root).rglob("*.py")}


def _is_ours(module: str, local: set) -> bool:
    return module == PACKAGE or module.startswith(PACKAGE + ".") or module.split(".")[0] in local


def _class_private_attributes() -> dict:
    """Private attributes that ampkit's classes define: name -> files defining it."""
    out: dict = {}
    for path in (REPO / "python").rglob("*.py"):
        tree = ast.parse(path.read_text(encoding="utf-8"))
        for cls in (n for n in ast.walk(tree) if isinstance(n, ast.ClassDef)):
            for node in ast.walk(cls):
                names = []
                if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name:
                    names.append(node.name)
                elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store) \
                        and isinstance(node.value, ast.Name) and node.value.id == "self":
                    names.append(node.attr)
                elif isinstance(node, (ast.Assign, ast.AnnAssign)) and node in cls.body:
                    targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                    names += [t.id for t in targets if isinstance(t, ast.Name)]
                for n in names:
                    if _private(n):
                        out.setdefault(n, set()).add(path)
    return out


def _defined_here(tree) -> set:
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
            names.add(node.attr)
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            names.add(node.id)
    return names


def _violations(path: Path, local: set, class_attrs: dict) -> list:
    """(name, line, what) for each private read of another module in one file."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    me = _module_of(path)
    in_package = me is not None and me.split(".")[0] == PACKAGE
    modules = {}  # local name -> module it is bound to
    out = []

    def bad(name, node, what):
        out.append((name, node.lineno, what))

    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                if not _is_ours(a.name, local):
                    continue
                if not in_package and any(_private(p) for p in a.name.split(".")):
                    bad(a.name, node, "imports the private module %s" % a.name)
                modules[a.asname or a.name.split(".")[0]] = a.name if a.asname else a.name.split(".")[0]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            if not _is_ours(node.module, local):
                continue
            if not in_package and any(_private(p) for p in node.module.split(".")):
                bad(node.module, node, "imports from the private module %s" % node.module)
            for a in node.names:
                full = "%s.%s" % (node.module, a.name)
                is_module = (REPO / "python" / (full.replace(".", "/") + ".py")).is_file() or \
                    (REPO / "python" / full.replace(".", "/")).is_dir()
                if is_module:
                    modules[a.asname or a.name] = full
                if _private(a.name):
                    if is_module and not in_package:
                        bad(full, node, "imports the private module %s" % full)
                    elif not is_module:
                        bad(a.name, node, "imports the private name %s from %s" % (a.name, node.module))
    here = _defined_here(tree)
    for node in ast.walk(tree):
        if not isinstance(node, ast.Attribute) or not _private(node.attr):
            continue
        base = node.value
        owner = _dotted(base, modules)
        if owner is not None:
            full = "%s.%s" % (owner, node.attr)
            is_module = (REPO / "python" / (full.replace(".", "/") + ".py")).is_file()
            if is_module and in_package:
                continue  # the package's own structure
            bad(full if is_module else node.attr, node, "reads %s.%s" % (owner, node.attr))
        elif isinstance(base, ast.Name) and base.id in ("self", "cls"):
            continue
        elif isinstance(base, ast.Call) and isinstance(base.func, ast.Name) and base.func.id == "super":
            continue
        elif node.attr in class_attrs and path not in class_attrs[node.attr] and node.attr not in here:
            bad(node.attr, node, "reads %s, private to %s" % (
                node.attr, ", ".join(sorted(p.name for p in class_attrs[node.attr]))))
    return out


def _dotted(node, modules: dict):
    """The module an expression names (``ampkit.bench`` for ``ampkit.bench`` when ``ampkit``
    is an imported module), else None."""
    if isinstance(node, ast.Name):
        return modules.get(node.id)
    if isinstance(node, ast.Attribute) and not _private(node.attr):
        owner = _dotted(node.value, modules)
        if owner is not None:
            full = "%s.%s" % (owner, node.attr)
            path = REPO / "python" / full.replace(".", "/")
            return full if path.is_dir() or path.with_suffix(".py").is_file() else None
    return None


def _all_violations() -> dict:
    local, class_attrs = _local_modules(), _class_private_attributes()
    found = {}
    for path in _files():
        rel = path.relative_to(REPO).as_posix()
        for name, line, what in _violations(path, local, class_attrs):
            found.setdefault((rel, name), []).append("%s:%d %s" % (rel, line, what))
    return found


def test_no_file_reads_another_modules_private_names():
    found = _all_violations()
    new = {k: v for k, v in found.items() if k not in ALLOWED}
    assert not new, "private names read across modules (give the room a public face, or list " \
        "the read in ALLOWED with the reason):\n  " + "\n  ".join(x for v in new.values() for x in v)


def test_every_allowed_read_still_occurs():
    found = _all_violations()
    stale = sorted(k for k in ALLOWED if k not in found)
    assert not stale, "ALLOWED lists reads that no longer occur (remove them): %s" % stale


def test_the_walk_catches_each_kind_of_read(tmp_path):
    """The detector itself, on a file that commits each kind of read once."""
    src = tmp_path / "probe.py"
    src.write_text(
        "import ampkit\n"
        "from ampkit import _autocast\n"
        "from ampkit._policy import parse_policy\n"
        "from ampkit._scaler import _inf_norms\n"
        "import ampkit._ops as ops\n"
        "_autocast._engine()\n"
        "ampkit.bench._runner\n"
        "def f(scaler):\n"
        "    return scaler._scale, self._fine\n")
    names = sorted(n for n, _, _ in _violations(src, set(), {"_scale": {Path("x.py")}}))
    assert names == ["_engine", "_inf_norms", "_scale", "ampkit._autocast", "ampkit._ops", "ampkit._policy",
                     "ampkit._scaler", "ampkit.bench._runner"]
