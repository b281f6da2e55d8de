"""make_train_step(..., compile=...) on CPU: the compiled eager step against the same step
written by hand over torch.compile of the model and the loss in one module (what the step
compiles: the oracle runs the same compiled kernels), bit for bit; a call that raises still changes nothing; what torch cannot compile runs
uncompiled; bad arguments raise at construction.

Each inductor compile costs tens of seconds on a small CPU: the models are tiny, and only
three tests compile with inductor (the others use backends that fail at once or
aot_eager, which compiles nothing).
"""

import warnings

import pytest
import torch
import torch._dynamo

import ampkit
from traps import Boom, Once, UpdateFailsOnce, poisoned_batches
from conftest import compiles_correctly_here

AC = dict(device_type="cpu", dtype=torch.float16)  # float16: the scaler is on
INF_STEPS = {2}
NAN_STEPS = {4}
N_STEPS = 6


@pytest.fixture(autouse=True)
def fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def make_model(seed=0):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))


def make_batches(n=N_STEPS, poison=True, seed=1):
    return poisoned_batches(n, 6, 8, 4, INF_STEPS if poison else (), NAN_STEPS if poison else (), seed)


def make_scaler():
    return ampkit.GradScaler("cpu", init_scale=2.0**10, growth_interval=2)


def make_opt(model):
    return torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True)


def assert_bitwise(a, b):
    torch.testing.assert_close(a, b, rtol=0, atol=0, equal_nan=True)


def params_and_state(model, opt):
    state = [v for s in opt.state.values() for v in s.values() if isinstance(v, torch.Tensor)]
    return [p.detach().clone() for p in model.parameters()] + [v.clone() for v in state]


class ForwardAndLoss(torch.nn.Module):
    """The oracle's compiled unit, written here: the model's forward, then the loss."""

    def __init__(self, model, loss_fn):
        super().__init__()
        self.model, self.loss_fn = model, loss_fn

    def forward(self, inputs, targets):
        return self.loss_fn(self.model(*inputs), *targets)


def test_the_compiled_eager_step_equals_the_hand_loop_over_the_compiled_model_and_loss_bitwise():
    compiles_correctly_here("cpu")
    batches = make_batches()
    ref_model = make_model()
    ref_opt, ref_scaler = make_opt(ref_model), make_scaler()
    compiled = torch.compile(ForwardAndLoss(ref_model, torch.nn.functional.mse_loss))
    ref_losses, ref_scales = [], []
    for x, y in batches:
        ref_opt.zero_grad()
        with ampkit.autocast(**AC):
            loss = compiled([x], [y])
        ref_scaler.scale(loss).backward()
        ref_scaler.step(ref_opt)
        ref_scaler.update()
        ref_losses.append(loss.detach())
        ref_scales.append(ref_scaler.get_scale())
    torch._dynamo.reset()

    model = make_model()
    opt = make_opt(model)
    step = ampkit.make_train_step(model, torch.nn.functional.mse_loss, opt, scaler=make_scaler(),
                                  autocast=AC, capture=False, compile=True)
    assert step.compiled and step.compile_reason is None
    losses, scales = [], []
    for x, y in batches:
        losses.append(step(x, y))
        scales.append(step.scaler.get_scale())

    assert step.compiled and step.model is model
    assert_bitwise(losses, ref_losses)
    assert scales == ref_scales
    assert_bitwise(params_and_state(model, opt), params_and_state(ref_model, ref_opt))
    stats = step.scaler.stats()
    assert stats == ref_scaler.stats() and stats.skipped == len(INF_STEPS | NAN_STEPS)


def _everything(model, opt, step):
    return dict(params=params_and_state(model, opt),
                grads=[None if p.grad is None else p.grad.clone() for p in model.parameters()],
                scaler=step.scaler.state_dict(), stages=step.scaler.stage(opt), step=repr(step),
                compiled=step.compiled)


def _assert_same(a, b):
    assert_bitwise(a["params"], b["params"])
    assert [g is None for g in a["grads"]] == [g is None for g in b["grads"]]
    assert_bitwise([g for g in a["grads"] if g is not None],
                   [g for g in b["grads"] if g is not None])
    for key in ("scaler", "stages", "step", "compiled"):
        assert a[key] == b[key], key


