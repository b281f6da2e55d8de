"""GPU proof for ampkit.GradScaler: no sync, CUDA-graph capture, steps/s.

    PYTHONPATH=$PWD/python python3 benchmarks/gpu/scaler_proof.py

1. Sync-free: under torch.cuda.set_sync_debug_mode("error") (the forward runs outside the
   guard: the scaler is on trial, not autocast), scale/backward/step/update
   with fused SGD, Adam and AdamW (also with hysteresis and clamps, and with an injected
   inf) raise nothing; a plain optimizer is shown to sync, as documented.
2. CUDA graph: a whole fused-optimizer training step (forward under ampkit.autocast,
   scaled backward, step, update) is captured once and replayed; a replay with an
   injected inf leaves every parameter bitwise unchanged and halves the scale.
3. Steps/s of the seed recipe (3 x Linear(4096), batch 512, SGD, MSE, fp16 autocast):
   torch.amp.GradScaler vs ours, plain and fused SGD (plus ours captured in a graph).
   Warm-up, then repeats of timed blocks (synchronize before reading the clock), medians.
4. The inf/NaN check before a fused optimizer, alone: torch's (its check-and-unscale kernel
   with inv_scale 1.0, which reads and writes every gradient) against ampkit's read-only
   check (max |g| per tensor with _foreach_norm, then torch's kernel on those scalars), on
   the seed recipe's gradients (fp32 and fp16) and on many tensors. GPU ms per check, from
   CUDA events around a CUDA graph of 20 checks (no launch overhead) and around 20 eager
   calls; both flags compared with an injected NaN, -inf and none.

Prints a compact table and writes $OUT/scaler_proof.json when $OUT is set.
``--cpu-check`` times only the two checks of 4., on 400 MB of CPU gradients (fp16, fp32).
"""

from __future__ import annotations

import json
import os
import random
import statistics
import sys
import time
import traceback

import torch

import ampkit

DEV = "cuda"
F = torch.nn.functional


