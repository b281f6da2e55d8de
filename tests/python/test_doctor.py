"""The numerics doctor: checked against hand-derived values and an independent fault injector."""

import doctest
import functools
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode, _get_current_dispatch_mode_stack

import ampkit
import faults
from conftest import bits_equal

pytestmark = [pytest.mark.usefixtures("ampkit_quiet"), pytest.mark.filterwarnings("ignore::UserWarning")]


def _mlp(seed=0):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))


# -- fault injection over the four benchmark cases ------------------------------------------
def test_fault_injector_docstring_example():
    # faults.py lives with the tests, outside the package test_doctests.py walks
    result = doctest.testmod(faults, optionflags=doctest.ELLIPSIS)
    assert result.attempted > 0 and result.failed == 0


@functools.lru_cache(maxsize=1)
def _plan():
    return faults.plan()


N_FAULTS = len(faults.CASES) * len(faults.DTYPES) * len(faults.MODES) * 4


def test_the_plan_covers_what_the_suite_promises():
    p = _plan()
    assert len(p) == N_FAULTS >= 50
    assert {f["case"] for f in p} == set(faults.CASES)
    assert {(f["phase"], f["kind"], f["dtype"], f["mode"]) for f in p} == {
        (ph, k, d, m) for ph in ("forward", "backward") for k in ("inf", "nan")
        for d in ("float16", "bfloat16") for m in faults.MODES}


@pytest.mark.parametrize("i", range(N_FAULTS))
def test_doctor_names_the_injected_op_module_and_phase(i):
    f = _plan()[i]
    finding, fired = faults.run_fault(f, step=1)
    assert fired == 1, "the injector did not fire: the fault plan is wrong"
    assert finding is not None
    assert (finding.op, finding.module, finding.phase, finding.step) == (f["op"], f["module"], f["phase"], fired)
    assert finding.output_absmax != finding.output_absmax if f["kind"] == "nan" else finding.output_absmax == float("inf")


# -- the record ---------------------------------------------------------------------------
def test_forward_overflow_values_match_a_hand_computation():
    model = _mlp()
    x = torch.full((3, 8), 200.0)
    with torch.no_grad():
        model[2].weight.fill_(100.0)  # |y| = 8 * 100 * relu(h) overflows float16 when relu(h) > 82
        model[0].weight.fill_(0.1)
        model[0].bias.zero_()
    with ampkit.doctor(model) as doc, ampkit.autocast("cpu", dtype=torch.float16):
        model(x)
    f = doc.first_nonfinite()
    with torch.autocast("cpu", dtype=torch.float16):
        h = torch.relu(model[0](x))
    assert not torch.isinf(h).any()  # the oracle: layer 0 is finite, layer 2's addmm is not
    want_in = max(h.abs().max().item(), 100.0, model[2].bias.abs().max().item())
    assert (f.op, f.module, f.phase, f.dtype, f.step) == ("addmm", "2", "forward", "float16", 0)
    assert f.input_absmax == pytest.approx(want_in)
    assert f.output_absmax == float("inf")


def test_clean_run_finds_nothing_and_changes_nothing():
    losses = {}
    for armed in (False, True):
        model = _mlp(1)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        doc = ampkit.doctor(model) if armed else None
        out = []
        for i in range(3):
            opt.zero_grad()
            with ampkit.autocast("cpu", dtype=torch.float16):
                loss = F.mse_loss(model(torch.randn(4, 8, generator=torch.Generator().manual_seed(i))),
                                  torch.zeros(4, 2))
            loss.backward()
            opt.step()
            out.append(loss.detach())
        losses[armed] = torch.stack(out)
        if doc:
            assert doc.first_nonfinite() is None
            doc.close()
    assert torch.equal(losses[True], losses[False])


class _CountHostReads(TorchDispatchMode):
    """A CPU proxy for 'no host sync': a device value read by the host is aten's
    _local_scalar_dense (item(), bool(), tolist() of a scalar ...)."""

    def __init__(self):
        super().__init__()
        self.reads = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten._local_scalar_dense.default:
            self.reads += 1
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("every", [1, 2])
def test_no_host_read_per_step(every):
    reads = {}
    for armed in (False, True):
        model = _mlp(2)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        step = ampkit.make_train_step(model, F.mse_loss, opt, scaler=ampkit.GradScaler("cpu"),
                                      autocast=dict(device_type="cpu", dtype=torch.float16))
        with _CountHostReads() as counter:  # below the doctor's mode: it sees the doctor's ops
            doc = ampkit.doctor(model, every=every) if armed else None
            for i in range(4):
                step(torch.randn(4, 8), torch.randn(4, 2))
            if doc:
                doc.close()
        reads[armed] = counter.reads
    assert reads[True] == reads[False]


