"""ampkit.GradScaler against torch.amp.GradScaler (the oracle), plus what torch lacks.

Trajectory tests train two copies of one model on the same batches, one with each
scaler, inject inf/NaN at chosen steps, and after every update compare the scale, the
growth tracker, every parameter and every optimizer state tensor bit for bit.
"""

from __future__ import annotations

import copy
import math
import re

import pytest
import torch

from torch.utils._python_dispatch import TorchDispatchMode

import ampkit
from ampkit._grad_check import finite_probes
from ampkit._scaler import HISTORY_SIZE, OptState
from conftest import bits_equal

INF, NAN = float("inf"), float("nan")


# --------------------------------------------------------------------------- helpers


def opt_tensors(opt: torch.optim.Optimizer) -> list[tuple[str, torch.Tensor]]:
    out = []
    for g, group in enumerate(opt.param_groups):
        for i, p in enumerate(group["params"]):
            for k, v in sorted(opt.state.get(p, {}).items()):
                if isinstance(v, torch.Tensor):
                    out.append((f"group{g}.param{i}.{k}", v.detach().clone()))
                else:
                    out.append((f"group{g}.param{i}.{k}", torch.tensor(float(v), dtype=torch.float64)))
    return out


def snapshot(models, opts, scaler) -> list[tuple[str, torch.Tensor]]:
    # the growth tracker as both scalers report it (ampkit's device copy lags on the plain path)
    tracker = torch.tensor(scaler.state_dict()["_growth_tracker"], dtype=torch.int32)
    snap = [("scale", scaler._scale.clone()), ("growth_tracker", tracker)]
    for m, model in enumerate(models):
        for name, p in model.named_parameters():
            snap.append((f"model{m}.{name}", p.detach().clone()))
    for o, opt in enumerate(opts):
        snap += [(f"opt{o}.{k}", v) for k, v in opt_tensors(opt)]
    return snap


def assert_same(step: int, ours, theirs) -> None:
    assert [k for k, _ in ours] == [k for k, _ in theirs], f"step {step}: different fields"
    for (name, a), (_, b) in zip(ours, theirs):
        assert bits_equal(a, b), f"step {step}: {name} differs:\nours   {a}\ntorch  {b}"


def make_model(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(6, 12), torch.nn.Tanh(), torch.nn.Linear(12, 3))


def batches(n: int, seed: int = 1, bad: dict | None = None):
    """n (x, y) batches; ``bad`` maps a step to a value written into that step's input."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        x, y = torch.randn(5, 6, generator=g), torch.randn(5, 3, generator=g)
        if bad and i in bad:
            x[0, 0] = bad[i]
        out.append((x, y))
    return out


def forward_loss(model, x, y):
    with torch.autocast("cpu", dtype=torch.bfloat16):  # the oracle autocast: a bf16 forward
        out = model(x)
    return torch.nn.functional.mse_loss(out.float(), y)


def poison_grad(model, value) -> None:
    """Write a non-finite value into one (scaled) gradient, as an fp16 overflow would."""
    next(iter(model.parameters())).grad.view(-1)[3] = value


OPTIMIZERS = {
    "sgd": lambda p: torch.optim.SGD(p, lr=0.05),
    "sgd_momentum_wd": lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9, weight_decay=1e-2),
    "adam": lambda p: torch.optim.Adam(p, lr=1e-2),
    "adamw_foreach": lambda p: torch.optim.AdamW(p, lr=1e-2, foreach=True),
    "rmsprop": lambda p: torch.optim.RMSprop(p, lr=1e-2),
    # Fused CPU kernels take grad_scale/found_inf themselves: the scaler's sync-free path.
    "sgd_fused": lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9, fused=True),
    "adam_fused": lambda p: torch.optim.Adam(p, lr=1e-2, fused=True),
    "adamw_fused": lambda p: torch.optim.AdamW(p, lr=1e-2, fused=True),
}


def _fused_supported(name: str = "adam_fused") -> bool:
    """Fused CPU kernels arrived optimizer by optimizer (torch 2.4+)."""
    try:
        OPTIMIZERS[name]([torch.nn.Parameter(torch.zeros(1))])
        return True
    except (RuntimeError, TypeError, ValueError):
        return False


def _opt_param(name):
    marks = []
    if name.endswith("_fused") and not _fused_supported(name):
        marks.append(pytest.mark.skip(reason="this torch has no fused CPU optimizers"))
    return pytest.param(name, marks=marks, id=name)


SCALER_KW = dict(init_scale=2.0**16, growth_factor=2.0, backoff_factor=0.5, growth_interval=2)


def run_pair(recipe, n_steps, make_opt, *, n_models=1, scaler_kw=None, check=True):
    """Run ``recipe`` with ours and torch's scaler; compare after every update."""
    kw = dict(SCALER_KW, **(scaler_kw or {}))
    runs = []
    for cls in (ampkit.GradScaler, torch.amp.GradScaler):
        models = [make_model(seed=m) for m in range(n_models)]
        opts = [make_opt(m.parameters()) for m in models]
        runs.append((models, opts, cls("cpu", **kw)))
    history = []
    for step in range(n_steps):
        snaps = []
        for models, opts, scaler in runs:
            recipe(step, models, opts, scaler)
            snaps.append(snapshot(models, opts, scaler))
        if check:
            assert_same(step, *snaps)
        history.append(snaps)
    return runs, history


# --------------------------------------------------------------------------- recipes

BAD_INPUT = {2: INF, 5: NAN, 6: NAN}  # non-finite batches (whole loss -> inf/NaN)
BAD_GRAD = {3: INF, 8: NAN}  # one poisoned gradient element
N_STEPS = 10
DATA = batches(N_STEPS * 2, bad={2 * k: v for k, v in BAD_INPUT.items()})


def recipe_basic(step, models, opts, scaler):
    (model,), (opt,) = models, opts
    x, y = DATA[2 * step]
    opt.zero_grad()
    scaler.scale(forward_loss(model, x, y)).backward()
    if step in BAD_GRAD:
        poison_grad(model, BAD_GRAD[step])
    scaler.step(opt)
    scaler.update()


def recipe_clip(step, models, opts, scaler):
    (model,), (opt,) = models, opts
    x, y = DATA[2 * step]
    opt.zero_grad()
    scaler.scale(forward_loss(model, x, y)).backward()
    if step in BAD_GRAD:
        poison_grad(model, BAD_GRAD[step])
    scaler.unscale_(opt)
    torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=0.1)
    scaler.step(opt)
    scaler.update()


def recipe_accumulate(step, models, opts, scaler):
    (model,), (opt,) = models, opts
    opt.zero_grad()
    for micro in range(2):
        x, y = DATA[2 * step + micro]
        scaler.scale(forward_loss(model, x, y) / 2).backward()
    if step in BAD_GRAD:
        poison_grad(model, BAD_GRAD[step])
    scaler.step(opt)
    scaler.update()


def recipe_two_optimizers(step, models, opts, scaler):
    """torch's "multiple models, losses and optimizers" example, one scaler for all."""
    (m0, m1), (o0, o1) = models, opts
    x, y = DATA[2 * step]
    o0.zero_grad()
    o1.zero_grad()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out0, out1 = m0(x), m1(x)
    loss0 = torch.nn.functional.mse_loss((2 * out0 + out1).float(), y)
    loss1 = torch.nn.functional.mse_loss((3 * out0 - out1).float(), y)
    scaler.scale(loss0).backward(retain_graph=True)
    scaler.scale(loss1).backward()
    if step in BAD_GRAD:
        poison_grad(m1, BAD_GRAD[step])  # only optimizer 1 sees it; the scale still backs off
    scaler.unscale_(o0)  # unscale one of them explicitly, as torch's example does
    torch.nn.utils.clip_grad_norm_(m0.parameters(), 0.5)
    scaler.step(o0)
    scaler.step(o1)
    scaler.update()


