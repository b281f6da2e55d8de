"""Drift check: does the shipped policy still describe the installed torch?

    python -m ampkit.drift check --device cpu [--dtype bfloat16] [--policy PATH] [--ops a,b] [--verbose]

For every op of the policy (and a broad list of candidates from
``ampkit.testing``) the same fresh inputs are run under ``torch.autocast`` and
under ``ampkit.autocast`` with its reference engine (``ampkit._autocast.reference``:
the YAML tables alone decide, torch's autocast off underneath) in three probes: all floating inputs float32
(``f32``), all in the region dtype (``low``), and the first one float32 with
the rest in the region dtype (``mixed``). Any probe whose output dtype (or
raise / no raise) differs is drift. The native category is inferred from the
probes (float32 in -> low out: lower_precision_fp; low in -> float32 out:
fp32 or fp32_output, which dtypes cannot tell apart; mixed -> float32 while
low -> low: promote; raises only under autocast: banned) so the table says
where to move the op in the YAML. An op under ``decompose`` must agree with
native in dtype and, since its decomposition runs native's own ops, in values
bit for bit (a value mismatch is drift too). Exit status 1 on drift, 0 otherwise.
"""

from __future__ import annotations

import argparse
import contextlib
import sys
import warnings

import torch

from ampkit import _autocast, _native
from ampkit._policy import CATEGORIES, PolicyError, load_policy
from ampkit.testing import CANDIDATES, op_sample

_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16}

# Differences a per-op table cannot express (documented in docs/autocast.md):
# op -> (probes where they show, why). Reported as "gap", not counted as drift.
KNOWN_GAPS = {
    "chain_matmul": (("mixed",), "native checks dtypes before its C++ decomposition reaches mm; ampkit casts first"),
    "inner": (("mixed",), "native checks dtypes before its C++ decomposition reaches mm; ampkit casts first"),
    "linalg.multi_dot": (("mixed",), "native checks dtypes before its C++ decomposition reaches mm; ampkit casts first"),
    "tensordot": (("mixed",), "native checks dtypes before its C++ decomposition reaches mm; ampkit casts first"),
    "lstm_cell": (("mixed",), "native casts only the inner linear layers (C++); the cell's output stays float32"),
    "gru": (("mixed",), "native casts only the inner linear layers (C++); the GRU's output stays float32"),
    "gru_cell": (("mixed",), "native casts only the inner linear layers (C++); the cell's output stays float32"),
    "linalg.pinv": (("f32",), "native runs the SVD in float32 and only the final matmul in low precision"),
    "pad": (("low",), "depends on mode: reflect/replicate pads run in float32 natively, constant pads do not"),
}
# Gaps that only show with one region dtype on cpu.
KNOWN_GAPS_BY_DTYPE = {
    torch.float16: {
        "lstm": (("f32", "mixed"), "native's oneDNN LSTM layer has no float16 kernel here and raises; ampkit's "
                 "float16 call takes torch's generic LSTM and succeeds"),
    },
}


# On cuda (torch's cuda lists cover the rnn cells and the matmul family).
KNOWN_GAPS_CUDA = {
    "linalg.pinv": KNOWN_GAPS["linalg.pinv"],
    "pinverse": (("f32",), "pinverse is linalg.pinv in C++: " + KNOWN_GAPS["linalg.pinv"][1]),
    "_native_multi_head_attention": (
        ("f32",),
        "native raises for float32 inputs (the CUDA kernel's general path casts only its inner "
        "projection and then mixes dtypes); ampkit casts all inputs and runs it. nn.MultiheadAttention "
        "never calls it in a cuda region (its fast path is off under autocast and under ampkit)",
    ),
}
_CUDNN_RNN_HALF = (
    ("f32", "low", "mixed"),
    "native's cuDNN RNN autocast (aten/src/ATen/cudnn/AutocastRNN.cpp) always casts to float16, "
    "even in a bfloat16 region; ampkit casts to the region's dtype",
)
KNOWN_GAPS_CUDA_BY_DTYPE = {
    torch.bfloat16: {op: _CUDNN_RNN_HALF for op in ("lstm", "gru", "rnn_tanh", "rnn_relu")},
}


