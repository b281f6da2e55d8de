"""Nothing lost: a step whose gradients hold an inf/NaN leaves params and optimizer state
bit for bit as they were, for every optimizer in torch.optim that works with a scaler."""

from __future__ import annotations

import inspect
import math

import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st

import ampkit
from ampkit._grad_check import inf_norms
from conftest import bits_equal

# Constructor keywords per optimizer; every Optimizer subclass in torch.optim must be listed
# here or in SKIPPED (test_every_optimizer_is_covered enforces it).
KWARGS = {
    "ASGD": dict(lr=0.05),
    "Adadelta": dict(lr=0.5),
    "Adafactor": dict(lr=0.05),
    "Adagrad": dict(lr=0.05),
    "Adam": dict(lr=0.05),
    "AdamW": dict(lr=0.05),
    "Adamax": dict(lr=0.05),
    "Muon": dict(lr=0.05),  # 2-D parameters only: the model below has only matrices
    "NAdam": dict(lr=0.05),
    "RAdam": dict(lr=0.05),
    "RMSprop": dict(lr=0.05, momentum=0.5),
    "Rprop": dict(lr=0.05),
    "SGD": dict(lr=0.05, momentum=0.9, nesterov=True, weight_decay=1e-2),
    "SparseAdam": dict(lr=0.05),  # sparse gradients: an nn.Embedding(sparse=True)
}
SKIPPED = {
    "LBFGS": "needs step(closure), which re-evaluates the loss and gradients after the "
    "scaler checked them; GradScaler.step refuses closures (as torch's does)",
}
FUSED = {"Adam", "AdamW", "SGD", "Adagrad"}


def _all_optimizers():
    return sorted(
        name
        for name, obj in vars(torch.optim).items()
        if inspect.isclass(obj) and issubclass(obj, torch.optim.Optimizer) and obj is not torch.optim.Optimizer
    )


def test_every_optimizer_is_covered():
    missing = [n for n in _all_optimizers() if n not in KWARGS and n not in SKIPPED]
    assert not missing, f"add {missing} to KWARGS (or to SKIPPED with a reason)"


def _cases():
    out = []
    for name in _all_optimizers():
        if name in SKIPPED:
            continue
        out.append((name, False))
        if name in FUSED:
            try:
                getattr(torch.optim, name)([torch.nn.Parameter(torch.zeros(2))], fused=True)
                out.append((name, True))
            except (RuntimeError, TypeError, ValueError):
                pass
    return out


CASES = _cases()


class Net(torch.nn.Module):
    def __init__(self, sparse: bool):
        super().__init__()
        torch.manual_seed(0)
        self.sparse = sparse
        if sparse:
            self.emb = torch.nn.Embedding(10, 4, sparse=True)
        else:
            self.w1 = torch.nn.Parameter(torch.randn(4, 6) * 0.3)
            self.w2 = torch.nn.Parameter(torch.randn(2, 4) * 0.3)

    def loss(self, g: torch.Generator) -> torch.Tensor:
        if self.sparse:
            idx = torch.randint(0, 10, (5,), generator=g)
            return self.emb(idx).pow(2).sum()
        x = torch.randn(3, 6, generator=g)
        return (torch.tanh(x @ self.w1.t()) @ self.w2.t()).pow(2).mean()


def _state(net, opt):
    tensors = [p.detach().clone() for p in net.parameters()]
    for p in net.parameters():
        for k, v in sorted(opt.state.get(p, {}).items()):
            tensors.append(v.detach().clone() if torch.is_tensor(v) else torch.tensor(float(v)))
    return tensors


