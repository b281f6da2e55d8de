"""Why a captured make_train_step dies beside torch.compile(mode="reduce-overhead").

Issue 25's sequence: an eager torch.autocast + torch.amp.GradScaler loop, then a captured
ampkit step, then a reduce-overhead compiled model, each built and warmed up in this order,
then one step of each in turn. Each variant runs in a fresh process (a dead CUDA context
does not come back) and prints one line: how many rounds ran, and the error if any.

    PYTHONPATH=$PWD/python python3 benchmarks/gpu/coexist_probe.py [ROUNDS]

Variants (``*_old``: the step captured on its warm-up stream, as before the fix):
  base          the sequence as the issue wrote it
  no_eager      captured step, then the compiled model (the trees' "not tracked" error)
  ws_none       CUBLAS_WORKSPACE_CONFIG=:0:0 (cuBLAS runs without a workspace)
  trees_keep_ws the trees' clear_cublas_manager made a no-op (they leave workspaces alone)
"""
import os
import subprocess
import sys

import torch

VARIANTS = ("base_old", "base", "no_eager_old", "no_eager", "ws_none_old", "trees_keep_ws_old")
D, B = 4096, 512


def mlp(seed):
    torch.manual_seed(seed)
    return torch.nn.Sequential(*[torch.nn.Linear(D, D) for _ in range(3)]).cuda()


def torch_loop(model, x, y):
    """A torch.autocast + torch.amp.GradScaler step over ``model``, warmed up (3 steps)."""
    opt = torch.optim.SGD(model.parameters(), lr=1e-3, fused=True)
    scaler = torch.amp.GradScaler("cuda")

    def step():
        opt.zero_grad(set_to_none=True)
        with torch.autocast("cuda", dtype=torch.float16):
            loss = torch.nn.functional.mse_loss(model(x), y)
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
    for _ in range(3):
        step()
    return step


def child(variant, rounds):
    import ampkit
    import ampkit._train_step as ts_mod

    old = variant.endswith("_old")
    variant = variant.removesuffix("_old")
    if variant == "no_eager":  # the trees' error then names each block's allocation stack
        torch.cuda.memory._record_memory_history(max_entries=200000)
    if variant == "trees_keep_ws":
        import contextlib

        import torch._inductor.cudagraph_trees as trees
        trees.clear_cublas_manager = contextlib.nullcontext
    x = torch.randn(B, D, device="cuda")
    y = torch.randn(B, D, device="cuda")
    loss_fn = torch.nn.functional.mse_loss
    steps = []

    if variant != "no_eager":
        steps.append(("eager", torch_loop(mlp(0), x, y)))

    m1 = mlp(1)
    o1 = torch.optim.SGD(m1.parameters(), lr=1e-3, fused=True)
    ts = ampkit.make_train_step(m1, loss_fn, o1)
    if old:
        ts_mod._fresh_stream = ts._side_stream
    for _ in range(5):
        ts(x, y)
    assert ts.captured, ts.reason
    steps.append(("captured", lambda: ts(x, y)))

    steps.append(("compiled", torch_loop(torch.compile(mlp(2), mode="reduce-overhead"), x, y)))
    torch.cuda.synchronize()
    done = 0
    for _ in range(rounds):
        for _, fn in steps:
            fn()
        torch.cuda.synchronize()
        done += 1
    print(f"{variant}{'_old' if old else ''}: {done} rounds OK", flush=True)


def main():
    if len(sys.argv) > 2 and sys.argv[1] == "--child":
        child(sys.argv[2], int(sys.argv[3]))
        return
    rounds = int(sys.argv[1]) if len(sys.argv) > 1 else 50
    for v in VARIANTS:
        env = dict(os.environ)
        if v.startswith("ws_none"):
            env["CUBLAS_WORKSPACE_CONFIG"] = ":0:0"
        p = subprocess.run([sys.executable, __file__, "--child", v, str(rounds)], env=env,
                           capture_output=True, text=True, timeout=300)
        out = os.environ.get("OUT")
        if out:
            with open(os.path.join(out, f"coexist_{v}.log"), "w") as f:
                f.write(p.stdout + "\n--- stderr ---\n" + p.stderr[-200000:])
        if p.returncode == 0:
            print(p.stdout.strip().splitlines()[-1], flush=True)
        else:
            err = [ln for ln in p.stderr.strip().splitlines() if "Error" in ln or "error" in ln]
            print(f"{v}: FAILED rc={p.returncode}: {' | '.join(err[-3:])[:600]}", flush=True)


if __name__ == "__main__":
    main()