def recipe_several_losses_list(step, models, opts, scaler):
    (model,), (opt,) = models, opts
    x, y = DATA[2 * step]
    opt.zero_grad()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = model(x).float()
    losses = (torch.nn.functional.mse_loss(out, y), out.abs().mean())
    scaled = scaler.scale(list(losses))  # a list in, a list out
    torch.autograd.backward(scaled)
    if step in BAD_GRAD:
        poison_grad(model, BAD_GRAD[step])
    scaler.step(opt)
    scaler.update()


def recipe_gradient_penalty(step, models, opts, scaler):
    """torch's gradient-penalty recipe: autograd.grad on scaled outputs, unscale by hand."""
    (model,), (opt,) = models, opts
    x, y = DATA[2 * step]
    opt.zero_grad()
    loss = torch.nn.functional.mse_loss(model(x), y)
    params = list(model.parameters())
    scaled_grads = torch.autograd.grad(scaler.scale(loss), params, create_graph=True)
    inv_scale = 1.0 / scaler.get_scale()
    penalty = sum((g * inv_scale).pow(2).sum() for g in scaled_grads).sqrt()
    scaler.scale(loss + 0.1 * penalty).backward()
    if step in BAD_GRAD:
        poison_grad(model, BAD_GRAD[step])
    scaler.step(opt)
    scaler.update()


# --------------------------------------------------------------------------- conformance


@pytest.mark.parametrize("opt_name", [_opt_param(n) for n in OPTIMIZERS])
def test_trajectory_matches_torch_bitwise(opt_name):
    runs, _ = run_pair(recipe_basic, N_STEPS, OPTIMIZERS[opt_name])
    ours, theirs = runs[0][2], runs[1][2]
    assert ours.get_scale() == theirs.get_scale()
    # The run did back off and grow, so the comparison covered both branches.
    assert ours.stats().skipped == len(BAD_INPUT) + len(BAD_GRAD)


@pytest.mark.parametrize(
    "recipe",
    [recipe_clip, recipe_accumulate, recipe_several_losses_list, recipe_gradient_penalty],
    ids=lambda r: r.__name__.removeprefix("recipe_"),
)
@pytest.mark.parametrize("opt_name", ["sgd_momentum_wd", "adam"])
def test_recipes_match_torch_bitwise(recipe, opt_name):
    run_pair(recipe, N_STEPS, OPTIMIZERS[opt_name])


@pytest.mark.parametrize("opt_name", ["sgd_momentum_wd", "adamw_foreach", _opt_param("adam_fused")])
def test_two_optimizers_sharing_a_scaler_match_torch(opt_name):
    run_pair(recipe_two_optimizers, N_STEPS, OPTIMIZERS[opt_name], n_models=2)


def test_natural_overflow_backs_off_like_torch():
    """No injection: a scale near float32's max makes the scaled loss overflow by itself."""
    def recipe_big_loss(step, models, opts, scaler):
        (model,), (opt,) = models, opts
        x, y = DATA[2 * step]
        opt.zero_grad()
        scaler.scale(1e3 * forward_loss(model, x, y)).backward()
        scaler.step(opt)
        scaler.update()

    runs, _ = run_pair(
        recipe_big_loss, N_STEPS, OPTIMIZERS["adam"], scaler_kw=dict(init_scale=2.0**127, growth_interval=1)
    )
    s = runs[0][2].stats()
    scales = (2.0**127,) + s.history_scales
    backed_off = {i for i in range(N_STEPS) if scales[i + 1] < scales[i]}
    assert backed_off - set(BAD_INPUT) - set(BAD_GRAD)  # some overflow came by itself


def _resume_recipe(step, models, opts, scaler):
    recipe_clip(step, models, opts, scaler)


@pytest.mark.parametrize("source", ["ours", "torch"])
def test_resume_from_state_dict_matches_uninterrupted_torch(source):
    """Save model, optimizer and scaler mid-run, rebuild, load, continue: same bits as torch."""
    make_opt = OPTIMIZERS["adam"]
    cut = 4
    runs, history = run_pair(_resume_recipe, N_STEPS, make_opt)
    # Replay the first `cut` steps with ours (or torch), then save.
    model = make_model(0)
    opt = make_opt(model.parameters())
    first = ampkit.GradScaler("cpu", **SCALER_KW) if source == "ours" else torch.amp.GradScaler("cpu", **SCALER_KW)
    for step in range(cut):
        _resume_recipe(step, [model], [opt], first)
    saved = copy.deepcopy((model.state_dict(), opt.state_dict(), first.state_dict()))
    # A fresh process: new objects with other defaults, then load.
    model2 = make_model(seed=123)
    opt2 = make_opt(model2.parameters())
    resumed = ampkit.GradScaler("cpu", init_scale=8.0, growth_interval=7)
    model2.load_state_dict(saved[0])
    opt2.load_state_dict(saved[1])
    resumed.load_state_dict(saved[2])
    assert resumed.get_growth_interval() == SCALER_KW["growth_interval"]
    for step in range(cut, N_STEPS):
        _resume_recipe(step, [model2], [opt2], resumed)
        assert_same(step, snapshot([model2], [opt2], resumed), history[step][1])


def test_torch_loads_our_state_dict():
    ours = ampkit.GradScaler("cpu", **SCALER_KW)
    model = make_model()
    opt = OPTIMIZERS["sgd"](model.parameters())
    for step in range(4):
        recipe_basic(step, [model], [opt], ours)
    theirs = torch.amp.GradScaler("cpu")
    theirs.load_state_dict(ours.state_dict())
    assert theirs.state_dict() == {k: ours.state_dict()[k] for k in theirs.state_dict()}


# --------------------------------------------------------------------------- enabled=False


def _plain_run(make_opt, scaler):
    model = make_model()
    opt = make_opt(model.parameters())
    for x, y in batches(6):
        opt.zero_grad()
        loss = forward_loss(model, x, y)
        if scaler is None:
            loss.backward()
            opt.step()
        else:
            scaled = scaler.scale(loss)
            assert scaled is loss
            scaled.backward()
            scaler.unscale_(opt)
            scaler.step(opt)
            scaler.update()
    return [p.detach().clone() for p in model.parameters()] + [v for _, v in opt_tensors(opt)]


@pytest.mark.parametrize("opt_name", ["sgd_momentum_wd", "adam", _opt_param("adam_fused")])
def test_disabled_is_a_pure_pass_through(opt_name):
    scaler = ampkit.GradScaler("cpu", enabled=False)
    with_scaler = _plain_run(OPTIMIZERS[opt_name], scaler)
    without = _plain_run(OPTIMIZERS[opt_name], None)
    assert all(bits_equal(a, b) for a, b in zip(with_scaler, without))
    assert not scaler.is_enabled() and scaler.get_scale() == 1.0 and scaler.state_dict() == {}
    assert scaler._scale is None  # nothing was ever allocated
    scaler.load_state_dict({"anything": 1})  # a no-op, like torch


def test_disabled_matches_torch_disabled():
    assert ampkit.GradScaler("cpu", enabled=False).state_dict() == torch.amp.GradScaler(
        "cpu", enabled=False
    ).state_dict()


# --------------------------------------------------------------------------- scale()


def test_scale_rebuilds_nested_containers_with_their_types():
    from collections import namedtuple

    Pair = namedtuple("Pair", "a b")
    scaler = ampkit.GradScaler("cpu", init_scale=4.0)
    t = torch.tensor([1.0, 2.0])
    out = scaler.scale([t, (t, Pair(t, [t]))])
    assert isinstance(out, list) and isinstance(out[1], tuple) and isinstance(out[1][1], Pair)
    assert isinstance(out[1][1].b, list)
    assert torch.equal(out[1][1].b[0], t * 4)
    theirs = torch.amp.GradScaler("cpu", init_scale=4.0).scale([t, (t, t)])
    assert bits_equal(out[0], theirs[0])


