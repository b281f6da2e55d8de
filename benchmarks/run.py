"""Run the benchmark suite from Python and from R, merge the results, write the report.

    python benchmarks/run.py --profile cpu --langs python,r --out benchmarks/results \
        [--cases seed_mlp,transformer] [--variants fp32,torch_amp,ampkit_amp] [--repeats 5] \
        [--device auto|cpu|cuda] [--threads N] [--rscript "Rscript"]
    python benchmarks/run.py --gpus N [--engines ddp,fsdp2] [--ddp-options SPEC ...] [--check] [--sequential] ...

With --gpus N it runs across processes instead (Python only): torchrun launches the
Python runner with 1 process and then with N (one per GPU; on the CPU, gloo processes),
for each case x engine x variant (by default transformer, text_classifier and gpt2_small,
DDP and FSDP2, torch_amp, ampkit_amp and ampkit_step), so that each N-process record has its
scaling efficiency. The variants of each case and engine configuration are timed
interleaved (rounds of one epoch each, the order rotating), so that their ratios compare
the same minutes; --sequential times each alone, its epochs in a row. A run that stalls is stopped by the runner's watchdog (--run-timeout
seconds), recorded as failed with where it stalled, and the launch starts again after it.

`make bench` calls this. The Python runner times the variants of a case interleaved
(rounds of one epoch of each, the order rotating, compiled variants included; --sequential:
each alone); the R runner times each alone. Each language runs in its own process (the Python runner is
`python -m ampkit.bench`, the R runner `Rscript benchmarks/run.R`), never two at once,
so each gets the whole machine with the same number of torch threads; case by case,
the two languages one after the other in alternating order. Writes, under --out:
raw-<language>-<case>.json (each runner's document), results.json (merged, with the
comparisons filled in), report.md and report.png; prints the table. A runner
that cannot start (no R, no R package) is recorded as failed runs, with its error.
"""

from __future__ import annotations

import argparse
import os
import shlex
import shutil
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "python"))
sys.path.insert(0, str(REPO / "benchmarks"))

LANGS = ("python", "r")
# make bench must finish within 10 minutes on a fresh clone on any CPU: setup takes about 2 of them.
DEFAULT_BUDGET_S = 400


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--profile", default="cpu")
    p.add_argument("--langs", default=None, help="comma-separated: python, r (default: both; with --gpus: python)")
    p.add_argument("--out", default=str(REPO / "benchmarks" / "results"), help="output folder")
    p.add_argument("--cases", default="")
    p.add_argument("--variants", default="")
    p.add_argument("--repeats", type=int, default=None)
    p.add_argument("--device", default="auto")
    p.add_argument("--threads", type=int, default=None,
                   help="torch threads in both runners (default: 1 on CPU, torch's own on CUDA)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--budget", type=float, default=None,
                   help="seconds the runs may take: each case is calibrated and, where the estimate is "
                        "over, its run lengths (then batch size) cut; every variant still runs "
                        "(default: %d for the cpu profile on the CPU, else none; 0: none); with --gpus: the runs "
                        "not started in time are recorded as skipped, each world size getting an equal "
                        "share of the time left" % DEFAULT_BUDGET_S)
    p.add_argument("--sequential", action="store_true",
                   help="time each variant alone, its epochs in a row (default: the Python runner times the "
                        "variants of each case interleaved, compiled ones included, rounds of one epoch each, the "
                        "order rotating; with --gpus, of each case and engine configuration, --repeats rounds, "
                        "without --repeats the profile's repeats, at least 3); the R runner always times each alone")
    p.add_argument("--rscript", default=os.environ.get("AMPKIT_RSCRIPT", "Rscript"),
                   help="command that runs an R script (default: Rscript; on the GPU machine the r-on-device wrapper)")
    g = p.add_argument_group("across GPUs (--gpus)")
    g.add_argument("--gpus", type=int, default=None,
                   help="run across N processes, one per GPU (on the CPU: gloo processes), and 1 for the "
                        "scaling efficiency")
    g.add_argument("--engines", default="ddp,fsdp2", help="comma-separated: ddp, fsdp2")
    g.add_argument("--ddp-options", action="append", default=None, metavar="SPEC",
                   help="a DDP configuration, 'default' or key=value,... among gradient_as_bucket_view, "
                        "static_graph, bucket_cap_mb; repeat to run several (default: DDP's defaults)")
    g.add_argument("--check", action="store_true",
                   help="with N > 1: also compare make_train_step captured and eager, per case and engine")
    g.add_argument("--run-timeout", type=float, default=300.0,
                   help="seconds one run (or check) may take before it is stopped and recorded as failed")
    return p.parse_args(argv)


