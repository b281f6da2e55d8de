"""Steps per second of one AMP training step: torch eager, ampkit eager, ampkit captured.

    PYTHONPATH=$PWD/python python3 benchmarks/gpu/train_step_bench.py [--cases seed_mlp,transformer,gpt2_small]

Cases are the shared benchmark cases (shared_specs/benchmarks/*.yaml, ``full`` profile),
built by ampkit.bench with the same seeds as ``make bench``. Variants:

  torch_amp          torch.autocast + torch.amp.GradScaler, the case's optimizer (the rival)
  torch_amp_fused    the same with the fused optimizer (how much is the fused kernel alone)
  ampkit_amp         ampkit.autocast + ampkit.GradScaler hand-written loop, case's optimizer
  ampkit_amp_fused   the same with the fused optimizer (ampkit_step_eager's control)
  ampkit_step_eager  ampkit.make_train_step(capture=False), fused optimizer
  ampkit_step        ampkit.make_train_step(capture="auto"), fused optimizer: one CUDA graph
  ampkit_step_rw_check  the same, but the scaler checks gradients as torch's does before a
                     fused optimizer (multiplies each by 1.0: reads and writes them), for an
                     A/B of ampkit's read-only check in the same run

The floor of a step is its matmul FLOPs at the card's fp16 rate (measured here with a large
fp16 matmul) plus the parameter traffic that AMP cannot avoid at the measured device-to-
device copy bandwidth: per parameter, read fp32 + write the fp16 copy (6 B), write the fp32
gradient (4 B), and the optimizer's read of gradient and parameter, write of parameter
(12 B) plus its state (SGD 0 B, AdamW m and v read and written: 16 B). Activation traffic
is left out (an ideal kernel fuses it into matmul epilogues), so the floor is a lower bound.
A profile of a few steps splits the GPU time of the eager and the captured step by kernel
kind (matmul, attention, optimizer, scaler, elementwise/cast, norm/reduce, other).

Prints the card and a table; writes $OUT/train_step_bench.json when $OUT is set.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import statistics
import sys
import time
import traceback

import torch

import ampkit

DTYPE = torch.float16
DEVICE = "cuda"  # --device cpu: a smoke run of the script itself (tiny profile), no figures
VARIANTS = ("torch_amp", "torch_amp_fused", "ampkit_amp", "ampkit_amp_fused", "ampkit_step_eager",
            "ampkit_step", "ampkit_step_rw_check")
TOP = 12  # kernels listed per profiled variant (--top)
WARMUP = 8  # > make_train_step's 3 warm-up steps + the capture


# --- the steps ----------------------------------------------------------------------------
def make_variant(name, built):
    model = built.new_model()
    fused = name not in ("torch_amp", "ampkit_amp")
    opt = built.new_optimizer(model, fused=fused)
    loss_fn = built.loss_fn
    if name.startswith(("torch_amp", "ampkit_amp")):
        # The hand-written eager loop, with the rival's autocast and scaler or ours.
        lib = torch if name.startswith("torch_amp") else ampkit
        scaler = (torch.amp.GradScaler if lib is torch else ampkit.GradScaler)(DEVICE)

        def step(x, y):
            opt.zero_grad(set_to_none=True)
            with lib.autocast(DEVICE, dtype=DTYPE):
                loss = loss_fn(model(x), y)
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
            return loss.detach()
    else:
        scaler = (ReadWriteCheckScaler if name == "ampkit_step_rw_check" else ampkit.GradScaler)(DEVICE)
        step = ampkit.make_train_step(
            model, loss_fn, opt, scaler=scaler,
            autocast=dict(device_type=DEVICE, dtype=DTYPE),
            capture=False if name == "ampkit_step_eager" else "auto")
    return model, opt, scaler, step


class ReadWriteCheckScaler(ampkit.GradScaler):
    """A scaler whose fused path checks the gradients as torch.amp.GradScaler does (torch's
    kernel with inv_scale 1.0: every gradient read and written back) instead of ampkit's
    read-only check; the flags are the same, only the memory traffic differs."""

    def found_inf(self, grouped, unscale):
        if unscale:
            return super().found_inf(grouped, unscale)
        found, ones = {}, {}
        with torch.no_grad():
            for (device, _), grads in grouped.items():
                flag = found.setdefault(device, torch.zeros((), device=device))
                one = ones.setdefault(device, torch.ones((), device=device))
                torch._amp_foreach_non_finite_check_and_unscale_(grads, flag, one)
        return found


def time_variant(name, built, repeats):
    gc.collect()
    if DEVICE == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    model, opt, scaler, step = make_variant(name, built)
    batches = built.batches
    for i in range(WARMUP):
        step(*batches[i % len(batches)])
    sync()
    samples = []
    for _ in range(repeats):
        losses = []
        t0 = time.perf_counter()
        for x, y in batches:
            losses.append(step(x, y))
        sync()
        samples.append((time.perf_counter() - t0) * 1e3 / len(batches))
    rec = dict(
        variant=name, ms_per_step=statistics.median(samples),
        ms_min=min(samples), ms_max=max(samples), samples=samples,
        final_loss=float(torch.stack([l.float() for l in losses]).mean()),
        scale=float(scaler.get_scale()),
        peak_mem_mib=torch.cuda.max_memory_allocated() / 2**20 if DEVICE == "cuda" else 0.0)
    if hasattr(step, "captured"):
        rec.update(captured=step.captured, reason=step.reason)
    breakdown = None
    if name in ("ampkit_step", "ampkit_step_eager", "ampkit_step_rw_check", "torch_amp_fused"):
        try:
            breakdown = kernel_breakdown(step, batches)
        except Exception as e:  # noqa: BLE001 - the timing stands without it
            breakdown = {"error": f"{type(e).__name__}: {e}"}
    rec["gpu_time_by_kind"] = breakdown
    del model, opt, scaler, step
    return rec


def sync():
    if DEVICE == "cuda":
        torch.cuda.synchronize()


# --- the floor ---------------------------------------------------------------------------
def measure_fp16_rate(n=8192, iters=20):
    a = torch.randn(n, n, device=DEVICE, dtype=DTYPE)
    b = torch.randn(n, n, device=DEVICE, dtype=DTYPE)
    for _ in range(3):
        a @ b
    sync()
    t0 = time.perf_counter()
    for _ in range(iters):
        a @ b
    sync()
    return 2 * n**3 * iters / (time.perf_counter() - t0)


def measure_copy_bandwidth(nbytes=1 << 30, iters=20):
    src = torch.empty(nbytes, dtype=torch.uint8, device=DEVICE)
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    sync()
    t0 = time.perf_counter()
    for _ in range(iters):
        dst.copy_(src)
    sync()
    return 2 * nbytes * iters / (time.perf_counter() - t0)  # read + write


def step_flops(model, s):
    """Matmul FLOPs of one training step (forward + backward = 3x forward) of a case's model
    (its builder's name) at sizes ``s``; attention counted over the whole sequence, causal
    or not (a causal kernel skips about half of those)."""
    if model == "mlp":
        b, d_in, d_out, n = s["batch_size"], s["in_size"], s["out_size"], s["num_layers"]
        fwd = 2 * b * (d_in * d_in * (n - 1) + d_in * d_out)
        # the first layer needs no input gradient
        return 3 * fwd - 2 * b * d_in * d_in
    if model in ("transformer", "gpt2"):
        t, d, f, v, L, sq = (s["batch_size"] * s["seq_len"], s["d_model"], s["d_ff"], s["vocab"],
                            s["n_layers"], s["seq_len"])
        if model == "gpt2":  # the head has the vocabulary rounded up to a multiple
            m = s.get("vocab_multiple", 64)
            v = -(-v // m) * m
        per_layer = 2 * t * (3 * d * d + d * d + 2 * d * f) + 4 * t * sq * d
        return 3 * (L * per_layer + 2 * t * d * v)
    return None


def param_bytes(n_params, optimizer):
    per = 6 + 4 + 12 + (16 if optimizer in ("adam", "adamw") else 0)
    return n_params * per


# --- where the GPU time goes -----------------------------------------------------------
KINDS = (
    ("matmul", ("gemm", "xmma", "cutlass", "nvjet", "cublas", "sm90_", "sm80_", "ampere_")),
    ("attention", ("flash", "fmha", "attention", "efficient")),
    # torch's check (and ampkit's before a plain optimizer) is an _amp_foreach_non_finite_
    # kernel; ampkit's read-only check before a fused one is _foreach_norm (LpNormFunctor +
    # lpnorm_cleanup) and the same kernel on the per-tensor norms.
    ("scaler", ("non_finite", "lpnorm", "update_scale", "unscale")),
    ("optimizer", ("sgd", "adam", "multi_tensor")),
    ("norm/reduce", ("norm", "reduce", "softmax", "nll", "cross_entropy")),
    ("elementwise/cast", ("elementwise", "copy", "cast", "fill", "gelu", "relu", "add", "mul")),
)


INF_CHECK = ("non_finite", "lpnorm")  # the kernels of the inf/NaN check of the gradients


def _kind(name):
    low = name.lower()
    for kind, keys in KINDS:
        if any(k in low for k in keys):
            return kind
    return "other"


def kernel_breakdown(step, batches, steps=3):
    from torch.profiler import ProfilerActivity, profile
    if DEVICE != "cuda":
        return None
    sync()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for i in range(steps):
            step(*batches[i % len(batches)])
        sync()
    totals, n, top, check = {}, 0, [], 0.0
    for evt in prof.key_averages():
        us = getattr(evt, "self_device_time_total", None)
        if us is None:
            us = getattr(evt, "self_cuda_time_total", 0)
        if not us or "Memcpy" in evt.key and "DtoD" not in evt.key:
            continue
        if evt.key.startswith(("cuda", "Activity Buffer")):
            continue
        k = _kind(evt.key)
        totals[k] = totals.get(k, 0.0) + us / 1e3 / steps
        if any(key in evt.key.lower() for key in INF_CHECK):
            check += us / 1e3 / steps
        n += evt.count
        top.append((round(us / 1e3 / steps, 4), evt.count // steps, k, evt.key[:110]))
    out = {k: round(v, 4) for k, v in sorted(totals.items(), key=lambda kv: -kv[1])}
    out["_total_ms"] = round(sum(totals.values()), 4)
    out["_kernels_per_step"] = n / steps
    out["_inf_check_ms"] = round(check, 4)
    out["_top"] = sorted(top, reverse=True)[:TOP]
    return out


# --- main ---------------------------------------------------------------------------------
def run_case(case, repeats, rate, bw, variants, profile):
    from ampkit.bench import build_case
    built = build_case(case, profile, seed=0, device=DEVICE)
    s = built.sizes
    probe = built.new_model()
    n_params = sum(p.numel() for p in probe.parameters())
    del probe
    flops = step_flops(built.case.model, s)
    nbytes = param_bytes(n_params, built.case.optimizer["name"])
    floor = dict(matmul_tflop=flops / 1e12, matmul_ms=flops / rate * 1e3,
                 param_gb=nbytes / 1e9, bytes_ms=nbytes / bw * 1e3)
    floor["floor_ms"] = floor["matmul_ms"] + floor["bytes_ms"]
    records = []
    for v in variants:
        print(f"  {case}/{v} ...", file=sys.stderr, flush=True)
        try:
            rec = time_variant(v, built, repeats)
        except Exception as e:  # noqa: BLE001 - recorded as a failure, never as a zero
            traceback.print_exc()
            rec = dict(variant=v, error=f"{type(e).__name__}: {e}")
        records.append(rec)
    base = next((r for r in records if r["variant"] == "torch_amp" and "ms_per_step" in r), None)
    for r in records:
        if "ms_per_step" in r:
            r["steps_per_s"] = 1e3 / r["ms_per_step"]
            r["x_floor"] = r["ms_per_step"] / floor["floor_ms"]
            if base:
                r["speedup_vs_torch_amp"] = base["ms_per_step"] / r["ms_per_step"]
    return dict(case=case, profile=profile, sizes=s, n_params=n_params,
                batches=len(built.batches), repeats=repeats, warmup=WARMUP,
                floor=floor, records=records)


def print_case(res):
    f = res["floor"]
    print(f"\n{res['case']} ({res['profile']}: {res['sizes']}, {res['n_params'] / 1e6:.1f}M params)")
    print(f"  floor {f['floor_ms']:.3f} ms = matmul {f['matmul_tflop']:.3f} TFLOP in "
          f"{f['matmul_ms']:.3f} ms + params {f['param_gb']:.2f} GB in {f['bytes_ms']:.3f} ms")
    print(f"  {'variant':<21}{'ms/step':>9}{'[min,max]':>17}{'steps/s':>9}{'vs torch':>9}"
          f"{'x floor':>9}{'peak MiB':>9}  loss")
    for r in res["records"]:
        if "error" in r:
            print(f"  {r['variant']:<21} FAILED: {r['error']}")
            continue
        spread = f"[{r['ms_min']:.3f},{r['ms_max']:.3f}]"
        print(f"  {r['variant']:<21}{r['ms_per_step']:>9.3f}{spread:>17}{r['steps_per_s']:>9.1f}"
              f"{r.get('speedup_vs_torch_amp', float('nan')):>8.2f}x{r['x_floor']:>9.2f}"
              f"{r['peak_mem_mib']:>9.0f}  {r['final_loss']:.5g}"
              + ("" if r.get("captured", True) else f"  (eager: {r.get('reason')})"))
    checks = [(r["variant"], r["gpu_time_by_kind"]["_inf_check_ms"]) for r in res["records"]
              if "_inf_check_ms" in (r.get("gpu_time_by_kind") or {})]
    if checks:
        print("  inf/NaN check of the gradients, GPU ms/step: "
              + ", ".join(f"{v} {ms:.4f}" for v, ms in checks))
    for r in res["records"]:
        kinds = dict(r.get("gpu_time_by_kind") or {})
        top = kinds.pop("_top", [])
        if kinds:
            print(f"  GPU ms/step by kernel kind, {r['variant']}: {kinds}")
        for ms, count, kind, name in top:
            print(f"      {ms:8.4f} ms  x{count:<4} {kind:<17} {name}")


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--cases", default="seed_mlp,transformer")
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--top", type=int, default=12, help="kernels listed per profiled variant")
    ap.add_argument("--device", default="cuda", choices=("cuda", "cpu"),
                    help="cpu: a smoke run of this script at the tiny profile (no figures)")
    args = ap.parse_args(argv)
    global DEVICE, DTYPE, TOP
    TOP = args.top
    DEVICE, DTYPE = args.device, (torch.float16 if args.device == "cuda" else torch.bfloat16)
    profile = "full" if DEVICE == "cuda" else "tiny"
    if DEVICE == "cuda" and not torch.cuda.is_available():
        print("train_step_bench: needs a CUDA GPU (--device cpu for a smoke run)", file=sys.stderr)
        return 2
    variants = [v for v in args.variants.split(",") if v]
    bad = sorted(set(variants) - set(VARIANTS))
    if bad:
        ap.error(f"unknown variant(s) {bad}; valid: {', '.join(VARIANTS)}")
    card = torch.cuda.get_device_name() if DEVICE == "cuda" else platform.processor() or "cpu"
    small = dict(n=512, iters=3) if DEVICE == "cpu" else {}
    rate = measure_fp16_rate(**small)
    bw = measure_copy_bandwidth(**({"nbytes": 1 << 24, "iters": 3} if small else {}))
    print(f"card: {card}; torch {torch.__version__}, CUDA {torch.version.cuda}, "
          f"Python {platform.python_version()}")
    print(f"measured: fp16 matmul {rate / 1e12:.1f} TFLOP/s, device copy {bw / 1e9:.0f} GB/s")
    results = []
    for case in [c for c in args.cases.split(",") if c]:
        res = run_case(case, args.repeats, rate, bw, variants, profile)
        print_case(res)
        results.append(res)
    out = dict(context=dict(card=card, torch=torch.__version__, cuda=torch.version.cuda,
                            python=platform.python_version(), host=platform.node(),
                            fp16_tflops=rate / 1e12, copy_gbps=bw / 1e9,
                            time=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())),
               results=results)
    if os.environ.get("OUT"):
        os.makedirs(os.environ["OUT"], exist_ok=True)
        path = os.path.join(os.environ["OUT"], "train_step_bench.json")
        with open(path, "w") as fh:
            json.dump(out, fh, indent=1)
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