def test_scale_keeps_dtype_like_torch():
    for dtype in (torch.float16, torch.bfloat16, torch.float32):
        loss = torch.tensor(3.0, dtype=dtype)
        ours = ampkit.GradScaler("cpu").scale(loss)
        theirs = torch.amp.GradScaler("cpu").scale(loss)
        assert bits_equal(ours, theirs)


# --------------------------------------------------------------------------- state machine


class Toy:
    """One parameter, a zero learning rate: drives update() with a chosen inf flag."""

    def __init__(self, scaler, opt_cls=torch.optim.SGD, **opt_kw):
        self.p = torch.nn.Parameter(torch.ones(4))
        self.opt = opt_cls([self.p], lr=0.0, **opt_kw)
        self.scaler = scaler

    def backward(self, found: bool = False):
        self.opt.zero_grad()
        self.scaler.scale(self.p.sum()).backward()
        if found:
            self.p.grad[1] = INF

    def iterate(self, found: bool = False):
        self.backward(found)
        self.scaler.step(self.opt)
        self.scaler.update()


def reference(flags, *, init_scale, growth_factor, backoff_factor, growth_interval, hysteresis=1,
              min_scale=None, max_scale=None):
    """The docstring's state machine in plain Python floats (powers of two: exact)."""
    scale, tracker, left, skipped, last = init_scale, 0, hysteresis, 0, None
    rows = []
    for i, found in enumerate(flags):
        if found and left > 1:
            left -= 1
            tracker = 0
        elif found:
            scale *= backoff_factor
            tracker = 0
        else:
            left = hysteresis
            tracker += 1
            if tracker == growth_interval:
                tracker = 0
                if math.isfinite(scale * growth_factor):
                    scale *= growth_factor
        if min_scale is not None:
            scale = max(scale, min_scale)
        if max_scale is not None:
            scale = min(scale, max_scale)
        skipped += found
        last = i if found else last
        rows.append(dict(scale=scale, growth_tracker=tracker, hysteresis_left=left,
                         steps=i + 1, skipped=skipped, last_skipped=last))
    return rows


def observed(scaler):
    s = scaler.stats()
    return dict(scale=s.scale, growth_tracker=s.growth_tracker, hysteresis_left=s.hysteresis_left,
                steps=s.steps, skipped=s.skipped, last_skipped=s.last_skipped)


def test_hysteresis_walked_step_by_step():
    """hysteresis=3: two consecutive overflows are absorbed, the third backs off; a clean
    step refills the budget; every field checked after every step (hand-written table)."""
    scaler = ampkit.GradScaler("cpu", init_scale=64.0, growth_interval=2, hysteresis=3)
    toy = Toy(scaler)
    #        found, scale, tracker, left, skipped, last
    table = [
        (False, 64.0, 1, 3, 0, None),
        (True, 64.0, 0, 2, 1, 1),  # absorbed: scale kept, growth window restarts
        (True, 64.0, 0, 1, 2, 2),  # absorbed
        (True, 32.0, 0, 1, 3, 3),  # budget spent: back off
        (True, 16.0, 0, 1, 4, 4),  # still spent: back off again (DeepSpeed)
        (False, 16.0, 1, 3, 4, 4),  # clean: refilled (consecutive_hysteresis=True)
        (False, 32.0, 0, 3, 4, 4),  # growth_interval clean steps: grow
        (True, 32.0, 0, 2, 5, 7),  # absorbed again
        (False, 32.0, 1, 3, 5, 7),
        (False, 64.0, 0, 3, 5, 7),
    ]
    p0 = toy.p.detach().clone()
    for i, (found, scale, tracker, left, skipped, last) in enumerate(table):
        toy.iterate(found)
        assert observed(scaler) == dict(scale=scale, growth_tracker=tracker, hysteresis_left=left,
                                        steps=i + 1, skipped=skipped, last_skipped=last), f"step {i}"
    assert torch.equal(toy.p.detach(), p0)


def test_hysteresis_one_is_torch():
    flags = [False, True, True, False, False, False, True, False, False]
    ours, theirs = (cls("cpu", init_scale=32.0, growth_interval=2) for cls in (ampkit.GradScaler, torch.amp.GradScaler))
    t_ours, t_theirs = Toy(ours), Toy(theirs)
    for f in flags:
        t_ours.iterate(f)
        t_theirs.iterate(f)
        assert bits_equal(ours._scale, theirs._scale)
        assert ours.state_dict()["_growth_tracker"] == theirs.state_dict()["_growth_tracker"]


@pytest.mark.parametrize(
    "kw, flags",
    [
        (dict(min_scale=4.0), [True] * 6 + [False] * 4),  # floors at min_scale
        (dict(max_scale=128.0), [False] * 12 + [True, False, False]),  # caps growth
        (dict(min_scale=8.0, max_scale=64.0, hysteresis=2), [True, True, True, True, False] * 2 + [False] * 8),
        (dict(hysteresis=4), [True, False] * 3 + [True] * 5 + [False] * 3),
    ],
    ids=["min", "max", "both+hysteresis", "hysteresis4"],
)
def test_clamps_and_hysteresis_follow_the_reference(kw, flags):
    base = dict(init_scale=32.0, growth_factor=2.0, backoff_factor=0.5, growth_interval=2)
    scaler = ampkit.GradScaler("cpu", **base, **kw)
    toy = Toy(scaler)
    expected = reference(flags, **base, **kw)
    for i, f in enumerate(flags):
        toy.iterate(f)
        assert observed(scaler) == expected[i], f"step {i}"
    lo, hi = kw.get("min_scale", 0), kw.get("max_scale", math.inf)
    assert all(lo <= r["scale"] <= hi for r in expected)
    if "min_scale" in kw or "max_scale" in kw:
        assert any(r["scale"] in (lo, hi) for r in expected)  # the clamp was actually hit


def _toy_optimizers(kinds):
    """The optimizer kinds a test drives one scaler with, in turn: "plain" steps read the
    inf flag on the host (the scaler counts there), "fused" ones never do (it counts on
    the device); a skip where fused SGD is missing."""
    if "fused" in kinds and not _fused_supported("sgd_fused"):
        pytest.skip("this torch has no fused CPU SGD")
    return [{"plain": {}, "fused": {"fused": True}}[k] for k in kinds]


@pytest.mark.parametrize("kinds", [["fused"], ["plain", "fused"], ["fused", "plain"],
                                   ["plain", "plain", "fused", "fused", "plain"]],
                         ids=["fused", "plain-then-fused", "fused-then-plain", "mixed"])
@pytest.mark.parametrize("kw", [dict(), dict(hysteresis=3), dict(min_scale=8.0, max_scale=64.0, hysteresis=2)],
                         ids=["torch", "hysteresis3", "clamps+hysteresis"])