def mlp(width: int, depth: int = 3, seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    layers = []
    for i in range(depth):
        layers.append(torch.nn.Linear(width, width))
        if i < depth - 1:
            layers.append(torch.nn.ReLU())
    return torch.nn.Sequential(*layers).to(DEV)


def make_opt(kind: str, params, **extra):
    table = {
        "sgd_plain": lambda: torch.optim.SGD(params, lr=1e-3, momentum=0.9),
        "sgd_fused": lambda: torch.optim.SGD(params, lr=1e-3, momentum=0.9, fused=True),
        "adam_fused": lambda: torch.optim.Adam(params, lr=1e-3, fused=True, **extra),
        "adamw_fused": lambda: torch.optim.AdamW(params, lr=1e-3, fused=True, **extra),
    }
    return table[kind]()


class SyncError:
    """set_sync_debug_mode("error") inside the block: any host-device sync raises."""

    def __enter__(self):
        torch.cuda.set_sync_debug_mode("error")

    def __exit__(self, *exc):
        torch.cuda.set_sync_debug_mode("default")
        return False


def train_step(model, opt, scaler, x, y, autocast=None, guard=None):
    """Forward under autocast, then (inside ``guard``) scaled backward, step and update."""
    autocast = autocast or (lambda: ampkit.autocast("cuda", dtype=torch.float16))
    opt.zero_grad(set_to_none=True)
    with autocast():
        out = model(x)
    loss = F.mse_loss(out.float(), y)
    if guard is None:
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        return
    with guard:
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()


# --------------------------------------------------------------------------- 1. sync-free


def sync_check() -> list[dict]:
    rows = []
    cases = [
        ("sgd_fused", {}),
        ("adam_fused", {}),
        ("adamw_fused", {}),
        ("adam_fused", dict(hysteresis=2, min_scale=1.0, max_scale=2.0**24)),
        ("sgd_plain", {}),  # expected to sync: the host decides whether to step
    ]
    for scaler_name, cls in (("ampkit", ampkit.GradScaler), ("torch", torch.amp.GradScaler)):
        for kind, kw in cases:
            if scaler_name == "torch" and kw:
                continue
            model = mlp(256)
            opt = make_opt(kind, model.parameters())
            scaler = cls("cuda", init_scale=2.0**16, growth_interval=2, **kw)
            x, y = torch.randn(64, 256, device=DEV), torch.randn(64, 256, device=DEV)
            for _ in range(2):  # lazy state (scale, optimizer state) before the check
                train_step(model, opt, scaler, x, y)
            bad = x.clone()
            bad[0, 0] = float("inf")
            torch.cuda.synchronize()
            error = None
            try:
                for xb in (x, bad, x, x):
                    train_step(model, opt, scaler, xb, y, guard=SyncError())
            except RuntimeError as e:
                error = str(e).splitlines()[0][:120]
            torch.cuda.synchronize()
            skipped = scaler.stats().skipped if scaler_name == "ampkit" and error is None else None
            rows.append(dict(scaler=scaler_name, optimizer=kind, options=kw or None,
                             synced=error is not None, error=error, skipped_in_stats=skipped))
    return rows


# --------------------------------------------------------------------------- 2. graph


def graph_check(kind: str) -> dict:
    model = mlp(512)
    extra = {"capturable": True} if kind != "sgd_fused" else {}
    opt = make_opt(kind, model.parameters(), **extra)
    scaler = ampkit.GradScaler("cuda", init_scale=2.0**16, growth_interval=3)
    static_x = torch.randn(128, 512, device=DEV)
    static_y = torch.randn(128, 512, device=DEV)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            train_step(model, opt, scaler, static_x, static_y)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    opt.zero_grad(set_to_none=True)
    with torch.cuda.graph(graph):
        with ampkit.autocast("cuda", dtype=torch.float16):
            out = model(static_x)
        loss = F.mse_loss(out.float(), static_y)
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
    # The capture itself ran nothing; replays do.
    clean_changes = []
    for _ in range(4):
        before = [p.detach().clone() for p in model.parameters()]
        graph.replay()
        torch.cuda.synchronize()
        clean_changes.append(any(not torch.equal(a, p) for a, p in zip(before, model.parameters())))
    stats0 = scaler.stats()
    params0 = [p.detach().clone() for p in model.parameters()]
    state0 = [v.clone() for s in opt.state.values() for v in s.values() if torch.is_tensor(v)]
    good_x = static_x.clone()
    static_x[0, 0] = float("inf")  # inject: the same graph now sees an overflow
    graph.replay()
    torch.cuda.synchronize()
    stats1 = scaler.stats()
    params_same = all(torch.equal(a, p) for a, p in zip(params0, model.parameters()))
    state1 = [v for s in opt.state.values() for v in s.values() if torch.is_tensor(v)]
    state_same = all(torch.equal(a, b) for a, b in zip(state0, state1))
    static_x.copy_(good_x)
    graph.replay()
    torch.cuda.synchronize()
    resumed = any(not torch.equal(a, p) for a, p in zip(params0, model.parameters()))
    return dict(
        optimizer=kind,
        clean_replays_changed_params=clean_changes,
        scale_before_inf=stats0.scale,
        scale_after_inf=stats1.scale,
        scale_backed_off=stats1.scale == stats0.scale * 0.5,
        params_unchanged_on_inf=params_same,
        optimizer_state_unchanged_on_inf=state_same,
        skipped_before=stats0.skipped,
        skipped_after=stats1.skipped,
        last_skipped=stats1.last_skipped,
        steps_counted_in_graph=stats1.steps,
        training_resumes_after=resumed,
        ok=params_same and state_same and stats1.scale == stats0.scale * 0.5
        and stats1.skipped == stats0.skipped + 1 and all(clean_changes) and resumed,
    )


# --------------------------------------------------------------------------- 3. speed


def speed(warmup: int = 20, repeats: int = 11, block: int = 30) -> list[dict]:
    width, batch = 4096, 512
    x = torch.randn(batch, width, device=DEV)
    y = torch.randn(batch, width, device=DEV)
    torch_autocast = lambda: torch.autocast("cuda", dtype=torch.float16)  # noqa: E731
    variants = {}
    for name, cls, kind, kw in [
        ("torch_plain", torch.amp.GradScaler, "sgd_plain", {}),
        ("ampkit_plain", ampkit.GradScaler, "sgd_plain", {}),
        ("torch_fused", torch.amp.GradScaler, "sgd_fused", {}),
        ("ampkit_fused", ampkit.GradScaler, "sgd_fused", {}),
        ("ampkit_fused_hyst_clamps", ampkit.GradScaler, "sgd_fused",
         dict(hysteresis=2, min_scale=1.0, max_scale=2.0**24)),
    ]:
        model = mlp(width)
        opt = make_opt(kind, model.parameters())
        scaler = cls("cuda", **kw)
        variants[name] = (lambda m=model, o=opt, s=scaler: train_step(m, o, s, x, y, torch_autocast))
    # Ours, the whole step captured once and replayed (possible only because it is sync-free).
    try:
        model = mlp(width)
        opt = make_opt("sgd_fused", model.parameters())
        scaler = ampkit.GradScaler("cuda")
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(3):
                train_step(model, opt, scaler, x, y, torch_autocast)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        opt.zero_grad(set_to_none=True)
        with torch.cuda.graph(graph):
            with torch_autocast():
                out = model(x)
            scaler.scale(F.mse_loss(out.float(), y)).backward()
            scaler.step(opt)
            scaler.update()
        variants["ampkit_fused_graph"] = graph.replay
    except Exception:  # noqa: BLE001 - report, do not hide the other figures
        traceback.print_exc()
    samples: dict[str, list[float]] = {k: [] for k in variants}
    for fn in variants.values():
        for _ in range(warmup):
            fn()
    torch.cuda.synchronize()
    order = list(variants)
    rng = random.Random(0)
    for _ in range(repeats):  # interleaved, shuffled: drift and order effects hit every variant
        rng.shuffle(order)
        for name in order:
            fn = variants[name]
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            for _ in range(block):
                fn()
            torch.cuda.synchronize()
            samples[name].append(block / (time.perf_counter() - t0))
    base = statistics.median(samples["torch_plain"])
    return [
        dict(variant=k, steps_per_s_median=statistics.median(v), steps_per_s_min=min(v),
             steps_per_s_max=max(v), vs_torch_plain=statistics.median(v) / base, samples=v)
        for k, v in samples.items()
    ]


# --------------------------------------------------------------------------- 4. the check


def _torch_check(grads, found, one):
    # What torch.amp.GradScaler runs before a fused optimizer (_unscale_grads_ with inv 1.0).
    torch._amp_foreach_non_finite_check_and_unscale_(grads, found, one)


def check_timing(repeats: int = 15, calls: int = 20) -> list[dict]:
    gen = torch.Generator(device=DEV).manual_seed(0)

    def mlp_grads(dtype):
        shapes = [(4096, 4096), (4096,)] * 3
        return [torch.randn(s, device=DEV, generator=gen).to(dtype) for s in shapes]

    cases = {
        "seed_mlp grads, fp32 (50.3M, 201 MB)": mlp_grads(torch.float32),
        "seed_mlp grads, fp16 (50.3M, 101 MB)": mlp_grads(torch.float16),
        "300 tensors, fp32 (150 x 1M + 150 x 1k, 630 MB)": [
            torch.randn(n, device=DEV, generator=gen) for _ in range(150) for n in (2**20, 1024)],
    }
    scaler = ampkit.GradScaler("cuda")
    one = torch.ones((), device=DEV)
    rows = []
    for name, grads in cases.items():
        dev, dtype = grads[0].device, grads[0].dtype
        grouped = {(dev, dtype): grads}
        found = torch.zeros((), device=DEV)
        fns = {
            "torch (x 1.0: read + write)": lambda: (found.zero_(), _torch_check(grads, found, one)),
            "ampkit (read only)": lambda: scaler.found_inf(grouped, unscale=False),
        }
        # The same flag, for a NaN, a -inf and nothing.
        flags_equal = True
        for value in (float("nan"), float("-inf"), None):
            saved = grads[2].view(-1)[12345].clone()
            if value is not None:
                grads[2].view(-1)[12345] = value
            ref = torch.zeros((), device=DEV)
            _torch_check([g.clone() for g in grads], ref, one)
            ours = scaler.found_inf(grouped, unscale=False)[dev]
            flags_equal &= bool(torch.equal(ours, ref)) and bool(ref) == (value is not None)
            grads[2].view(-1)[12345] = saved
        graphs = {}
        for k, fn in fns.items():
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                for _ in range(3):
                    fn()
            torch.cuda.current_stream().wait_stream(side)
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g):
                for _ in range(calls):
                    fn()
            graphs[k] = g
        samples = {k: {"graph": [], "eager": []} for k in fns}
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        for _ in range(repeats):  # interleaved: drift hits both
            for k, fn in fns.items():
                for mode, run in (("graph", graphs[k].replay),
                                  ("eager", lambda fn=fn: [fn() for _ in range(calls)])):
                    torch.cuda.synchronize()
                    start.record()
                    run()
                    end.record()
                    end.synchronize()
                    samples[k][mode].append(start.elapsed_time(end) / calls)
        med = {k: {m: statistics.median(v) for m, v in d.items()} for k, d in samples.items()}
        nbytes = sum(g.numel() * g.element_size() for g in grads)
        for k in fns:
            rows.append(dict(case=name, check=k, gb=nbytes / 1e9, flags_equal=flags_equal,
                             ms_graph=med[k]["graph"], ms_eager=med[k]["eager"],
                             ms_graph_min=min(samples[k]["graph"]),
                             ms_graph_max=max(samples[k]["graph"]),
                             gbps_read=nbytes / 1e6 / med[k]["graph"]))
        del graphs
    return rows


