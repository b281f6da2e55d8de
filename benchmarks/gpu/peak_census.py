"""What is alive on the GPU at a variant's peak: the benchmark's runner for one case and one
variant under the CUDA allocator's memory history, then, at the moment the allocated bytes
were highest, the live blocks grouped by where they were allocated. Never a test.

    PYTHONPATH=$PWD/python python3 benchmarks/gpu/peak_census.py CASE VARIANT[,VARIANT...] [--repeats 1] [--top 25]

Each variant runs in a process of its own (``python -m ampkit.bench --cases CASE --variants V``,
the full profile), so the census sees that variant alone. Printed per variant: the runner's
own peak figure, the allocator's peak (``max_memory_allocated``), and the blocks alive at the
highest point of the history, summed by their innermost frame in ampkit, torch or benchmarks
(file:line function), largest first, with how many blocks and the private graph pools they sit
in. The history is a ring of ``AMPKIT_CENSUS_ENTRIES`` events (default 3,000,000); where the
ring wrapped, blocks allocated before it are missing and the script says so.
"""
from __future__ import annotations

import argparse
import collections
import json
import os
import subprocess
import sys
import tempfile


def _frame(frames) -> str:
    """The innermost frame worth naming: ampkit's, the benchmark's, then torch's Python."""
    for want in ("/ampkit/", "/benchmarks/", "/torch/"):
        for f in frames or ():
            name = f.get("filename", "")
            if want in name and name.endswith(".py"):
                return "%s:%s %s" % (name.split(want)[-1] if want != "/torch/" else "torch/" + name.split("/torch/")[-1],
                                     f.get("line"), f.get("name"))
    return "(no Python frame)"


def census(snapshot: dict, top: int) -> list:
    """Replay every device's trace: the live set at the highest allocated total."""
    lines = []
    for dev, trace in enumerate(snapshot.get("device_traces", [])):
        if not trace:
            continue
        def replay(upto):
            live, total, best, best_i = {}, 0, -1, -1
            for i, e in enumerate(trace[:upto]):
                act = e.get("action")
                if act == "alloc":
                    live[e["addr"]] = e
                    total += e["size"]
                elif act == "free_completed" and e["addr"] in live:
                    total -= live.pop(e["addr"])["size"]
                if total > best:
                    best, best_i = total, i
            return live, best, best_i

        _, best, best_i = replay(len(trace))  # where the live total was highest
        best_at = replay(best_i + 1)[0]  # what was alive then
        wrapped = trace[0].get("action") != "alloc" or len(trace) >= int(os.environ.get("AMPKIT_CENSUS_ENTRIES", 3_000_000))
        lines.append("device %d: %d events%s; highest live total in the history %.1f MiB (%d blocks)" % (
            dev, len(trace), " (the ring may have wrapped: older blocks are missing)" if wrapped else "",
            best / 2**20, len(best_at or {})))
        groups = collections.defaultdict(lambda: [0, 0, None])
        for e in (best_at or {}).values():
            g = groups[_frame(e.get("frames"))]
            g[0] += e["size"]
            g[1] += 1
            if g[2] is None or e["size"] > g[2]["size"]:
                g[2] = e
        for where, (size, n, big) in sorted(groups.items(), key=lambda kv: -kv[1][0])[:top]:
            lines.append("  %9.2f MiB %5d blocks  %s" % (size / 2**20, n, where))
            if size >= 2**20 * 8:  # the largest block's stack, innermost first, for the big groups
                frames = [f for f in big.get("frames") or () if f.get("filename", "").endswith(".py")][:8]
                lines.append("      largest %.2f MiB (stream %s): %s" % (big["size"] / 2**20, big.get("stream"), " < ".join(
                    "%s:%s %s" % (f["filename"].rsplit("/", 1)[-1], f.get("line"), f.get("name")) for f in frames)))
        streams = collections.Counter()
        for e in (best_at or {}).values():
            streams[e.get("stream")] += e["size"]
        lines.append("  at event %d of %d; by stream: %s" % (best_i, len(trace), ", ".join(
            "%s %.1f MiB" % (k, v / 2**20) for k, v in streams.most_common())))
    return lines


CHILD = r"""
import os, pickle, sys, torch
torch.cuda.memory._record_memory_history(max_entries=int(os.environ.get("AMPKIT_CENSUS_ENTRIES", 3000000)))
from ampkit.bench.__main__ import main
rc = main(sys.argv[2:])
print("allocator peak: %.1f MiB" % (torch.cuda.max_memory_allocated() / 2**20), flush=True)
with open(sys.argv[1], "wb") as f:
    pickle.dump(torch.cuda.memory._snapshot(), f)
sys.exit(rc or 0)
"""


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("case")
    p.add_argument("variants")
    p.add_argument("--repeats", type=int, default=1)
    p.add_argument("--top", type=int, default=25)
    a = p.parse_args(argv)
    import pickle
    for v in a.variants.split(","):
        with tempfile.TemporaryDirectory() as tmp:
            snap, out = os.path.join(tmp, "snap.pickle"), os.path.join(tmp, "raw.json")
            cmd = [sys.executable, "-c", CHILD, snap, "--profile", "full", "--device", "cuda", "--cases", a.case,
                   "--variants", v, "--repeats", str(a.repeats), "--out", out]
            r = subprocess.run(cmd, capture_output=True, text=True)
            tail = [l for l in (r.stdout + r.stderr).splitlines() if "peak" in l or "Error" in l][-4:]
            print("== %s / %s (exit %d)" % (a.case, v, r.returncode), flush=True)
            for l in tail:
                print("  " + l)
            if os.path.exists(out):
                for rec in json.load(open(out)).get("records", []):
                    pk = rec.get("peak_memory_bytes")
                    print("  runner's peak: %s MiB, %s ms/step" % (
                        None if pk is None else round(pk / 2**20, 1), rec.get("median")))
            if not os.path.exists(snap):
                print("  no snapshot:", (r.stderr or r.stdout)[-800:])
                continue
            with open(snap, "rb") as f:
                for line in census(pickle.load(f), a.top):
                    print(line, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