def test_host_and_device_counting_follow_the_reference(kinds, kw):
    """The stats and the hysteresis are counted on the host while every update knew its
    flag there, on the device from the first one that did not; each phase of the run
    drives one optimizer kind for a while (2 to 4 consecutive overflows included), and
    every field is checked after every step against the docstring's state machine."""
    base = dict(init_scale=32.0, growth_factor=2.0, backoff_factor=0.5, growth_interval=2)
    scaler = ampkit.GradScaler("cpu", **base, **kw)
    toys = [Toy(scaler, **opt_kw) for opt_kw in _toy_optimizers(kinds)]
    phase = [False, True, True, False, False, False, True, True, True, True, False, False]
    flags = phase * len(toys)
    expected = reference(flags, **base, **kw)
    for i, f in enumerate(flags):
        toys[i // len(phase)].iterate(f)
        assert observed(scaler) == expected[i], f"step {i} ({kinds[i // len(phase)]})"
        if i % 5 == 4:  # a read in between writes what the host held back
            assert scaler.stats().history_scales == tuple(r["scale"] for r in expected[:i + 1])
    s = scaler.stats()
    assert s.history_scales == tuple(r["scale"] for r in expected)
    sd = scaler.state_dict()
    twin = ampkit.GradScaler("cpu")  # a loaded scaler counts on from the loaded values
    twin.load_state_dict(sd)
    toy = Toy(twin, **_toy_optimizers(kinds[-1:])[0])
    more = reference(flags + phase, **base, **kw)
    for i, f in enumerate(phase):
        toy.iterate(f)
        assert observed(twin) == more[len(flags) + i], f"step {len(flags) + i} after loading"


@pytest.mark.parametrize("kind", ["plain", "fused"])
def test_history_of_long_runs_of_one_scale_follows_torchs_scales(kind):
    """Runs of hundreds of updates under one scale (growth_interval 300), wrapping the ring
    twice, read in between: the history holds the scale torch's scaler had after each
    update, for the last HISTORY_SIZE updates."""
    kw = dict(init_scale=2.0**10, growth_factor=2.0, backoff_factor=0.5, growth_interval=300)
    (opt_kw,) = _toy_optimizers([kind])
    ours, theirs = ampkit.GradScaler("cpu", **kw), torch.amp.GradScaler("cpu", **kw)
    t_ours, t_theirs = Toy(ours, **opt_kw), Toy(theirs, **opt_kw)
    n = 2 * HISTORY_SIZE + 37
    scales = []
    for i in range(n):
        found = i in (5, 6, 1500, 2000)
        t_ours.iterate(found)
        t_theirs.iterate(found)
        scales.append(theirs.get_scale())
        if i in (3, 700, HISTORY_SIZE + 1, n - 1):
            s = ours.stats()
            first = max(0, i + 1 - HISTORY_SIZE)
            assert s.history_steps == tuple(range(first, i + 1)), f"update {i}"
            assert s.history_scales == tuple(scales[first:]), f"update {i}"
    assert len(set(scales)) > 3  # it did grow and back off


@pytest.mark.parametrize("kind", ["plain", "fused"])
def test_update_new_scale_keeps_the_history_of_the_updates_before_it(kind):
    """update(new_scale=...) is not an entry of the history; the entries before it keep the
    scale they had, the ones after it start from the new one (torch's scaler: the oracle)."""
    kw = dict(init_scale=8.0, growth_interval=1000)
    (opt_kw,) = _toy_optimizers([kind])
    scales = {}
    for cls in (ampkit.GradScaler, torch.amp.GradScaler):
        scaler = cls("cpu", **kw)
        toy = Toy(scaler, **opt_kw)
        seen = []
        for new_scale, found in [(None, False)] * 5 + [(2.0, None)] + [(None, False)] * 3 + [
                (torch.tensor(32.0), None), (None, True), (None, False)]:
            if new_scale is None:
                toy.iterate(found)
                seen.append(scaler.get_scale())
            else:
                toy.backward()
                scaler.update(new_scale=new_scale)
        scales[cls] = seen
        if cls is ampkit.GradScaler:
            s = scaler.stats()
    assert s.steps == 10 and s.history_scales == tuple(scales[torch.amp.GradScaler])
    assert scales[ampkit.GradScaler] == scales[torch.amp.GradScaler]


def test_stats_history_wraps_around():
    scaler = ampkit.GradScaler("cpu", init_scale=2.0**10, growth_interval=1, max_scale=2.0**14)
    toy = Toy(scaler)
    n = HISTORY_SIZE + 5
    flags = [i % 7 == 3 for i in range(n)]
    expected = reference(flags, init_scale=2.0**10, growth_factor=2.0, backoff_factor=0.5,
                         growth_interval=1, max_scale=2.0**14)
    for f in flags:
        toy.iterate(f)
    s = scaler.stats()
    assert s.history_steps == tuple(range(5, n))
    assert s.history_scales == tuple(r["scale"] for r in expected[5:])
    assert (s.steps, s.skipped, s.taken) == (n, sum(flags), n - sum(flags))
    assert s.last_skipped == max(i for i, f in enumerate(flags) if f)


def test_stats_before_any_step_and_update_new_scale_is_not_counted():
    scaler = ampkit.GradScaler("cpu", init_scale=8.0)
    s = scaler.stats()
    assert (s.steps, s.skipped, s.last_skipped, s.scale, s.history_steps) == (0, 0, None, 8.0, ())
    toy = Toy(scaler)
    toy.iterate(False)
    toy.backward()
    scaler.update(new_scale=2.0)
    assert scaler.get_scale() == 2.0 and scaler.stats().steps == 1
    scaler.update(new_scale=torch.tensor(16.0))
    assert scaler.get_scale() == 16.0


def test_state_dict_round_trips_every_field_with_non_default_values():
    kw = dict(init_scale=2.0**9, growth_factor=4.0, backoff_factor=0.25, growth_interval=3,
              hysteresis=3, min_scale=2.0, max_scale=2.0**20)
    scaler = ampkit.GradScaler("cpu", **kw)
    toy = Toy(scaler)
    for f in [False, True, False, False, False, True]:
        toy.iterate(f)
    sd = scaler.state_dict()
    assert sd["_hysteresis_left"] == 2 and sd["_steps"] == 6 and sd["_skipped"] == 2
    assert sd["_last_skipped"] == 5 and sd["hysteresis"] == 3 and sd["min_scale"] == 2.0
    for target in (ampkit.GradScaler("cpu"), None):
        if target is None:  # after lazy init too
            target = ampkit.GradScaler("cpu")
            Toy(target).iterate(True)
        target.load_state_dict(copy.deepcopy(sd))
        assert target.state_dict() == sd
        assert (target.hysteresis, target.min_scale, target.max_scale) == (3, 2.0, 2.0**20)
        # ... and both continue identically.
        twin = Toy(target)
        for f in [True, True, False, False, False, False]:
            toy.iterate(f)
            twin.iterate(f)
            assert target.state_dict() == scaler.state_dict()
        sd = scaler.state_dict()


def test_state_dict_prints_its_history_compactly_and_round_trips_through_torch_save(tmp_path):
    flags = [i % 5 == 2 for i in range(40)]
    kw = dict(init_scale=2.0**10, growth_factor=2.0, backoff_factor=0.5, growth_interval=2)
    scaler = ampkit.GradScaler("cpu", **kw)
    toy = Toy(scaler)
    for f in flags:
        toy.iterate(f)
    ring = [0.0] * HISTORY_SIZE  # slot i % HISTORY_SIZE: the scale update i left (0.0: never written)
    for i, row in enumerate(reference(flags, **kw)):
        ring[i % HISTORY_SIZE] = row["scale"]
    sd = scaler.state_dict()
    assert sd["_scale_history"] == ring and len(set(ring)) > 2
    plain = {**sd, "_scale_history": list(sd["_scale_history"])}
    assert len(repr(sd)) < 600 < len(repr(plain))  # a summary, not 1024 floats
    assert f"{HISTORY_SIZE} scales" in repr(sd) and str(sd) == repr(sd)
    path = tmp_path / "scaler.pt"
    torch.save(sd, path)
    loaded = torch.load(path)  # weights_only, torch's default
    assert type(loaded["_scale_history"]) is type(sd["_scale_history"])
    assert loaded == sd and loaded["_scale_history"] == ring
    assert copy.deepcopy(sd) == sd and repr(copy.deepcopy(sd)) == repr(sd)
    resumed = ampkit.GradScaler("cpu")
    resumed.load_state_dict(loaded)
    assert resumed.state_dict() == sd and resumed.stats() == scaler.stats()
    assert resumed.stats().history_scales == tuple(ring[:len(flags)])
    torch_scaler = torch.amp.GradScaler("cpu")
    torch_scaler.load_state_dict(loaded)  # torch reads its own five keys
    assert torch_scaler.get_scale() == scaler.get_scale()


@pytest.mark.parametrize("initialized", [True, False], ids=["after-scale", "before-scale"])
def test_state_dict_keeps_counters_past_2_to_the_53_exactly(initialized):
    """The counters are int64 on the device; float64 would round 2**53 + 1 to 2**53."""
    big = 2**53 + 1
    sd = _our_sd()
    sd.update(_steps=big + 2, _skipped=big, _last_skipped=big + 1)
    scaler = ampkit.GradScaler("cpu", init_scale=16.0, hysteresis=2, min_scale=1.0)
    toy = Toy(scaler)
    if initialized:
        toy.iterate(False)
    scaler.load_state_dict(sd)
    assert scaler.state_dict() == sd
    toy.iterate(True)
    s = scaler.stats()
    assert (s.steps, s.skipped, s.last_skipped) == (big + 3, big + 1, big + 2)
    assert s.history_steps[-1] == big + 2
    sd = scaler.state_dict()
    assert (sd["_steps"], sd["_skipped"], sd["_last_skipped"]) == (big + 3, big + 1, big + 2)


def test_loading_a_torch_state_dict_clamps_and_refills_hysteresis():
    theirs = torch.amp.GradScaler("cpu", init_scale=2.0**30, growth_interval=5)
    Toy(theirs).iterate(False)
    ours = ampkit.GradScaler("cpu", hysteresis=2, max_scale=2.0**20)
    toy = Toy(ours)
    toy.iterate(True)  # uses one unit of hysteresis
    ours.load_state_dict(theirs.state_dict())
    sd = ours.state_dict()
    assert sd["scale"] == 2.0**20 and sd["growth_interval"] == 5 and sd["_growth_tracker"] == 1
    assert sd["_hysteresis_left"] == 2 and sd["_steps"] == 1  # stats kept


# --------------------------------------------------------------------------- errors


def full_state(scaler, *opts):
    return (scaler.state_dict(), scaler._scale is None, [scaler.stage(o) for o in opts],
            {k: (r.stage, dict(r.found_inf_per_device)) for k, r in scaler._per_optimizer.items()})


def assert_unchanged(before, scaler, *opts):
    after = full_state(scaler, *opts)
    assert after[:3] == before[:3]
    assert after[3].keys() == before[3].keys()
    for k in after[3]:
        assert after[3][k][0] == before[3][k][0]
        assert after[3][k][1].keys() == before[3][k][1].keys()


@pytest.mark.parametrize(
    "setup, call, exc, match",
    [
        ("stepped", lambda s, o: s.step(o), RuntimeError, r"step\(\) was already called.*update\(\)"),
        ("unscaled", lambda s, o: s.unscale_(o), RuntimeError, r"already called.*at most once"),
        ("stepped", lambda s, o: s.unscale_(o), RuntimeError, r"unscale_\(\) was called after step\(\)"),
        ("fresh", lambda s, o: s.step(o), RuntimeError, r"before any scale\(\)"),
        ("fresh", lambda s, o: s.unscale_(o), RuntimeError, r"before any scale\(\)"),
        ("fresh", lambda s, o: s.update(), RuntimeError, r"before any scale\(\)"),
        ("backward", lambda s, o: s.update(), RuntimeError, r"no inf/NaN checks.*step\(optimizer\)"),
        ("backward", lambda s, o: s.step(o, closure=lambda: 0), RuntimeError, r"closure"),
        ("backward", lambda s, o: s.step(object()), TypeError, r"torch.optim.Optimizer"),
        ("no_grad", lambda s, o: s.step(o), RuntimeError, r"no gradients"),
        ("backward", lambda s, o: s.update(new_scale=-1.0), ValueError, r"new_scale=-1.0"),
        ("backward", lambda s, o: s.update(new_scale="big"), TypeError, r"new_scale"),
        ("backward", lambda s, o: s.update(new_scale=torch.ones(2)), ValueError, r"one-element"),
        ("backward", lambda s, o: s.scale(3.0), TypeError, r"got|is float"),
        ("fresh", lambda s, o: s.scale([torch.ones(1), "x"]), TypeError, r"outputs\[1\] is str"),
        ("fresh", lambda s, o: s.scale({"loss": torch.ones(1)}), TypeError, r"is dict"),
    ],
    ids=["step-twice", "unscale-twice", "unscale-after-step", "step-before-scale",
         "unscale-before-scale", "update-before-scale", "update-without-step", "closure",
         "not-an-optimizer", "no-grads", "negative-new-scale", "str-new-scale",
         "tensor-new-scale", "scale-float", "scale-list-with-str", "scale-dict"],
)
def test_misuse_raises_a_clear_error_and_changes_nothing(setup, call, exc, match):
    scaler = ampkit.GradScaler("cpu", init_scale=8.0, hysteresis=2)
    toy = Toy(scaler)
    if setup != "fresh":
        toy.iterate(True)  # non-default state: scale, hysteresis, stats
        if setup == "no_grad":
            toy.opt.zero_grad(set_to_none=True)
            scaler.scale(torch.ones(()))
        else:
            toy.backward()
        if setup == "unscaled":
            scaler.unscale_(toy.opt)
        if setup == "stepped":
            scaler.step(toy.opt)
    grad = None if toy.p.grad is None else toy.p.grad.clone()
    before = full_state(scaler, toy.opt)
    with pytest.raises(exc, match=match):
        call(scaler, toy.opt)
    assert_unchanged(before, scaler, toy.opt)
    assert (grad is None and toy.p.grad is None) or bits_equal(grad, toy.p.grad)


def test_fp16_gradients_are_refused_before_anything_is_unscaled():
    scaler = ampkit.GradScaler("cpu", init_scale=8.0)
    p32 = torch.nn.Parameter(torch.ones(3))
    p16 = torch.nn.Parameter(torch.ones(3, dtype=torch.float16))
    opt = torch.optim.SGD([p32, p16], lr=0.1)
    scaler.scale(p32.sum() + p16.float().sum()).backward()
    grads = [p32.grad.clone(), p16.grad.clone()]
    before = full_state(scaler, opt)
    for call in (scaler.unscale_, scaler.step):
        with pytest.raises(ValueError, match=r"float16 gradient.*float32.*autocast"):
            call(opt)
        assert_unchanged(before, scaler, opt)
        assert bits_equal(p32.grad, grads[0]) and bits_equal(p16.grad, grads[1])
        assert scaler.stage(opt) is OptState.READY


def test_stage_machine_walks_ready_unscaled_stepped():
    scaler = ampkit.GradScaler("cpu")
    toy = Toy(scaler)
    assert scaler.stage(toy.opt) is OptState.READY
    toy.backward()
    scaler.unscale_(toy.opt)
    assert scaler.stage(toy.opt) is OptState.UNSCALED
    scaler.step(toy.opt)
    assert scaler.stage(toy.opt) is OptState.STEPPED
    scaler.update()
    assert scaler.stage(toy.opt) is OptState.READY


BAD_CTOR = [
    (dict(growth_interval=0), ValueError, r"growth_interval=0 .*\[1, "),
    (dict(growth_interval=-3), ValueError, r"growth_interval=-3"),
    (dict(growth_interval=1.5), TypeError, r"growth_interval must be an int, got 1.5"),
    (dict(growth_interval=True), TypeError, r"growth_interval must be an int"),
    (dict(growth_interval=2**31), ValueError, r"growth_interval"),
    (dict(growth_factor=1.0), ValueError, r"growth_factor=1.0 .*\(1, inf\)"),
    (dict(growth_factor=0.5), ValueError, r"growth_factor=0.5"),
    (dict(growth_factor=INF), ValueError, r"growth_factor=inf .*finite"),
    (dict(growth_factor="2"), TypeError, r"growth_factor must be a real number, got '2'"),
    (dict(backoff_factor=1.0), ValueError, r"backoff_factor=1.0 .*\(0, 1\)"),
    (dict(backoff_factor=0.0), ValueError, r"backoff_factor=0.0"),
    (dict(backoff_factor=NAN), ValueError, r"backoff_factor=nan"),
    (dict(init_scale=0.0), ValueError, r"init_scale=0.0"),
    (dict(init_scale=-1.0), ValueError, r"init_scale=-1.0"),
    (dict(init_scale=INF), ValueError, r"init_scale=inf"),
    (dict(init_scale=1e39), ValueError, r"init_scale=1e\+39"),
    (dict(init_scale=None), TypeError, r"init_scale must be a real number, got None"),
    (dict(hysteresis=0), ValueError, r"hysteresis=0 .*\[1, "),
    (dict(hysteresis=2.0), TypeError, r"hysteresis must be an int"),
    (dict(min_scale=0.0), ValueError, r"min_scale=0.0"),
    (dict(max_scale=-2.0), ValueError, r"max_scale=-2.0"),
    (dict(min_scale=4.0, max_scale=2.0, init_scale=3.0), ValueError, r"min_scale=4.0 is larger than max_scale=2.0"),
    (dict(min_scale=2.0**20), ValueError, r"init_scale=65536.0 lies outside"),
    (dict(max_scale=2.0), ValueError, r"init_scale=65536.0 lies outside"),
    (dict(enabled="yes"), TypeError, r"enabled must be True or False, got 'yes'"),
    (dict(device=3), TypeError, r"device must be a str"),
    (dict(device="gpu0"), ValueError, r"device='gpu0'"),
]


@pytest.mark.parametrize("kw, exc, match", BAD_CTOR, ids=[str(k) for k, _, _ in BAD_CTOR])
def test_constructor_validates_every_argument(kw, exc, match):
    kw = dict(kw)
    device = kw.pop("device", "cpu")
    with pytest.raises(exc, match=match):
        ampkit.GradScaler(device, **kw)


def test_torch_accepts_what_we_refuse():
    """The reason for the validation: torch silently accepts growth_interval=0."""
    torch.amp.GradScaler("cpu", growth_interval=0)
    with pytest.raises(ValueError):
        ampkit.GradScaler("cpu", growth_interval=0)


@pytest.mark.parametrize(
    "setter, value, exc",
    [("set_growth_interval", 0, ValueError), ("set_growth_factor", 0.9, ValueError),
     ("set_backoff_factor", 2, ValueError), ("set_growth_interval", "3", TypeError)],
)
def test_setters_validate_and_keep_the_old_value(setter, value, exc):
    scaler = ampkit.GradScaler("cpu")
    before = scaler.state_dict()
    with pytest.raises(exc):
        getattr(scaler, setter)(value)
    assert scaler.state_dict() == before


def _our_sd():
    scaler = ampkit.GradScaler("cpu", init_scale=16.0, hysteresis=2, min_scale=1.0)
    Toy(scaler).iterate(True)
    return scaler.state_dict()


BAD_SD = [
    (lambda sd: sd.pop("scale"), ValueError, r"missing key\(s\) \['scale'\]"),
    (lambda sd: sd.pop("_hysteresis_left"), ValueError, r"missing key\(s\) \['_hysteresis_left'\]"),
    (lambda sd: sd.update(scale="1.0"), TypeError, r"state_dict\['scale'\] must be a real number"),
    (lambda sd: sd.update(scale=-4.0), ValueError, r"state_dict\['scale'\]=-4.0"),
    (lambda sd: sd.update(growth_interval=0), ValueError, r"state_dict\['growth_interval'\]=0"),
    (lambda sd: sd.update(_growth_tracker=1.0), TypeError, r"_growth_tracker'\] must be an int"),
    (lambda sd: sd.update(hysteresis=None), TypeError, r"state_dict\['hysteresis'\]"),
    (lambda sd: sd.update(_hysteresis_left=5), ValueError, r"_hysteresis_left'\]=5"),
    (lambda sd: sd.update(min_scale=32.0), ValueError, r"lies outside its own clamps"),
    (lambda sd: sd.update(_skipped=9), ValueError, r"_skipped'\]=9"),
    (lambda sd: sd.update(_steps=2**62), ValueError, r"_steps'\]=4611686018427387904 .*\[0, 4611686018427387903\]"),
    (lambda sd: sd.update(_scale_history=[1.0]), ValueError, r"list of 1024 floats"),
    (lambda sd: sd.update(_scale_history=[1.0] * 1023 + ["x"]), TypeError, r"_scale_history'\]\[1023\]"),
    (lambda sd: sd.clear(), ValueError, r"empty dict.*disabled"),
    # torch's kernel grows when the tracker reaches the interval: at or past it, never.
    (lambda sd: sd.update(_growth_tracker=sd["growth_interval"]), ValueError,
     r"_growth_tracker'\]=2000 .*\[0, 1999\]"),
    (lambda sd: sd.update(growth_interval=4, _growth_tracker=9), ValueError,
     r"_growth_tracker'\]=9 .*\[0, 3\]"),
    (lambda sd: sd.update(_growth_tracker=-1), ValueError, r"_growth_tracker'\]=-1"),
    (lambda sd: sd.update(growth_factor="2"), TypeError, r"state_dict\['growth_factor'\]"),
    (lambda sd: sd.update(backoff_factor=1.5), ValueError, r"state_dict\['backoff_factor'\]=1.5"),
    (lambda sd: sd.update(_last_skipped=-1), ValueError, r"_last_skipped'\]=-1"),
]


@pytest.mark.parametrize("mutate, exc, match", BAD_SD, ids=[m for _, _, m in BAD_SD])
@pytest.mark.parametrize("initialized", [True, False], ids=["after-scale", "before-scale"])
def test_bad_state_dict_raises_and_changes_nothing(mutate, exc, match, initialized):
    sd = _our_sd()
    mutate(sd)
    scaler = ampkit.GradScaler("cpu", init_scale=2.0**10, growth_interval=3, hysteresis=3, max_scale=2.0**12)
    if initialized:
        Toy(scaler).iterate(True)
    before = full_state(scaler)
    with pytest.raises(exc, match=match):
        scaler.load_state_dict(sd)
    assert_unchanged(before, scaler)


def test_load_state_dict_refuses_a_non_dict():
    with pytest.raises(TypeError, match="takes a dict, got list"):
        ampkit.GradScaler("cpu").load_state_dict([("scale", 1.0)])


def test_cuda_amp_grad_scaler():
    with pytest.raises(TypeError, match="always uses 'cuda'"):
        ampkit.cuda_amp_grad_scaler(device="cpu")
    with pytest.raises(ValueError, match="growth_interval=0"):
        ampkit.cuda_amp_grad_scaler(growth_interval=0)
    if torch.cuda.is_available():
        assert ampkit.cuda_amp_grad_scaler(init_scale=4.0).is_enabled()
    else:
        with pytest.warns(UserWarning, match="CUDA is not available"):
            scaler = ampkit.cuda_amp_grad_scaler(init_scale=4.0)
        assert not scaler.is_enabled()


@pytest.mark.skipif(not _fused_supported("sgd_fused"), reason="this torch has no fused CPU SGD")
def test_fused_sgd_skipped_first_step_leaves_no_garbage():
    """Fused SGD allocates its momentum buffer with empty_like before it sees found_inf, so
    with torch's scaler a skipped *first* step leaves garbage that the next step reads. Ours
    zeroes state born in a skipped step: the run equals one where that step never happened."""

    def run(scaler, steps):
        model = make_model()
        opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9, fused=True)
        for step, bad in steps:
            x, y = DATA[2 * step]
            opt.zero_grad()
            scaler.scale(forward_loss(model, x, y)).backward()
            if bad:
                poison_grad(model, INF)
            scaler.step(opt)
            scaler.update()
        return snapshot([model], [opt], scaler)[2:]  # params and optimizer state

    ours = run(ampkit.GradScaler("cpu", init_scale=2.0**16), [(0, True), (0, False), (1, False)])
    clean = run(torch.amp.GradScaler("cpu", init_scale=2.0**15), [(0, False), (1, False)])
    assert_same(2, ours, clean)


