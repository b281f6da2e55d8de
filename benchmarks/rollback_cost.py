"""What the eager train step's rollback costs: ampkit.make_train_step run eagerly
(capture=False, which copies the parameters and optimizer state before each scaler.step so
that a failed call can be put back) against the same step written by hand
(ampkit.bench.loop_step, no copy). 4 x Linear(1024), AdamW, batch 64, bf16 on the CPU, one
thread; interleaved repeats, medians. Printed, never asserted.

    python benchmarks/rollback_cost.py
"""
import statistics
import time

import torch

import ampkit
import ampkit.bench as bench

torch.set_num_threads(1)
x, y = torch.randn(64, 1024), torch.randn(64, 1024)
loss_fn = torch.nn.functional.mse_loss


def model_and_opt():
    torch.manual_seed(0)
    m = torch.nn.Sequential(*[torch.nn.Linear(1024, 1024) for _ in range(4)])
    return m, torch.optim.AdamW(m.parameters(), lr=1e-3)


m1, o1 = model_and_opt()
m2, o2 = model_and_opt()
steps = {
    "make_train_step (eager, with rollback copy)": ampkit.make_train_step(
        m1, loss_fn, o1, capture=False, autocast=dict(device_type="cpu", dtype=torch.bfloat16)),
    "hand-written loop (no copy)": bench.loop_step(
        m2, loss_fn, o2, lambda: ampkit.autocast("cpu", dtype=torch.bfloat16),
        ampkit.GradScaler("cpu", enabled=False)),
}
for s in steps.values():
    for _ in range(3):
        s(x, y)
res = {k: [] for k in steps}
for _ in range(7):
    for k, s in steps.items():
        t = time.perf_counter()
        for _ in range(10):
            s(x, y)
        res[k].append((time.perf_counter() - t) / 10 * 1e3)
for k, v in res.items():
    print(f"{k}: {statistics.median(v):.2f} ms/step")
a, b = res.values()
print(f"ratio {statistics.median(p / q for p, q in zip(a, b)):.3f}")
