"""benchmarks/run.py --gpus N: the benchmark across processes, launched through torchrun.

For each world size (1, then N), one torchrun launch runs the whole plan
(``ampkit.bench.plan_runs``: per case, the capture checks, then engine x variant, the
variants of each engine configuration timed interleaved unless --sequential) with
``python -m ampkit.bench --engines ...``; rank 0 logs each item to
``<out>/events-x<world>.jsonl`` as it goes and the launch's output is kept in
``<out>/launch-x<world>.log``. When a launch ends before its plan does (the runner's
watchdog stopped a stalled item, or a rank died), the items it was on (a check, or the
variants of an interleaved group) are recorded as failed, with the exit status and the
tail of the output, and a new launch starts after them. The records of all launches are
merged into results.json (the one schema) and the report gains its multi-GPU section.
"""

from __future__ import annotations

import os
import shlex
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

DEFAULT_CASES = "transformer,text_classifier,gpt2_small"
DEFAULT_VARIANTS = "torch_amp,ampkit_amp,ampkit_step"
LAUNCH_SLACK_S = 120  # process start, imports and rendezvous, on top of the items' own limits


def validate(a, bench):
    """(device, cases, variants, engines, world sizes) or ValueError naming the bad input."""
    if a.gpus < 1:
        raise ValueError("--gpus must be >= 1, got %d" % a.gpus)
    if a.langs not in (None, "python"):
        raise ValueError("--gpus runs the Python runner only (torchrun starts Python processes); "
                         "got --langs %s" % a.langs)
    if a.run_timeout <= 0:
        raise ValueError("--run-timeout must be > 0, got %g" % a.run_timeout)
    if a.repeats is not None and a.repeats < 1:
        raise ValueError("--repeats must be >= 1, got %d" % a.repeats)
    cases, variants = bench.plan(a.profile, a.cases or DEFAULT_CASES, a.variants or DEFAULT_VARIANTS)
    if not a.sequential:  # a compiled variant is timed alone: after the group of the others, not inside it
        variants = sorted(variants, key=lambda v: v.compile != "none")
    engines = bench.parse_engines(a.engines, a.ddp_options)
    device = bench.resolve_device(a.device)
    if device == "cuda":
        import torch
        have = torch.cuda.device_count()
        if a.gpus > have:
            raise ValueError("--gpus %d, but this machine has %d GPU(s) (torch.cuda.device_count())" % (a.gpus, have))
    else:
        have = os.cpu_count() or 1
        if a.gpus > have:
            raise ValueError("--gpus %d on the CPU starts %d gloo processes, but this machine has %d CPU(s)"
                             % (a.gpus, a.gpus, have))
        import torch
        old = tuple(int(v) for v in torch.__version__.split("+")[0].split(".")[:2]) < (2, 5)
        if old and any(e.name == "fsdp2" for e in engines):
            raise ValueError("--engines fsdp2 on the CPU needs torch >= 2.5 (torch %s's fully_shard creates "
                             "CUDA streams); run --engines ddp here, or on a GPU" % torch.__version__)
    return device, cases, variants, engines, sorted({1, a.gpus})


def worker_cmd(a, device, cases, variants, world, start, events, threads, deadline=None) -> list:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(world),
           "-m", "ampkit.bench", "--profile", a.profile, "--device", device, "--seed", str(a.seed),
           "--cases", ",".join(c.name for c in cases), "--variants", ",".join(v.name for v in variants),
           "--engines", a.engines, "--from-item", str(start), "--run-timeout", str(a.run_timeout), "--out", str(events)]
    for spec in a.ddp_options or ():
        cmd += ["--ddp-options", spec]
    if a.check and world > 1:
        cmd.append("--check")
    if a.sequential:
        cmd.append("--sequential")
    if a.repeats is not None:
        cmd += ["--repeats", str(a.repeats)]
    if threads:
        cmd += ["--threads", str(threads)]
    if deadline is not None:
        cmd += ["--deadline", "%.0f" % deadline]
    return cmd


def launch(cmd, env, log: Path, timeout_s: float):
    """Run one torchrun launch, streaming its output (to stderr and the log);
    (exit status, last lines). On timeout its whole process group is killed."""
    print("== launch: " + " ".join(shlex.quote(c) for c in cmd), file=sys.stderr, flush=True)
    tail = []
    with open(log, "a") as f:
        proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                start_new_session=True)
        deadline = time.monotonic() + timeout_s

        def stop():
            while proc.poll() is None and time.monotonic() < deadline:
                time.sleep(1)
            if proc.poll() is None:
                # torchrun starts its workers in sessions of their own: the group of the
                # launch alone would leave them running, and the output open. They are
                # found first (then torchrun, then they, go), so torchrun does not see them
                # end and exit on its own with another status.
                workers = _descendants(proc.pid)
                os.killpg(proc.pid, signal.SIGKILL)
                for pid in workers:
                    try:
                        os.kill(pid, signal.SIGKILL)
                    except ProcessLookupError:
                        pass
        threading.Thread(target=stop, daemon=True).start()
        for line in proc.stdout:
            f.write(line)
            if "OMP_NUM_THREADS" in line or line.strip("* \n") == "" or "torch/distributed/run.py" in line:
                continue  # torchrun's banner
            sys.stderr.write(line)
            sys.stderr.flush()
            tail = (tail + [line.rstrip()])[-8:]
        rc = proc.wait()
    if time.monotonic() >= deadline:
        tail.append("the launch was killed after %d s" % timeout_s)
    return rc, tail