def test_a_compiled_call_that_raises_changes_nothing_and_the_run_goes_on():
    """A fault in the backward (a gradient hook, run by the compiled backward's caller) at
    one call and in the scaler's update (after the optimizer wrote) at another: each call
    leaves everything bitwise as before, and the retried run equals the run in which
    nothing raised, still compiled."""
    compiles_correctly_here("cpu")
    batches = make_batches()

    def build():
        traps = dict(backward=Once(), scaler_update=Once())
        model = make_model()
        model[0].weight.register_hook(lambda g: traps["backward"].fire())
        scaler = UpdateFailsOnce("cpu", init_scale=2.0**10, growth_interval=2)
        scaler.trap = traps["scaler_update"]
        opt = make_opt(model)
        step = ampkit.make_train_step(model, torch.nn.functional.mse_loss, opt, scaler=scaler,
                                      autocast=AC, capture=False, compile=True)
        return traps, model, opt, step

    _, ref_model, ref_opt, ref_step = build()
    ref_losses = [ref_step(x, y) for x, y in batches]

    traps, model, opt, step = build()
    fail_at = {1: "backward", 3: "scaler_update"}
    losses = []
    for i, (x, y) in enumerate(batches):
        if i in fail_at:
            before = _everything(model, opt, step)
            trap = traps[fail_at[i]]
            trap.armed = True
            with pytest.raises(Boom):
                step(x, y)
            assert not trap.armed  # the fault did fire inside the call
            _assert_same(_everything(model, opt, step), before)
        losses.append(step(x, y))

    assert step.compiled
    assert_bitwise(losses, ref_losses)
    _assert_same(_everything(model, opt, step), _everything(ref_model, ref_opt, ref_step))


def _failing_backend(gm, example_inputs):
    raise RuntimeError("this backend compiles nothing")