def test_off_costs_nothing():
    model = _mlp()
    before = len(_get_current_dispatch_mode_stack())
    seen = {}

    class Probe(torch.nn.Module):  # what is installed while a sampled and an unsampled step run
        def forward(self, x):
            seen.setdefault("modes", []).append(len(_get_current_dispatch_mode_stack()))
            return x

    model.append(Probe())
    with ampkit.doctor(model, every=2):
        # armed: the root's two hooks, no mode (the op-level watch is on in sampled steps only)
        assert len(_get_current_dispatch_mode_stack()) == before
        assert [len(m._forward_pre_hooks) + len(m._forward_hooks) for m in model.modules()] == [2, 0, 0, 0, 0]
        for _ in range(2):
            model(torch.randn(2, 8))
    assert seen["modes"] == [before + 1, before]  # step 0 sampled, step 1 not
    assert len(_get_current_dispatch_mode_stack()) == before
    assert all(not m._forward_pre_hooks and not m._forward_hooks for m in model.modules())


def test_a_forward_that_raises_in_a_sampled_step_leaves_the_watch_clean():
    # the root's post-hook runs also when the forward raises (torch's always_call): the
    # op-level watch's stack is emptied, and the next step is watched as usual
    class BoomOnce(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.armed = True

        def forward(self, x):
            if self.armed:
                self.armed = False
                raise ValueError("boom")
            return x

    model = _mlp()
    model.append(BoomOnce())
    before = len(_get_current_dispatch_mode_stack())
    with ampkit.doctor(model, every=1) as doc:
        with pytest.raises(ValueError, match="boom"):
            model(torch.randn(2, 8))
        model(torch.randn(2, 8))  # its rows name the modules
        modules = {r["module"] for r in doc.stats() if r["step"] == 1}
    assert {"0", "1", "2"} <= modules
    assert len(_get_current_dispatch_mode_stack()) == before


def test_backward_finding_names_the_module_and_the_step():
    torch.manual_seed(0)
    model = _mlp()
    scaler = ampkit.GradScaler("cpu", init_scale=1.0)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with ampkit.doctor(model) as doc:
        for i in range(3):
            opt.zero_grad()
            with ampkit.autocast("cpu", dtype=torch.float16):
                out = model(torch.randn(4, 8))
            # step 2 only: a gradient beyond float16 arrives at the last layer's output
            g = torch.full_like(out, 1e5 if i == 2 else 1.0, dtype=torch.float32)
            scaler.scale((out.float() * g).sum()).backward()
            scaler.step(opt)
            scaler.update()
            assert (doc.on_skip(scaler) is None) == (i < 2)
    f = doc.first_nonfinite()
    # the fp32 grad 1e5 is cast back to float16 (the backward of the output's cast) outside
    # the model: the gradient arrives at the model's output already inf
    assert (f.op, f.module, f.phase, f.step, f.dtype) == ("<output gradient>", "<outside model>", "backward", 2,
                                                          "float16")
    assert f.output_absmax == float("inf")


# -- statistics -------------------------------------------------------------------------------
def test_stats_fractions_match_a_hand_count():
    torch.manual_seed(0)
    lin = torch.nn.Linear(4, 3)
    model = torch.nn.Sequential(lin)
    x = torch.tensor([[1e-9, 1.0, 7e4, 0.0], [2e-8, -3e-9, 1.0, 2.0]])
    with ampkit.doctor(model) as doc, ampkit.autocast("cpu", dtype=torch.float16):
        y = model(x)
    (row,) = doc.stats()
    cast = [x, lin.weight.detach(), lin.bias.detach()]
    n_cast = sum(t.numel() for t in cast)
    under = sum(((t != 0) & (t.half() == 0)).sum().item() for t in cast)
    low = [t.half() for t in cast] + [y]
    over = sum((~torch.isfinite(t)).sum().item() for t in low)
    assert under == 3 and over >= 1  # 1e-9, 2e-8, -3e-9 underflow; 7e4 does not fit
    assert row["module"] == "0" and row["step"] == 0
    assert row["cast_elements"] == n_cast
    assert row["underflow"] == pytest.approx(under / n_cast)
    assert row["overflow"] == pytest.approx(over / sum(t.numel() for t in low))


def test_stats_are_sampled_every_n_steps():
    model = _mlp()
    with ampkit.doctor(model, every=3) as doc:
        for _ in range(7):
            with ampkit.autocast("cpu", dtype=torch.bfloat16):
                model(torch.randn(2, 8)).float().sum().backward()
    rows = doc.stats()
    assert sorted({r["step"] for r in rows}) == [0, 3, 6]
    # the loss (.float().sum()) is computed outside the model: its backward is a row too
    assert {r["module"] for r in rows} == {"0", "1", "2", "<outside model>"}
    assert all(r["grad_absmax"] > 0 for r in rows if r["module"] in ("0", "2"))


# -- suggest -------------------------------------------------------------------------------
def test_suggest_pins_the_overflowing_module_and_round_trips(tmp_path):
    model = _mlp()
    with torch.no_grad():
        model[2].weight.fill_(3e4)
    with ampkit.doctor(model) as doc, ampkit.autocast("cpu", dtype=torch.float16):
        model(torch.full((2, 8), 50.0))
    p = doc.suggest()
    assert [(m.pattern, m.pin) for m in p.modules] == [("2", "float32")]
    f = tmp_path / "fix.yaml"
    f.write_text(p.to_yaml())
    assert ampkit.load_policy(f) == p
    with ampkit.doctor(model) as doc2, p.apply(model), ampkit.autocast("cpu", dtype=torch.float16):
        out = model(torch.full((2, 8), 50.0))
    assert torch.isfinite(out).all() and doc2.first_nonfinite() is None
    clean = ampkit.doctor(_mlp())
    assert clean.suggest() == clean.policy
    clean.close()


# -- bad input --------------------------------------------------------------------------------
@pytest.mark.parametrize("every", [0, -1, 1.5, True, "2", None])
def test_every_must_be_a_positive_int(every):
    model = _mlp()
    with pytest.raises(ValueError, match=f"every must be a positive integer.*got {every!r}"):
        ampkit.doctor(model, every=every)
    assert all(not m._forward_pre_hooks for m in model.modules())


def test_armed_twice_raises_and_changes_nothing():
    model = _mlp()
    modes = len(_get_current_dispatch_mode_stack())
    with ampkit.doctor(model):
        hooks = [(len(m._forward_pre_hooks), len(m._forward_hooks)) for m in model.modules()]
        with pytest.raises(RuntimeError, match="already armed on this Sequential"):
            ampkit.doctor(model)
        assert [(len(m._forward_pre_hooks), len(m._forward_hooks)) for m in model.modules()] == hooks
        assert len(_get_current_dispatch_mode_stack()) == modes
    with ampkit.doctor(model):  # closed: armed again
        pass


def test_model_must_be_a_module():
    with pytest.raises(TypeError, match="torch.nn.Module, got function"):
        ampkit.doctor(lambda x: x)


def test_heatmap_writes_a_png(tmp_path):
    model = _mlp()
    with ampkit.doctor(model, every=1) as doc:
        for _ in range(3):
            with ampkit.autocast("cpu", dtype=torch.float16):
                model(torch.randn(2, 8) * 1e-6)
    path = doc.heatmap(tmp_path / "h.png")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_a_mode_entered_in_a_sampled_step_keeps_its_place():
    # the op-level watch's mode sits where the stack ended at arming: a mode the user enters
    # around a step (a FLOP counter, say) is above it, and leaving that mode pops that mode
    model = _mlp()
    doc = ampkit.doctor(model, every=1)
    counter = _CountHostReads()
    with counter:
        model(torch.randn(2, 8)).sum().backward()
        assert _get_current_dispatch_mode_stack()[-1] is counter
    stack = _get_current_dispatch_mode_stack()
    assert len(stack) == 1 and type(stack[0]).__module__ == "ampkit._doctor._op_watch"  # the doctor's own
    doc.close()
    assert not doc.armed and len(_get_current_dispatch_mode_stack()) == 0


def test_uninitialized_memory_is_not_a_finding():
    class Garbage(torch.nn.Module):
        def forward(self, x):
            e = torch.empty_like(x)
            e.fill_(float("inf"))  # what uninitialized memory may hold; then written over
            return e.zero_() + x

    with ampkit.doctor(Garbage()) as doc:
        doc.model(torch.ones(3))
    f = doc.first_nonfinite()
    # fill_ wrote the inf: that op is named, never empty_like
    assert f is not None and f.op == "fill_" and f.module == ""


def test_suggest_pins_a_module_whose_casts_underflow():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 2))
    x = torch.full((4, 8), 1e-9)  # every input value underflows in float16 (min subnormal 6e-8)
    with ampkit.doctor(model, every=1) as doc, ampkit.autocast("cpu", dtype=torch.float16):
        model(x)
    rows = {r["module"]: r for r in doc.stats()}
    w, b = model[0].weight, model[0].bias
    want = 32 / (32 + w.numel() + b.numel())  # x underflows; the parameters do not
    assert ((w != 0) & (w.half() == 0)).sum() == 0 and ((b != 0) & (b.half() == 0)).sum() == 0
    assert rows["0"]["underflow"] == pytest.approx(want)
    assert doc.first_nonfinite() is None
    assert [(m.pattern, m.pin) for m in doc.suggest().modules] == [("0", "float32")]
    assert doc.suggest(underflow=0.5).modules == ()


