"""The numerics doctor on a GPU: overhead, no host sync, detection inside a CUDA graph, the
fault suite, the repair demo and the heatmap. Writes everything to OUTDIR.

    python benchmarks/gpu/doctor_gpu.py OUTDIR [--quick]

OUTDIR/doctor_gpu.json   one record per check ("ok": false with the error when it failed)
OUTDIR/doctor_gpu.log    what was printed
OUTDIR/heatmap.png       per-module underflow/overflow of the diverging repair run
OUTDIR/pytest_cuda.log   pytest -m cuda tests/python/test_doctor_cuda.py

Expected runtime on one H100: under 3 minutes (--quick: under 1).
"""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
import time
import traceback
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
sys.path.insert(0, str(HERE.parent))  # benchmarks/: doctor_overhead, doctor_repair
sys.path.insert(0, str(REPO / "tests" / "python"))  # faults: the tests' fault injector

import ampkit  # noqa: E402
from ampkit.bench import build_case  # noqa: E402

import doctor_overhead  # noqa: E402
import faults  # noqa: E402
import doctor_repair  # noqa: E402

RESULTS: list = []
# DOCTOR_GPU_DEVICE=cpu: a dry run of this script's logic on a machine without a GPU
DEVICE = os.environ.get("DOCTOR_GPU_DEVICE", "cuda")


def log(*a):
    print(*a, flush=True)


def check(name):
    def wrap(fn):
        def run(*args, **kw):
            t = time.perf_counter()
            rec = {"check": name}
            try:
                rec.update(fn(*args, **kw) or {})
                rec.setdefault("ok", True)
            except Exception as e:  # recorded as a failure, never as numbers
                rec.update(ok=False, error=f"{type(e).__name__}: {e}", traceback=traceback.format_exc())
            rec["seconds"] = round(time.perf_counter() - t, 2)
            RESULTS.append(rec)
            log(f"[{'ok' if rec['ok'] else 'FAILED'}] {name} ({rec['seconds']} s)"
                + ("" if rec["ok"] else f": {rec.get('error', 'a record failed, see above')}"))
            return rec
        return run
    return wrap


@check("context")
def context():
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True,
                            text=True).stdout.strip()
    return {"card": torch.cuda.get_device_name(0), "torch": torch.__version__,
            "cuda": torch.version.cuda, "python": platform.python_version(), "commit": commit}


@check("overhead")
def overhead(quick):
    cases = [("seed_mlp", "full")] + ([] if quick else [("transformer", "full")])
    if DEVICE == "cpu":
        cases = [("seed_mlp", "tiny")]
    out = []
    for case, profile in cases:
        recs = doctor_overhead.measure(case, profile, DEVICE, steps=10 if quick else (20 if case == "transformer" else 150),
                                       repeats=2 if quick else 9, everies=(1, 100), dtype=torch.float16 if DEVICE == "cuda" else torch.bfloat16)
        for r in recs:
            r.pop("samples", None)
            if r["ok"]:
                log(f"  {case} {r['variant']}: off {r['seconds_per_step']['off'] * 1e3:.3f} ms/step, "
                    f"armed every=1 x{r['ratio_every=1']['median']:.3f}, every=100 "
                    f"x{r['ratio_every=100']['median']:.3f} [{r['ratio_every=100']['q1']:.3f}, "
                    f"{r['ratio_every=100']['q3']:.3f}], amortized every=100 x{r['amortized_every=100']:.3f}, "
                    f"captured {r['captured']}")
            else:
                log(f"  {case} {r['variant']}: FAILED {r['error']}")
        out += recs
    return {"records": out, "ok": all(r["ok"] for r in out)}


def _no_sync_run(variant, armed, steps=4):
    built = build_case("seed_mlp", "tiny", device="cuda")
    model = built.new_model()
    run, step = doctor_overhead.trainer(built, model, "cuda", variant, torch.float16)
    doc = ampkit.doctor(model) if armed else None
    try:
        for i in range(4):  # warm-up (and, for the train step, its capture) outside the check
            run(*built.batches[i % len(built.batches)])
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            for i in range(steps):
                run(*built.batches[i % len(built.batches)])
        finally:
            torch.cuda.set_sync_debug_mode("default")
        torch.cuda.synchronize()
        return {"synced": False, "captured": bool(step.captured) if step else False}
    except RuntimeError as e:
        return {"synced": True, "error": str(e)[:300]}
    finally:
        if doc is not None:
            doc.close()


@check("no_sync")
def no_sync():
    """The doctor adds no host sync: steps under set_sync_debug_mode('error'), off and armed."""
    out = {}
    for variant in ("eager", "train_step"):
        off, on = _no_sync_run(variant, False), _no_sync_run(variant, True)
        out[variant] = {"off": off, "armed": on}
        log(f"  {variant}: off synced={off['synced']}, armed synced={on['synced']}")
    ok = all(not v["armed"]["synced"] or v["off"]["synced"] for v in out.values())
    return {"variants": out, "ok": ok and not out["train_step"]["armed"]["synced"]}


