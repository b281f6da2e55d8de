"""make_train_step on CPU: the eager fallback against a hand-written AMP loop, bit for bit.

The control is the loop a user would write with ampkit.autocast + ampkit.GradScaler; the
step object must give the same losses, parameters, optimizer state, scale trajectory and
skipped steps, with infs and NaNs injected at known steps through the targets.
"""

import copy
import gc
import signal
import threading
import warnings

import pytest
import torch

import ampkit
from traps import Boom, Once, UpdateFailsOnce, poisoned_batches
from ampkit._train_step import _optimizer_refusals
from torch.optim.optimizer import register_optimizer_step_post_hook

AC = dict(device_type="cpu", dtype=torch.bfloat16)
INF_STEPS = {3, 7, 8}
NAN_STEPS = {12}
N_STEPS = 16


def make_model(seed=0):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 8))


def make_batches(n=N_STEPS, poison=True, seed=1):
    return poisoned_batches(n, 12, 16, 8, INF_STEPS if poison else (), NAN_STEPS if poison else (), seed)


OPTIMIZERS = {
    "sgd": lambda p: torch.optim.SGD(p, lr=0.05),
    "sgd_momentum_wd": lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9, weight_decay=1e-3),
    "sgd_fused": lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9, fused=True),
    "adam": lambda p: torch.optim.Adam(p, lr=1e-3),
    "adamw_fused": lambda p: torch.optim.AdamW(p, lr=1e-3, fused=True),
}


def make_scaler():
    # A small growth interval so that the trajectory grows as well as backs off.
    return ampkit.GradScaler("cpu", init_scale=2.0**10, growth_interval=3)


def snapshot(model):
    return [p.detach().clone() for p in model.parameters()]


def hand_step(model, opt, scaler, x, y, ac=None, loss_fn=torch.nn.functional.mse_loss):
    """One step of the hand-written AMP loop (the oracle): returns the loss, detached."""
    opt.zero_grad()
    with ampkit.autocast(**(AC if ac is None else ac)):
        loss = loss_fn(model(x), y)
    scaler.scale(loss).backward()
    scaler.step(opt)
    scaler.update()
    return loss.detach()


def run_hand_loop(model, opt, scaler, batches, loss_fn=torch.nn.functional.mse_loss):
    losses, scales, skipped = [], [], []
    for i, (x, y) in enumerate(batches):
        before = snapshot(model)
        losses.append(hand_step(model, opt, scaler, x, y, loss_fn=loss_fn))
        scales.append(scaler.get_scale())
        if all(torch.equal(a, b) for a, b in zip(before, model.parameters())):
            skipped.append(i)
    return losses, scales, skipped


def run_step(step, model, batches):
    losses, scales, skipped = [], [], []
    for i, (x, y) in enumerate(batches):
        before = snapshot(model)
        losses.append(step(x, y))
        scales.append(step.scaler.get_scale())
        if all(torch.equal(a, b) for a, b in zip(before, model.parameters())):
            skipped.append(i)
    return losses, scales, skipped


def assert_bitwise(a, b):
    torch.testing.assert_close(a, b, rtol=0, atol=0, equal_nan=True)


def optimizer_state_tensors(opt):
    return [v for s in opt.state.values() for v in s.values() if isinstance(v, torch.Tensor)]


@pytest.mark.parametrize("poison", [False, True], ids=["clean", "inf_nan"])
@pytest.mark.parametrize("opt_name", sorted(OPTIMIZERS))
def test_eager_step_equals_hand_loop_bitwise(opt_name, poison):
    batches = make_batches(poison=poison)
    ref_model = make_model()
    ref_opt = OPTIMIZERS[opt_name](ref_model.parameters())
    ref_scaler = make_scaler()
    ref = run_hand_loop(ref_model, ref_opt, ref_scaler, batches)

    model = make_model()
    opt = OPTIMIZERS[opt_name](model.parameters())
    step = ampkit.make_train_step(model, torch.nn.functional.mse_loss, opt,
                                  scaler=make_scaler(), autocast=AC, capture=False)
    got = run_step(step, model, batches)

    for a, b in zip(got[0], ref[0]):
        assert_bitwise(a, b)
    assert got[1] == ref[1]  # scale trajectory, exactly
    assert got[2] == ref[2]
    expected_skips = sorted(INF_STEPS | NAN_STEPS) if poison else []
    assert ref[2] == expected_skips
    for p, q in zip(model.parameters(), ref_model.parameters()):
        assert_bitwise(p, q)
        assert_bitwise(p.grad, q.grad)
    for s, t in zip(optimizer_state_tensors(opt), optimizer_state_tensors(ref_opt)):
        assert_bitwise(s, t)
    st, rt = step.scaler.stats(), ref_scaler.stats()
    assert (st.steps, st.skipped, st.last_skipped) == (rt.steps, rt.skipped, rt.last_skipped)
    assert st.skipped == len(expected_skips)
    if poison:  # the scale did back off, so the comparison above had something to see
        assert min(ref[1]) < 2.0**10


def test_default_scaler_and_autocast_follow_the_device():
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    step = ampkit.make_train_step(model, torch.nn.functional.mse_loss, opt, capture=False)
    # CPU parameters: bfloat16 autocast, which needs no loss scaling.
    assert step.autocast == dict(device_type="cpu", dtype=torch.bfloat16)
    assert isinstance(step.scaler, ampkit.GradScaler) and not step.scaler.is_enabled()
    batches = make_batches(n=4, poison=False)
    got = [step(x, y) for x, y in batches]

    ref_model = make_model()
    ref_opt = torch.optim.SGD(ref_model.parameters(), lr=0.05)
    for (x, y), loss in zip(batches, got):
        ref_opt.zero_grad()
        with ampkit.autocast("cpu", dtype=torch.bfloat16):
            ref = torch.nn.functional.mse_loss(ref_model(x), y)
        ref.backward()
        ref_opt.step()
        assert_bitwise(loss, ref.detach())
    for p, q in zip(model.parameters(), ref_model.parameters()):
        assert_bitwise(p, q)