def _descendants(pid: int) -> list:
    """The processes below ``pid`` (Linux's /proc; none where it cannot be read)."""
    children: dict = {}
    for entry in Path("/proc").glob("[0-9]*"):
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])  # the name may hold spaces and parentheses
        children.setdefault(ppid, []).append(int(entry.name))
    out, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            out.append(child)
            todo.append(child)
    return out


def failed_item(item, error, a, device, world, bench):
    """The record (or check) of a plan item that never finished."""
    if item.kind == "check":
        return None, dict(case=item.case, engine=item.engine.name, engine_options=item.engine.options_dict(),
                          world_size=world, error=error)
    variant = bench.load_variants()[item.variant]
    repeats = bench.repeats_for(item.case, a.profile, a.repeats, not a.sequential)
    run = bench.resolve_run(bench.load_cases()[item.case], variant, "python", a.profile, device, repeats=repeats,
                            placement=bench.Placement(item.engine, device, world_size=world))
    return bench.make_record(run, status="failed", error=error), None


def run_world(a, device, cases, variants, engines, world, env, out: Path, bench, threads, deadline=None):
    """All items at one world size: (context or None, records, checks), in plan order."""
    items = bench.plan_runs([c.name for c in cases], engines, [v.name for v in variants], a.check and world > 1)
    events, log = out / ("events-x%d.jsonl" % world), out / ("launch-x%d.log" % world)
    for f in (events, log):
        if f.exists():
            f.unlink()
    failed = {}
    start = 0
    while start < len(items):
        print("== %d process(es): items %d-%d of %d" % (world, start + 1, len(items), len(items)),
              file=sys.stderr, flush=True)
        # The runner's watchdog bounds each item; this bounds the launch as a whole (a
        # start-up that never reaches the watchdog), and by the budget when there is one.
        limit = a.run_timeout * (len(items) - start + 2) + LAUNCH_SLACK_S
        if deadline is not None:
            limit = min(limit, deadline - time.time() + a.run_timeout + LAUNCH_SLACK_S)
        rc, tail = launch(worker_cmd(a, device, cases, variants, world, start, events, threads, deadline), env, log,
                          limit)
        got = bench.read_events(events)
        done = set(got["records"]) | set(got["checks"]) | set(failed)
        left = [i for i in range(start, len(items)) if i not in done]
        if not left:
            break
        at = [i for i in got["started_items"] if i in left] if got["started"] in left else []
        how = " / ".join(tail) or "(no output)"
        if not at:  # the launch died before starting an item: no point in retrying each one
            for i in left:
                failed[i] = "the launch with %d process(es) exited with status %d before this run: %s" % (world, rc, how)
            break
        together = "" if len(at) == 1 else " (%d runs interleaved: %s; each has the limit, the group %d times it)" % (
            len(at), ", ".join(items[i].variant for i in at), len(at))
        for i in at:
            failed[i] = ("did not finish: the launch with %d process(es) ended (status %d) during this run%s, "
                         "after the %g s limit a run has (--run-timeout) or when a rank died; the stack of "
                         "every rank is in launch-x%d.log: %s" % (world, rc, together, a.run_timeout, world, how))
            print("== %s: FAILED (%s)" % (items[i].describe(), failed[i][:300]), file=sys.stderr, flush=True)
        start = max(at) + 1
    records, checks = [], []
    for i, item in enumerate(items):
        if i in failed:
            rec, chk = failed_item(item, failed[i], a, device, world, bench)
        else:
            rec, chk = got["records"].get(i), got["checks"].get(i)
        if rec is not None:
            records.append(rec)
        if chk is not None:
            checks.append(chk)
    return got["context"], records, checks


def main(a, repo: Path, runner_env, t_start: float) -> int:
    from ampkit import bench
    import report
    try:
        device, cases, variants, engines, worlds = validate(a, bench)
    except ValueError as e:
        print("error: %s" % e, file=sys.stderr)
        return 2
    threads = a.threads or (1 if device == "cpu" else None)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    env = runner_env(threads)
    env.setdefault("OMP_NUM_THREADS", str(threads or 1))  # torchrun's default; set, it prints no banner
    print("== across processes on %s: world sizes %s; %s; cases %s; variants %s" % (
        device, ", ".join(map(str, worlds)), ", ".join(e.label() for e in engines),
        ", ".join(c.name for c in cases), ", ".join(v.name for v in variants)), file=sys.stderr, flush=True)
    docs, checks = [], []
    for k, world in enumerate(worlds):
        # --budget: each world size gets an equal share of the time left (what one leaves,
        # the next may use); the items a share cannot start are recorded as skipped.
        deadline = None if not a.budget else time.time() + (a.budget - (time.perf_counter() - t_start)) / (len(worlds) - k)
        ctx, recs, chks = run_world(a, device, cases, variants, engines, world, env, out, bench, threads, deadline)
        docs.append({"context": ctx or bench.context(a.profile, device, "python", seed=a.seed), "records": recs})
        checks += chks
    doc = bench.merge(docs)
    doc["context"]["distributed_checks"] = checks or None
    results = out / "results.json"
    doc = bench.write_document(results, doc["context"], doc["records"])
    md = report.write(doc, out)
    print(report.across(doc))
    print("\n" + report.goals(doc))
    print("\nresults: %s\nreport:  %s\nwall time: %.1f s" % (results, md, time.perf_counter() - t_start))
    return 0
