"""The numerics doctor on CUDA: no host sync (sync debug mode 'error'), the finding of a bad
batch replayed through make_train_step's CUDA graph equals the eager one, faults named."""

import contextlib

import pytest
import torch

import ampkit
import faults
from ampkit.bench import build_case
from conftest import SyncError

pytestmark = [pytest.mark.cuda, pytest.mark.filterwarnings("ignore::UserWarning")]


def _run(capture, bad_step=None, steps=7, sync_check_from=None):
    def around(i):
        return SyncError() if sync_check_from is not None and i >= sync_check_from else contextlib.nullcontext()

    return faults.bad_batch("cuda", capture, bad_step=bad_step, steps=steps, around_step=around)


def test_armed_doctor_adds_no_sync_inside_the_captured_step():
    finding, captured = _run("auto", sync_check_from=4)
    assert captured[-1] and finding is None


def test_a_bad_batch_in_the_graph_is_named_as_in_eager_mode():
    eager, _ = _run(False, bad_step=5)
    graph, captured = _run(True, bad_step=5)
    assert captured[5]
    assert eager is not None and graph is not None
    assert (graph.op, graph.module, graph.phase, graph.dtype, graph.step) == \
        (eager.op, eager.module, eager.phase, eager.dtype, eager.step)
    assert graph.step == 5 and graph.module == "0" and graph.phase == "forward"
    assert graph.input_absmax == pytest.approx(1e6)


@pytest.mark.parametrize("i", range(0, 64, 5))
def test_faults_on_cuda(i):
    f = faults.plan(device="cuda")[i]
    finding, fired = faults.run_fault(f, device="cuda", step=1)
    assert fired == 1
    assert (finding.op, finding.module, finding.phase, finding.step) == (f["op"], f["module"], f["phase"], 1)


def test_eager_step_armed_adds_no_sync():
    built = build_case("seed_mlp", "tiny", device="cuda")
    model = built.new_model()
    x, y = built.batches[0]

    def step():
        with ampkit.autocast("cuda", dtype=torch.float16):
            loss = built.loss_fn(model(x), y)
        loss.backward()

    with ampkit.doctor(model) as doc:
        step()  # the first step makes the per-op constants
        torch.cuda.synchronize()
        with SyncError():
            step()
            step()
        assert doc.first_nonfinite() is None


def test_host_verdicts_add_no_sync(monkeypatch):
    # new batches each step: the host reads the verdicts; with sends every 2 steps, the
    # flags' stack and its copy to pinned memory run inside the checked steps too
    import ampkit._doctor._step_watch as _step_watch

    monkeypatch.setattr(_step_watch, "_BATCH", 2)
    built = build_case("seed_mlp", "tiny", device="cuda")
    model = built.new_model()
    opt = built.new_optimizer(model, fused=True)
    scaler = ampkit.GradScaler("cuda")
    xs = [torch.randn_like(built.batches[0][0]) for _ in range(10)]
    y = built.batches[0][1]

    def step(x):
        with ampkit.autocast("cuda", dtype=torch.float16):
            loss = built.loss_fn(model(x), y)
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        opt.zero_grad(set_to_none=True)

    with ampkit.doctor(model) as doc:
        for x in xs[:3]:  # the first step makes the per-op constants
            step(x)
        torch.cuda.synchronize()
        with SyncError():
            for x in xs[3:]:
                step(x)
        assert doc.host_verdict_steps >= 8
        assert doc.first_nonfinite() is None


@pytest.mark.parametrize("phase", ["forward", "backward"])
def test_a_large_output_is_kept_by_the_conditional_copy_and_replayed(phase):
    # a 64 MiB float16 output (over the doctor's 32 MiB line): an eager step's record is the
    # Triton kernel, which copies the held inputs and output gradient only for the first bad
    # step. Step 2 of 4 is bad: its batch overflows the forward, or its output gradient the
    # backward (1e5 * a weight beyond float16); the finding is derived by hand from that step
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Linear(64, 8192)).cuda()
    scaler = ampkit.GradScaler("cuda", init_scale=1.0)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    xs = [torch.randn(4096, 64, device="cuda") for _ in range(4)]
    gs = [torch.full((4096, 8192), 1e-3, device="cuda") for _ in range(4)]  # (1.0 overflows sum())
    if phase == "forward":
        xs[2] = xs[2].mul(1e6)  # beyond float16: layer 0's input cast overflows
    else:
        gs[2] = gs[2].mul(1e8)  # 1e5: the float32 gradient cast back to float16 overflows
    with ampkit.doctor(model) as doc:
        for x, g in zip(xs, gs):
            opt.zero_grad()
            with ampkit.autocast("cuda", dtype=torch.float16):
                out = model(x)
            assert out.numel() * out.element_size() > 32 << 20
            scaler.scale((out.float() * g).sum()).backward()
            scaler.step(opt)
            scaler.update()
        f = doc.first_nonfinite()
    assert f.step == 2 and f.weights == "current"
    if phase == "forward":
        assert (f.op, f.module, f.phase) == ("_to_copy", "0", "forward")
        assert f.input_absmax == pytest.approx(xs[2].abs().max().item())
    else:  # the gradient arrives at the model's output already inf (made by the loss's cast)
        assert (f.op, f.module, f.phase) == ("<output gradient>", "<outside model>", "backward")
        assert f.output_absmax == float("inf")