def test_tuple_inputs_and_targets_are_unpacked():
    class Two(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = torch.nn.Linear(4, 3), torch.nn.Linear(5, 3)

        def forward(self, x, z):
            return self.a(x) + self.b(z)

    def loss_fn(out, y, w):
        return ((out.float() - y) ** 2 * w).mean()

    torch.manual_seed(0)
    model = Two()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    step = ampkit.make_train_step(model, loss_fn, opt, autocast=AC, capture=False)
    x, z, y, w = torch.randn(6, 4), torch.randn(6, 5), torch.randn(6, 3), torch.rand(6, 3)
    loss = step((x, z), [y, w])
    torch.manual_seed(0)
    ref_model = Two()
    with ampkit.autocast(**AC):
        ref = loss_fn(ref_model(x, z), y, w)
    assert_bitwise(loss, ref.detach())


def test_auto_on_cpu_warns_once_with_the_reason():
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        step = ampkit.make_train_step(model, torch.nn.functional.mse_loss, opt, autocast=AC)
        for x, y in make_batches(n=5, poison=False):
            step(x, y)
    ours = [w for w in caught if "make_train_step" in str(w.message)]
    assert len(ours) == 1
    assert "'cpu'" in str(ours[0].message) and "CUDA graphs need 'cuda'" in str(ours[0].message)
    assert ours[0].filename == __file__  # points at the caller, not at ampkit
    assert step.captured is False
    assert step.reason == "autocast device_type is 'cpu'; CUDA graphs need 'cuda'"
    assert step.calls == 5 and step.replays == 0 and step.captures == 0


def test_auto_equals_capture_false_on_cpu():
    batches = make_batches()
    results = []
    for capture in ("auto", False):
        model = make_model()
        opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            step = ampkit.make_train_step(model, torch.nn.functional.mse_loss, opt,
                                          scaler=make_scaler(), autocast=AC, capture=capture)
        results.append((run_step(step, model, batches), snapshot(model)))
    (a, pa), (b, pb) = results
    assert a[1] == b[1] and a[2] == b[2]
    for x, y in zip(a[0] + pa, b[0] + pb):
        assert_bitwise(x, y)


def test_capture_false_does_not_warn():
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        step = ampkit.make_train_step(model, torch.nn.functional.mse_loss, opt,
                                      autocast=AC, capture=False)
        step(*make_batches(n=1, poison=False)[0])
    assert step.reason == "capture=False was passed"


def test_capture_true_on_cpu_raises_with_the_reason():
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    with pytest.raises(RuntimeError, match=r"capture=True.*CUDA graphs need 'cuda'"):
        ampkit.make_train_step(model, torch.nn.functional.mse_loss, opt, autocast=AC,
                               capture=True)


def _params():
    return [torch.nn.Parameter(torch.zeros(2))]


@pytest.mark.parametrize("make, scaling, expected", [
    (lambda: torch.optim.SGD(_params(), lr=0.1), True, "fused=True"),
    (lambda: torch.optim.SGD(_params(), lr=0.1), False, None),
    (lambda: torch.optim.SGD(_params(), lr=0.1, fused=True), True, None),
    (lambda: torch.optim.Adam(_params(), fused=True), True, "capturable=True"),
    (lambda: torch.optim.Adam(_params(), fused=True, capturable=True), True, None),
    (lambda: torch.optim.AdamW(_params(), capturable=True), True, "fused=True"),
    (lambda: torch.optim.AdamW(_params(), capturable=True), False, None),
    (lambda: torch.optim.AdamW(_params()), False, "capturable=True"),
    (lambda: torch.optim.Adagrad(_params()), False, "no capturable path"),
], ids=["sgd", "sgd_unscaled", "sgd_fused", "adam_fused_noncapturable", "adam_fused_capturable",
        "adamw_capturable_scaled", "adamw_capturable_unscaled", "adamw_plain_unscaled",
        "adagrad"])
def test_optimizer_refusal_reasons(make, scaling, expected):
    reasons = _optimizer_refusals(make(), ampkit.GradScaler("cpu", enabled=scaling))
    if expected is None:
        assert reasons == []
    else:
        assert len(reasons) == 1 and expected in reasons[0]


# -- bad input -------------------------------------------------------------------------------
def _parts():
    model = make_model()
    return model, torch.nn.functional.mse_loss, torch.optim.SGD(model.parameters(), lr=0.1)


@pytest.mark.parametrize("change, error, match", [
    (dict(model=lambda x: x), TypeError, "model must be a torch.nn.Module"),
    (dict(loss_fn="mse"), TypeError, "loss_fn must be callable"),
    (dict(optimizer="sgd"), TypeError, "optimizer must be a torch.optim.Optimizer"),
    (dict(capture="yes"), ValueError, "capture='yes' is not valid"),
    (dict(capture=1), ValueError, "capture=1 is not valid"),
    (dict(warmup=0), ValueError, "warmup=0 is not valid"),
    (dict(warmup=2.0), TypeError, "warmup must be an int"),
    (dict(autocast="cpu"), TypeError, "autocast must be a dict"),
    (dict(autocast=dict(device_type="cpu", dtyp=torch.bfloat16)), ValueError,
     r"unknown autocast key\(s\) \['dtyp'\]"),
    (dict(autocast=dict(device_type="tpu")), ValueError, "device_type='tpu' is not valid"),
    (dict(scaler=torch.amp.GradScaler("cpu")), TypeError, "scaler must be an ampkit.GradScaler"),
])
def test_bad_arguments_raise_clearly(change, error, match):
    model, loss_fn, opt = _parts()
    kw = dict(model=model, loss_fn=loss_fn, optimizer=opt, autocast=AC, capture=False)
    kw.update(change)
    with pytest.raises(error, match=match):
        ampkit.make_train_step(kw.pop("model"), kw.pop("loss_fn"), kw.pop("optimizer"), **kw)


def test_bad_batches_raise_clearly_and_change_nothing():
    model, loss_fn, opt = _parts()
    step = ampkit.make_train_step(model, loss_fn, opt, autocast=AC, capture=False)
    before = snapshot(model)
    with pytest.raises(TypeError, match=r"inputs must be a torch.Tensor.*got str"):
        step("batch", torch.zeros(2, 8))
    with pytest.raises(TypeError, match=r"inputs\[0\] must be a torch.Tensor.*got list"):
        step([[1.0, 2.0]], torch.zeros(2, 8))
    with pytest.raises(TypeError, match=r"targets\[1\] must be a torch.Tensor.*got int"):
        step(torch.zeros(2, 16), (torch.zeros(2, 8), 3))
    for a, b in zip(before, model.parameters()):
        assert torch.equal(a, b)
    assert step.calls == 0


def test_non_scalar_loss_raises():
    model, _, opt = _parts()
    step = ampkit.make_train_step(model, lambda out, y: (out.float() - y) ** 2, opt,
                                  autocast=AC, capture=False)
    with pytest.raises(ValueError, match=r"scalar tensor, got shape \(12, 8\)"):
        step(*make_batches(n=1, poison=False)[0])


def test_an_aborted_capture_leaves_the_scaler_ready_for_the_eager_step():
    """After a failed capture the iteration's half-done scaler stages are forgotten through
    the scaler's public reset, and the eager step that follows runs as a first step would."""
    model, loss_fn, _ = _parts()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)  # it has state to forget
    step = ampkit.make_train_step(model, loss_fn, opt, scaler=make_scaler(), autocast=AC,
                                  capture=False)
    x, y = make_batches(n=1, poison=False)[0]
    state_before = set(opt.state)
    with ampkit.autocast(**AC):  # an iteration abandoned after step(), before update()
        step.scaler.scale(loss_fn(model(x), y)).backward()
    step.scaler.step(opt)
    assert step.scaler.stage(opt) is ampkit._scaler.OptState.STEPPED
    assert set(opt.state) != state_before
    step._after_failed_capture(state_before)
    assert step.scaler.stage(opt) is ampkit._scaler.OptState.READY
    assert all(p.grad is None for p in model.parameters())
    assert set(opt.state) == state_before  # state born in the aborted capture is dropped
    step(x, y)  # would raise "step() was already called" without the reset
    assert step.scaler.stats().steps == 1
    assert set(opt.state) == set(model.parameters())