# -- the replay: a bad step that was not sampled ------------------------------------------
def _fp16_step(model, opt, scaler, x, device):
    """One training step in float16 with the scaler, the loss the output's sum (``opt``: an
    optimizer, or a list of them, each stepped through the scaler)."""
    opts = opt if isinstance(opt, list) else [opt]
    for o in opts:
        o.zero_grad()
    with ampkit.autocast(device, dtype=torch.float16):
        loss = model(x).float().sum()
    scaler.scale(loss).backward()
    for o in opts:
        scaler.step(o)
    scaler.update()


def _armed_run(model, opt, scaler, xs):
    """A doctor armed over float16 CPU steps on the batches ``xs``: (its first finding, the
    steps whose verdict the host read)."""
    with ampkit.doctor(model) as doc:
        for x in xs:
            _fp16_step(model, opt, scaler, x, "cpu")
        return doc.first_nonfinite(), doc.host_verdict_steps


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)])
def test_an_unsampled_bad_step_is_replayed_with_its_inputs_weights_and_dropout(device):
    # the last of 5 steps of a run armed with every=100 (only step 0 is sampled) overflows
    # after a dropout: the replay must run that step's weights, batch and dropout mask (the
    # CPU generator's bytes, or the CUDA generator's logged offset) again to name the op and
    # give its input's absmax, which the oracle computes from the same state
    get_rng, set_rng = (torch.get_rng_state, torch.set_rng_state) if device == "cpu" else \
        (torch.cuda.get_rng_state, torch.cuda.set_rng_state)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Dropout(0.5), torch.nn.Linear(8, 2)).to(device)
    with torch.no_grad():
        model[2].weight.mul_(50.0)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    scaler = ampkit.GradScaler(device, init_scale=1.0)
    bad = 4
    xs = [torch.randn(4, 8, device=device) * (5e3 if i == bad else 1.0) for i in range(bad + 1)]
    with ampkit.doctor(model) as doc:
        for i, x in enumerate(xs):
            if i == bad:
                rng, weights = get_rng(), {k: v.clone() for k, v in model.state_dict().items()}
            _fp16_step(model, opt, scaler, x, device)
        after = {k: v.clone() for k, v in model.state_dict().items()}
        grads = [p.grad.clone() for p in model.parameters()]
        rng_after = get_rng()
        f = doc.first_nonfinite()
        # reading put everything back: weights, gradients, the random state
        assert all(torch.equal(after[k], v) for k, v in model.state_dict().items())
        assert all(torch.equal(g, p.grad) for g, p in zip(grads, model.parameters()))
        assert torch.equal(rng_after, get_rng())
    oracle = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Dropout(0.5), torch.nn.Linear(8, 2)).to(device)
    oracle.load_state_dict(weights)
    set_rng(rng)
    with torch.autocast(device, dtype=torch.float16):
        h = oracle[1](oracle[0](xs[bad]))
        y = oracle[2](h)
    assert torch.isfinite(h).all() and not torch.isfinite(y).all()
    # addmm reads the float16 casts of layer 2's weight and bias
    want_in = max(h.abs().max().item(), oracle[2].weight.half().abs().max().item(),
                  oracle[2].bias.half().abs().max().item())
    assert (f.op, f.module, f.phase, f.dtype, f.step) == ("addmm", "2", "forward", "float16", bad)
    assert f.input_absmax == pytest.approx(want_in)
    assert f.output_absmax == float("inf")