def test_update_new_scale_respects_the_clamps():
    scaler = ampkit.GradScaler("cpu", init_scale=8.0, min_scale=2.0, max_scale=64.0)
    toy = Toy(scaler)
    toy.backward()
    before = full_state(scaler, toy.opt)
    for bad in (1.0, 128.0, float("nan")):
        with pytest.raises(ValueError, match=r"new_scale=.*\[2, 64\]"):
            scaler.update(new_scale=bad)
        assert_unchanged(before, scaler, toy.opt)
    scaler.update(new_scale=torch.tensor(1000.0))  # a tensor is clamped on the device
    assert scaler.get_scale() == 64.0


def test_reset_iteration_forgets_stages_but_keeps_the_scale_state():
    scaler = ampkit.GradScaler("cpu", init_scale=8.0, hysteresis=2)
    toy = Toy(scaler)
    toy.iterate(True)
    toy.backward()
    scaler.step(toy.opt)
    sd = scaler.state_dict()
    scaler.reset_iteration()
    assert scaler.stage(toy.opt) is OptState.READY and scaler.state_dict() == sd
    with pytest.raises(RuntimeError, match="no inf/NaN checks"):
        scaler.update()  # nothing recorded any more
    toy.iterate(False)  # and the next iteration runs normally
    assert scaler.stats().steps == 2


