"""A cast trace: what each intercepted call in an ampkit region did.

>>> import torch, ampkit
>>> lin = torch.nn.Linear(4, 3)
>>> with ampkit.trace() as tr, ampkit.autocast("cpu"):
...     loss = torch.nn.functional.mse_loss(lin(torch.randn(2, 4)), torch.randn(2, 3))
>>> [(r.op, r.rule, r.output_dtype) for r in tr.records if r.rule != "none"]
[('linear', 'lower_precision_fp', 'bfloat16'), ('mse_loss', 'fp32', 'float32')]
>>> print(tr)  # doctest: +SKIP
op        rule                device  inputs                       output
linear    lower_precision_fp  cpu     float32, float32, float32    bfloat16
mse_loss  fp32                cpu     bfloat16, float32            float32

Records are kept for calls whose result holds a tensor (property reads and
metadata calls such as ``size()`` are skipped). ``rule`` is the category that
was applied, ``"none"`` for an op in no table (or one whose tensors are on
another device), ``"composite"`` for a torch Python function whose body was
traced through. Tracing costs nothing when no trace is active.

Only the casts ampkit makes are recorded: a C++ composite that is in no table
(``gru``, say) runs with torch's autocast on, and the casts torch makes inside it
do not reach Python.

Code under ``torch.compile`` runs eagerly while a trace is active (torch's compiler
stance ``"force_eager"``, torch >= 2.6; process-wide, as the stance is: while any thread
traces), so that a compiled model's casts, its fp8 casts and their scales included, are
recorded as an eager model's are; its compiled graphs are kept and run again once the
last trace has ended. (A graph runs no Python: its casts cannot be recorded as it runs.)
"""

from __future__ import annotations

import dataclasses
import threading

import torch

from ampkit import _ops
from ampkit._engine import thread_engine
from ampkit._module_scopes import deciding_scope

_SEQ = (list, tuple)
#: What ``CastRecord.rule`` can be: a policy category, or how the call was handled.
RULES = ("lower_precision_fp", "fp32", "fp32_output", "promote", "fp8", "banned", "decompose",
         "composite", "none")


def _dtype_name(d) -> str:
    return str(d).replace("torch.", "")


def _tensors(x):
    if isinstance(x, torch.Tensor):
        return [x]
    if isinstance(x, _SEQ):
        return [t for t in x if isinstance(t, torch.Tensor)]
    return []


@dataclasses.dataclass(frozen=True)
class CastRecord:
    """One intercepted call."""

    op: str
    rule: str
    device: str
    input_dtypes: tuple
    output_dtype: str
    scope: str = ""  # the module scope (policy.with_module glob) that decided it; "" none did
    # rule "fp8": the casts it made (ampkit._fp8.Fp8Cast: operand, fp8 dtype, scale) and the
    # path that ran the matmul ("scaled_mm" or "emulated")
    fp8_casts: tuple = ()
    fp8_path: str = ""

    def to_dict(self) -> dict:
        """Plain values (strings and lists), e.g. for a data.frame in R."""
        return {
            "op": self.op,
            "rule": self.rule,
            "device": self.device,
            "input_dtypes": list(self.input_dtypes),
            "output_dtype": self.output_dtype,
            "scope": self.scope,
            "fp8_casts": [str(c) for c in self.fp8_casts],
            "fp8_path": self.fp8_path,
        }