@settings(max_examples=40, deadline=None)
@given(
    case=st.sampled_from(CASES),
    warm=st.integers(0, 2),
    where=st.integers(0, 10_000),
    value=st.sampled_from([float("inf"), float("-inf"), float("nan")]),
    explicit_unscale=st.booleans(),
    hysteresis=st.sampled_from([1, 3]),
)
def test_a_non_finite_step_loses_nothing(case, warm, where, value, explicit_unscale, hysteresis):
    name, fused = case
    net = Net(sparse=name == "SparseAdam")
    kw = dict(KWARGS[name], **({"fused": True} if fused else {}))
    opt = getattr(torch.optim, name)(net.parameters(), **kw)
    scaler = ampkit.GradScaler("cpu", init_scale=2.0**8, growth_interval=1, hysteresis=hysteresis)
    g = torch.Generator().manual_seed(where)

    def iterate(poison: bool):
        opt.zero_grad()
        scaler.scale(net.loss(g)).backward()
        if poison:
            grads = [p.grad for p in net.parameters()]
            grad = grads[where % len(grads)]
            flat = grad._values().view(-1) if grad.is_sparse else grad.view(-1)
            flat[where % flat.numel()] = value
        if explicit_unscale and not fused:
            scaler.unscale_(opt)
        scaler.step(opt)
        scaler.update()

    for _ in range(warm):
        before = _state(net, opt)
        iterate(poison=False)
        # A clean step does change something, so the check below can fail.
        assert not all(bits_equal(a, b) for a, b in zip(before, _state(net, opt)))
    before = _state(net, opt)
    iterate(poison=True)
    after = _state(net, opt)
    n_params = len(list(net.parameters()))
    if len(after) != len(before):
        # Fused kernels allocate their state before they see found_inf (torch's scaler does
        # the same); a skipped first step must leave it at its initial value: zeros, step 0.
        assert fused and warm == 0 and len(before) == n_params, f"{name}: state appeared"
        assert all(not t.any() for t in after[n_params:]), f"{name}: new state is not initial"
        after = after[:n_params]
    for a, b in zip(before, after):
        assert bits_equal(a, b), f"{name} (fused={fused}): a skipped step changed state"
    assert scaler.stats().last_skipped == warm


@pytest.mark.parametrize("name", sorted(SKIPPED))
def test_skipped_optimizers_are_refused_clearly(name):
    p = torch.nn.Parameter(torch.ones(3))
    opt = getattr(torch.optim, name)([p])
    scaler = ampkit.GradScaler("cpu")
    scaler.scale(p.sum()).backward()
    with pytest.raises(RuntimeError, match="closure"):
        scaler.step(opt, closure=lambda: p.sum())


_BIG = {torch.float16: 65504.0, torch.bfloat16: 3.3895e38, torch.float32: 3.4028e38, torch.float64: 1.7e308}
# (tensor index, element index, what to write there), up to three pokes
_POKES = st.lists(
    st.tuples(st.integers(0, 10**6), st.integers(0, 10**6),
              st.sampled_from(["inf", "-inf", "nan", "big", "-big", "tiny"])),
    max_size=3,
)


def _poked_grads(dtype, sizes, pokes, transpose):
    """(2, n) gradients of ``dtype``, one per size, with the pokes written into them."""
    values = {"inf": float("inf"), "-inf": float("-inf"), "nan": float("nan"),
              "big": _BIG[dtype], "-big": -_BIG[dtype], "tiny": 1e-45}
    gen = torch.Generator().manual_seed(len(sizes))
    bases = [torch.randn(2, n, generator=gen).to(dtype) for n in sizes]
    for i, j, what in pokes:
        b = bases[i % len(bases)]
        if b.numel():
            b.view(-1)[j % b.numel()] = values[what]
    return [b.t() if transpose else b for b in bases]


@settings(max_examples=60, deadline=None)
@given(
    dtype=st.sampled_from(list(_BIG)),
    sizes=st.lists(st.integers(0, 300), min_size=1, max_size=6),
    pokes=_POKES,
    transpose=st.booleans(),
)
def test_the_fused_check_flags_exactly_what_torchs_check_flags(dtype, sizes, pokes, transpose):
    """The fused path's read-only check against torch's check-and-multiply-by-1.0, for any
    mix of sizes (empty ones too), layouts, dtypes and inf/-inf/NaN/extreme finite values."""
    grads = _poked_grads(dtype, sizes, pokes, transpose)
    cpu = torch.device("cpu")
    ours = ampkit.GradScaler("cpu").found_inf({(cpu, dtype): grads}, unscale=False)[cpu]
    theirs = torch.zeros(())
    torch._amp_foreach_non_finite_check_and_unscale_([g.clone() for g in grads], theirs, torch.ones(()))
    assert bits_equal(ours, theirs), (ours, theirs)
    assert bool(theirs) == any(not torch.isfinite(g).all() for g in grads)  # the oracle is right