# -- a call that raises changes nothing ----------------------------------------------------
FP16 = dict(device_type="cpu", dtype=torch.float16)  # the scaler is on for float16
FAIL_AT = 4  # the call that raises once (after warm optimizer state and a grown scale)


def _bn_model(seed=0):
    torch.manual_seed(seed)
    # BatchNorm: the forward changes buffers, which a failed call must put back too.
    return torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.BatchNorm1d(32),
                               torch.nn.ReLU(), torch.nn.Linear(32, 8))


def _failing_step(where, opt_name, trap):
    model = _bn_model()
    opt = OPTIMIZERS[opt_name](model.parameters())
    if where == "scaler_update":
        scaler = UpdateFailsOnce("cpu", init_scale=2.0**10, growth_interval=3)
        scaler.trap = trap
    else:  # ampkit's own: the step checks the optimizer instead of copying (rollback_copy)
        scaler = ampkit.GradScaler("cpu", init_scale=2.0**10, growth_interval=3)

    def loss_fn(out, y):
        if where == "loss":
            trap.fire()
        return torch.nn.functional.mse_loss(out, y)

    if where == "forward":
        model[1].register_forward_hook(lambda *a: trap.fire())
    if where == "backward":
        model[0].weight.register_hook(lambda g: trap.fire())
    real_step = opt.step
    if where == "optimizer_step_before":
        opt.step = lambda *a, **k: (trap.fire(), real_step(*a, **k))[1]
    if where == "optimizer_step_after":  # the update is applied, then the step raises
        opt.step = lambda *a, **k: (real_step(*a, **k), trap.fire())[0]
    if where == "optimizer_post_hook":  # the same through torch's hook
        opt.register_step_post_hook(lambda *a: trap.fire())
    step = ampkit.make_train_step(model, loss_fn, opt, scaler=scaler, autocast=FP16,
                                  capture=False)
    return model, opt, step


def _everything(model, opt, step):
    return dict(
        params=[p.detach().clone() for p in model.parameters()],
        grads=[None if p.grad is None else p.grad.clone() for p in model.parameters()],
        buffers=[b.clone() for b in model.buffers()],
        state={i: {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in s.items()}
               for i, s in enumerate(opt.state.values())},
        scaler=step.scaler.state_dict(),
        stages=step.scaler.stage(opt),
        step=repr(step),
    )


def _assert_same(a, b):
    assert a.keys() == b.keys()
    assert_bitwise(a["params"], b["params"])
    assert_bitwise(a["buffers"], b["buffers"])
    assert [g is None for g in a["grads"]] == [g is None for g in b["grads"]]
    assert_bitwise([g for g in a["grads"] if g is not None],
                   [g for g in b["grads"] if g is not None])
    assert a["state"].keys() == b["state"].keys()
    for i in a["state"]:
        assert a["state"][i].keys() == b["state"][i].keys()
        for k in a["state"][i]:
            assert_bitwise(a["state"][i][k], b["state"][i][k])
    for key in ("scaler", "stages", "step"):
        assert a[key] == b[key], key


# Where a fault is injected, and whether the step must copy the parameters and the
# optimizer state to put them back (the code that raises runs after the optimizer wrote,
# or may), or checks instead (the fault comes before the optimizer step).
WHERE_COPIES = {"forward": False, "loss": False, "backward": False,
                "optimizer_step_before": True, "optimizer_step_after": True,
                "optimizer_post_hook": True, "scaler_update": True}


@pytest.mark.parametrize("opt_name", ["sgd_momentum_wd", "sgd_fused", "adam", "adamw_fused"])
@pytest.mark.parametrize("where", list(WHERE_COPIES))
def test_a_call_that_raises_changes_nothing_and_the_run_goes_on_as_a_clean_one(where, opt_name):
    """Fault injected once at call FAIL_AT: that call leaves parameters, gradients, buffers,
    optimizer state, scaler and step object bitwise as before; retrying the batch and
    going on gives exactly the run in which nothing ever raised. Where the fault runs
    after the optimizer may have written (a replaced step, a hook, a scaler subclass), the
    step copied what it writes; elsewhere it checked the optimizer and copied nothing."""
    batches = make_batches(n=8)  # infs at 3 and 7: skips and back-offs around the fault
    clean_trap = Once()
    ref_model, ref_opt, ref_step = _failing_step(where, opt_name, clean_trap)
    ref_losses = [ref_step(x, y) for x, y in batches]

    trap = Once()
    model, opt, step = _failing_step(where, opt_name, trap)
    losses = []
    for i, (x, y) in enumerate(batches):
        if i == FAIL_AT:
            before = _everything(model, opt, step)
            trap.armed = True
            with pytest.raises(Boom):
                step(x, y)
            assert not trap.armed  # the fault did fire inside the call
            _assert_same(_everything(model, opt, step), before)
            assert (step.rollback_copy is not None) == WHERE_COPIES[where], step.rollback_copy
        losses.append(step(x, y))

    assert_bitwise(losses, ref_losses)
    _assert_same(_everything(model, opt, step), _everything(ref_model, ref_opt, ref_step))
    assert step.scaler.stats() == ref_step.scaler.stats()