def _bad_batch_run(device, feed, bad=3, steps=6, after_step=None):
    """A 2-layer model trained in float16 on ``steps`` batches, batch ``bad`` holding 1e6
    (its cast to float16 in layer 0 overflows): ``feed`` "new" passes each step a new
    tensor, "refill" copies each batch into one buffer. Returns (finding, the batches, the
    steps whose verdict the host read)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1)).to(device)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    scaler = ampkit.GradScaler(device, init_scale=1.0)
    xs = [torch.randn(4, 8, device=device) for _ in range(steps)]
    xs[bad][1, 2] = 1e6
    buf = torch.empty(4, 8, device=device)
    with ampkit.doctor(model) as doc:
        for i, x in enumerate(xs):
            if feed == "refill":
                buf.copy_(x)
                x = buf
            _fp16_step(model, opt, scaler, x, device)
            if after_step:
                after_step(i, x)
        f = doc.first_nonfinite()
        host = doc.host_verdict_steps
    return f, xs, host


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)])
def test_the_bad_batch_is_replayed_whether_steps_get_new_tensors_or_refill_one(device):
    # new tensors: the host reads each step's verdict a step later (or when the record is
    # read) and copies the first bad step's batch only then; one buffer refilled in place:
    # its bytes change before the verdict, so the device copies each step's bytes at once.
    # Either way the replay runs the bad batch: its finding is the same, at that step, with
    # the batch's absmax as the input's
    new, xs, host_new = _bad_batch_run(device, "new")
    refill, _, host_refill = _bad_batch_run(device, "refill")
    assert host_new > 0 and host_refill == 0
    key = (new.op, new.module, new.phase, new.dtype, new.step, new.input_absmax)
    assert key == (refill.op, refill.module, refill.phase, refill.dtype, refill.step, refill.input_absmax)
    assert (new.module, new.phase, new.step) == ("0", "forward", 3)
    assert new.input_absmax == xs[3].abs().max().item()


@pytest.mark.parametrize("batch,pending", [(1, 1), (3, 2), (32, 64)])
def test_the_verdicts_sent_in_batches_or_waited_for_name_the_same_step(monkeypatch, batch, pending):
    # the host sends the held flags every `batch` steps and waits once `pending` steps
    # hold their tensors: however they are set, the first bad step is the one replayed
    import ampkit._doctor._step_watch as _step_watch

    monkeypatch.setattr(_step_watch, "_BATCH", batch)
    monkeypatch.setattr(_step_watch, "_PENDING", pending)
    f, xs, host = _bad_batch_run("cpu", "new", steps=9)
    assert host == 8  # (step 0 has no last step to compare its inputs with: the device copies it)
    assert (f.module, f.phase, f.step) == ("0", "forward", 3)
    assert f.input_absmax == xs[3].abs().max().item()


class _OwnCheckScaler(ampkit.GradScaler):
    """A scaler whose gradient check is its own (flags in tensors it makes): the doctor's
    slot is not written, and the scaler tells the doctor after its check. ``inject``: the
    number of a check (counted from 0) that reports an inf whatever the gradients hold."""

    def __init__(self, *args, inject=None, **kwargs):
        super().__init__(*args, **kwargs)
        self.inject, self.calls = inject, 0

    def found_inf(self, grouped, unscale):
        out = {}
        for (dev, _), grads in grouped.items():
            bad = torch.stack([torch.isfinite(g).all().logical_not() for g in grads]).any().float()
            if unscale:
                inv = self._scale.reciprocal()
                for g in grads:
                    g.mul_(inv)
            out[dev] = torch.maximum(out[dev], bad) if dev in out else bad
        if self.calls == self.inject:
            out = {d: torch.ones_like(f) for d, f in out.items()}
        self.calls += 1
        return out


@pytest.mark.parametrize("optimizers,scaler_kind", [(1, "scaler"), (3, "scaler"), (3, "own")])
def test_the_flag_ring_wraps_and_folds_many_checks_of_a_step(monkeypatch, optimizers, scaler_kind):
    # a ring of 32 flag slots, sent every 3 steps, is passed 3 times by 40 steps; with three
    # optimizers a step has three checks, and at most 2 flags: the third check is folded into
    # the second. "scaler": an ampkit.GradScaler, step 33's batch overflows. "own": a scaler
    # with a check of its own, which reports an inf at the third check of step 33 only (the
    # replay then finds no op: the step is what counts; without the fold the flag is lost).
    # Either way step 33 is named: its flags are among those sent across the ring's end.
    import ampkit._doctor._step_watch as _step_watch

    monkeypatch.setattr(_step_watch, "_RING", 32)
    monkeypatch.setattr(_step_watch, "_BATCH", 3)
    monkeypatch.setattr(_step_watch, "_PENDING", 4)
    monkeypatch.setattr(_step_watch, "_FLAGS", 2)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1))
    params = list(model.parameters())
    opts = [torch.optim.SGD(params[i::optimizers], lr=1e-3) for i in range(optimizers)]
    if scaler_kind == "own":
        scaler = _OwnCheckScaler("cpu", init_scale=1.0, inject=33 * optimizers + 2)
    else:
        scaler = ampkit.GradScaler("cpu", init_scale=1.0)
    xs = [torch.randn(4, 8) for _ in range(40)]
    if scaler_kind == "scaler":
        xs[33][1, 2] = 1e6
    f, host = _armed_run(model, opts, scaler, xs)
    assert host == 39  # (step 0 has no last step to compare its inputs with: the device copies it)
    assert f.step == 33 and scaler.stats().skipped == 1
    if scaler_kind == "scaler":
        assert (f.module, f.phase) == ("0", "forward")
        assert f.input_absmax == xs[33].abs().max().item()


def test_an_armed_run_trains_as_the_unarmed_one_and_names_its_first_skip(monkeypatch):
    # the doctor takes each step's flag from the scaler and sends it around a small ring
    # (32 slots, passed twice): the training must not change (the oracle: the same run
    # unarmed, every parameter bitwise, the scale, the skipped steps), and the step the
    # doctor names is the scaler's first skipped one
    import ampkit._doctor._step_watch as _step_watch

    monkeypatch.setattr(_step_watch, "_RING", 32)
    monkeypatch.setattr(_step_watch, "_BATCH", 3)

    def run(armed):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1))
        opt = torch.optim.SGD(model.parameters(), lr=1e-2)
        scaler = ampkit.GradScaler("cpu", init_scale=2.0**8, growth_interval=4)
        xs = [torch.randn(4, 8) for _ in range(70)]
        for k in (33, 40):  # (the flag of step 33 sits in slot 0, reused by step 65's)
            xs[k][1, 2] = 1e6
        doc = ampkit.doctor(model) if armed else None
        first_skip = None
        for i, x in enumerate(xs):
            _fp16_step(model, opt, scaler, x, "cpu")
            if first_skip is None and scaler.stats().skipped:
                first_skip = i
        f = None
        if doc is not None:
            f = doc.first_nonfinite()
            doc.close()
        params = [p.detach().clone() for p in model.parameters()]
        return params, scaler.get_scale(), scaler.stats().skipped, first_skip, f

    params, scale, skipped, first_skip, f = run(True)
    params0, scale0, skipped0, first_skip0, _ = run(False)
    assert skipped == skipped0 and skipped0 >= 2 and scale == scale0  # (the growth overflows too)
    assert all(torch.equal(a, b) for a, b in zip(params, params0))
    assert f is not None and f.step == first_skip == first_skip0


def test_a_doctor_armed_under_another_default_dtype_checks_float32_training():
    # the doctor's own buffers are float32 whatever the default dtype at arming
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1))
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    scaler = ampkit.GradScaler("cpu", init_scale=1.0)
    xs = [torch.randn(4, 8) for _ in range(6)]
    xs[4][0, 1] = 1e6
    old = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        doc = ampkit.doctor(model)
    finally:
        torch.set_default_dtype(old)
    with doc:
        for x in xs:
            _fp16_step(model, opt, scaler, x, "cpu")
        f = doc.first_nonfinite()
    assert (f.module, f.phase, f.step) == ("0", "forward", 4) and scaler.stats().skipped == 1


def test_an_evaluation_forward_is_checked_before_a_capture_begins():
    # make_train_step notifies about_to_capture right before its CUDA graph capture: a forward
    # whose output got no backward (here: an overflowing evaluation batch, its output kept)
    # is checked then, eagerly, not inside the capture. The output is changed afterwards:
    # only a check made at that point still sees its inf
    from ampkit._listeners import about_to_capture

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1))
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    scaler = ampkit.GradScaler("cpu", init_scale=1.0)
    with ampkit.doctor(model) as doc:
        for _ in range(3):
            _fp16_step(model, opt, scaler, torch.randn(4, 8), "cpu")
        x = torch.randn(4, 8)
        x[0, 0] = 1e6
        with torch.no_grad(), ampkit.autocast("cpu", dtype=torch.float16):
            out = model(x)  # step 3, evaluation: no backward
        assert not torch.isfinite(out).all()
        about_to_capture.notify()
        out.zero_()
        f = doc.first_nonfinite()
    assert f is not None and (f.module, f.phase, f.step) == ("0", "forward", 3)


def test_a_scaler_whose_check_is_its_own_still_gives_the_doctor_its_flag():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1))
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    scaler = _OwnCheckScaler("cpu", init_scale=1.0)
    xs = [torch.randn(4, 8) for _ in range(9)]
    xs[5][0, 1] = 1e6
    f, host = _armed_run(model, opt, scaler, xs)
    assert host == 8 and scaler.stats().skipped == 1
    assert (f.module, f.phase, f.step) == ("0", "forward", 5)
    assert f.input_absmax == xs[5].abs().max().item()


def test_closing_lets_go_of_the_steps_still_waiting_for_their_verdict():
    # the host holds each step's batch until its verdict (up to 32 steps): closing the
    # doctor reads the verdicts, and the batches are freed once the caller drops them
    import gc
    import weakref

    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    scaler = ampkit.GradScaler("cpu", init_scale=1.0)
    doc = ampkit.doctor(model)
    refs = []
    for _ in range(5):
        x = torch.randn(3, 4)
        refs.append(weakref.ref(x))
        _fp16_step(model, opt, scaler, x, "cpu")
    del x
    gc.collect()
    assert sum(r() is not None for r in refs) >= 3  # held while armed, waiting for verdicts
    doc.close()
    gc.collect()
    assert all(r() is None for r in refs)


def test_a_batch_changed_in_place_before_its_verdict_is_named_in_a_warning():
    # the bad step's new tensor is zeroed right after its step, before the host read the
    # step's verdict (at the next step): the replay cannot run the bytes the step ran, and
    # says so
    def zero_bad(i, x):
        if i == 3:
            x.zero_()

    with pytest.warns(RuntimeWarning, match="step 3 were changed in place"):
        f, _, _ = _bad_batch_run("cpu", "new", after_step=zero_bad)
    assert f.step == 3


def test_the_scaler_of_another_model_is_not_this_doctors_check():
    # two models, each with its own optimizer and scaler; the doctor is armed on the first,
    # whose steps stay finite, while the second's loss is inf from step 1 on (its scaler
    # skips those; step 0, the sampled one, watches every op until the next step): the
    # second scaler's verdicts are not the first model's
    torch.manual_seed(0)
    models = [torch.nn.Linear(4, 2) for _ in range(2)]
    opts = [torch.optim.SGD(m.parameters(), lr=1e-3) for m in models]
    scalers = [ampkit.GradScaler("cpu", init_scale=1.0) for _ in models]
    with ampkit.doctor(models[0]) as doc:
        for i in range(4):
            for k, (m, opt, sc) in enumerate(zip(models, opts, scalers)):
                loss = m(torch.randn(3, 4)).sum() * (float("inf") if k and i else 1.0)
                sc.scale(loss).backward()
                sc.step(opt)
                sc.update()
                opt.zero_grad()
        assert scalers[1].stats().skipped == 3 and scalers[0].stats().skipped == 0
        assert doc.first_nonfinite() is None


def test_reading_mid_run_changes_nothing_in_the_run():
    def run(read):
        torch.manual_seed(3)
        model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Dropout(0.2), torch.nn.Linear(8, 2))
        opt = torch.optim.Adam(model.parameters(), lr=1e-2)
        scaler = ampkit.GradScaler("cpu", init_scale=2.0**20)  # overflows early: skips, backs off
        out = []
        with ampkit.doctor(model, every=3) as doc:
            for i in range(6):
                opt.zero_grad()
                with ampkit.autocast("cpu", dtype=torch.float16):
                    loss = model(torch.randn(4, 8) * 100).float().pow(2).sum()
                scaler.scale(loss).backward()
                if read:
                    doc.first_nonfinite()
                scaler.step(opt)
                scaler.update()
                out.append(loss.detach())
            f = doc.first_nonfinite()
        return torch.stack(out), [p.detach().clone() for p in model.parameters()], f

    a, pa, fa = run(False)
    b, pb, fb = run(True)
    assert fa is not None and fa == fb
    assert bits_equal(a, b) and all(bits_equal(x, y) for x, y in zip(pa, pb))


@pytest.mark.parametrize("i", range(0, N_FAULTS, 4))
def test_a_sampled_step_names_a_single_element_fault(i):
    # every=1: the op-level watch runs in the faulty step itself and sees a fault that a
    # ReLU masks before any gradient (elements="first"), which the per-step check cannot
    f = _plan()[i]
    finding, fired = faults.run_fault(f, step=1, every=1, elements="first")
    assert fired == 1
    assert (finding.op, finding.module, finding.phase, finding.step) == (f["op"], f["module"], f["phase"], 1)


def test_a_fault_that_dies_inside_the_step_is_not_a_finding_of_an_unsampled_step():
    # the per-step check looks at what reaches the gradients and the outputs: an inf that
    # a ReLU masks in the backward does no harm, and an unsampled step does not report it
    f = next(f for f in _plan() if (f["case"], f["mode"], f["phase"], f["module"], f["op"])
             == ("seed_mlp", "eager", "backward", "4", "mm"))
    finding, fired = faults.run_fault(f, step=1, every=100, elements="first")
    assert fired == 1 and finding is None
    finding, _ = faults.run_fault(f, step=1, every=100, elements="all")
    assert (finding.op, finding.module, finding.phase) == ("mm", "4", "backward")


def test_inject_refuses_a_bad_elements_value():
    with pytest.raises(ValueError, match="elements must be 'all' or 'first', got 'some'"):
        faults.inject(_mlp(), "0", "addmm", elements="some")


@pytest.mark.parametrize("keep_weights", [True, False])
def test_keep_weights_replays_the_bad_steps_own_weights_after_later_steps(keep_weights):
    # step 1 overflows in layer 2; each step's update scales layer 2's weights (nothing skips). The finding's
    # input absmax (layer 2's input and weights) is derived by hand from step 1's weights
    # (keep_weights) or from the weights at reading (the default), which the finding says
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    with torch.no_grad():
        model[2].weight.mul_(2000.0)
    xs = [torch.randn(4, 8), torch.randn(4, 8) * 300, torch.randn(4, 8), torch.randn(4, 8)]

    def want(weights):
        oracle = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
        oracle.load_state_dict(weights)
        with torch.autocast("cpu", dtype=torch.float16):
            h = oracle[1](oracle[0](xs[1]))
            assert torch.isfinite(h).all() and not torch.isfinite(oracle[2](h)).all()
        # addmm reads the float16 casts of layer 2's weight and bias
        return max(h.abs().max().item(), oracle[2].weight.half().abs().max().item(),
                   oracle[2].bias.half().abs().max().item())

    with ampkit.doctor(model, keep_weights=keep_weights) as doc:
        for i, x in enumerate(xs):
            if i == 1:
                step1 = {k: v.clone() for k, v in model.state_dict().items()}
            model.zero_grad()
            with ampkit.autocast("cpu", dtype=torch.float16):
                loss = model(x).float().sum()
            loss.backward()
            with torch.no_grad():  # an update that steps on (only the doctor's check saw the inf)
                model[2].weight.mul_(1.5)
        now = {k: v.clone() for k, v in model.state_dict().items()}
        f = doc.first_nonfinite()
    assert (f.op, f.module, f.phase, f.step) == ("addmm", "2", "forward", 1)
    assert f.weights == ("step" if keep_weights else "current")
    assert want(step1) != pytest.approx(want(now))  # the later steps did change what the op saw
    assert f.input_absmax == pytest.approx(want(step1 if keep_weights else now))


def test_keep_weights_must_be_a_bool():
    model = _mlp()
    with pytest.raises(ValueError, match="keep_weights must be True or False, got 1"):
        ampkit.doctor(model, keep_weights=1)
    assert all(not m._forward_pre_hooks for m in model.modules())


def test_a_non_contiguous_parameter_is_refused_only_when_its_bytes_are_kept():
    model = _mlp()
    model[0].weight.data = model[0].weight.data.t().contiguous().t()  # same values, transposed strides
    with pytest.raises(ValueError, match="keep_weights=True, and the model has a non-contiguous parameter"):
        ampkit.doctor(model, keep_weights=True)
    assert all(not m._forward_pre_hooks for m in model.modules())
    with ampkit.doctor(model) as doc, ampkit.autocast("cpu", dtype=torch.float16):
        model(torch.full((2, 8), 1e6))  # the input's cast overflows
    assert doc.first_nonfinite().op == "_to_copy"


def test_an_input_that_requires_grad_is_replayed():
    # the step's inputs are held as they come (here one that requires grad, as an
    # embedding fed in from outside would) and copied only for the first bad step
    torch.manual_seed(0)
    model = _mlp()
    with ampkit.doctor(model) as doc:
        for i in range(2):
            x = torch.randn(2, 8).mul_(1e6 if i == 1 else 1.0).requires_grad_()
            with ampkit.autocast("cpu", dtype=torch.float16):
                loss = model(x).float().sum()
            loss.backward()
        f = doc.first_nonfinite()
    assert (f.op, f.module, f.phase, f.step, f.input_absmax) == ("_to_copy", "0", "forward", 1, x.abs().max().item())


@pytest.mark.parametrize("placed_by", ["keep_weights", "refilled_buffer"])
def test_a_step_checked_twice_keeps_its_data_for_the_bad_second_check(placed_by):
    # two optimizers through one scaler check a step twice; only the second one's gradients
    # overflow. On the device's path (keep_weights, or one input buffer refilled each step)
    # the step's inputs must still be kept for the second, bad check (they were let go at the
    # first, and the replay then failed). The oracle: the same run with one optimizer over
    # every parameter (one check a step) names the same op, module, phase and step.
    def run(split):
        torch.manual_seed(0)
        m = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
        with torch.no_grad():
            m[2].weight.fill_(1e-3)
        opts = [torch.optim.SGD(m[0].parameters(), lr=0.0), torch.optim.SGD(m[2].parameters(), lr=0.0)] \
            if split else [torch.optim.SGD(m.parameters(), lr=0.0)]
        scaler = ampkit.GradScaler("cpu", init_scale=2.0**12, growth_interval=10**6)
        xs = [torch.rand(4, 8) * 0.1 for _ in range(6)]
        xs[4] = torch.rand(4, 8) * 10 + 5  # layer 2's weight gradient overflows float16, layer 0's does not
        buf = torch.empty(4, 8)
        with ampkit.doctor(m, keep_weights=placed_by == "keep_weights") as doc:
            for x in xs:
                _fp16_step(m, opts, scaler, buf.copy_(x) if placed_by == "refilled_buffer" else x, "cpu")
            f = doc.first_nonfinite()
        return f, scaler.stats().skipped

    (f2, skipped2), (f1, skipped1) = run(True), run(False)
    assert skipped1 == skipped2 == 1
    assert f1 is not None and f1.step == 4 and f1.op != "<not reproduced>"
    assert f2 is not None and (f2.op, f2.module, f2.phase, f2.step) == (f1.op, f1.module, f1.phase, f1.step)


def test_the_doctor_listens_to_the_scaler_and_the_capture_only_while_armed():
    # the core offers listener points and knows no doctor: arming subscribes, closing (or
    # the doctor's collection with its model, never closed) unsubscribes; a second model's
    # doctor may arm once the first is gone
    import gc
    import weakref

    from ampkit._listeners import about_to_capture, gradients_checked

    def points():
        return len(gradients_checked.listeners), len(about_to_capture.listeners)

    before = points()
    model = torch.nn.Linear(4, 1)
    doc = ampkit.doctor(model)
    assert points() == (before[0] + 1, before[1] + 1)
    doc.close()
    assert points() == before
    doc = ampkit.doctor(model)
    with pytest.raises(RuntimeError, match="already armed"):
        ampkit.doctor(model)
    ref = weakref.ref(doc)
    del doc, model
    gc.collect()
    assert ref() is None and points() == before
    ampkit.doctor(torch.nn.Linear(4, 1)).close()
    assert points() == before