# --------------------------------------------------------------------------- sync-free, read-only check


@pytest.mark.parametrize(
    "make, enabled",
    [
        (lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9), True),
        (lambda p: torch.optim.SGD(p, lr=0.05, foreach=True), True),
        (lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9, fused=True), True),
        (lambda p: torch.optim.Adam(p, lr=1e-2, fused=True), True),
        (lambda p: torch.optim.AdamW(p, lr=1e-2, fused=True), True),
        (lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9), False),
    ],
    ids=["sgd", "sgd_foreach", "sgd_fused", "adam_fused", "adamw_fused", "sgd_disabled"],
)
def test_is_sync_free_says_whether_step_and_update_read_the_device(make, enabled, monkeypatch):
    """is_sync_free(opt) == "step() + update() never call .item()" (the plain path's sync)."""
    model = make_model()
    try:
        opt = make(model.parameters())
    except (RuntimeError, TypeError, ValueError):
        pytest.skip("this torch has no fused CPU optimizer of this kind")
    scaler = ampkit.GradScaler("cpu", init_scale=2.0**8, growth_interval=1, enabled=enabled)
    reads = []
    real_item = torch.Tensor.item
    for i, (x, y) in enumerate(DATA[:3]):
        opt.zero_grad()
        scaler.scale(forward_loss(model, x, y)).backward()
        if i == 1:
            poison_grad(model, NAN)
        monkeypatch.setattr(torch.Tensor, "item", lambda t: reads.append(1) or real_item(t))
        scaler.step(opt)
        scaler.update()
        monkeypatch.setattr(torch.Tensor, "item", real_item)
    assert scaler.is_sync_free(opt) == (not reads)
    if enabled:
        assert scaler.stats().skipped == 1