class _GraphBreak(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.inner = make_model()

    def forward(self, x):
        torch._dynamo.graph_break()  # (fullgraph=True cannot hold it)
        return self.inner(x)


@pytest.mark.parametrize("compile, make, cause", [
    (dict(backend=_failing_backend), make_model, "BackendCompilerFailed"),
    (dict(fullgraph=True, backend="eager"), _GraphBreak, "Unsupported"),
], ids=["backend_fails", "fullgraph_breaks"])
def test_what_torch_cannot_compile_runs_uncompiled_with_one_warning(compile, make, cause):
    batches = make_batches()
    ref_model = make()
    ref_opt = torch.optim.SGD(ref_model.parameters(), lr=0.1)
    ref = ampkit.make_train_step(ref_model, torch.nn.functional.mse_loss, ref_opt,
                                 scaler=make_scaler(), autocast=AC, capture=False)
    ref_losses = [ref(x, y) for x, y in batches]

    model = make()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    step = ampkit.make_train_step(model, torch.nn.functional.mse_loss, opt, scaler=make_scaler(),
                                  autocast=AC, capture=False, compile=compile)
    assert step.compiled
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        losses = [step(x, y) for x, y in batches]
    messages = [str(w.message) for w in caught if "uncompiled" in str(w.message)]
    assert len(messages) == 1 and cause in messages[0], messages
    assert not step.compiled and cause in step.compile_reason
    assert step.calls == len(batches)  # the failed first attempt was put back, not counted
    assert_bitwise(losses, ref_losses)
    assert_bitwise(params_and_state(model, opt), params_and_state(ref_model, ref_opt))
    assert step.scaler.stats() == ref.scaler.stats()


def _parts():
    model = make_model()
    return model, torch.nn.functional.mse_loss, torch.optim.SGD(model.parameters(), lr=0.1)


@pytest.mark.parametrize("compile, capture, error, match", [
    (1, "auto", TypeError, r"compile=1 is not valid; use None or False .*True .*dict"),
    ("default", "auto", TypeError, r"compile='default' is not valid"),
    (dict(mode="reduce-overhead"), "auto", ValueError,
     r"mode='reduce-overhead' records CUDA graphs of its own.*'max-autotune-no-cudagraphs' or "
     r"the default mode"),
    (dict(mode="max-autotune"), True, ValueError,
     r"mode='max-autotune' records CUDA graphs.*'max-autotune-no-cudagraphs'"),
    (dict(options={"triton.cudagraphs": True}), "auto", ValueError,
     r"options=\{'triton.cudagraphs': True\} records CUDA graphs"),
    (dict(backend="cudagraphs"), "auto", ValueError, r"backend='cudagraphs' records CUDA graphs"),
    (dict(fullgraf=True), False, ValueError,
     r"unknown torch.compile argument\(s\) \['fullgraf'\]; valid: \[.*'fullgraph'"),
    (dict(mode="fastest"), False, ValueError, r"compile=\{'mode': 'fastest'\}.*fastest"),
], ids=["int", "str", "reduce_overhead", "max_autotune", "cudagraphs_option",
        "cudagraphs_backend", "unknown_key", "unknown_mode"])
def test_bad_compile_arguments_raise_at_construction(compile, capture, error, match):
    model, loss_fn, opt = _parts()
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(error, match=match):
        ampkit.make_train_step(model, loss_fn, opt, autocast=AC, capture=capture,
                               compile=compile)
    assert_bitwise(list(model.parameters()), before)  # nothing ran
    assert not isinstance(model, torch._dynamo.eval_frame.OptimizedModule)


def test_modes_with_their_own_cuda_graphs_are_allowed_when_the_step_never_captures():
    model, loss_fn, opt = _parts()
    step = ampkit.make_train_step(model, loss_fn, opt, autocast=AC, capture=False,
                                  compile=dict(mode="reduce-overhead"))
    assert step.compiled


def test_an_already_compiled_model_with_compile_raises():
    model, loss_fn, opt = _parts()
    with pytest.raises(ValueError, match=r"already compiled .*compile=None"):
        ampkit.make_train_step(torch.compile(model), loss_fn, opt, autocast=AC, compile=True)


def test_without_compile_the_step_runs_the_model_as_given():
    model, loss_fn, opt = _parts()
    for compile in (None, False):
        step = ampkit.make_train_step(model, loss_fn, opt, autocast=AC, capture=False,
                                      compile=compile)
        assert not step.compiled and step.compile_reason is None
        assert step.autocast == dict(AC)  # the cast cache as asked (torch's default)


def _policy_run(how, compile):
    """Losses and the dtype of the model's output under a changed policy (linear in float32)
    or a module scope (the last layer pinned to float32); dynamo starts empty, as in a new
    process, so the step's region is entered before anything was compiled."""
    torch._dynamo.reset()
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    dtypes = []

    def loss_fn(out, y):
        dtypes.append(out.dtype)
        return torch.nn.functional.mse_loss(out.float(), y)

    base = ampkit.load_policy("torch_default")
    ac = dict(device_type="cpu", dtype=torch.bfloat16)
    if how == "policy":
        ac["policy"] = base.with_ops("cpu", fp32=["linear"])
    step = ampkit.make_train_step(model, loss_fn, opt, autocast=ac, capture=False, compile=compile)
    scope = base.with_module("2", pin="float32").apply(model) if how == "scope" else None
    try:
        losses = [step(x, y) for x, y in make_batches(n=3, poison=False)]
    finally:
        if scope is not None:
            scope.remove()
    return losses, dtypes, step.compiled


@pytest.mark.parametrize("how, compile", [("policy", True), ("scope", dict(backend="aot_eager"))],
                         ids=["policy", "scope"])
def test_the_policy_and_module_scopes_hold_inside_the_compiled_model(how, compile):
    """The casts a changed policy or a module scope asks for must be in the compiled graph
    (the model's output is float32, where it is bfloat16 without them), from the first call
    of a process that had compiled nothing. Values: inductor's kernels (the policy case, the
    third inductor compile here) agree with eager to rounding; dynamo's aot_eager backend
    (the scope case) runs the traced forward with torch's eager kernels, so its first loss
    is the uncompiled step's bit for bit (its backward is AOTAutograd's own)."""
    compiles_correctly_here("cpu")
    losses, dtypes, compiled = _policy_run(how, None)
    c_losses, c_dtypes, c_compiled = _policy_run(how, compile)
    assert (compiled, c_compiled) == (False, True)
    assert dtypes == c_dtypes == [torch.float32] * 3  # (bfloat16 without the change)
    torch.testing.assert_close(c_losses, losses, rtol=1e-3, atol=0)
    if how == "scope":
        assert_bitwise(c_losses[0], losses[0])
