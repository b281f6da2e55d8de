"""What making a failed call change nothing costs the eager train step: ampkit.make_train_step
run eagerly (capture=False) against the same step written by hand (ampkit.bench.loop_step),
with AdamW as torch makes it (the step checks that its optimizer step cannot fail half-way
and copies nothing: step.rollback_copy is None) and with a step hook on the optimizer (the
step cannot check what a hook does, so it copies the parameters and the optimizer state
before each optimizer step). 4 x Linear(1024), batch 64, bf16 on the CPU, one thread;
interleaved repeats, medians of the per-round ratios to the hand-written step. Printed,
never asserted.

    python benchmarks/rollback_cost.py
"""
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "python"))

import torch  # noqa: E402

import ampkit  # noqa: E402
import ampkit.bench as bench  # noqa: E402

torch.set_num_threads(1)
x, y = torch.randn(64, 1024), torch.randn(64, 1024)
loss_fn = torch.nn.functional.mse_loss
AUTOCAST = dict(device_type="cpu", dtype=torch.bfloat16)


def model_and_opt():
    torch.manual_seed(0)
    m = torch.nn.Sequential(*[torch.nn.Linear(1024, 1024) for _ in range(4)])
    return m, torch.optim.AdamW(m.parameters(), lr=1e-3)


m1, o1 = model_and_opt()
m2, o2 = model_and_opt()
m3, o3 = model_and_opt()
o3.register_step_post_hook(lambda *a: None)  # does nothing, but the step cannot know that
steps = {
    "hand-written loop": bench.loop_step(m1, loss_fn, o1, lambda: ampkit.autocast(**AUTOCAST),
                                         ampkit.GradScaler("cpu", enabled=False)),
    "make_train_step, eager, checked": ampkit.make_train_step(m2, loss_fn, o2, capture=False, autocast=AUTOCAST),
    "make_train_step, eager, copying (a step hook)": ampkit.make_train_step(m3, loss_fn, o3, capture=False,
                                                                            autocast=AUTOCAST),
}
for s in steps.values():
    for _ in range(3):
        s(x, y)
res = {k: [] for k in steps}
names = list(steps)
for r in range(41):
    for k in names[r % len(names):] + names[:r % len(names)]:  # the order rotating
        t = time.thread_time()
        for _ in range(5):
            steps[k](x, y)
        res[k].append((time.thread_time() - t) / 5 * 1e3)
hand = res[names[0]]
for k in names:
    print(f"{k}: {statistics.median(res[k]):.2f} ms/step (CPU time), "
          f"ratio {statistics.median(a / b for a, b in zip(res[k], hand)):.3f}"
          + (f"; rollback_copy: {steps[k].rollback_copy}" if k != names[0] else ""))
