"""The Python side of R's seed step, without R: the calls into ``ampkit.r_bridge`` that the
R package's compiled crossing makes each step (small_step.R's step(i): enter_autocast,
net(x), loss_fn(output, y), exit_autocast, ScalerCalls.scale_backward and .step, the
deferred ScalerCalls.update_deferred and bound_zero_grad), made from a Python loop, against
``r_bridge.amp_step`` (Python's own loop) at the same sizes; and the four scaler and
optimizer calls alone over objects whose methods do nothing ("wrappers": what the bridge's
own layers cost). CPU time per step, median and min of the rounds, interleaved:

    PYTHONPATH=<repo>/python OMP_NUM_THREADS=1 python benchmarks/r/bridge_calls.py [steps=500] [rounds=7]

Timings on a shared VM move by 10% between runs; the wrappers row is stable.
"""

import statistics
import sys
import time

import torch

import ampkit
from ampkit import r_bridge


def main(steps: int, rounds: int) -> None:
    torch.set_num_threads(1)
    torch.manual_seed(1)
    data = [torch.randn(8, 16) for _ in range(10)]
    targets = [torch.randn(8, 16) for _ in range(10)]
    net = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.ReLU(), torch.nn.Linear(16, 16),
                              torch.nn.ReLU(), torch.nn.Linear(16, 16))
    loss_fn = torch.nn.MSELoss()
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    scaler = ampkit.GradScaler("cpu", init_scale=2.0**10)
    calls = r_bridge.ScalerCalls(scaler)
    enter, leave = r_bridge.enter_autocast, r_bridge.exit_autocast
    scale_backward, step, update, zero_grad = (calls.scale_backward, calls.step, calls.update_deferred,
                                               r_bridge.bound_zero_grad(opt))

    def r_calls(n):
        for s in range(n):
            i = s % 10
            token = enter("cpu", None, True, None, None)
            loss = loss_fn(net(data[i]), targets[i])
            leave(token)
            scale_backward(loss)
            step(opt)
            update()  # (deferred by `scaler$update()`, made before `opt$zero_grad()`)
            zero_grad()

    def python(n):
        for s in range(n):
            r_bridge.amp_step(net, loss_fn, opt, scaler, data[s % 10], targets[s % 10], "cpu")

    class Idle:  # a scaler, its scaled loss and an optimizer whose methods do nothing
        def scale(self, loss):
            return self

        def backward(self):
            pass

        def step(self, optimizer):
            pass

        def update(self, new_scale=None):
            pass

        def zero_grad(self):
            pass

    idle = r_bridge.ScalerCalls(Idle())
    idle_calls = (idle.scale_backward, idle.step, idle.update_deferred, r_bridge.bound_zero_grad(Idle()))

    def wrappers(n):
        a, b, c, d = idle_calls
        for _ in range(n):
            a(1)
            b(2)
            c()
            d()

    loops = {"r_calls": (r_calls, steps), "python": (python, steps), "wrappers": (wrappers, 20 * steps)}
    for f, _ in loops.values():
        f(50)
    us = {name: [] for name in loops}
    for _ in range(rounds):
        for name, (f, n) in loops.items():
            t = time.process_time()
            f(n)
            us[name].append((time.process_time() - t) / n * 1e6)
    print(f"CPU us per step, {rounds} rounds (torch {torch.__version__}, Python {sys.version.split()[0]})")
    for name, v in us.items():
        print(f"{name:9s} median {statistics.median(v):8.2f}  min {min(v):8.2f}")


if __name__ == "__main__":
    a = [int(x) for x in sys.argv[1:3]]
    main(a[0] if a else 500, a[1] if len(a) > 1 else 7)