class _LinearAndEmbedding(torch.nn.Module):
    """Two param groups' worth of parameters: a Linear, and an Embedding whose gradient is
    sparse when ``emb.sparse`` is set."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.lin = torch.nn.Linear(16, 8)
        self.emb = torch.nn.Embedding(16, 8)

    def forward(self, x):
        return self.lin(x).float() + self.emb(x.argmax(dim=1)).float()


def _two_groups(model):
    # foreach on the CPU too: torch refuses a tensor lr there only when it reaches group 2
    return torch.optim.Adam([{"params": model.lin.parameters()}, {"params": model.emb.parameters()}],
                            lr=1e-2, foreach=True)


def _half_way(why, model, opt):
    """Make torch's Adam raise at group 2, after it stepped group 1; returns the undo."""
    if why == "tensor_lr":
        opt.param_groups[1]["lr"] = torch.tensor(1e-2)
        return lambda: opt.param_groups[1].update(lr=1e-2)
    if why == "sparse_gradient":
        model.emb.sparse = True
        return lambda: setattr(model.emb, "sparse", False)
    if why == "state_replaced":  # one state tensor swapped for another dtype's, in the same dict
        s = opt.state[model.emb.weight]
        kept = s["exp_avg"]
        s["exp_avg"] = kept.double()
        return lambda: s.update(exp_avg=kept)
    if why == "state_data_retyped":  # the same state tensor, its .data of another dtype
        kept = opt.state[model.emb.weight]["exp_avg"]
        data = kept.data
        kept.data = data.double()
        return lambda: setattr(kept, "data", data)
    model.emb.double()  # its parameter and gradient (exactly), not its Adam state
    return model.emb.float


HALF_WAY = {"tensor_lr": "lr as a Tensor is not supported", "sparse_gradient": "does not support sparse",
            "state_of_another_dtype": "expected dtype float", "state_replaced": "expected dtype double",
            "state_data_retyped": "expected dtype double"}


@pytest.mark.parametrize("why", sorted(HALF_WAY))
def test_a_torch_optimizer_that_raises_half_way_changes_nothing(why):
    """torch's own Adam raising at its second param group, after the first was stepped (a
    tensor lr with foreach, a sparse gradient, a parameter or a state tensor changed
    between calls): the step saw it coming although its verdict from the calls before
    (no copy needed) is kept between calls, copied, and put everything back; the run then goes on bitwise as the one without it. The control, a
    hand-written step with the same Adam, shows that the raise does come half-way."""
    batches = make_batches(n=8)
    ref_model = _LinearAndEmbedding()
    ref_step = ampkit.make_train_step(ref_model, torch.nn.functional.mse_loss, _two_groups(ref_model),
                                      scaler=make_scaler(), autocast=FP16, capture=False)
    ref_losses = [ref_step(x, y) for x, y in batches]

    model = _LinearAndEmbedding()
    opt = _two_groups(model)
    step = ampkit.make_train_step(model, torch.nn.functional.mse_loss, opt, scaler=make_scaler(),
                                  autocast=FP16, capture=False)
    losses = []
    for i, (x, y) in enumerate(batches):
        if i == FAIL_AT:
            assert step.rollback_copy is None  # warm: checked, not copied
            undo = _half_way(why, model, opt)
            before = _everything(model, opt, step)
            with pytest.raises(RuntimeError, match=HALF_WAY[why]) as raised:
                step(x, y)
            _assert_same(_everything(model, opt, step), before)
            assert step.rollback_copy is not None
            undo()
        losses.append(step(x, y))
    assert_bitwise(losses, ref_losses)
    _assert_same(_everything(model, opt, step), _everything(ref_model, ref_step.optimizer, ref_step))

    # The control: the same fault in a hand-written step leaves group 1 stepped.
    model = _LinearAndEmbedding()
    opt = _two_groups(model)
    for x, y in batches[:2]:  # state for both groups
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
    _half_way(why, model, opt)
    lin, emb = model.lin.weight.detach().clone(), model.emb.weight.detach().clone()
    opt.zero_grad()
    torch.nn.functional.mse_loss(model(batches[2][0]), batches[2][1]).backward()
    with pytest.raises(RuntimeError, match=HALF_WAY[why]):
        opt.step()
    assert not torch.equal(model.lin.weight, lin) and torch.equal(model.emb.weight, emb)


class _CheckOnly(ampkit.GradScaler):
    """A scaler subclass that only overrides the gradient check (it runs before the
    optimizer writes anything)."""

    def found_inf(self, grouped, unscale):
        return super().found_inf(grouped, unscale)


class _SGDPlus(torch.optim.SGD):
    pass


def _hooked(kind):
    def make(model):
        opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
        getattr(opt, kind)(lambda *a: None)
        return opt
    return make


def _scheduled(model):
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    torch.optim.lr_scheduler.StepLR(opt, step_size=1)  # wraps opt.step on the instance
    return opt