def _bad_batch_finding(capture, bad_step=6, steps=8):
    f, captured = faults.bad_batch(DEVICE, capture, bad_step=bad_step, steps=steps)
    return (f.to_dict() if f else None), captured


@check("captured_detection")
def captured_detection():
    """A bad batch replayed through the captured graph: the finding equals the eager one."""
    eager, _ = _bad_batch_finding(False)
    graph, captured = _bad_batch_finding(True)
    log(f"  eager: {eager}\n  graph: {graph} (captured per step: {captured})")
    same = eager is not None and graph is not None and all(
        eager[k] == graph[k] for k in ("op", "module", "phase", "dtype", "step"))
    return {"eager": eager, "graph": graph, "captured": captured,
            "ok": same and (captured[6] or DEVICE == "cpu")}


@check("fault_suite")
def fault_suite(quick):
    plan = faults.plan(device=DEVICE)
    if quick:
        plan = plan[::4]
    hits, misses = 0, []
    for f in plan:
        finding, fired = faults.run_fault(f, device=DEVICE, step=1)
        good = finding is not None and fired == 1 and (finding.op, finding.module, finding.phase, finding.step) == (
            f["op"], f["module"], f["phase"], fired)
        hits += good
        if not good:
            misses.append({"fault": f, "finding": finding.to_dict() if finding else None, "fired": fired})
    rate = hits / len(plan)
    log(f"  {hits}/{len(plan)} faults named right ({rate:.1%})")
    return {"faults": len(plan), "named_right": hits, "rate": rate, "misses": misses, "ok": rate >= 0.95}


@check("repair")
def repair(out):
    r = doctor_repair.repair(DEVICE, steps=100, broken_steps=20)
    (out / "suggested_policy.yaml").write_text(r.pop("policy_yaml"))
    log(f"  default skipped {r['fp16_default']['skipped']}/20; finding {r['finding']}; "
        f"repaired loss ratio {r['loss_ratio']:.4f}, low-precision matmul FLOPs "
        f"{r['fp16_repaired']['low_precision_matmul_fraction']:.3f}")
    ok = (r["fp16_default"]["skipped"] == 20 and abs(r["loss_ratio"] - 1) <= 0.01
          and r["fp16_repaired"]["low_precision_matmul_fraction"] >= 0.9)
    return {**r, "ok": ok}


@check("heatmap")
def heatmap(out):
    res = doctor_repair.train(DEVICE, 10, "fp16", doctor_every=1)
    doc = res["doctor"]
    path = doc.heatmap(out / "heatmap.png")
    return {"path": str(path), "rows": len(doc.stats())}


@check("pytest_cuda")
def pytest_cuda(out):
    p = subprocess.run([sys.executable, "-m", "pytest", "-q", "-m", "cuda", "tests/python/test_doctor_cuda.py"],
                       cwd=REPO, capture_output=True, text=True)
    (out / "pytest_cuda.log").write_text(p.stdout + p.stderr)
    tail = (p.stdout.strip().splitlines() or [""])[-1]
    log(f"  {tail}")
    return {"returncode": p.returncode, "summary": tail, "ok": p.returncode == 0}


def main():
    if len(sys.argv) < 2:
        sys.exit(__doc__)
    out = Path(sys.argv[1])
    out.mkdir(parents=True, exist_ok=True)
    quick = "--quick" in sys.argv
    if DEVICE == "cuda" and not torch.cuda.is_available():
        sys.exit("doctor_gpu.py needs a CUDA GPU (DOCTOR_GPU_DEVICE=cpu for a dry run of its logic)")
    t = time.perf_counter()
    if DEVICE == "cuda":
        context()
        no_sync()
    captured_detection()
    fault_suite(quick)
    repair(out)
    heatmap(out)
    overhead(quick)
    if DEVICE == "cuda":
        pytest_cuda(out)
    summary = {"total_seconds": round(time.perf_counter() - t, 1), "results": RESULTS}
    (out / "doctor_gpu.json").write_text(json.dumps(summary, indent=1, default=str))
    log(f"done in {summary['total_seconds']} s; failed: "
        f"{[r['check'] for r in RESULTS if not r['ok']] or 'none'}")


if __name__ == "__main__":
    class _Tee:
        def __init__(self, *files):
            self.files = files

        def write(self, s):
            for f in self.files:
                f.write(s)

        def flush(self):
            for f in self.files:
                f.flush()

    if len(sys.argv) > 1:
        os.makedirs(sys.argv[1], exist_ok=True)
        _logf = open(Path(sys.argv[1]) / "doctor_gpu.log", "w")
        sys.stdout = _Tee(sys.__stdout__, _logf)
    main()