class CastTrace:
    """The records of a :func:`trace` block, in call order."""

    def __init__(self):
        self.records: list = []
        self._fp8 = ((), "")  # the fp8 casts of the call being recorded (note_fp8)

    def __len__(self):
        return len(self.records)

    def __iter__(self):
        return iter(self.records)

    def as_rows(self) -> list:
        """The records as a list of plain dicts (``input_dtypes`` joined by ', ')."""
        rows = []
        for r in self.records:
            d = r.to_dict()
            d["input_dtypes"] = ", ".join(r.input_dtypes)
            d["fp8_casts"] = ", ".join(d["fp8_casts"])
            rows.append(d)
        return rows

    def table(self, rules=None) -> str:
        """An aligned text table; ``rules``: only records whose rule is in it."""
        if rules is not None:
            if isinstance(rules, str) or not isinstance(rules, (list, tuple, set, frozenset)):
                raise TypeError(f"table(rules=...) takes a list or set of rule names such as "
                                f"{{'fp32', 'lower_precision_fp'}}, got {rules!r}")
            unknown = [r for r in rules  # a call dispatched on its arguments: "fp32/promote"
                       if not isinstance(r, str) or not all(p in RULES for p in r.split("/"))]
            if unknown:
                raise ValueError(f"table(rules=...): unknown rule(s) {unknown}; valid: "
                                 f"{', '.join(RULES)}")
        rows = [r for r in self.as_rows() if rules is None or r["rule"] in rules]
        head = {"op": "op", "rule": "rule", "device": "device", "input_dtypes": "inputs", "output_dtype": "output"}
        head["scope"] = "scope"
        cols = ("op", "rule", "device", "input_dtypes", "output_dtype")
        if any(r["scope"] for r in rows):  # the column only where policy.apply(model) scoped casts
            cols += ("scope",)
        head["fp8_casts"], head["fp8_path"] = "fp8 casts", "fp8 path"
        if any(r["fp8_casts"] for r in rows):  # the columns only where an op ran in fp8
            cols += ("fp8_casts", "fp8_path")
        width = {c: max([len(head[c])] + [len(str(r[c])) for r in rows]) for c in cols}
        lines = ["  ".join(head[c].ljust(width[c]) for c in cols).rstrip()]
        lines += ["  ".join(str(r[c]).ljust(width[c]) for c in cols).rstrip() for r in rows]
        return "\n".join(lines)

    def __str__(self):
        return self.table()

    def __repr__(self):
        return f"<CastTrace of {len(self.records)} records>"

    def note_fp8(self, casts, path) -> None:
        """Called by an fp8 op while it runs (ampkit._fp8): its casts go into its record."""
        self._fp8 = (tuple(casts), path)

    def record_fp8_backward(self, op, device, grad_dtype, casts, path) -> None:
        """Called by an fp8 op's backward: a record ``<op>.backward`` with the cast of the
        output's gradient, appended when backward runs (inside the block or after it)."""
        dt = _dtype_name(grad_dtype)
        self.records.append(CastRecord(op=f"{op}.backward", rule="fp8", device=device, input_dtypes=(dt,),
                                       output_dtype=dt, fp8_casts=tuple(casts), fp8_path=path))

    def record_call(self, func, act, args, kwargs):
        """Run ``func`` (through ``act``, the engine's cast rule, when given) and record the
        cast it made; the engine calls this for each op while the trace is active."""
        self._fp8 = ((), "")
        out = func(*args, **kwargs) if act is None else act(func, args, kwargs)
        fp8_casts, fp8_path = self._fp8
        self._fp8 = ((), "")
        outs = _tensors(out)
        if not outs:
            return out
        ins = [t for a in list(args) + list(kwargs.values()) for t in _tensors(a)]
        rule = "none" if act is None else getattr(act, "rule", "none")
        if act is not None and rule != "composite" and ins and hasattr(act, "on") and not act.on(ins[0]):
            rule = "none"
        op = getattr(act, "op", None) or _ops.op_name(func)
        device = (ins[0] if ins else outs[0]).device.type
        self.records.append(
            CastRecord(
                op=op,
                rule=rule,
                device=device,
                input_dtypes=tuple(_dtype_name(t.dtype) for t in ins),
                output_dtype=_dtype_name(outs[0].dtype),
                scope=deciding_scope(op),
                fp8_casts=fp8_casts,
                fp8_path=fp8_path,
            )
        )
        return out