# (optimizer, scaler class, the reason for the copy in the third call, in part; None: it
# checked and copied nothing)
COPY_OR_CHECK = {
    "sgd": (lambda m: torch.optim.SGD(m.parameters(), lr=0.05), ampkit.GradScaler, None),
    "sgd_momentum": (lambda m: torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9),
                     ampkit.GradScaler, None),
    "adam": (lambda m: torch.optim.Adam(m.parameters()), ampkit.GradScaler, None),
    "adamw_fused": (lambda m: torch.optim.AdamW(m.parameters(), fused=True), ampkit.GradScaler, None),
    "adam_foreach": (lambda m: torch.optim.Adam(m.parameters(), foreach=True), ampkit.GradScaler, None),
    "lr_scheduler": (_scheduled, ampkit.GradScaler, None),
    "scaler_checks_only": (lambda m: torch.optim.SGD(m.parameters(), lr=0.05), _CheckOnly, None),
    "scaler_updates": (lambda m: torch.optim.SGD(m.parameters(), lr=0.05), UpdateFailsOnce,
                       "overrides more than found_inf"),
    "adagrad": (lambda m: torch.optim.Adagrad(m.parameters()), ampkit.GradScaler, "is not torch's SGD"),
    "sgd_subclass": (lambda m: _SGDPlus(m.parameters(), lr=0.05), ampkit.GradScaler, "is not torch's SGD"),
    "pre_hook": (_hooked("register_step_pre_hook"), ampkit.GradScaler, "has step hooks"),
    "post_hook": (_hooked("register_step_post_hook"), ampkit.GradScaler, "has step hooks"),
    "tensor_lr": (lambda m: torch.optim.Adam(m.parameters(), lr=torch.tensor(1e-3)), ampkit.GradScaler,
                  "has a Tensor 'lr'"),
}


@pytest.mark.parametrize("name", list(COPY_OR_CHECK))
def test_the_step_copies_only_where_the_optimizer_step_could_fail_half_way(name):
    """step.rollback_copy: None where the eager step checked that nothing after the
    optimizer's first write can raise (torch's SGD, Adam and AdamW as they come, with an
    LR scheduler, a scaler subclass that only checks gradients), else why it copied; a
    first step that creates optimizer state copies. Either way it trains as the
    hand-written loop does."""
    make_opt, scaler_cls, reason = COPY_OR_CHECK[name]
    batches = make_batches(n=3, poison=False)
    model = make_model()
    opt = make_opt(model)
    step = ampkit.make_train_step(model, torch.nn.functional.mse_loss, opt,
                                  scaler=scaler_cls("cpu", init_scale=2.0**10), autocast=FP16,
                                  capture=False)
    if scaler_cls is UpdateFailsOnce:
        step.scaler.trap = Once()
    assert step.rollback_copy is None
    got = []
    for i, (x, y) in enumerate(batches):
        got.append(step(x, y))
        first = step.rollback_copy
        if i == 0 and isinstance(opt, (torch.optim.Adam, torch.optim.AdamW)) and reason is None:
            assert "creates its state" in first
    if reason is None:
        assert step.rollback_copy is None
    else:
        assert reason in step.rollback_copy

    ref_model = make_model()
    ref_opt = make_opt(ref_model)
    ref_scaler = ampkit.GradScaler("cpu", init_scale=2.0**10)
    for (x, y), loss in zip(batches, got):
        assert_bitwise(loss, hand_step(ref_model, ref_opt, ref_scaler, x, y, ac=FP16))
    assert_bitwise(list(model.parameters()), list(ref_model.parameters()))


# (a value set in the param group between calls; the reason the next call's copy gives, or
# None where it checks and copies nothing)
GROUP_VALUES = {
    "tuple_of_floats": ("betas_like", (0.9, 0.999), None),
    "list_of_floats": ("weights", [1.0, 2.0], None),
    "nested_plain": ("nested", [(1, 2), ("a", None)], None),
    "tensor_in_tuple": ("betas_like", (0.9, torch.tensor(0.999)), "has a tuple 'betas_like'"),
    "tensor_in_list": ("weights", [1.0, torch.tensor(2.0)], "has a list 'weights'"),
    "tensor_value": ("lr", torch.tensor(0.05), "has a Tensor 'lr'"),
    "dict_value": ("extra", {"a": 1}, "has a dict 'extra'"),
    "the_params_list_again": ("alias", "params", "has a list 'alias'"),
}


@pytest.mark.parametrize("name", list(GROUP_VALUES))
def test_a_param_group_value_that_is_not_a_host_value_makes_the_step_copy(name):
    """Sequences in a param group are looked into (a tensor inside one makes the step copy),
    whatever else the group holds; the params list itself is never taken for a value."""
    key, value, reason = GROUP_VALUES[name]
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    step = ampkit.make_train_step(model, torch.nn.functional.mse_loss, opt, autocast=FP16,
                                  capture=False)
    x, y = make_batches(n=1, poison=False)[0]
    step(x, y)
    assert step.rollback_copy is None
    group = opt.param_groups[0]
    group[key] = group["params"] if value == "params" else value
    step(x, y)
    if reason is None:
        assert step.rollback_copy is None
    else:
        assert reason in step.rollback_copy
    if key == "lr":
        group["lr"] = 0.05
    else:
        del group[key]
    step(x, y)
    assert step.rollback_copy is None


def test_global_optimizer_hooks_make_the_step_copy():
    model = make_model()
    step = ampkit.make_train_step(model, torch.nn.functional.mse_loss,
                                  torch.optim.SGD(model.parameters(), lr=0.05), autocast=FP16,
                                  capture=False)
    x, y = make_batches(n=1, poison=False)[0]
    step(x, y)
    assert step.rollback_copy is None
    handle = register_optimizer_step_post_hook(lambda *a: None)
    try:
        step(x, y)
        assert "has step hooks" in step.rollback_copy
    finally:
        handle.remove()
    step(x, y)
    assert step.rollback_copy is None


def _fused_sgd_then(signum, check=lambda: True):
    """torch._fused_sgd_ that, once armed (``armed[0] = True``), raises ``signum`` right
    after the kernel ran (inside the optimizer step), asserts ``check()`` there and disarms."""
    real, armed = torch._fused_sgd_, [False]

    def kernel_then_signal(*a, **k):
        out = real(*a, **k)
        if armed[0]:
            armed[0] = False
            signal.raise_signal(signum)
            assert check()
        return out

    return kernel_then_signal, armed