def runner_env(threads: int | None) -> dict:
    env = dict(os.environ)
    env.setdefault("RETICULATE_PYTHON", sys.executable)
    if "R_LIBS" not in env and (REPO / ".rlib").is_dir():
        env["R_LIBS"] = str(REPO / ".rlib")
    env.setdefault("AMPKIT_REPO", str(REPO))
    env["PYTHONPATH"] = str(REPO / "python") + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    env["PYTHONUNBUFFERED"] = "1"
    if threads:
        env["OMP_NUM_THREADS"] = str(threads)
    return env


def common_args(a, device: str, threads, budgeted: bool = False) -> list:
    args = ["--profile", a.profile, "--device", device, "--seed", str(a.seed)]
    for flag, value in (("--variants", a.variants), ("--repeats", None if budgeted else a.repeats),
                        ("--threads", threads)):
        if value not in (None, ""):
            args += [flag, str(value)]
    return args


def run_runner(lang: str, cmd: list, env: dict, out: Path) -> str | None:
    """Run one runner, streaming its progress; None when it wrote its document, else the error."""
    print("== %s runner: %s" % (lang, " ".join(shlex.quote(c) for c in cmd)), file=sys.stderr, flush=True)
    if out.exists():
        out.unlink()
    t0 = time.perf_counter()
    try:
        proc = subprocess.Popen(cmd, env=env, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    except OSError as e:
        return "could not start the %s runner (%s): %s" % (lang, cmd[0], e)
    tail = []
    for line in proc.stdout:
        sys.stderr.write(line)
        sys.stderr.flush()
        tail = (tail + [line.rstrip()])[-5:]
    rc = proc.wait()
    print("== %s runner: exit %d after %.1f s" % (lang, rc, time.perf_counter() - t0), file=sys.stderr, flush=True)
    if rc != 0 or not out.exists():
        return "the %s runner exited with status %d: %s" % (lang, rc, " / ".join(tail) or "(no output)")
    return None


def _with_variants(args: list, variants) -> list:
    """The runner's arguments with --variants naming exactly ``variants``."""
    args = list(args)
    if "--variants" in args:
        i = args.index("--variants")
        del args[i:i + 2]
    return args + ["--variants", ",".join(v.name for v in variants)]


def skipped_document(lang: str, reason: str, a, device: str, case, variants) -> dict:
    """Runs the budget left out: one skipped record each, with the reason (never dropped); a
    variant that could not run on this device anyway keeps its own reason (e.g. CUDA only)."""
    from ampkit import bench
    recs = [bench.make_record(bench.resolve_run(case, v, lang, a.profile, device),
                              status="skipped", reason=v.skip_reason(device) or reason)
            for v in variants if lang in v.languages]
    return {"context": bench.context(a.profile, device, lang, seed=a.seed), "records": recs}


def failed_document(lang: str, error: str, a, device: str, cases, variants) -> dict:
    """When a runner could not run at all: one failed record per run it should have made."""
    from ampkit import bench
    recs = []
    for c in cases:
        for v in variants:
            if lang in v.languages:
                reason = v.skip_reason(device)
                recs.append(bench.make_record(bench.resolve_run(c, v, lang, a.profile, device, repeats=a.repeats),
                                              status="skipped" if reason else "failed", reason=reason,
                                              error=None if reason else error))
    ctx = bench.context(a.profile, device, lang, seed=a.seed)
    return {"context": ctx, "records": recs}


def _minutes(seconds: float) -> str:
    seconds = max(0, int(round(seconds)))
    return "%d min %02d s" % divmod(seconds, 60) if seconds >= 60 else "%d s" % seconds


def _describe_length(n, profile_n) -> str:
    text = "%d batches x %d repeats after %d warm-up steps, batch size %d" % (
        n.num_batches, n.repeats, n.warmup_steps, n.batch_size)
    return text + (" (the profile's)" if n == profile_n else " (cut to fit the time budget from %d x %d after %d, batch %d)"
                   % (profile_n.num_batches, profile_n.repeats, profile_n.warmup_steps, profile_n.batch_size))


def plan_budget(a, cases, variants, langs, device, threads):
    """(budget seconds or 0, {case: StepCost}, {case: RunLength}): each case calibrated once."""
    from ampkit import bench
    budget = a.budget if a.budget is not None else (DEFAULT_BUDGET_S if (device, a.profile) == ("cpu", "cpu") else 0)
    lengths = {c.name: bench.RunLength.of(c, a.profile, a.repeats) for c in cases}
    if not budget:
        return 0, {}, lengths
    import torch
    if threads:
        torch.set_num_threads(threads)
    costs = {}
    for c in cases:
        t0 = time.perf_counter()
        costs[c.name] = bench.calibrate(bench.build_case(c, a.profile, seed=a.seed, device=device))
        print("== calibrated %s: %.0f ms a float32 step, %.0f ms a low-precision step (%.1f s)"
              % (c.name, costs[c.name].fp32_ms, costs[c.name].low_ms, time.perf_counter() - t0),
              file=sys.stderr, flush=True)
    return budget, costs, lengths


def main(argv=None) -> int:
    t_start = time.perf_counter()
    a = parse_args(argv)
    if a.gpus is not None:
        import across
        return across.main(a, REPO, runner_env, t_start)
    from ampkit import bench
    import report
    try:
        langs = bench.select(a.langs or ",".join(LANGS), LANGS, "language")
        cases, variants = bench.plan(a.profile, a.cases, a.variants)
        device = bench.resolve_device(a.device)
        if a.repeats is not None and a.repeats < 1:
            raise ValueError("--repeats must be >= 1, got %d" % a.repeats)
    except ValueError as e:
        print("error: %s" % e, file=sys.stderr)
        return 2
    if a.profile == "full" and device == "cpu":
        print("warning: the full profile is sized for a GPU; on the CPU it takes hours", file=sys.stderr)
    threads = a.threads or (1 if device == "cpu" else None)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    env = runner_env(threads)
    cap = bench.cpu_capability() if device == "cpu" else None
    if cap is not None:
        print("== CPU: " + cap.describe(), file=sys.stderr, flush=True)
    budget, costs, lengths = plan_budget(a, cases, variants, langs, device, threads)
    planned = dict(lengths)
    t_runs, spent, compile_spent, compile_runs, estimated_done, scale = time.perf_counter(), 0.0, 0.0, 0, 0.0, 1.0
    running, not_run = list(variants), None  # not_run: why the compiled variants stopped running
    docs = []
    # Case by case, the languages one after the other, their order alternating: the
    # R / Python comparison of a case is then made minutes apart, not the whole suite
    # apart, and a drift of the machine's load does not favour one language.
    for k, case in enumerate(cases):
        left = cases[k:]
        if budget:  # refit what is left to the time left, corrected by how the estimates fared
            compile_s = compile_spent / compile_runs if compile_runs else bench.COMPILE_S

            def refit(vs):
                return bench.fit_budget({c.name: planned[c.name] for c in left}, {c.name: costs[c.name] for c in left},
                                        vs, langs, device, budget - spent, scale, compile_s)
            fitted, est = refit(running)
            eager = [v for v in running if v.compile == "none"]
            if est > budget - spent and len(eager) < len(running):
                # Compiling costs what no cut can save: where even the shortest runs would
                # overrun, the compiled variants of the cases left are not run, and say why.
                not_run = ("not run: the %d s time budget had %d s left for %d case(s), estimated at "
                           "%d s with torch.compile's compilations (%d s a compiled run on this machine) "
                           "and run lengths already cut; make bench BUDGET=0 runs everything"
                           % (budget, max(budget - spent, 0), len(left), est, compile_s))
                running = eager
                fitted, est = refit(running)
                print("== the compiled variants are " + not_run, file=sys.stderr, flush=True)
            lengths.update(fitted)
            env["AMPKIT_BENCH_SPECS"] = bench.write_sized_cases(left, lengths, a.profile, out / "sized-cases")
            this = scale * bench.estimate_s(lengths[case.name], costs[case.name], running, langs, device, compile_s)
            print("== case %d/%d: %s, %s (about %s; about %s left in all)" % (
                k + 1, len(cases), case.name, _describe_length(lengths[case.name], planned[case.name]),
                _minutes(this), _minutes(est)), file=sys.stderr, flush=True)
        else:
            print("== case %d/%d: %s" % (k + 1, len(cases), case.name), file=sys.stderr, flush=True)
        t_case = time.perf_counter()
        case_docs = []
        for lang in (langs if k % 2 == 0 else langs[::-1]):
            raw = out / ("raw-%s-%s.json" % (lang, case.name))
            if lang == "python":
                cmd = [sys.executable, "-m", "ampkit.bench"] + (["--sequential"] if a.sequential else [])
            else:
                cmd = shlex.split(a.rscript) + [str(REPO / "benchmarks" / "run.R")]
                if shutil.which(cmd[0]) is None:
                    err = "R is not available (%r not found); run `make setup-r`" % cmd[0]
                    case_docs.append(failed_document(lang, err, a, device, [case], variants))
                    print("== r runner: " + err, file=sys.stderr)
                    continue
            args = common_args(a, device, threads, budgeted=bool(budget)) + ["--cases", case.name, "--out", str(raw)]
            if len(running) < len(variants):
                args = _with_variants(args, running)
            err = run_runner(lang, cmd + args, env, raw)
            case_docs.append(bench.read_document(raw) if err is None else
                             failed_document(lang, err, a, device, [case], running))
            if len(running) < len(variants):
                sized = bench.load_case(Path(env["AMPKIT_BENCH_SPECS"]) / ("%s.yaml" % case.name))
                case_docs.append(skipped_document(lang, not_run, a, device, sized, [v for v in variants if v not in running]))
        docs += case_docs
        if budget:
            spent = time.perf_counter() - t_runs
            compiled = [r for d in case_docs for r in d["records"] if r["compile"] != "none" and r["wall_s"]]
            compile_spent += sum(r["wall_s"] for r in compiled)
            compile_runs += len(compiled)
            estimated_done += bench.estimate_s(lengths[case.name], costs[case.name], running, langs, device, 0.0)
            scale = min(max((spent - compile_spent) / estimated_done, 0.5), 5.0)
        print("== case %d/%d done in %s" % (k + 1, len(cases), _minutes(time.perf_counter() - t_case)),
              file=sys.stderr, flush=True)
    doc = bench.merge(docs)
    doc["context"]["cpu_capability"] = cap.to_dict() if cap is not None else None
    doc["context"]["budget"] = None if not budget else {
        "budget_s": budget, "spent_s": round(time.perf_counter() - t_runs, 1),
        "cut": {c.name: _describe_length(lengths[c.name], planned[c.name])
                for c in cases if lengths[c.name] != planned[c.name]}}
    results = out / "results.json"
    bench.write_document(results, doc["context"], doc["records"])
    md = report.write(doc, out)
    print(report.table(doc))
    print("\n" + report.goals(doc))
    print("\nresults: %s\nreport:  %s (and report.png)\nwall time: %.1f s"
          % (results, md, time.perf_counter() - t_start))
    return 0


if __name__ == "__main__":
    sys.exit(main())
