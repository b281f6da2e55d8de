"""ampkit.trace() around compiled code: the compiled model runs eagerly while a trace is
active, so its records are the uncompiled model's, fp8 casts and scales included; its
graphs are kept and run again after the last trace (in any thread) has ended."""

from __future__ import annotations

import threading

import pytest
import torch

import ampkit

pytestmark = [
    pytest.mark.usefixtures("ampkit_quiet"),
    pytest.mark.skipif(not hasattr(torch.compiler, "set_stance"),
                       reason="torch < 2.6 has no compiler stance: a trace records nothing inside compiled code"),
]

FP8 = ampkit.load_policy("fp8")


class CountingBackend:
    """aot_eager, counting the runs of the graphs it compiled."""

    def __init__(self):
        self.compiled = self.runs = 0

    def __call__(self, gm, example_inputs):
        from torch._dynamo.backends.common import aot_autograd

        self.compiled += 1

        def counted(*args):
            self.runs += 1
            return gm(*args)

        return aot_autograd(fw_compiler=lambda g, _: counted if g is not None else g)(gm, example_inputs)


def model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 8))


def plain(records):
    return [(r.op, r.rule, r.device, r.input_dtypes, r.output_dtype, r.scope,
             tuple(str(c) for c in r.fp8_casts), r.fp8_path) for r in records]


@pytest.fixture(autouse=True)
def fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


@pytest.mark.parametrize("policy", ["torch_default", "fp8_scoped"])
def test_a_compiled_models_trace_is_the_uncompiled_models(policy):
    """The records of a trace around a compiled model equal those around the same model
    uncompiled (the oracle), fp8 casts with their scales included; the compiled graph
    does not run inside the trace, and runs again after it without a recompile."""
    x = torch.randn(4, 16)
    if policy == "fp8_scoped":  # fp8 for the first linear, bf16 for the last (a module scope)
        pol = FP8.with_module("2", lower_precision_fp=["linear"])
    else:
        pol = ampkit.load_policy(policy)
    want_model, got_model = model(), model()
    with pol.apply(want_model), ampkit.trace() as want, ampkit.autocast("cpu", policy=pol.without_modules()):
        want_out = want_model(x)
    backend = CountingBackend()
    compiled = torch.compile(got_model, backend=backend)
    with pol.apply(got_model):
        with ampkit.autocast("cpu", policy=pol.without_modules()):
            compiled(x)  # compiled and run once, untraced
        assert (backend.compiled, backend.runs) == (1, 1)
        with ampkit.trace() as got, ampkit.autocast("cpu", policy=pol.without_modules()):
            got_out = compiled(x)
        assert backend.runs == 1  # the trace ran the model eagerly
        with ampkit.autocast("cpu", policy=pol.without_modules()):
            compiled(x)
    assert (backend.compiled, backend.runs) == (1, 2)  # the graph again, not a recompile
    assert plain(got.records) == plain(want.records) and len(want.records) > 0
    if policy == "fp8_scoped":
        assert [r.rule for r in got.records if r.op == "linear"] == ["fp8", "lower_precision_fp"]
        assert got.records[0].fp8_casts  # the fp8 casts and their scales
    assert got_out.dtype == want_out.dtype and torch.equal(got_out, want_out)


def test_compiled_code_runs_compiled_again_only_once_every_thread_has_ended_its_trace():
    """The compiler stance is process-wide: two overlapping traces in two threads hold it
    eager until the later one ends, whichever ends first."""
    backend = CountingBackend()
    compiled = torch.compile(model(), backend=backend)
    x = torch.randn(4, 16)
    compiled(x)
    entered, release = threading.Event(), threading.Event()

    def other_thread():
        with ampkit.trace():
            entered.set()
            release.wait(30)

    t = threading.Thread(target=other_thread)
    with ampkit.trace():
        t.start()
        assert entered.wait(30)
    compiled(x)
    assert backend.runs == 1  # the other thread still traces: eager here too
    release.set()
    t.join(30)
    compiled(x)
    assert (backend.compiled, backend.runs) == (1, 2)


def test_nested_traces_keep_compiled_code_eager_until_the_outer_one_ends():
    backend = CountingBackend()
    compiled = torch.compile(model(), backend=backend)
    x = torch.randn(4, 16)
    with ampkit.trace() as outer:
        with ampkit.trace() as inner, ampkit.autocast("cpu"):
            compiled(x)
        with ampkit.autocast("cpu"):
            compiled(x)
        assert backend.runs == 0
    assert len(inner.records) > 0 and len(outer.records) > 0  # (each block's own calls)
    compiled(x)
    assert backend.runs == 1


def test_a_compiled_step_first_called_in_a_trace_still_falls_back_when_torch_cannot_compile():
    """make_train_step(compile=...): a first call inside a trace runs the model eagerly and
    proves nothing about compiling it; the first call after the trace that cannot compile
    falls back to the uncompiled model, as a first call would (compile_reason says why)."""
    def failing(gm, example_inputs):
        raise RuntimeError("this backend compiles nothing")

    m = model()
    step = ampkit.make_train_step(m, torch.nn.functional.mse_loss, torch.optim.SGD(m.parameters(), lr=0.1),
                                  scaler=ampkit.GradScaler("cpu", enabled=False),
                                  autocast=dict(device_type="cpu", dtype=torch.bfloat16),
                                  compile=dict(backend=failing), capture=False)
    x, y = torch.randn(4, 16), torch.randn(4, 8)
    with ampkit.trace() as tr:
        step(x, y)
    assert [r.rule for r in tr.records if r.op == "linear"] == ["lower_precision_fp"] * 2
    with pytest.warns(UserWarning, match="this backend compiles nothing"):
        step(x, y)
    assert not step.compiled and "this backend compiles nothing" in step.compile_reason


@pytest.mark.cuda
def test_a_captured_compiled_step_does_not_capture_inside_a_trace():
    """A capture inside a trace would hold the uncompiled kernels: the step runs its
    warm-up path instead, and captures at its first call after the trace."""
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 8)).cuda()
    opt = torch.optim.SGD(m.parameters(), lr=0.1, fused=True)
    step = ampkit.make_train_step(m, torch.nn.functional.mse_loss, opt, compile=True, warmup=2)
    x, y = torch.randn(32, 64, device="cuda"), torch.randn(32, 8, device="cuda")
    for _ in range(2):
        step(x, y)  # the warm-up
    with ampkit.trace() as tr:
        step(x, y)  # would capture here
    assert step.captures == 0 and any(r.op == "linear" for r in tr.records)
    step(x, y)
    step(x, y)
    assert step.captures == 1 and step.captured and step.compiled
