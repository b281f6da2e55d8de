"""What entering and leaving one ampkit region costs on the host, against torch.autocast.

    PYTHONPATH=python python benchmarks/probes/region_entry_cost.py

Two measures, for a region with the default policy (plain), one whose change runs as a
kernel (cdist), one whose change needs the handler mode (norm), and three nested regions:

- time: us per enter+exit, the min over 15 blocks of 5000, the cases interleaved block by
  block in one process (a noisy moment hits all alike); compare two trees by running this
  alternately with each on PYTHONPATH;
- calls: the Python function calls and C calls made by one enter+exit (sys.setprofile),
  which do not depend on the machine's load.

Timings are printed, never asserted.
"""

from __future__ import annotations

import sys
import time

import torch

import ampkit


def cases():
    default = ampkit.load_policy("torch_default")
    kernel = default.with_ops("cpu", lower_precision_fp=["cdist"])
    handler = default.with_ops("cpu", lower_precision_fp=["norm"])

    def native():
        with torch.autocast("cpu"):
            pass

    def plain():
        with ampkit.autocast("cpu"):
            pass

    def kernel_change():
        with ampkit.autocast("cpu", policy=kernel):
            pass

    def handler_change():
        with ampkit.autocast("cpu", policy=handler):
            pass

    def nested():
        with ampkit.autocast("cpu", policy=handler):
            with ampkit.autocast("cpu", enabled=False):
                with ampkit.autocast("cpu", policy=kernel):
                    pass

    return [("torch.autocast", native), ("plain", plain), ("kernel change", kernel_change),
            ("handler change", handler_change), ("nested x3", nested)]


def calls(f) -> tuple:
    count = {"call": 0, "c_call": 0}

    def profile(frame, event, arg):
        if event in count:
            count[event] += 1

    sys.setprofile(profile)
    f()
    sys.setprofile(None)
    return count["call"] - 1, count["c_call"]  # (less the call of f itself)


def main(blocks=15, per_block=5000):
    torch.set_num_threads(1)
    todo = cases()
    for _, f in todo:
        f()
        f()
    best = {name: float("inf") for name, _ in todo}
    for _ in range(blocks):
        for name, f in todo:
            t0 = time.perf_counter()
            for _ in range(per_block):
                f()
            best[name] = min(best[name], (time.perf_counter() - t0) / per_block * 1e6)
    base = best["torch.autocast"]
    for name, f in todo:
        py, c = calls(f)
        print(f"{name:15s} {best[name]:6.2f} us ({best[name] / base:.2f}x torch)  "
              f"python calls {py:3d}  C calls {c:3d}")


if __name__ == "__main__":
    main()