def test_a_ctrl_c_while_the_optimizer_writes_is_raised_once_the_step_is_whole(monkeypatch):
    """SIGINT arriving inside the fused SGD kernel's call (no copy to put back): the call
    completes the step, then raises KeyboardInterrupt; the run that goes on with the next
    batch is bitwise the run without the interrupt, and the handler is back in place. (Were
    the interrupt raised where it came, the optimizer would have stepped while the scaler's
    update and the step's count were undone.)"""
    batches = make_batches(n=8)
    _, _, ref_step = _failing_step("none", "sgd_fused", Once())
    ref_losses = [ref_step(x, y) for x, y in batches]

    model, opt, step = _failing_step("none", "sgd_fused", Once())
    kernel_then_sigint, armed = _fused_sgd_then(signal.SIGINT)
    monkeypatch.setattr(torch, "_fused_sgd_", kernel_then_sigint)
    handler = signal.getsignal(signal.SIGINT)
    losses = []
    for i, (x, y) in enumerate(batches):
        if i == FAIL_AT:
            armed[0] = True
            try:
                step(x, y)
            except KeyboardInterrupt:
                pass
            else:  # (what the call saw, for a failure that has come only in full-suite runs)
                pytest.fail("DID NOT RAISE KeyboardInterrupt: kernel reached %s, SIGINT handler %r, "
                            "SIGINT blocked %s, rollback_copy %r, in the main thread %s" % (
                                not armed[0], signal.getsignal(signal.SIGINT),
                                signal.SIGINT in signal.pthread_sigmask(signal.SIG_BLOCK, []),
                                step.rollback_copy, threading.current_thread() is threading.main_thread()))
            assert not armed[0] and step.rollback_copy is None
            assert signal.getsignal(signal.SIGINT) is handler
            losses.append(ref_losses[i])  # (the step was taken; its loss was not returned)
            continue
        losses.append(step(x, y))
    assert_bitwise(losses, ref_losses)
    _assert_same(_everything(model, opt, step), _everything(ref_step.model, ref_step.optimizer, ref_step))
    assert step.scaler.stats() == ref_step.scaler.stats()


def test_the_default_dtype_is_the_policys_for_the_device():
    """autocast= without a dtype takes the policy's lower_precision_dtype, as ampkit.autocast
    does: the step trains exactly as a hand-written loop in that policy's region."""
    policy = ampkit.load_policy("torch_default").with_dtype("cpu", torch.float16)
    x, y = torch.randn(8, 4), torch.randn(8, 2)
    torch.manual_seed(0)
    ours = torch.nn.Linear(4, 2)
    theirs = torch.nn.Linear(4, 2)
    theirs.load_state_dict(ours.state_dict())
    step = ampkit.make_train_step(ours, torch.nn.functional.mse_loss, torch.optim.SGD(ours.parameters(), lr=0.1),
                                  scaler=ampkit.GradScaler("cpu", enabled=False),
                                  autocast=dict(device_type="cpu", policy=policy), capture=False)
    assert step.autocast["dtype"] is torch.float16
    opt = torch.optim.SGD(theirs.parameters(), lr=0.1)
    with ampkit.autocast("cpu", policy=policy):
        loss = torch.nn.functional.mse_loss(theirs(x), y)
    loss.backward()
    opt.step()
    step(x, y)
    for p, q in zip(ours.parameters(), theirs.parameters()):
        assert torch.equal(p, q)


def test_the_eager_rollback_copy_keeps_no_tensor_the_optimizer_dropped():
    """The CPU copies are kept between eager calls (a fresh large allocation page-faults
    each step); a state tensor the optimizer replaces (load_state_dict) is not kept alive
    by them, and a fault after the swap still puts the new state back bitwise."""
    import weakref

    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    opt = torch.optim.Adam(model.parameters(), lr=0.1)
    step = ampkit.make_train_step(model, torch.nn.functional.mse_loss, opt, capture=False,
                                  scaler=ampkit.GradScaler("cpu", enabled=False),
                                  autocast=dict(device_type="cpu", dtype=torch.bfloat16))
    x, y = torch.randn(8, 4), torch.randn(8, 2)
    step(x, y)
    step(x, y)
    old = weakref.ref(next(iter(opt.state.values()))["exp_avg"])
    opt.load_state_dict(copy.deepcopy(opt.state_dict()))  # new state tensors, same values
    step(x, y)
    gc.collect()
    assert old() is None
    before = [t.clone() for s in opt.state.values() for t in s.values()] + [p.detach().clone() for p in model.parameters()]
    real_step = opt.step

    def half_then_boom(*a, **k):
        real_step(*a, **k)
        raise Boom()

    opt.step = half_then_boom
    with pytest.raises(Boom):
        step(x, y)
    after = [t for s in opt.state.values() for t in s.values()] + list(model.parameters())
    assert_bitwise(after, before)


def test_the_fallback_beside_a_graph_leaves_the_graphs_gradients_and_gives_them_back_at_the_next_replay():
    """The eager fallback next to a captured graph (driven directly: no graph on the CPU)
    computes its own gradients and leaves the .grad tensors the graph owns (and overwrites
    whole at each replay) untouched, succeeding or failing: once the call succeeded, .grad
    holds bitwise the gradients of the hand-written step from the same state, and the
    parameters, optimizer state and buffers are that step's; the next replay makes the
    graph's tensors .grad again."""
    model = _bn_model()
    opt = OPTIMIZERS["sgd_fused"](model.parameters())
    scaler = make_scaler()
    step = ampkit.make_train_step(model, torch.nn.functional.mse_loss, opt, scaler=scaler,
                                  autocast=FP16, capture=False)
    batches = make_batches(n=4, poison=False)
    for x, y in batches[:2]:
        step(x, y)
    owned = [p.grad for p in model.parameters()]
    step._graph_grads = owned  # (as a capture leaves them)
    kept = [g.clone() for g in owned]
    ref_model, ref_opt = copy.deepcopy((model, opt))
    ref_scaler = make_scaler()
    ref_scaler.load_state_dict(scaler.state_dict())
    x, y = batches[2]
    ref_loss = hand_step(ref_model, ref_opt, ref_scaler, x, y, ac=FP16)

    loss = step._eager([x], [y], beside_graph=True)
    assert not any(p.grad is g for p, g in zip(model.parameters(), owned))
    assert_bitwise(owned, kept)  # the graph's tensors, untouched
    assert_bitwise(loss, ref_loss)
    assert_bitwise([p.grad for p in model.parameters()], [p.grad for p in ref_model.parameters()])
    assert_bitwise(list(model.parameters()), list(ref_model.parameters()))
    assert_bitwise(optimizer_state_tensors(opt), optimizer_state_tensors(ref_opt))
    assert_bitwise(list(model.buffers()), list(ref_model.buffers()))

    grads = [p.grad for p in model.parameters()]
    buffers = [b.clone() for b in model.buffers()]
    step.loss_fn = lambda out, y: (_ for _ in ()).throw(Boom())  # after the forward
    with pytest.raises(Boom):
        step(*batches[3])  # (no graph on the CPU: the call runs eagerly, and fails)
    assert all(p.grad is g for p, g in zip(model.parameters(), grads))  # (put back by the call)
    with pytest.raises(Boom):
        step._eager([batches[3][0]], [batches[3][1]], beside_graph=True)
    assert_bitwise(owned, kept)  # the graph's tensors, untouched
    assert_bitwise(list(model.buffers()), buffers)  # the forward's statistics, put back
    step._give_graph_its_grads()  # what the next replay does first
    assert all(p.grad is g for p, g in zip(model.parameters(), owned))


