"""ampkit._compiled_graphs: a graph torch.compile traced under an ampkit handler (here the fp8
policy's, a TorchFunctionMode) runs with ``__torch_function__`` off, so its ops do not pass
through the handler a second time (on the GPU that second pass made the compiled fp8 loop
host-bound). The oracle for values is the eager region (``aot_eager``: the same ATen kernels,
so bit for bit); the handler's calls are counted by wrapping its ``__torch_function__``
after the graph is compiled."""
from __future__ import annotations

import collections

import pytest
import torch

import ampkit
import ampkit._engine as engine
from ampkit import _compiled_graphs

FP8 = ampkit.load_policy("fp8")
BF16 = torch.bfloat16


def mlp():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.GELU(), torch.nn.Linear(64, 32))


def run(model, x, policy):
    with ampkit.autocast("cpu", dtype=BF16, policy=policy):
        return model(x)


@pytest.fixture
def handler_calls(monkeypatch):
    """Start counting the funcs that reach ampkit's eager handler (call ``start()`` once the
    graphs are compiled: dynamo would trace the counting wrapper otherwise)."""
    seen = collections.Counter()
    original = engine.Mode.__torch_function__

    def counting(self, func, types, args=(), kwargs=None):
        seen[getattr(func, "__name__", repr(func))] += 1
        return original(self, func, types, args, kwargs)

    seen.start = lambda: monkeypatch.setattr(engine.Mode, "__torch_function__", counting)
    return seen


def test_ampkit_installs_it():
    assert _compiled_graphs.installed()


def test_a_graph_compiled_under_the_handler_runs_without_it(handler_calls):
    model, x = mlp(), torch.randn(16, 32)
    compiled = torch.compile(model, backend="aot_eager")
    want = run(model, x, FP8)
    for _ in range(2):
        got = run(compiled, x, FP8)
    handler_calls.start()
    got = run(compiled, x, FP8)
    assert dict(handler_calls) == {}, "ops of the compiled graph went through the handler again"
    assert torch.equal(got, want) and got.dtype == want.dtype == BF16


def test_eager_code_between_graphs_still_runs_under_the_handler(handler_calls):
    """A graph break: the code dynamo leaves to eager (here a linear) is cast by the handler,
    and the graphs on either side of it hold its decisions: the whole equals the eager region."""
    lin1, lin2, lin3 = mlp()[0], torch.nn.Linear(64, 64), torch.nn.Linear(64, 8)

    @torch._dynamo.disable
    def middle(h):
        return torch.nn.functional.linear(h, lin2.weight, lin2.bias)

    def f(x):
        return lin3(torch.relu(middle(torch.relu(lin1(x)))))

    x = torch.randn(16, 32)
    compiled = torch.compile(f, backend="aot_eager")
    want, plain = run(f, x, FP8), run(f, x, None)
    assert not torch.equal(want, plain)  # fp8 changes the values: the comparison can tell them apart
    run(compiled, x, FP8)
    handler_calls.start()
    got = run(compiled, x, FP8)
    assert torch.equal(got, want)
    assert handler_calls["linear"] == 1  # the eager linear, and nothing from the graphs


def test_a_region_with_another_policy_still_gets_a_graph_of_its_own():
    """The handler is off only while a graph runs: dynamo's guards, evaluated before, still see
    it, so the same compiled model in a region without it (the default policy) is traced again."""
    model, x = mlp(), torch.randn(16, 32)
    compiled = torch.compile(model, backend="aot_eager")
    fp8 = run(compiled, x, FP8)
    plain = run(compiled, x, None)
    assert torch.equal(fp8, run(model, x, FP8))
    assert torch.equal(plain, run(model, x, None))
    assert not torch.equal(fp8, plain)
