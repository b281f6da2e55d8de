"""The fp8 tier under ``torch.compile(model)``: one graph, no graph break, no recompile, and
the same loss and gradients as the eager fp8 model.

The model is the benchmark's GPT-2 case at its tiny profile (every dimension a multiple of
16, so the ``_scaled_mm`` path takes every fp8 call), run as the GPU benchmark runs it: the
fp8 policy with the vocabulary head kept in bfloat16 by a module scope, the region entered
around the compiled model. Each case runs twice: the CPU's emulation (shipped) and the
GPU's ``_scaled_mm`` path, turned on for the CPU (``SCALED_MM_DEVICES``). The backend is
``aot_eager``: dynamo's graphs and AOT autograd's forward and backward graphs, run by the
same ATen kernels as eager, so the compiled model must equal the eager one bit for bit
(inductor's fused kernels round differently; tests/python/test_fp8.py compares a small
model under inductor).
"""

from __future__ import annotations

import contextlib
import dataclasses
import copy

import pytest
import torch
from torch._dynamo.utils import counters

import ampkit
import ampkit.bench as bench
from ampkit import _fp8
from conftest import cpu_scaled_mm_on

FP8 = ampkit.load_policy("fp8")
RECIPES = {"tensorwise": {"scaling": "tensorwise"}, "rowwise": {"scaling": "rowwise"},
           "delayed": {"scaling": "delayed", "amax_history": 4}}


def head_in_bf16(recipe):
    return FP8.with_fp8_recipe(**RECIPES[recipe]).with_module("head", lower_precision_fp=["linear"])


@pytest.fixture(params=["emulated", "scaled_mm"])
def path(request, monkeypatch):
    if request.param == "scaled_mm":
        cpu_scaled_mm_on(monkeypatch)
    return request.param


class CountingBackend:
    """aot_eager, counting the graphs dynamo hands it."""

    def __init__(self):
        self.graphs = 0

    def __call__(self, gm, example_inputs):
        self.graphs += 1
        return torch._dynamo.backends.registry.lookup_backend("aot_eager")(gm, example_inputs)