@pytest.mark.skipif(not _fused_supported("sgd_fused"), reason="this torch has no fused CPU SGD")
def test_fused_step_skips_when_several_devices_overflow():
    """Fused kernels skip only when found_inf == 1.0, so the per-device flags are combined
    by max: summed, two overflowing devices gave 2.0 and the step ran on inf gradients. The
    CPU has one device; the second GPU's flag is planted under another device key."""
    p = torch.nn.Parameter(torch.ones(4))
    opt = torch.optim.SGD([p], lr=0.1, fused=True)
    scaler = ampkit.GradScaler("cpu", init_scale=8.0)
    scaler.scale(p.sum()).backward()
    p.grad[1] = INF
    scaler.unscale_(opt)
    flags = scaler._per_optimizer[id(opt)].found_inf_per_device
    flags[torch.device("cpu", 1)] = torch.ones(())
    before = p.detach().clone()
    scaler.step(opt)
    assert bits_equal(p.detach(), before)
    scaler.update()
    s = scaler.stats()
    assert (s.skipped, s.scale) == (1, 4.0)


@pytest.mark.skipif(not _fused_supported("sgd_fused"), reason="this torch has no fused CPU SGD")
def test_fused_step_on_one_device_passes_its_flag_itself():
    """No kernel to combine a lone flag: the optimizer gets the checked flag tensor itself."""

    class Spy(torch.optim.SGD):
        def step(self, *args, **kwargs):
            self.seen = self.found_inf
            return super().step(*args, **kwargs)

    p = torch.nn.Parameter(torch.ones(4))
    opt = Spy([p], lr=0.1, fused=True)
    scaler = ampkit.GradScaler("cpu")
    scaler.scale(p.sum()).backward()
    scaler.step(opt)
    assert opt.seen is scaler._per_optimizer[id(opt)].found_inf_per_device[p.device]
    scaler.update()


class _Writes(TorchDispatchMode):
    """Records every op that writes into one of ``watched`` (by its schema's alias info)."""

    def __init__(self, watched):
        super().__init__()
        self.ptrs = {t.data_ptr() for t in watched if t.numel()}
        self.ops = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        named = dict(zip((a.name for a in func._schema.arguments), args), **kwargs)
        for arg in func._schema.arguments:
            if arg.alias_info is None or not arg.alias_info.is_write:
                continue
            value = named.get(arg.name)
            values = value if isinstance(value, (list, tuple)) else [value]
            if any(isinstance(v, torch.Tensor) and v.data_ptr() in self.ptrs for v in values):
                self.ops.append(str(func))
        return func(*args, **kwargs)


class _Ops(TorchDispatchMode):
    """Records the name of every op that runs."""

    def __init__(self):
        super().__init__()
        self.ops = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(str(func))
        return func(*args, **(kwargs or {}))


def reciprocal_mismatches(device, step=1):
    """How many positive finite float32 values x (every ``step``-th bit pattern, subnormals
    included) have torch.reciprocal(x) != float(1 / double(x)), torch's unscale factor."""
    bad, chunk = 0, 1 << 24
    for start in range(0, 0x7F800000, chunk * step):
        bits = torch.arange(start, min(start + chunk * step, 0x7F800000), step, device=device)
        x = bits.to(torch.int32).view(torch.float32)
        ours = torch.reciprocal(x).view(torch.int32)
        bad += int((ours != x.double().reciprocal().float().view(torch.int32)).sum())
    return bad


def test_the_unscale_factor_is_torchs_to_the_bit():
    """The scaler unscales by a float32 reciprocal of the scale, torch's by the float32 of a
    float64 reciprocal: the same bits for every scale (a sample of the float32 range here;
    every value on CUDA in test_scaler_cuda, and once on this CPU: 0 differ)."""
    assert reciprocal_mismatches("cpu", step=251) == 0
    odd = dict(init_scale=1000.0, growth_factor=3.0, backoff_factor=0.3, growth_interval=1)
    run_pair(recipe_basic, N_STEPS, OPTIMIZERS["sgd_momentum_wd"], scaler_kw=odd)  # bitwise each step