class _StandInGraph:
    """Counts replays: what a captured graph would run is of no matter to the batch checks."""

    def __init__(self):
        self.replays = 0

    def replay(self):
        self.replays += 1


def test_a_captured_step_replays_the_captured_shapes_whatever_the_strides_and_runs_others_beside():
    """A captured step (a stand-in graph, kept as a capture keeps its graph: no CUDA graph
    on the CPU) replays a batch of the captured shapes, dtypes and devices, also one laid
    out with other strides, and runs every other batch eagerly beside the graph (fewer rows,
    another dtype); the reason names the shapes, written once a shape."""
    model = _bn_model()
    opt = OPTIMIZERS["sgd_fused"](model.parameters())
    step = ampkit.make_train_step(model, torch.nn.functional.mse_loss, opt, scaler=make_scaler(),
                                  autocast=FP16, capture=False)
    (x, y), (x2, y2) = make_batches(n=2, poison=False)
    step(x, y)  # (eager on the CPU: the gradients a graph would own)
    graph = _StandInGraph()
    step._eligible = True
    step._static_in, step._static_tg = [x.clone()], [y.clone()]
    step._keep_graph(graph, torch.zeros(()), [x], [y])

    def call(*batch):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            step(*batch)
        return step.captured

    assert call(x2, y2) and graph.replays == 1
    strided = x2.t().contiguous().t()  # (the same shape, column-major)
    assert strided.stride() != x2.stride()
    assert call(strided, y2) and graph.replays == 2
    assert not call(x2[:-1], y2[:-1]) and graph.replays == 2
    reason = step.reason
    assert "[11, 16] float32" in reason and "[12, 16] float32" in reason
    assert not call(x2[1:], y2[1:]) and step.reason is reason  # (the same shapes again)
    assert not call(x2.half(), y2) and "[12, 16] float16" in step.reason
    assert call(x2, y2) and graph.replays == 3  # (after a run beside the graph: the graph's shapes)
    assert not call(x2[1:], y2[1:]) and not call(x2[:-1], y2[:-1])
    assert call(strided, y2) and graph.replays == 4


def _lin_then_emb_adam(model):
    return torch.optim.Adam(model.lin.parameters(), lr=1e-2, foreach=True)


def _sgd_without_momentum(model):
    return torch.optim.SGD(model.parameters(), lr=1e-2)


# A change between calls that turns the verdict "nothing can raise half-way, copy nothing"
# into "copy": the step keeps its verdict between calls and must see each of these.
VERDICT_CHANGES = {
    "param_group_added": (_lin_then_emb_adam,
                          lambda model, opt: opt.add_param_group({"params": list(model.emb.parameters())})),
    "momentum_turned_on": (_sgd_without_momentum,
                           lambda model, opt: [g.update(momentum=0.9) for g in opt.param_groups]),
    # (the group's own list grows in place: its dict's version stays, its length does not)
    "parameter_appended_in_place": (_lin_then_emb_adam,
                                    lambda model, opt: opt.param_groups[0]["params"].extend(model.emb.parameters())),
    # (another parameter in one's place: the group's version and length stay, its identity not)
    "parameter_replaced_in_place": (_lin_then_emb_adam,
                                    lambda model, opt: opt.param_groups[0]["params"].__setitem__(0, model.emb.weight)),
}


@pytest.mark.parametrize("change", sorted(VERDICT_CHANGES))
def test_the_kept_verdict_follows_the_optimizer_between_calls(change):
    """After a change to the optimizer between calls, the step decides to copy (or not)
    as a step built afresh at that point does (it has no verdict kept), and computes
    bitwise what that step computes."""
    make_opt, apply_change = VERDICT_CHANGES[change]
    batches = make_batches(n=5, poison=False)
    model = _LinearAndEmbedding()
    opt = make_opt(model)
    step = ampkit.make_train_step(model, torch.nn.functional.mse_loss, opt, scaler=make_scaler(),
                                  autocast=FP16, capture=False)
    for x, y in batches[:3]:
        step(x, y)
    assert step.rollback_copy is None
    apply_change(model, opt)
    fresh_model, fresh_opt = copy.deepcopy((model, opt))
    fresh_scaler = make_scaler()
    fresh_scaler.load_state_dict(step.scaler.state_dict())
    fresh = ampkit.make_train_step(fresh_model, torch.nn.functional.mse_loss, fresh_opt,
                                   scaler=fresh_scaler, autocast=FP16, capture=False)
    verdicts = []
    for x, y in batches[3:]:
        assert_bitwise(step(x, y), fresh(x, y))
        verdicts.append(step.rollback_copy)
        assert step.rollback_copy == fresh.rollback_copy
    assert verdicts[0] is not None and verdicts[1] is None  # (state created, then there)
    assert_bitwise(list(model.parameters()), list(fresh_model.parameters()))


def test_a_hyperparameter_list_changed_in_place_is_seen_at_the_next_call():
    """A param group's value of a mutable type (a list) can change without its group dict
    changing: the step does not keep its verdict on such a group, and sees a tensor put
    into the list between calls as a step built afresh does (SGD ignores the key)."""
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.05, fused=True)
    opt.param_groups[0]["notes"] = [0.5]
    step = ampkit.make_train_step(model, torch.nn.functional.mse_loss, opt, scaler=make_scaler(),
                                  autocast=FP16, capture=False)
    batches = make_batches(n=4, poison=False)
    for x, y in batches[:2]:
        step(x, y)
    assert step.rollback_copy is None
    opt.param_groups[0]["notes"].append(torch.tensor(1.0))
    step(*batches[2])
    assert step.rollback_copy == "SGD has a list 'notes'"
    opt.param_groups[0]["notes"].pop()
    step(*batches[3])
    assert step.rollback_copy is None