def train(model, policy, case, steps, compiled=None, after_step=lambda: None):
    """[(loss, [grads])] of ``steps`` AdamW steps of ``compiled`` (or ``model``) under the policy."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    run = model if compiled is None else compiled
    out = []
    with policy.apply(model):
        for i in range(steps):
            ids, target = case.batches[i % len(case.batches)]
            with ampkit.autocast("cpu", policy=policy.without_modules()):
                loss = case.loss_fn(run(ids), target)
            loss.backward()
            out.append((loss.detach(), [p.grad.clone() for p in model.parameters()]))
            opt.step()
            opt.zero_grad()
            after_step()
    return out


def scope_per_linear(recipe, name):
    """The policy calibrate_fp8 gives where fp8 does not pay: a scope on each linear of the
    tiny model giving ``linear`` back to lower_precision_fp, so each linear's region holds its
    own policy (one traced table per scope, each built in the middle of the model's trace)."""
    policy = FP8.with_fp8_recipe(**RECIPES[recipe]).with_name(name)
    for linear in ("layers.0.qkv", "layers.0.proj", "layers.0.fc1", "layers.0.fc2", "head"):
        policy = policy.with_module(linear, lower_precision_fp=["linear"])
    return policy


def compiled_run(recipe, steps=3, policy=None):
    case = bench.build_case("gpt2_small", "tiny", device="cpu")
    model = case.new_model()
    twin = copy.deepcopy(model)
    policy = head_in_bf16(recipe) if policy is None else policy
    torch._dynamo.reset()
    counters.clear()
    backend = CountingBackend()
    graphs = []  # after each step: a recompile adds a graph
    got = train(twin, policy, case, steps, compiled=torch.compile(twin, backend=backend),
                after_step=lambda: graphs.append(backend.graphs))
    breaks = sum(counters["graph_break"].values())
    want = train(model, policy, case, steps)
    return got, want, graphs, breaks


def the_fp8_path_ran(path, recipe):
    """What the eager fp8 model's trace says ran: every linear but the head in fp8 on this path."""
    case = bench.build_case("gpt2_small", "tiny", device="cpu")
    model, policy = case.new_model(), head_in_bf16(recipe)
    with policy.apply(model), ampkit.trace() as tr, ampkit.autocast("cpu", policy=policy.without_modules()):
        model(case.batches[0][0])
    rows = [r for r in tr.records if r.op == "linear"]
    return [r.rule for r in rows], {r.fp8_path for r in rows if r.rule == "fp8"}


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise", "delayed"])
def test_fp8_model_compiles_to_one_graph_without_breaks_or_recompiles(recipe, path):
    rules, paths = the_fp8_path_ran(path, recipe)
    assert rules == ["fp8"] * (len(rules) - 1) + ["lower_precision_fp"] and paths == {path}
    got, want, graphs, breaks = compiled_run(recipe)
    assert (graphs, breaks) == ([1, 1, 1], 0), counters["graph_break"]


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise", "delayed"])
def test_compiled_fp8_model_trains_as_the_eager_fp8_model_bit_for_bit(recipe, path):
    got, want, _, _ = compiled_run(recipe)
    for (loss, grads), (ref_loss, ref_grads) in zip(got, want):
        assert loss.dtype == ref_loss.dtype and torch.equal(loss, ref_loss)
        for g, r in zip(grads, ref_grads):
            assert g.dtype == r.dtype and torch.equal(g, r)
    # the comparison can fail: the same model in plain bf16 gives another loss
    case = bench.build_case("gpt2_small", "tiny", device="cpu")
    model = case.new_model()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        plain = case.loss_fn(model(case.batches[0][0]), case.batches[0][1])
    assert not torch.equal(plain.detach(), want[0][0])


def test_compiled_delayed_scaling_writes_the_histories_the_eager_model_writes(path):
    """Inside torch.compile the delayed histories are graph inputs that the forward (input,
    weight) and the backward (grad_output) write in place: after each of 4 steps every
    linear's histories equal the eager model's bit for bit, and they moved (not all zero)."""
    case = bench.build_case("gpt2_small", "tiny", device="cpu")
    model = case.new_model()
    twin = copy.deepcopy(model)
    policy = head_in_bf16("delayed")
    torch._dynamo.reset()

    def fp8_weights(m):
        return [lin.weight for name, lin in m.named_modules() if isinstance(lin, torch.nn.Linear) and name != "head"]

    def histories(m):
        return [torch.cat([h.flatten() for h in _fp8.HISTORIES.get(w, 4)]) for w in fp8_weights(m)]

    got, want = [], []
    train(twin, policy, case, 4, compiled=torch.compile(twin, backend="aot_eager"),
          after_step=lambda: got.append(histories(twin)))
    train(model, policy, case, 4, after_step=lambda: want.append(histories(model)))
    assert len(got) == len(want) == 4 and len(got[0]) == len(fp8_weights(model)) > 0
    for step_got, step_want in zip(got, want):
        for g, w in zip(step_got, step_want):
            assert torch.equal(g, w) and bool(w.abs().sum() > 0)


def compile_in_turn_then_interleave(case, policies, backend, warmup_steps):
    """A fresh model per policy, its scopes installed and kept, compiled with ``backend`` and
    trained ``warmup_steps`` steps, one policy after the other; then every model stepped in
    turn, twice round. Returns the graphs ``backend`` had compiled before the interleaved steps."""
    runs = []
    with contextlib.ExitStack() as installed:
        for policy in policies:
            model = case.new_model()
            installed.enter_context(policy.apply(model))
            runs.append((model, policy.without_modules(), torch.compile(model, backend=backend)))
            train(model, runs[-1][1], case, warmup_steps, compiled=runs[-1][2])
        built = backend.graphs
        for model, region_policy, compiled in runs * 2:
            train(model, region_policy, case, 1, compiled=compiled)
    return built


def test_a_new_policy_compiled_later_does_not_recompile_models_compiled_before(path):
    """Two copies of the model under two fp8 policies, compiled one after the other, then
    stepped in turn (as the GPU benchmark interleaves its arms, each with its scopes kept
    installed): the second policy's traced tables must not invalidate the first's graphs."""
    case = bench.build_case("gpt2_small", "tiny", device="cpu")
    torch._dynamo.reset()
    backend = CountingBackend()
    # (named for this test: tables that no earlier test built, so that this one builds them)
    policies = [head_in_bf16(r).with_name(f"fp8_{r}_later_{path}") for r in ("tensorwise", "rowwise")]
    built = compile_in_turn_then_interleave(case, policies, backend, warmup_steps=1)
    assert built == 2 and backend.graphs == built


def test_nested_scopes_and_a_pin_on_a_compiled_model_equal_eager(path):
    """A scope inside a scope (fp8 given back, then taken again) and a pinned scope: each
    linear's rule as the eager trace shows it, and the compiled model's output and gradients
    equal the eager model's bit for bit."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Sequential(torch.nn.Linear(32, 32), torch.nn.Linear(32, 32)),
                                torch.nn.Linear(32, 16), torch.nn.Linear(16, 16))
    twin = copy.deepcopy(model)
    policy = (FP8.with_module("0", lower_precision_fp=["linear"]).with_module("0.1", fp8=["linear"])
              .with_module("2", pin="float32"))
    x = torch.randn(16, 32)
    with policy.apply(model), ampkit.trace() as tr, ampkit.autocast("cpu", policy=policy.without_modules()):
        model(x)
    assert [r.rule for r in tr.records if r.op == "linear"] == ["lower_precision_fp", "fp8", "fp8", "none"]
    torch._dynamo.reset()
    outs = []
    for m, run in ((model, model), (twin, torch.compile(twin, backend="aot_eager"))):
        with policy.apply(m), ampkit.autocast("cpu", policy=policy.without_modules()):
            y = run(x)
        y.float().sum().backward()
        outs.append((y, [p.grad for p in m.parameters()]))
    (want, want_grads), (got, got_grads) = outs
    assert got.dtype == want.dtype == torch.float32 and torch.equal(got, want)
    for g, w in zip(got_grads, want_grads):
        assert torch.equal(g, w)


def test_a_model_whose_scopes_add_tables_mid_trace_compiles_to_one_graph_as_eager(path):
    """Issue 27: each linear's scope holds its own policy, so the trace of the model builds a
    table at each scope it reaches, after earlier scopes' tables were read. One graph, no
    break, no recompile, and the eager model's losses and gradients bit for bit (before the
    fix, dynamo's snapshot of the tables lacked the new one: KeyError, the whole forward
    given up and run eagerly)."""
    policy = scope_per_linear("tensorwise", f"fp8_scope_per_linear_{path}")  # (tables no other test built)
    got, want, graphs, breaks = compiled_run("tensorwise", policy=policy)
    assert (graphs, breaks) == ([1, 1, 1], 0), counters["graph_break"]
    for (loss, grads), (ref_loss, ref_grads) in zip(got, want):
        assert loss.dtype == ref_loss.dtype and torch.equal(loss, ref_loss)
        for g, r in zip(grads, ref_grads):
            assert g.dtype == r.dtype and torch.equal(g, r)


def test_interleaved_fp8_recipes_and_a_scope_per_linear_model_never_recompile(path):
    """The GPU benchmark's arms in one process (issue 27): the tensorwise and rowwise fp8
    models and a model with a scope per linear (ampkit_fp8_auto), compiled in that order,
    then stepped in turn: no step after the warm-up compiles a graph or breaks one. Before
    the fix the third model's trace failed, dynamo gave up the models' shared forward code,
    and every model recompiled its linears frame by frame in the timed rounds."""
    case = bench.build_case("gpt2_small", "tiny", device="cpu")
    torch._dynamo.reset()
    counters.clear()
    backend = CountingBackend()
    policies = [head_in_bf16(r).with_name(f"fp8_{r}_interleaved_{path}") for r in ("tensorwise", "rowwise")]
    policies.append(scope_per_linear("tensorwise", f"fp8_scope_per_linear_interleaved_{path}"))
    built = compile_in_turn_then_interleave(case, policies, backend, warmup_steps=2)
    assert (built, backend.graphs, sum(counters["graph_break"].values())) == (3, 3, 0), counters["graph_break"]


def decoder_of_the_fp8_benchmark(device="cpu"):
    """benchmarks/gpu/fp8_speed.py's decoder16x2048 at its --smoke sizes: the GPT-2 case's
    tiny profile with two layers (every dimension a multiple of 16)."""
    case = bench.load_case(bench.spec_dir() / "gpt2_small.yaml")
    tiny = case.profiles["tiny"]
    prof = {**tiny, "sizes": {**tiny["sizes"], "n_layers": 2}, "num_batches": 2}
    case = dataclasses.replace(case, profiles={**case.profiles, "decoder": prof})
    return bench.build_case(case, "decoder", device=device)


def train_step_run(case, policy, steps, compile, capture=False):
    """Losses and final parameters of ``steps`` calls of make_train_step (fused AdamW, the
    case's loss, the policy's scopes installed, its tables as the region's policy)."""
    model = case.new_model()
    opt = case.new_optimizer(model, fused=True)
    with policy.apply(model):
        step = ampkit.make_train_step(model, case.loss_fn, opt, capture=capture, compile=compile, autocast=dict(
            device_type=case.device, dtype=torch.bfloat16, policy=policy.without_modules()))
        losses = [step(*case.batches[i % len(case.batches)]) for i in range(steps)]
    return losses, [p.detach().clone() for p in model.parameters()], step


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise", "delayed"])
def test_the_compiled_fp8_train_step_trains_as_the_eager_fp8_step_bit_for_bit(recipe, path):
    """make_train_step(compile=...) with the fp8 benchmark's policy (the head kept in bf16 by a
    scope) on its decoder: the model and the loss compiled into one graph (aot_eager: the same
    ATen kernels as eager), no graph break, and over 3 steps the eager fp8 step's losses and
    parameters bit for bit."""
    case = decoder_of_the_fp8_benchmark()
    policy = head_in_bf16(recipe)
    torch._dynamo.reset()
    counters.clear()
    backend = CountingBackend()
    got, got_params, step = train_step_run(case, policy, 3, compile=dict(backend=backend))
    breaks = dict(counters["graph_break"])
    want, want_params, _ = train_step_run(case, policy, 3, compile=None)
    assert step.compiled and step.compile_reason is None
    assert (backend.graphs, breaks) == (1, {}), breaks
    for loss, ref in zip(got, want):
        assert loss.dtype == ref.dtype and torch.equal(loss, ref)
    for p, ref in zip(got_params, want_params):
        assert p.dtype == ref.dtype and torch.equal(p, ref)
    # the comparison can fail: the same compiled step without fp8 (the head's bf16 everywhere)
    plain, _, _ = train_step_run(case, FP8.with_ops(lower_precision_fp=["linear"]), 1,
                                 compile=dict(backend="aot_eager"))
    assert not torch.equal(plain[0], want[0])


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 9),
                    reason="needs a CUDA GPU with fp8 (capability >= 8.9)")