def cpu_check(repeats: int = 11) -> int:
    """--cpu-check: both checks on 400 MB of CPU gradients (fp16: 50 x 4M, fp32: 25 x 4M),
    one thread (the 2-core CI box is shared: OpenMP threads spin when a core is busy),
    medians of wall and CPU time."""
    torch.set_num_threads(1)
    gen = torch.Generator().manual_seed(0)
    cpu = torch.device("cpu")
    scaler, one, found = ampkit.GradScaler("cpu"), torch.ones(()), torch.zeros(())
    print(f"CPU, 1 thread, torch {torch.__version__}: the inf/NaN check before a fused optimizer, "
          f"400 MB of gradients, median [min, max] of {repeats}")
    for dtype, n in ((torch.float16, 50), (torch.float32, 25)):
        grads = [torch.randn(4 * 2**20, generator=gen).to(dtype) for _ in range(n)]
        fns = {
            "torch (x 1.0: read + write)": lambda: (found.zero_(), _torch_check(grads, found, one)),
            "ampkit (read only)": lambda: scaler.found_inf({(cpu, dtype): grads}, unscale=False),
        }
        wall, cpu_time = ({k: [] for k in fns} for _ in range(2))
        for fn in fns.values():
            fn()
        for _ in range(repeats):
            for k, fn in fns.items():
                t0, c0 = time.perf_counter(), time.process_time()
                fn()
                cpu_time[k].append((time.process_time() - c0) * 1e3)
                wall[k].append((time.perf_counter() - t0) * 1e3)
        for k in fns:
            w, c = wall[k], cpu_time[k]
            print(f"   {str(dtype)[6:]:8} {k:28} wall {statistics.median(w):7.2f} ms "
                  f"[{min(w):.2f}, {max(w):.2f}]   CPU {statistics.median(c):7.2f} ms")
    return 0