@settings(max_examples=60, deadline=None)
@given(
    sizes=st.lists(st.integers(1, 300), min_size=1, max_size=6),
    pokes=_POKES,
    transpose=st.booleans(),
)
def test_bfloat16_inf_norms_equal_the_widened_norms(sizes, pokes, transpose):
    """The device path's bfloat16 probes (float32 straight out of _foreach_norm) equal the
    bfloat16 norms widened afterwards, as it did before, bit for bit (NaN as NaN), and flag
    exactly what torch's check flags. Run on CPU tensors (no GPU here), whose _foreach_norm
    is the per-tensor route of the same op."""
    grads = _poked_grads(torch.bfloat16, sizes, pokes, transpose)
    ours = inf_norms(grads)
    widened = [p.float() for p in torch._foreach_norm(grads, math.inf)]
    assert len(ours) == len(widened)
    for a, b in zip(ours, widened):
        assert a.dtype == torch.float32 and (bits_equal(a, b) or (a.isnan() and b.isnan())), (a, b)
    flag, theirs = torch.zeros(()), torch.zeros(())
    torch._amp_foreach_non_finite_check_and_unscale_(ours, flag, torch.ones(()))
    torch._amp_foreach_non_finite_check_and_unscale_([g.float() for g in grads], theirs, torch.ones(()))
    assert bits_equal(flag, theirs)


# --------------------------------------------------------------------------- call sequences
# Random sequences of scaler calls, valid and not, against torch.amp.GradScaler driven
# through the same sequence. Every action is applied to two identical systems (model,
# optimizer, scaler): ours and torch's. A failed iteration (an exception between scale
# and update) is recovered the documented way on ours, scaler.reset_iteration(), and on
# torch's the only way it has, a new scaler loaded from its state_dict; an invalid call is
# made on ours only and must raise and change nothing. After every action the two systems
# hold bitwise the same parameters, optimizer state, scale and growth tracker, and every
# step with inf/NaN gradients leaves parameters and optimizer state as they were.
SEQ_KW = dict(init_scale=2.0**6, growth_factor=2.0, backoff_factor=0.5, growth_interval=2)
SEQ_OPTIMIZERS = {
    "sgd_momentum": lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9),
    "sgd_fused": lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9, fused=True),
    "adam": lambda p: torch.optim.Adam(p, lr=0.01),
}


class _Injected(Exception):
    pass


class _System:
    def __init__(self, make_opt, scaler):
        self.net = Net(sparse=False)
        self.opt = make_opt(list(self.net.parameters()))
        self.scaler = scaler
        self.gen = torch.Generator().manual_seed(7)

    def backward(self, poison):
        self.opt.zero_grad()
        self.scaler.scale(self.net.loss(self.gen)).backward()
        if poison is not None:
            self.net.w2.grad[1, 2] = poison

    def fail_inside_optimizer_step(self):
        real = self.opt.step
        self.opt.step = lambda *a, **k: (_ for _ in ()).throw(_Injected())
        try:
            self.scaler.step(self.opt)
        except _Injected:
            pass
        finally:
            self.opt.step = real


def _bad_calls(ours):
    """(description, call) pairs that must raise on a scaler between iterations."""
    sd = ours.scaler.state_dict()
    return {
        "update_without_step": lambda: ours.scaler.update(),
        "update_nan_tensor": lambda: ours.scaler.update(new_scale=torch.tensor(float("nan"))),
        "update_negative": lambda: ours.scaler.update(new_scale=-1.0),
        "load_tracker_at_interval": lambda: ours.scaler.load_state_dict(
            {**sd, "_growth_tracker": sd["growth_interval"]}),
        "load_missing_key": lambda: ours.scaler.load_state_dict(
            {k: v for k, v in sd.items() if k != "scale"}),
        "set_growth_interval_0": lambda: ours.scaler.set_growth_interval(0),
        "step_not_an_optimizer": lambda: ours.scaler.step(object()),
        "scale_a_string": lambda: ours.scaler.scale("loss"),
    }


BAD_CALLS = ["update_without_step", "update_nan_tensor", "update_negative",
             "load_tracker_at_interval", "load_missing_key", "set_growth_interval_0",
             "step_not_an_optimizer", "scale_a_string"]
_ACTIONS = st.one_of(
    st.tuples(st.just("iterate"), st.sampled_from([None, float("inf"), float("nan")]),
              st.booleans()),
    st.tuples(st.just("fail"), st.sampled_from(
        ["after_scale", "after_unscale", "in_optimizer_step", "after_step"]), st.booleans()),
    st.tuples(st.just("invalid"), st.sampled_from(BAD_CALLS), st.booleans()),
    st.tuples(st.just("round_trip"), st.none(), st.booleans()),
    st.tuples(st.just("set_scale"), st.sampled_from([1.0, 512.0, 2.0**20]), st.booleans()),
)


def _tracker(scaler):
    return scaler.state_dict()["_growth_tracker"]


