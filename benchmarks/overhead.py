"""Per-op overhead of ampkit.autocast against torch.autocast on this CPU.

    python benchmarks/overhead.py [--repeats 15] [--threads 1] [--size 8] [--json PATH]

Three cases, each run under torch.autocast (native) and ampkit.autocast in one
process, interleaved (the order alternates every repeat); the ratio reported is
the median over repeats of ampkit/native timed back to back, with its quartiles:

- unlisted: a chain of 20 small ops that are in no table (relu, mul, add, tanh ...)
- listed:   a chain of 20 small listed ops (linear, matmul, mse_loss, cat ...)
- step:     a seed-shaped MLP training step (3 Linear + ReLU, MSE, SGD) at batch 64 x
            width 256, and at the seed_mlp cpu profile (batch 128 x width 1024)
- mha:      nn.MultiheadAttention forward, a Python composite whose body is traced through

Each case also runs ``ampkit (1 override)``: a region whose policy moves one op the
case never calls (cdist -> lower_precision_fp). cdist is one ATen op, so the change runs as
a kernel at torch's Autocast key and nothing else pays for it. ``1 handler override`` moves
an op that cannot run as a kernel (``norm``, a Python function of torch, -> lower_precision_fp):
ampkit's handler mode is pushed and sees every call, the cost of such a change.

The region is entered once per chain (per step for ``step``), as in real code.
Timings are printed, never asserted.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import torch
import torch.nn.functional as F

import ampkit


def _unlisted_chain(x):
    for _ in range(4):
        x = torch.relu(x)
        x = x * 1.0001
        x = x + 0.001
        x = torch.tanh(x)
        x = x.view(-1).view(x.shape)
    return x


def _listed_chain(x, w, t):
    for _ in range(4):
        y = F.linear(x, w)
        y = torch.matmul(y, w)
        y = torch.cat([y, y], 0)[: y.shape[0]]
        y = F.mse_loss(y, t) + y
        x = torch.mm(y.float(), w)
    return x


def _make_step(batch, width, device):
    torch.manual_seed(0)
    layers = []
    for _ in range(2):
        layers += [torch.nn.Linear(width, width), torch.nn.ReLU()]
    model = torch.nn.Sequential(*layers, torch.nn.Linear(width, width)).to(device)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    x = torch.randn(batch, width, device=device)
    y = torch.randn(batch, width, device=device)

    def step(ctx):
        with ctx:
            loss = F.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    return step


def _time(fn, inner):
    # CPU time of this thread: time spent descheduled (other processes on a busy
    # machine) does not count; torch runs on this thread (set_num_threads(1)).
    t0 = _clock()
    for _ in range(inner):
        fn()
    return (_clock() - t0) / inner


_clock = time.thread_time


def run(repeats=15, device="cpu", size=8):
    dtype = torch.bfloat16
    x = torch.randn(size, size)
    w = torch.randn(size, size)
    t = torch.randn(size, size)
    step = _make_step(64, 256, device)
    seed_step = _make_step(128, 1024, device)  # shared_specs/benchmarks/seed_mlp.yaml, cpu profile
    torch.manual_seed(0)
    mha = torch.nn.MultiheadAttention(64, 4, batch_first=True).to(device)
    q = torch.randn(8, 16, 64, device=device)

    def native():
        return torch.autocast(device, dtype=dtype)

    def amp():
        return ampkit.autocast(device, dtype=dtype)

    one_override = ampkit.load_policy("torch_default").with_ops(device, lower_precision_fp=["cdist"])

    def amp_override():
        return ampkit.autocast(device, dtype=dtype, policy=one_override)

    one_handler = ampkit.load_policy("torch_default").with_ops(device, lower_precision_fp=["norm"])

    def amp_handler():
        return ampkit.autocast(device, dtype=dtype, policy=one_handler)

    def chain(ctx_factory, body, *a):
        def f():
            with ctx_factory():
                body(*a)

        return f

    cases = {
        f"unlisted (20 ops {size}x{size})": {
            "native": chain(native, _unlisted_chain, x),
            "ampkit": chain(amp, _unlisted_chain, x),
            "override": chain(amp_override, _unlisted_chain, x),
            "handler": chain(amp_handler, _unlisted_chain, x),
            "none": chain(lambda: torch.autocast(device, enabled=False), _unlisted_chain, x),
            "inner": 100,
        },
        f"listed (20 ops {size}x{size})": {
            "native": chain(native, _listed_chain, x, w, t),
            "ampkit": chain(amp, _listed_chain, x, w, t),
            "override": chain(amp_override, _listed_chain, x, w, t),
            "handler": chain(amp_handler, _listed_chain, x, w, t),
            "inner": 100,
        },
        "mlp step (64x256)": {
            "native": lambda: step(native()),
            "ampkit": lambda: step(amp()),
            "override": lambda: step(amp_override()),
            "handler": lambda: step(amp_handler()),
            "inner": 5,
        },
        "mha forward (8x16x64)": {  # a Python composite whose body ampkit traces through
            "native": chain(native, mha, q, q, q),
            "ampkit": chain(amp, mha, q, q, q),
            "override": chain(amp_override, mha, q, q, q),
            "handler": chain(amp_handler, mha, q, q, q),
            "inner": 10,
        },
        "mlp step (128x1024)": {
            "native": lambda: seed_step(native()),
            "ampkit": lambda: seed_step(amp()),
            "override": lambda: seed_step(amp_override()),
            "handler": lambda: seed_step(amp_handler()),
            "inner": 1,
        },
    }
    results = {}
    for name, case in cases.items():
        variants = [v for v in ("native", "ampkit", "override", "handler", "none") if v in case]
        for v in variants:  # warm up (first calls classify and compile)
            _time(case[v], max(3, case["inner"] // 10))
        samples = {v: [] for v in variants}
        for r in range(repeats):
            order = variants if r % 2 == 0 else variants[::-1]
            for v in order:
                samples[v].append(_time(case[v], case["inner"]))
        med = {v: statistics.median(s) for v, s in samples.items()}
        spread = {v: (min(s), max(s)) for v, s in samples.items()}
        # each repeat times native and ampkit back to back: the ratio of a pair cancels
        # slow drifts in machine load, so the median paired ratio is the headline figure
        ratios = sorted(a / n for a, n in zip(samples["ampkit"], samples["native"]))
        override = sorted(a / n for a, n in zip(samples["override"], samples["native"]))
        handler = sorted(a / n for a, n in zip(samples["handler"], samples["native"]))
        results[name] = {
            "median_s": med, "min_max_s": spread, "ratio": statistics.median(ratios),
            "ratio_of_medians": med["ampkit"] / med["native"], "paired_ratios": ratios,
            "override_ratio": statistics.median(override), "override_paired_ratios": override,
            "handler_ratio": statistics.median(handler), "handler_paired_ratios": handler,
        }
    return results


def _quartiles(q):
    return f"[{q[len(q) // 4]:.3f}, {q[(3 * len(q)) // 4]:.3f}]"


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--size", type=int, default=8, help="side of the square tensors of the op chains")
    ap.add_argument("--wall", action="store_true", help="time wall-clock instead of this thread's CPU time")
    ap.add_argument("--json", default=None)
    a = ap.parse_args(argv)
    torch.set_num_threads(a.threads)
    global _clock
    if a.wall or a.threads != 1:
        _clock = time.perf_counter
    res = run(a.repeats, size=a.size)
    clock = "wall-clock" if _clock is time.perf_counter else "thread CPU time"
    print(f"torch {torch.__version__}, {a.threads} thread(s), {a.repeats} interleaved repeats, {clock}, medians")
    print(f"{'case':<26} {'native':>12} {'ampkit':>12} {'ratio':>7} {'[q1, q3]':>16}"
          f" {'1 override':>12} {'ratio':>7} {'[q1, q3]':>16}"
          f" {'1 handler ov.':>13} {'ratio':>7} {'[q1, q3]':>16}  (median of paired ratios)")
    for name, r in res.items():
        m = r["median_s"]
        q, o, h = r["paired_ratios"], r["override_paired_ratios"], r["handler_paired_ratios"]
        print(f"{name:<26} {m['native'] * 1e6:>10.1f}us {m['ampkit'] * 1e6:>10.1f}us {r['ratio']:>7.3f} {_quartiles(q):>16}"
              f" {m['override'] * 1e6:>10.1f}us {r['override_ratio']:>7.3f} {_quartiles(o):>16}"
              f" {m['handler'] * 1e6:>11.1f}us {r['handler_ratio']:>7.3f} {_quartiles(h):>16}")
        if "none" in m:
            print(f"{'  (no autocast)':<26} {m['none'] * 1e6:>10.1f}us")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(res, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