class _EagerCompiledCode:
    """torch's compiler stance held at ``"force_eager"`` while any trace is active, in any
    thread (the stance is process-wide): the first trace to start sets it, the last to end
    puts back the one before. Where torch has no stance (< 2.6), or while dynamo traces (a
    stance cannot change there), nothing changes and compiled code records nothing."""

    def __init__(self):
        self.lock, self.count, self.stance = threading.Lock(), 0, None

    def hold(self) -> bool:
        set_stance = getattr(torch.compiler, "set_stance", None)
        if set_stance is None or torch.compiler.is_compiling():
            return False
        with self.lock:
            if self.count == 0:
                try:
                    self.stance = set_stance("force_eager")  # (set now; its __exit__ puts back)
                except RuntimeError:  # (inside a compile region)
                    return False
            self.count += 1
        return True

    def release(self) -> None:
        with self.lock:
            self.count -= 1
            if self.count == 0:
                stance, self.stance = self.stance, None
                stance.__exit__(None, None, None)


_EAGER_COMPILED_CODE = _EagerCompiledCode()


def compiled_code_runs_eagerly() -> bool:
    """Whether ``torch.compile``'d code runs eagerly now, for a trace (make_train_step does
    not capture a CUDA graph then: it would hold the uncompiled kernels)."""
    return _EAGER_COMPILED_CODE.count > 0


class trace:
    """Context manager recording the ampkit regions of this thread into a CastTrace.

    ``with ampkit.trace() as tr: ...`` then ``print(tr)`` or ``tr.records``.
    Nested traces record into the innermost one. While a trace is active, every op
    of the region's policy is cast by ampkit's Python engine (so that each cast can
    be recorded) rather than by torch's C++ autocast: the same casts, a few
    microseconds more per call.

    Code under ``torch.compile`` runs eagerly while any trace is active (torch >= 2.6), so
    that its casts are recorded too (the module docstring says how).

    One trace object is one block: entering it again while it is active raises
    ``RuntimeError`` (nest a new ``ampkit.trace()`` instead; a finished one may be entered
    again and appends to its records). Exiting one that is not active in this thread, or
    that is not the innermost active trace, raises ``RuntimeError`` and changes nothing:
    the enclosing trace keeps recording.

    >>> import ampkit
    >>> tr = ampkit.trace()
    >>> with tr:
    ...     with tr:
    ...         pass
    Traceback (most recent call last):
    ...
    RuntimeError: this ampkit.trace() is already active; nest a new ampkit.trace() instead
    """

    def __init__(self):
        self.result = CastTrace()
        self._prev = None
        self._pushed = False
        self._entered = False
        self._thread = None
        self._eager = False  # whether this block holds the eager compiler stance

    def __enter__(self) -> CastTrace:
        if self._entered:
            raise RuntimeError(
                "this ampkit.trace() is already active; nest a new ampkit.trace() instead")
        eng = thread_engine()
        prev = eng.trace
        eager = _EAGER_COMPILED_CODE.hold()  # (first: a stance that cannot be set changes nothing)
        try:
            self._pushed = eng.set_trace(self.result)
        except BaseException:
            if eager:
                _EAGER_COMPILED_CODE.release()
            raise
        self._prev = prev
        self._entered = True
        self._thread = threading.get_ident()
        self._eager = eager
        return self.result

    def __exit__(self, exc_type, exc_val, exc_tb):
        eng = thread_engine()
        if not self._entered or self._thread != threading.get_ident():
            where = "was never entered (or was already exited)" if not self._entered \
                else "was entered in another thread"
            raise RuntimeError(f"ampkit.trace().__exit__(): this trace {where}; nothing changed")
        if eng.trace is not self.result:
            raise RuntimeError(
                "ampkit.trace().__exit__(): this trace is not the innermost active one (a "
                "trace entered inside it is still active); exit traces in the reverse order "
                "of entering them (nested `with` blocks do); nothing changed")
        self._entered = False
        if self._pushed:
            eng.drop_trace_push()
        eng.set_trace(self._prev)
        if self._eager:
            self._eager = False
            _EAGER_COMPILED_CODE.release()
        return False