def _torch_restarted(scaler, opt=None):
    # torch's scaler, when a fused optimizer's step raises, leaves its grad_scale (None
    # after unscale_) and found_inf attributes on the optimizer, and its next step() then
    # fails on them; part of torch's way out is to delete them. Ours removes them itself.
    for name in ("grad_scale", "found_inf"):
        if opt is not None and hasattr(opt, name):
            delattr(opt, name)
    fresh = torch.amp.GradScaler("cpu", **SEQ_KW)
    fresh.load_state_dict(scaler.state_dict())
    return fresh


@settings(max_examples=40, deadline=None)
@example(opt_name="sgd_fused", actions=[("fail", "in_optimizer_step", False), ("iterate", None, False)])
@example(opt_name="sgd_momentum", actions=[("fail", "in_optimizer_step", True), ("iterate", None, True)])
@given(opt_name=st.sampled_from(sorted(SEQ_OPTIMIZERS)),
       actions=st.lists(_ACTIONS, min_size=1, max_size=10))
def test_random_call_sequences_follow_torch_and_recover(opt_name, actions):
    make_opt = SEQ_OPTIMIZERS[opt_name]
    ours = _System(make_opt, ampkit.GradScaler("cpu", **SEQ_KW))
    theirs = _System(make_opt, torch.amp.GradScaler("cpu", **SEQ_KW))
    both = (ours, theirs)
    # One clean iteration first: a skipped *first* fused-SGD step leaves torch's momentum
    # buffer uninitialised (garbage; ours zeroes it, a documented difference).
    for s in both:
        s.backward(None)
        s.scaler.step(s.opt)
        s.scaler.update()
    for i, (kind, arg, flag) in enumerate(actions):
        if kind == "iterate":  # a valid iteration, optionally with unscale_ (for clipping)
            before = _state(ours.net, ours.opt)
            for s in both:
                s.backward(arg)
                if flag:
                    s.scaler.unscale_(s.opt)
                s.scaler.step(s.opt)
                s.scaler.update()
            if arg is not None:  # skipped: nothing moved
                after = _state(ours.net, ours.opt)
                assert len(after) == len(before)
                for a, b in zip(before, after):
                    assert bits_equal(a, b), "a step with inf/NaN gradients changed state"
        elif kind == "fail":  # an exception between scale and update, then the recovery
            for s in both:
                s.backward(float("inf") if flag else None)
                if arg in ("after_unscale", "in_optimizer_step"):
                    s.scaler.unscale_(s.opt)
                if arg == "in_optimizer_step":
                    s.fail_inside_optimizer_step()
                if arg == "after_step":
                    s.scaler.step(s.opt)
            assert not hasattr(ours.opt, "grad_scale") and not hasattr(ours.opt, "found_inf")
            ours.scaler.reset_iteration()
            theirs.scaler = _torch_restarted(theirs.scaler, theirs.opt)
        elif kind == "invalid":  # ours only: raises, changes nothing
            name = arg
            sd, stage, st_before = (ours.scaler.state_dict(), ours.scaler.stage(ours.opt),
                                    _state(ours.net, ours.opt))
            with pytest.raises((RuntimeError, ValueError, TypeError)):
                _bad_calls(ours)[name]()
            assert ours.scaler.state_dict() == sd and ours.scaler.stage(ours.opt) is stage
            assert all(bits_equal(a, b) for a, b in zip(st_before, _state(ours.net, ours.opt)))
        elif kind == "round_trip":  # through a new scaler of each kind
            fresh = ampkit.GradScaler("cpu", **SEQ_KW)
            fresh.load_state_dict(ours.scaler.state_dict())
            ours.scaler = fresh
            theirs.scaler = _torch_restarted(theirs.scaler)
        elif kind == "set_scale":  # a valid iteration ending in update(new_scale=...)
            for s in both:
                s.backward(None)
                s.scaler.step(s.opt)
                s.scaler.update(new_scale=arg)
        # Same trajectory as torch, bit for bit.
        assert ours.scaler.get_scale() == theirs.scaler.get_scale(), (i, kind, arg)
        assert _tracker(ours.scaler) == _tracker(theirs.scaler), (i, kind, arg)
        for a, b in zip(_state(ours.net, ours.opt), _state(theirs.net, theirs.opt)):
            assert bits_equal(a, b), (i, kind, arg)
    # A valid iteration can always follow, and it is torch's.
    for s in both:
        s.backward(None)
        s.scaler.step(s.opt)
        s.scaler.update()
    assert ours.scaler.get_scale() == theirs.scaler.get_scale()
    for a, b in zip(_state(ours.net, ours.opt), _state(theirs.net, theirs.opt)):
        assert bits_equal(a, b)