@pytest.mark.parametrize("recipe", ["tensorwise", "delayed"])
def test_the_compiled_captured_fp8_step_equals_the_compiled_eager_fp8_step_on_cuda(recipe):
    """make_train_step(compile=True) with the fp8 benchmark's policy on its decoder: captured
    (the warm-up's 3 eager steps, then replays) against capture=False, each step compiling the
    same inductor kernels: losses and parameters over 8 steps bit for bit, and the fp8 calls
    took _scaled_mm."""
    case = decoder_of_the_fp8_benchmark("cuda")
    policy = head_in_bf16(recipe)
    runs = {}
    for capture in (False, True):
        torch._dynamo.reset()
        runs[capture] = train_step_run(case, policy, 8, compile=True, capture=capture)
    (want, want_params, eager), (got, got_params, step) = runs[False], runs[True]
    assert step.compiled and eager.compiled and step.replays == 5 and step.captured, step
    for loss, ref in zip(got, want):
        assert torch.equal(loss, ref), (got, want)
    for p, ref in zip(got_params, want_params):
        assert torch.equal(p, ref)
    model = case.new_model()
    with policy.apply(model), ampkit.trace() as tr, ampkit.autocast("cuda", policy=policy.without_modules()):
        model(case.batches[0][0])
    assert {r.fp8_path for r in tr.records if r.rule == "fp8"} == {"scaled_mm"}


def test_a_delayed_weight_that_is_not_a_parameter_runs_eagerly_inside_compile_as_eager():
    """Delayed scaling of a weight the compiled function makes itself (a leaf, not a
    parameter: another tensor at each call, with fresh histories): the fp8 call runs eagerly
    at a graph break, and each call's output equals the uncompiled function's bit for bit."""
    policy = ampkit.load_policy("torch_default").with_ops("cpu", fp8=["mm"]).with_fp8_recipe(
        scaling="delayed", amax_history=4)

    def f(x):
        return torch.mm(x, torch.linspace(-1, 1, 256).reshape(16, 16))

    torch._dynamo.reset()
    counters.clear()
    compiled = torch.compile(f, backend="aot_eager")
    torch.manual_seed(0)
    for _ in range(3):
        x = torch.randn(16, 16)
        with ampkit.autocast("cpu", policy=policy):
            got, want = compiled(x), f(x)
        assert got.dtype == want.dtype == torch.bfloat16 and torch.equal(got, want)
    reasons = list(counters["graph_break"])
    assert len(reasons) == 1 and "_apply_eagerly" in reasons[0], reasons
