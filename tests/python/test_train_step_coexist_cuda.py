"""A captured make_train_step beside what else a training script runs (run on the device).

    PYTHONPATH=$PWD/python python3 -m pytest -q -m cuda tests/python/test_train_step_coexist_cuda.py

Each sequence builds its steps in the order written, then runs ROUNDS rounds of one step
of each in turn. The oracle for the captured step is the same step (same seed, same
batches, same captured kernels) run alone afterwards in the same process: its losses must
be bitwise the ones it gave among the others. A graph that replays into memory it does not
own (issue 25: cuBLAS's workspace freed by torch.compile's CUDA-graph trees) dies with
"unspecified launch failure" or trains on garbage; either fails here.
"""

import pytest
import torch

import ampkit

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

ROUNDS = 1000
D, BATCH, N_BATCHES = 4096, 512, 4  # the seeds' MLP recipe, the issue's sizes
LOSS = torch.nn.functional.mse_loss


def mlp(seed, d=D):
    torch.manual_seed(seed)
    return torch.nn.Sequential(*[torch.nn.Linear(d, d) for _ in range(3)]).cuda()


def batches(seed=7, d=D):
    g = torch.Generator(device="cuda").manual_seed(seed)
    return [(torch.randn(BATCH, d, device="cuda", generator=g),
             torch.randn(BATCH, d, device="cuda", generator=g)) for _ in range(N_BATCHES)]


class Captured:
    """A captured ampkit step over its own model; keeps its losses on the device."""

    def __init__(self, seed, data):
        self.model = mlp(seed)
        opt = torch.optim.SGD(self.model.parameters(), lr=1e-3, momentum=0.9, fused=True)
        self.step = ampkit.make_train_step(self.model, LOSS, opt, capture=True)
        self.data, self.i, self.losses = data, 0, []

    def __call__(self):
        x, y = self.data[self.i % len(self.data)]
        self.i += 1
        self.losses.append(self.step(x, y))

    def warm(self):
        for _ in range(self.step.warmup + 2):
            self()


class TorchLoop:
    """A hand-written torch.autocast + torch.amp.GradScaler loop, optionally compiled."""

    def __init__(self, seed, data, compile_mode=None, region=torch.autocast):
        model = mlp(seed)
        self.fwd = torch.compile(model, mode=compile_mode) if compile_mode else model
        self.opt = torch.optim.SGD(model.parameters(), lr=1e-3, fused=True)
        self.scaler = torch.amp.GradScaler("cuda")
        self.region, self.data, self.i = region, data, 0

    def __call__(self):
        x, y = self.data[self.i % len(self.data)]
        self.i += 1
        self.opt.zero_grad(set_to_none=True)
        with self.region("cuda", dtype=torch.float16):
            loss = LOSS(self.fwd(x), y)
        self.scaler.scale(loss).backward()
        self.scaler.step(self.opt)
        self.scaler.update()

    def warm(self):
        for _ in range(3):
            self()


def run_rounds(parts, between=None):
    for _ in range(ROUNDS):
        for part in parts:
            part()
            if between is not None:
                between()
    torch.cuda.synchronize()


def assert_same_as_alone(captured, seed, data):
    """The captured step's losses among the others == the same step's losses alone."""
    alone = Captured(seed, data)
    for _ in range(len(captured.losses)):
        alone()
    torch.cuda.synchronize()
    assert captured.step.captured and captured.step.captures == 1, captured.step.reason
    got, want = torch.stack(captured.losses), torch.stack(alone.losses)
    assert torch.isfinite(got).all()
    assert torch.equal(got, want), (
        f"{int((got != want).sum())} of {got.numel()} losses differ from the step run alone")


@pytest.mark.parametrize("region", ["torch", "ampkit"])
def test_beside_reduce_overhead_in_the_issues_order(region):
    # An eager torch loop, the captured step, then a reduce-overhead model: each built and
    # warmed up in this order, then one step of each in turn.
    data = batches()
    eager = TorchLoop(0, data)
    eager.warm()
    cap = Captured(1, data)
    cap.warm()
    compiled = TorchLoop(2, data, "reduce-overhead",
                         torch.autocast if region == "torch" else ampkit.autocast)
    compiled.warm()
    run_rounds([eager, cap, compiled])
    assert_same_as_alone(cap, 1, data)


def test_beside_reduce_overhead_built_first():
    data = batches()
    compiled = TorchLoop(2, data, "reduce-overhead")
    compiled.warm()
    cap = Captured(1, data)
    cap.warm()
    run_rounds([compiled, cap])
    assert_same_as_alone(cap, 1, data)


def test_two_captured_steps_interleaved():
    data = batches()
    a, b = Captured(1, data), Captured(3, data)
    a.warm()
    b.warm()
    run_rounds([a, b])
    assert_same_as_alone(a, 1, data)
    assert_same_as_alone(b, 3, data)


def test_an_evaluation_under_no_grad_between_replays():
    data = batches()
    cap = Captured(1, data)
    cap.warm()
    x_eval = torch.randn(3 * BATCH, D, device="cuda")  # another shape, another allocation

    def evaluate():
        cap.model.eval()
        with torch.no_grad(), ampkit.autocast("cuda", dtype=torch.float16):
            out = cap.model(x_eval)
        cap.model.train()
        assert torch.isfinite(out).all()

    run_rounds([cap], between=evaluate)
    assert cap.step.replays == ROUNDS + 2  # (warm()'s capture call and last call replay too)
    assert_same_as_alone(cap, 1, data)


def test_empty_cache_between_builds_and_steps():
    data = batches()
    a = Captured(1, data)
    a.warm()
    torch.cuda.empty_cache()
    compiled = TorchLoop(2, data, "reduce-overhead")
    compiled.warm()
    torch.cuda.empty_cache()
    b = Captured(3, data)
    b.warm()
    torch.cuda.empty_cache()
    run_rounds([a, compiled, b], between=torch.cuda.empty_cache)
    assert_same_as_alone(a, 1, data)
    assert_same_as_alone(b, 3, data)
