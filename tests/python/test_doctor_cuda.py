"""The numerics doctor on CUDA: no host sync (sync debug mode 'error'), the finding of a bad
batch replayed through make_train_step's CUDA graph equals the eager one, faults named."""

import contextlib

import pytest
import torch

import ampkit
from ampkit import faults
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