def known_gap(op, device, dtype, probe):
    """The reason a probe of ``op`` is a known gap, or None.

    Ops that the installed torch is declared to handle otherwise than the table
    (``ampkit._native.NATIVE_DIFFERS``: an older torch) are gaps in every probe: ampkit
    runs them itself, so regions follow the table there too.
    """
    if probe in _native.differs(device).get(op, ()):
        return (f"torch {torch.__version__.split('+')[0]}'s autocast handles it otherwise; declared in "
                "ampkit._native.NATIVE_DIFFERS, so ampkit runs it by the table")
    if device == "cpu":
        tables = (KNOWN_GAPS, KNOWN_GAPS_BY_DTYPE.get(dtype, {}))
    else:
        tables = (KNOWN_GAPS_CUDA, KNOWN_GAPS_CUDA_BY_DTYPE.get(dtype, {}))
    for table in tables:
        probes, why = table.get(op, ((), None))
        if probe in probes:
            return why
    return None


def _short(d):
    return {torch.float32: "f32", torch.bfloat16: "bf16", torch.float16: "f16", torch.float64: "f64"}.get(d, str(d).replace("torch.", ""))


# Errors that say the machine lacks a kernel (oneDNN has no primitive for this CPU's ISA
# and dtype, e.g. the bf16 LSTM on an AVX2-only CPU): native cannot run, so it is no oracle.
ORACLE_CANNOT_RUN = ("could not create a primitive",)
UNAVAILABLE = "unavailable"


def oracle_cannot_run(error: BaseException) -> bool:
    """Whether ``error`` (raised by native autocast) says this machine has no kernel for the call."""
    return any(m in str(error) for m in ORACLE_CANNOT_RUN)


def _outcome(fn, keep=None):
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            out = fn()
    except Exception as e:  # noqa: BLE001 - an error is an outcome to compare
        return UNAVAILABLE if oracle_cannot_run(e) else f"error:{type(e).__name__}"
    for t in out if isinstance(out, (tuple, list)) else (out,):
        if isinstance(t, torch.Tensor):
            if keep is not None:
                keep.append(t.detach())
            return _short(t.dtype)
    return type(out).__name__


def _same_values(a, b) -> bool:
    return a.shape == b.shape and torch.equal(torch.nan_to_num(a.float(), 7.0), torch.nan_to_num(b.float(), 7.0))


def _probe_sample(op, device, kind, low):
    if kind == "f32":
        return op_sample(op, device, torch.float32)
    if kind == "low":
        return op_sample(op, device, low)
    s = op_sample(op, device, torch.float32)
    seen = [0]

    def conv(x):
        if isinstance(x, torch.Tensor) and x.is_floating_point() and x.dtype is torch.float32:
            seen[0] += 1
            return x if seen[0] == 1 else x.to(low)
        if isinstance(x, (list, tuple)):
            return type(x)(conv(v) for v in x)
        return x

    s.args = tuple(conv(a) for a in s.args)
    s.kwargs = {k: conv(v) for k, v in s.kwargs.items()}
    return s if seen[0] >= 2 else None


def probe(op, device, low, policy, values=False):
    """{probe: (plain, native, ampkit)} outcomes for one op.

    ``values``: also compare the outputs bit for bit; a mismatch makes the
    ampkit outcome read ``<dtype>, values differ``.
    """
    res = {}
    for kind in ("f32", "low", "mixed"):
        s = _probe_sample(op, device, kind, low)
        if s is None:
            continue
        plain = _outcome(s)
        s = _probe_sample(op, device, kind, low)

        def nat(s=s):
            with torch.autocast(device, dtype=low):
                return s()

        kept = [] if values else None
        native = _outcome(nat, kept)
        s = _probe_sample(op, device, kind, low)

        def amp(s=s):  # the tables alone, torch's autocast off underneath
            with _autocast.reference(), _autocast.autocast(device, dtype=low, policy=policy):
                return s()

        ampkit = _outcome(amp, kept)
        if values and len(kept) == 2 and native == ampkit and not _same_values(*kept):
            ampkit += ", values differ"
        res[kind] = (plain, native, ampkit)
    return res