def main() -> int:
    if "--cpu-check" in sys.argv[1:]:
        return cpu_check()
    if not torch.cuda.is_available():
        print("no CUDA device: nothing to prove here")
        return 1
    card = torch.cuda.get_device_name()
    result = dict(card=card, torch=torch.__version__, cuda=torch.version.cuda,
                  python=sys.version.split()[0])
    print(f"card: {card}  torch {torch.__version__}  cuda {torch.version.cuda}")

    result["sync"] = sync_check()
    print("\n1. host-device syncs under set_sync_debug_mode('error') (4 iterations, one with inf)")
    print(f"   {'scaler':7} {'optimizer':12} {'options':45} result")
    for r in result["sync"]:
        opts = json.dumps(r["options"]) if r["options"] else "-"
        what = f"SYNC ({r['error']})" if r["synced"] else "no sync"
        print(f"   {r['scaler']:7} {r['optimizer']:12} {opts:45} {what}")

    result["graph"] = []
    print("\n2. whole fused step captured in a CUDA graph, replayed with an injected inf")
    for kind in ("sgd_fused", "adam_fused", "adamw_fused"):
        try:
            g = graph_check(kind)
        except Exception as e:  # noqa: BLE001
            traceback.print_exc()
            g = dict(optimizer=kind, ok=False, error=f"{type(e).__name__}: {e}"[:300])
        result["graph"].append(g)
        if "error" in g:
            print(f"   {kind:12} FAILED: {g['error']}")
        else:
            print(f"   {kind:12} ok={g['ok']}  scale {g['scale_before_inf']:g} -> {g['scale_after_inf']:g}"
                  f"  params unchanged={g['params_unchanged_on_inf']}"
                  f"  opt state unchanged={g['optimizer_state_unchanged_on_inf']}"
                  f"  skipped {g['skipped_before']} -> {g['skipped_after']}"
                  f" (last {g['last_skipped']}, steps {g['steps_counted_in_graph']})")

    result["speed"] = speed()
    print("\n3. seed recipe: 3 x Linear(4096), batch 512, SGD(momentum 0.9), MSE, fp16 autocast")
    print(f"   {'variant':26} {'steps/s (median)':>17} {'min':>8} {'max':>8} {'vs torch_plain':>15}")
    for r in result["speed"]:
        print(f"   {r['variant']:26} {r['steps_per_s_median']:17.1f} {r['steps_per_s_min']:8.1f} "
              f"{r['steps_per_s_max']:8.1f} {r['vs_torch_plain']:15.3f}")
    try:
        result["check"] = check_timing()
    except Exception as e:  # noqa: BLE001 - report, do not hide the other figures
        traceback.print_exc()
        result["check"] = [dict(error=f"{type(e).__name__}: {e}"[:300])]
    print("\n4. the inf/NaN check before a fused optimizer, GPU ms per check (median of 15;"
          " graph: 20 checks captured, eager: 20 calls)")
    print(f"   {'case':48} {'check':28} {'graph ms':>9} {'[min, max]':>17} {'eager ms':>9}"
          f" {'GB/s read':>9}  same flag")
    for r in result["check"]:
        if "error" in r:
            print(f"   FAILED: {r['error']}")
            continue
        print(f"   {r['case']:48} {r['check']:28} {r['ms_graph']:9.4f} "
              f"[{r['ms_graph_min']:.4f}, {r['ms_graph_max']:.4f}] {r['ms_eager']:9.4f}"
              f" {r['gbps_read']:9.0f}  {r['flags_equal']}")
    out = os.environ.get("OUT")
    if out:
        with open(os.path.join(out, "scaler_proof.json"), "w") as f:
            json.dump(result, f, indent=1)
    ok = all(not r["synced"] for r in result["sync"] if r["scaler"] == "ampkit" and r["optimizer"] != "sgd_plain")
    ok = ok and all(g.get("ok") for g in result["graph"])
    ok = ok and all(r.get("flags_equal") for r in result["check"])
    print("\nPROOF", "PASSED" if ok else "FAILED")
    return 0 if ok else 2


if __name__ == "__main__":
    sys.exit(main())