@pytest.mark.parametrize("opt_name", ["sgd_momentum_wd", "adamw_foreach"])
def test_plain_step_and_update_run_no_more_ops_than_torchs(opt_name):
    """The host cost of an eager step is mostly ops: the plain path's step() and update()
    (stats included) dispatch no more of them than torch.amp.GradScaler's, and land on the
    same values."""
    counts, models = {}, {}
    for cls in (ampkit.GradScaler, torch.amp.GradScaler):
        model = make_model()
        opt = OPTIMIZERS[opt_name](model.parameters())
        scaler = cls("cpu", **SCALER_KW)
        for step in range(4):  # past lazy init and the optimizer's state creation
            x, y = DATA[step]
            opt.zero_grad()
            scaler.scale(forward_loss(model, x, y)).backward()
            if step == 3:
                with _Ops() as ops:
                    scaler.step(opt)
                    scaler.update()
                counts[cls] = ops.ops
            else:
                scaler.step(opt)
                scaler.update()
        models[cls] = (model, scaler.get_scale())
    ours, theirs = counts[ampkit.GradScaler], counts[torch.amp.GradScaler]
    assert len(ours) <= len(theirs), f"ours {ours}\ntorch {theirs}"
    (m0, s0), (m1, s1) = models.values()
    assert s0 == s1 and all(bits_equal(a, b) for a, b in zip(m0.parameters(), m1.parameters()))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_device_probes_are_one_multi_tensor_kernel(dtype):
    """Off the CPU the probes are one _foreach_norm per (device, dtype) group, bfloat16
    included (float32 out of the same kernel, no .float() per gradient). Meta tensors take
    that path on a machine without a GPU; the values are checked in test_scaler_property."""
    grads = [torch.empty(s, device="meta", dtype=dtype) for s in [(5,), (3, 4), (0,), (7,)]]
    with _Ops() as ops:
        probes = finite_probes(grads)
    assert ops.ops == ["aten._foreach_norm.Scalar"]
    want = torch.float32 if dtype == torch.bfloat16 else dtype
    assert [(p.dtype, p.shape) for p in probes] == [(want, torch.Size([]))] * 3


CHECK_CASES = {
    "clean": (torch.float32, [(7,), (3, 5), (1,)], []),
    "nan_fp32": (torch.float32, [(7,), (3, 5)], [(1, 14, NAN)]),
    "inf_fp16": (torch.float16, [(65,), (3, 5)], [(0, 64, INF)]),
    "neg_inf_bf16": (torch.bfloat16, [(33,), (2,)], [(0, 0, -INF)]),
    "nan_fp64": (torch.float64, [(5,)], [(0, 2, NAN)]),
    "largest_finite_fp16": (torch.float16, [(9,)], [(0, 1, 65504.0), (0, 2, -65504.0)]),
    "largest_finite_fp32": (torch.float32, [(9,), (4,)], [(0, 1, 3.4e38), (1, 0, 3.4e38)]),
    "empty_among_others": (torch.float32, [(0,), (4,), (0, 3)], [(1, 3, -INF)]),
    "only_empty": (torch.float16, [(0,), (2, 0)], []),
    "transposed": (torch.float32, [(4, 6)], [(0, 23, INF)]),
}


@pytest.mark.parametrize("case", list(CHECK_CASES))
def test_fused_check_reads_gradients_only_and_flags_like_torch(case):
    """The fused path's check: the same flag as torch's check-and-multiply-by-1.0 kernel,
    and no op that writes into a gradient (per the ops' schemas) runs."""
    dtype, shapes, pokes = CHECK_CASES[case]
    gen = torch.Generator().manual_seed(3)
    grads = [torch.randn(s, generator=gen).to(dtype) for s in shapes]
    for i, pos, value in pokes:
        grads[i].view(-1)[pos] = value
    if case == "transposed":
        grads = [g.t() for g in grads]
    saved = [g.clone() for g in grads]
    with _Writes(grads) as writes:
        ours = ampkit.GradScaler("cpu").found_inf({(torch.device("cpu"), dtype): grads}, unscale=False)
    theirs = torch.zeros(())
    torch._amp_foreach_non_finite_check_and_unscale_([g.clone() for g in grads], theirs, torch.ones(()))
    assert list(ours) == [torch.device("cpu")] and bits_equal(ours[torch.device("cpu")], theirs)
    assert theirs.item() == (1.0 if any(v != v or abs(v) == INF for _, _, v in pokes) else 0.0)
    assert writes.ops == [] and all(bits_equal(g, c) for g, c in zip(grads, saved))


@pytest.mark.parametrize("bad", [float("nan"), -4.0, 0.0, float("inf"), -float("inf")])
@pytest.mark.parametrize("as_tensor", [False, True], ids=["float", "tensor"])
def test_update_refuses_a_non_finite_or_non_positive_new_scale_naming_it(bad, as_tensor):
    scaler = ampkit.GradScaler("cpu", init_scale=8.0, hysteresis=2)
    toy = Toy(scaler)
    toy.iterate(True)
    toy.backward()
    scaler.step(toy.opt)
    before = full_state(scaler, toy.opt)
    value = torch.tensor(bad) if as_tensor else bad
    with pytest.raises(ValueError, match=rf"new_scale=(tensor\()?{re.escape(repr(bad))}"):
        scaler.update(new_scale=value)
    assert_unchanged(before, scaler, toy.opt)
    scaler.update()  # the iteration is still there to finish
    assert scaler.stats().steps == 2


def _torch_reference_after(scaler_state, flags):
    """torch.amp.GradScaler from a state, driven through iterations with these inf flags."""
    ref = torch.amp.GradScaler("cpu")
    ref.load_state_dict(scaler_state)
    toy = Toy(ref)
    for found in flags:
        toy.iterate(found)
    return ref.get_scale(), ref.state_dict()["_growth_tracker"]


@pytest.mark.parametrize("opt_kw", [{}, {"fused": True}], ids=["plain", "fused"])
@pytest.mark.parametrize("fails_at", ["after_scale", "after_unscale", "in_optimizer_step",
                                      "after_step"])
def test_after_a_failed_iteration_reset_iteration_starts_a_clean_one(fails_at, opt_kw):
    """The documented recovery: whatever stage the failed iteration stopped at,
    reset_iteration() then a normal iteration gives what torch's scaler gives when the
    failed iteration never happened (scale and tracker), and changes nothing else."""
    scaler = ampkit.GradScaler("cpu", init_scale=8.0, growth_interval=2)
    toy = Toy(scaler, **opt_kw)
    toy.iterate(False)
    start = scaler.state_dict()
    toy.backward()
    if fails_at in ("after_unscale", "in_optimizer_step"):
        scaler.unscale_(toy.opt)
    if fails_at == "in_optimizer_step":
        real = toy.opt.step
        toy.opt.step = lambda *a, **k: (_ for _ in ()).throw(RuntimeError("boom"))
        with pytest.raises(RuntimeError, match="boom"):
            scaler.step(toy.opt)
        toy.opt.step = real
    if fails_at == "after_step":
        scaler.step(toy.opt)
    assert scaler.state_dict() == start  # only update() changes the scale state
    scaler.reset_iteration()
    assert scaler.stage(toy.opt) is OptState.READY
    for found in (False, True, False):
        toy.iterate(found)
    got = scaler.state_dict()
    assert (got["scale"], got["_growth_tracker"]) == _torch_reference_after(start, [False, True, False])


def test_a_stale_unscale_from_a_failed_iteration_is_refused_not_applied():
    """Without reset_iteration(), step() would apply the new, still-scaled gradients with
    the failed iteration's inf check (what torch's scaler does): it raises instead."""
    scaler = ampkit.GradScaler("cpu", init_scale=2.0**10)
    toy = Toy(scaler)
    toy.opt.param_groups[0]["lr"] = 0.1
    toy.backward()
    scaler.unscale_(toy.opt)  # ... and the iteration fails here
    toy.backward()  # the next one: zero_grad, a new backward
    before = toy.p.detach().clone()
    with pytest.raises(RuntimeError, match=r"not the ones unscale_\(\) unscaled.*reset_iteration\(\)"):
        scaler.step(toy.opt)
    assert torch.equal(toy.p, before)
    scaler.reset_iteration()
    toy.backward()
    scaler.step(toy.opt)
    scaler.update()
    assert torch.equal(toy.p.detach(), before - 0.1)  # unscaled: a gradient of ones


def test_clipping_between_unscale_and_step_is_not_a_stale_unscale():
    scaler = ampkit.GradScaler("cpu", init_scale=2.0**10)
    toy = Toy(scaler)
    toy.backward()
    scaler.unscale_(toy.opt)
    torch.nn.utils.clip_grad_norm_([toy.p], 0.5)  # in place: the same gradient tensors
    scaler.step(toy.opt)
    scaler.update()
    assert scaler.stats().steps == 1