def infer(res, low) -> str:
    """The native category that the probe outcomes point to."""
    lo = _short(low)
    p32, n32, _ = res["f32"]
    plo, nlo, _ = res["low"]
    if n32.startswith("error") and not p32.startswith("error"):
        return "banned"
    if n32 == lo and p32 == "f32":
        return "lower_precision_fp"
    if nlo == "f32" and plo != "f32":
        return "fp32|fp32_output"
    if "mixed" in res:
        pm, nm, _ = res["mixed"]
        if nm == "f32" and nlo == lo and pm != "f32":
            return "promote"
    return "-"


def check(device="cpu", dtype=None, policy="torch_default", ops=None, verbose=False, out=sys.stdout) -> int:
    """Run the drift check; print a table; return the number of drifting ops."""
    pol = load_policy(policy)
    rules = pol.rules(device)
    low = rules.lower_precision_dtype if dtype is None else _DTYPES[dtype]
    spec_ops = [n for c in CATEGORIES for n in rules.ops(c)] + list(rules.decompose)
    names = sorted(set(spec_ops) | set(CANDIDATES)) if ops is None else ops
    rows, drift, unchecked = [], 0, []
    for op in names:
        try:
            op_sample(op, device)
        except KeyError:
            unchecked.append(op)
            continue
        cat = rules.category(op) or ("decompose" if rules.decomposes(op) else "-")
        res = probe(op, device, low, pol, values=cat == "decompose")
        bad = [k for k, (_, n, a) in res.items() if n != a]
        status = "ok"
        if bad:
            status = "gap" if all(known_gap(op, device, low, k) for k in bad) else "DRIFT"
            if status == "DRIFT" and all(res[k][1] == UNAVAILABLE for k in bad):
                status = "no oracle"  # native has no kernel here: nothing to compare with
        nat = infer(res, low)
        if status == "DRIFT":
            drift += 1
        if status != "ok" or verbose:
            detail = "; ".join(f"{k}: native {res[k][1]} ampkit {res[k][2]}" for k in (bad or res))
            if status == "gap":
                detail += f" (known gap: {known_gap(op, device, low, bad[0])})"
            if status == "no oracle":
                detail += " (native raised that this machine has no kernel for it: not compared)"
            rows.append((op, cat, nat, status, detail))
    head = ("op", "spec", "native (inferred)", "status", "probes (output dtype)")
    w = [max(len(str(r[i])) for r in rows + [head]) for i in range(5)]
    print(f"ampkit drift check: torch {torch.__version__}, device {device}, dtype {low}, policy {pol.name!r}", file=out)
    print(f"{len(names) - len(unchecked)} ops probed, {drift} drifting", file=out)
    if rows:
        print("  ".join(h.ljust(w[i]) for i, h in enumerate(head)), file=out)
        for r in rows:
            print("  ".join(str(x).ljust(w[i]) for i, x in enumerate(r)).rstrip(), file=out)
    if unchecked:
        print(f"no sample in ampkit.testing (not probed): {', '.join(unchecked)}", file=out)
    return drift


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m ampkit.drift", description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    c = sub.add_parser("check", help="compare the policy with the installed torch's native autocast")
    c.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    c.add_argument("--dtype", default=None, choices=sorted(_DTYPES), help="region dtype (default: the policy's)")
    c.add_argument("--policy", default="torch_default", help="shipped name or YAML path")
    c.add_argument("--ops", default=None, help="comma-separated op names (default: policy ops + candidates)")
    c.add_argument("--verbose", action="store_true", help="list agreeing ops too")
    a = ap.parse_args(argv)
    if a.device == "cuda" and not torch.cuda.is_available():
        print("ampkit drift check: --device cuda needs a CUDA GPU (torch.cuda.is_available() is False)", file=sys.stderr)
        return 2
    try:
        n = check(a.device, a.dtype, a.policy, a.ops.split(",") if a.ops else None, a.verbose)
    except PolicyError as e:
        print(f"ampkit drift check: {e}", file=sys.stderr)
        return 2
    return 1 if n else 0


if __name__ == "__main__":
    with contextlib.suppress(KeyboardInterrupt):
        sys.exit(main())