def test_a_sigterm_while_the_optimizer_writes_is_held_as_a_ctrl_c_is():
    """With a Python SIGTERM handler installed (Python's default is the C one, not held),
    a SIGTERM arriving inside the fused kernel's call runs that handler once the step is
    whole, as SIGINT does, and both handlers are back in place after the call."""
    import signal

    came = []

    def on_term(signum, frame):
        came.append((signum, step.calls, float(model[0].weight.detach().sum())))

    model, opt, step = _failing_step("none", "sgd_fused", Once())
    kernel_then_sigterm, armed = _fused_sgd_then(signal.SIGTERM, check=lambda: not came)  # (held: not run inside the optimizer step)

    int_handler = signal.getsignal(signal.SIGINT)
    previous = signal.signal(signal.SIGTERM, on_term)
    try:
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(torch, "_fused_sgd_", kernel_then_sigterm)
            x, y = make_batches(n=1, poison=False)[0]
            step(x, y)
            armed[0] = True
            step(x, y)
        assert not armed[0] and step.rollback_copy is None
        assert came == [(signal.SIGTERM, 2, float(model[0].weight.detach().sum()))]  # after the step
        assert signal.getsignal(signal.SIGTERM) is on_term
        assert signal.getsignal(signal.SIGINT) is int_handler
    finally:
        signal.signal(signal.SIGTERM, previous)


class _Tally(torch.nn.Module):
    """A buffer the forward writes in place, of any dtype (BatchNorm's must be float)."""

    def __init__(self):
        super().__init__()
        self.register_buffer("total", torch.zeros(()))

    def forward(self, x):
        self.total.add_(x.detach().float().mean())
        return x


def _tally_model():
    model = _bn_model()
    model.insert(2, _Tally())
    return model


def _retype_tally(model):
    # a float64 value that float32 cannot hold: a copy kept in the old dtype rounds it
    model[2].total.data = model[2].total.double() + 2.0**-40


def test_the_kept_verdict_holds_no_state_the_optimizer_dropped():
    """The verdict kept between calls names state tensors by identity but holds none: a
    state replaced by load_state_dict is freed at once, not at the next call (whose forward
    it would otherwise add to the peak memory), and the next call checks the new state."""
    import weakref

    model = _LinearAndEmbedding()
    opt = _two_groups(model)
    step = ampkit.make_train_step(model, torch.nn.functional.mse_loss, opt, scaler=make_scaler(),
                                  autocast=FP16, capture=False)
    batches = make_batches(n=4, poison=False)
    for x, y in batches[:2]:
        step(x, y)
    assert step.rollback_copy is None
    old = weakref.ref(opt.state[model.emb.weight]["exp_avg"])
    opt.load_state_dict(copy.deepcopy(opt.state_dict()))
    gc.collect()
    assert old() is None
    undo = _half_way("state_replaced", model, opt)  # the new state, now of another dtype
    before = _everything(model, opt, step)
    with pytest.raises(RuntimeError, match=HALF_WAY["state_replaced"]):
        step(*batches[2])
    _assert_same(_everything(model, opt, step), before)
    undo()


def _insert_bn(model):
    model.insert(2, torch.nn.BatchNorm1d(32))  # (ModuleList/Sequential.insert: no registration hook)


def _register_on_a_leaf(model):
    # a buffer on a module that had none (the step keeps no version of an empty dict),
    # written by the forward through a hook
    def count(m, args, out):
        m.seen.add_(out.detach().float().mean())

    model[0].register_buffer("seen", torch.zeros(()))
    model[0].register_forward_hook(count)


def _add_to_a_leaf(model):
    # a module with a buffer under a module that had no children, run by a forward hook
    def run(m, args, out):
        m.tally(out)

    model[3].add_module("tally", _Tally())
    model[3].register_forward_hook(run)


# Changes to the model's buffers between calls, by routes that do and do not go through
# torch's registration hooks: the step keeps its list of buffers between calls.
BUFFER_CHANGES = {
    "buffer_registered_on_a_leaf": _register_on_a_leaf,
    "module_added_to_a_leaf": _add_to_a_leaf,
    "buffer_reassigned": lambda model: setattr(model[1], "running_mean", torch.randn(32)),
    "buffer_data_replaced": lambda model: setattr(model[1].running_var, "data", torch.rand(32) + 0.5),
    "module_converted": lambda model: model[1].bfloat16().float(),  # (new buffer tensors)
    "module_inserted": _insert_bn,
    "buffer_data_retyped": _retype_tally,
}


@pytest.mark.parametrize("change", sorted(BUFFER_CHANGES))
def test_buffers_changed_between_calls_are_put_back_by_a_failed_call(change):
    """A buffer replaced, its .data swapped (for another dtype's), the module converted, or a
    BatchNorm inserted after some calls: a call that then fails after the forward (which
    wrote the statistics) puts every buffer back, bitwise, into the tensors the model holds
    now."""
    model = _tally_model()
    opt = OPTIMIZERS["sgd_fused"](model.parameters())
    step = ampkit.make_train_step(model, torch.nn.functional.mse_loss, opt, scaler=make_scaler(),
                                  autocast=FP16, capture=False)
    batches = make_batches(n=4, poison=False)
    for x, y in batches[:2]:
        step(x, y)
    BUFFER_CHANGES[change](model)
    held = list(model.buffers())
    before = [b.clone() for b in held]
    loss_fn = step.loss_fn
    step.loss_fn = lambda out, y: (_ for _ in ()).throw(Boom())  # after the forward
    with pytest.raises(Boom):
        step(*batches[2])
    assert all(a is b for a, b in zip(model.buffers(), held))
    assert_bitwise(held, before)
    step.loss_fn = loss_fn
    step(*batches[3])  # and the run goes on: the forward writes them again
    assert not torch.equal(model[1].running_mean, before[0])
