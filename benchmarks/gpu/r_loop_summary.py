"""Summary of benchmarks/gpu/r_loop_compare.sh: per case and variant, the median ms/step
of Python and of R from each tree (all samples of all rounds pooled), R / Python, and
peak memory (max over rounds) with R / Python.

    python3 benchmarks/gpu/r_loop_summary.py <folder with raw-*.json>
"""
import glob
import json
import os
import statistics
import sys
from collections import defaultdict


def main(folder: str) -> None:
    samples = defaultdict(list)
    peak = defaultdict(int)
    for path in sorted(glob.glob(os.path.join(folder, "raw-*.json"))):
        parts = os.path.basename(path)[:-5].split("-")  # raw-python-<case>-rN / raw-r-<tree>-<case>-rN
        who = "python" if parts[1] == "python" else f"r_{parts[2]}"
        for rec in json.load(open(path))["records"]:
            if rec.get("status") != "ok":
                print(f"{who} {rec['case']}/{rec['variant']}: {rec.get('status')} {rec.get('error') or rec.get('reason')}")
                continue
            key = (rec["case"], rec["variant"], who)
            samples[key] += rec["samples"]
            peak[key] = max(peak[key], rec.get("peak_memory_bytes") or 0)
    rows = sorted({(c, v) for c, v, _ in samples})
    print("case | variant | python ms | R base ms | R new ms | R/Py base | R/Py new | new/base | "
          "peak MiB py | R base | R new | mem R/Py base | mem R/Py new | R nodefer ms | nodefer/new")
    for c, v in rows:
        med = {w: statistics.median(samples[(c, v, w)]) for w in ("python", "r_base", "r_new", "r_nodefer")
               if (c, v, w) in samples}
        mem = {w: peak[(c, v, w)] / 2**20 for w in med}
        py, b, n = med.get("python"), med.get("r_base"), med.get("r_new")
        r = lambda a, d: f"{a / d:.2f}" if a and d else "-"
        f = lambda a: f"{a:.2f}" if a else "-"
        print(f"{c} | {v} | {f(py)} | {f(b)} | {f(n)} | {r(b, py)} | {r(n, py)} | {r(n, b)} | "
              f"{mem.get('python', 0):.0f} | {mem.get('r_base', 0):.0f} | {mem.get('r_new', 0):.0f} | "
              f"{r(mem.get('r_base'), mem.get('python'))} | {r(mem.get('r_new'), mem.get('python'))} | "
              f"{f(med.get('r_nodefer'))} | {r(med.get('r_nodefer'), n)}")
    print("(medians of all timed samples over the rounds; peak: the largest over the rounds)")


if __name__ == "__main__":
    main(sys.argv[1])
