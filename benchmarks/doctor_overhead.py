"""What an armed ampkit.doctor costs per training step, against the same step with it off.

    python benchmarks/doctor_overhead.py [--device cpu|cuda] [--case seed_mlp] [--profile cpu]
                                         [--steps 20] [--repeats 5] [--out FILE.json]

Per variant (an eager hand-written loop; ``ampkit.make_train_step``, a CUDA graph on cuda),
off and armed are timed in interleaved repeats on fresh seeded models; a repeat is
``--steps`` steps after a warm-up of 5. Armed ``every=1``: every step is a sampled one
(the op-level watch, statistics); armed ``every=100``: the timed steps are not sampled
(step 0, in the warm-up, is), so they pay the per-step check and replay copies only.
Reported: median seconds per step, the median ratio armed/off with its quartiles, and
``amortized_every=100``: the mean step of a run that samples one step in 100, from the
two ratios, ``(99 * r100 + r1) / 100``. A failed variant is recorded as a failure.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
import traceback

import torch

import ampkit
from ampkit.bench import build_case, loop_step


def trainer(built, model, device, variant, dtype):
    opt = built.new_optimizer(model, fused=device == "cuda")
    scaler = ampkit.GradScaler(device, enabled=dtype == torch.float16)
    region = dict(device_type=device, dtype=dtype)
    if variant == "train_step":
        step = ampkit.make_train_step(model, built.loss_fn, opt, scaler=scaler, autocast=region)
        return lambda x, y: step(x, y), step

    return loop_step(model, built.loss_fn, opt, lambda: ampkit.autocast(**region), scaler), None


def _sync(device):
    if device == "cuda":
        torch.cuda.synchronize()


def time_variant(built, device, variant, every, steps, dtype, warmup=5):
    """Seconds per step of one repeat (every=None: the doctor is off)."""
    model = built.new_model()
    run, step = trainer(built, model, device, variant, dtype)
    doc = ampkit.doctor(model, every=every) if every else None
    try:
        batches = built.batches
        for i in range(warmup):
            run(*batches[i % len(batches)])
        _sync(device)
        t = time.perf_counter()
        for i in range(steps):
            run(*batches[i % len(batches)])
        _sync(device)
        dt = (time.perf_counter() - t) / steps
        captured = bool(step.captured) if step is not None else False
        return dt, captured
    finally:
        if doc is not None:
            doc.close()


def measure(case="seed_mlp", profile="cpu", device="cpu", steps=20, repeats=5,
            variants=("eager", "train_step"), everies=(1, 100), dtype=None):
    dtype = dtype or (torch.float16 if device == "cuda" else torch.bfloat16)
    built = build_case(case, profile, device=device)
    out = []
    for variant in variants:
        rec = {"case": case, "profile": profile, "device": device, "variant": variant,
               "dtype": str(dtype).replace("torch.", ""), "steps": steps, "repeats": repeats}
        try:
            samples = {"off": [], **{f"every={e}": [] for e in everies}}
            captured = {}
            for _ in range(repeats):  # interleaved: off, armed, armed, off, ...
                for key, every in [("off", None)] + [(f"every={e}", e) for e in everies]:
                    dt, cap = time_variant(built, device, variant, every, steps, dtype)
                    samples[key].append(dt)
                    captured[key] = cap
            rec["seconds_per_step"] = {k: statistics.median(v) for k, v in samples.items()}
            rec["samples"] = samples
            rec["captured"] = captured
            for e in everies:
                ratios = sorted(a / b for a, b in zip(samples[f"every={e}"], samples["off"]))
                q = statistics.quantiles(ratios, n=4) if len(ratios) > 1 else [ratios[0]] * 3
                rec[f"ratio_every={e}"] = {"median": statistics.median(ratios), "q1": q[0], "q3": q[2]}
            if 1 in everies:  # a run of N steps samples one: its mean step, from the two ratios
                for e in everies:
                    if e > 1:
                        r1, re_ = rec["ratio_every=1"]["median"], rec[f"ratio_every={e}"]["median"]
                        rec[f"amortized_every={e}"] = ((e - 1) * re_ + r1) / e
            rec["ok"] = True
        except Exception as e:  # a failure is recorded as a failure, with no timings
            rec["ok"] = False
            rec["error"] = f"{type(e).__name__}: {e}"
            rec["traceback"] = traceback.format_exc()
        out.append(rec)
    return out


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--case", default="seed_mlp")
    ap.add_argument("--profile", default="cpu")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--out")
    a = ap.parse_args()
    res = measure(a.case, a.profile, a.device, a.steps, a.repeats)
    text = json.dumps(res, indent=1)
    if a.out:
        with open(a.out, "w") as f:
            f.write(text)
    for r in res:
        if r["ok"]:
            print(f"{r['case']}/{r['profile']} {r['device']} {r['variant']}: off {r['seconds_per_step']['off']*1e3:.3f} ms/step; "
                  + "; ".join(f"{k} x{v['median']:.3f} [{v['q1']:.3f}, {v['q3']:.3f}]"
                              for k, v in r.items() if k.startswith("ratio_"))
                  + "".join(f"; {k} x{v:.3f}" for k, v in r.items() if k.startswith("amortized_")))
        else:
            print(f"{r['case']} {r['variant']}: FAILED {r['error']}", file=sys.stderr)
