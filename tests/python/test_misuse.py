"""The misuse catalogue: every public entry point, given a bad value, a wrong type or a
wrong call order, raises the documented error class with a message that names what was
wrong, and changes nothing.

The cases are data (one row each, with a readable id). Each runs in a fresh world (a
model, an optimizer with state, a GradScaler past its first iteration, a train step that
has run once, a policy), optionally brought into a state first (an active region, a
half-done iteration); the world's state is read before and after the bad call and must
be bitwise the same: parameters, gradients, optimizer state, ``scaler.state_dict()`` and
the optimizer's stage, the policy, the step object, torch's autocast state and its
function-mode stack. ``test_every_public_name_has_cases`` fails when a public name or a
public method is added without cases here.
"""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
from typing import Any, Callable

import pytest
import torch
import yaml

import ampkit
import ampkit.bench as bench

F16 = dict(device_type="cpu", dtype=torch.float16)


# --------------------------------------------------------------------------- the world
@dataclasses.dataclass
class World:
    model: torch.nn.Module
    opt: torch.optim.Optimizer
    scaler: ampkit.GradScaler
    step: Any
    policy: ampkit.Policy
    stack: contextlib.ExitStack
    tmp: Any
    extra: dict = dataclasses.field(default_factory=dict)

    def backward(self):
        self.opt.zero_grad()
        with ampkit.autocast(**F16):
            loss = self.model(torch.ones(3, 4)).float().pow(2).mean()
        self.scaler.scale(loss).backward()


def make_world(tmp_path) -> World:
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    scaler = ampkit.GradScaler("cpu", init_scale=2.0**8, growth_interval=3, hysteresis=2)
    step = ampkit.make_train_step(model, torch.nn.functional.mse_loss, opt, scaler=scaler,
                                  autocast=F16, capture=False)
    step(torch.randn(3, 4), torch.randn(3, 2))  # optimizer state, a stepped scaler
    policy = ampkit.load_policy("torch_default").with_ops("cpu", fp32=["mm"])
    return World(model, opt, scaler, step, policy, contextlib.ExitStack(), tmp_path)


def state_of(w: World) -> dict:
    return dict(
        params=[p.detach().clone() for p in w.model.parameters()],
        grads=[None if p.grad is None else p.grad.clone() for p in w.model.parameters()],
        opt=[(k, v.clone() if isinstance(v, torch.Tensor) else v)
             for s in w.opt.state.values() for k, v in s.items()],
        scaler=w.scaler.state_dict(),
        stage=w.scaler.stage(w.opt),
        policy=(w.policy, w.policy.to_dict()),
        step=repr(w.step),
        autocast=(ampkit.is_autocast_enabled("cpu"), ampkit.get_autocast_dtype("cpu"),
                  torch.is_autocast_cache_enabled(), torch._C._len_torch_function_stack()),
    )


def assert_same_state(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for key in a:
        x, y = a[key], b[key]
        if key in ("params", "grads"):
            assert len(x) == len(y)
            for s, t in zip(x, y):
                assert (s is None) == (t is None)
                assert s is None or torch.equal(s, t), key
        elif key == "opt":
            assert [k for k, _ in x] == [k for k, _ in y]
            for (_, s), (_, t) in zip(x, y):
                assert torch.equal(s, t) if isinstance(s, torch.Tensor) else s == t
        else:
            assert x == y, key


# --------------------------------------------------------------------------- helpers for cases
def _enter(w, cm):
    w.extra["entered"] = w.stack.enter_context(cm) or cm
    w.extra["cm"] = cm


def _active_region(w):
    _enter(w, ampkit.autocast("cpu", dtype=torch.bfloat16))


def _active_trace(w):
    tr = ampkit.trace()
    w.stack.enter_context(tr)
    w.extra["cm"] = tr


def _outer_then_inner_trace(w):
    outer, inner = ampkit.trace(), ampkit.trace()
    w.stack.enter_context(outer)
    w.stack.enter_context(inner)
    w.extra["cm"] = outer


def _unscaled(w):
    w.backward()
    w.scaler.unscale_(w.opt)


def _stepped(w):
    w.backward()
    w.scaler.step(w.opt)


def _stale_unscale(w):  # an iteration failed after unscale_; the next one skipped the reset
    _unscaled(w)
    w.backward()


def _non_utf8_policy(w):
    path = w.tmp / "latin1.yaml"
    path.write_bytes("name: caf\u00e9\n".encode("latin-1"))
    w.extra["path"] = path


def _taken_op(w):
    ampkit.op(_first_registered, name="misuse_catalogue_op")


def _first_registered(x):
    return x * 2


def _second_function(x):
    return x * 3


def _bench_case(w, **sizes):
    src = bench.load_cases()["seed_mlp"].path
    doc = yaml.safe_load(open(src))
    doc["profiles"]["tiny"]["sizes"].update(sizes)
    path = w.tmp / "seed_mlp.yaml"
    path.write_text(yaml.safe_dump(doc))
    w.extra["path"] = path


def _bench_built(w):
    w.extra["built"] = bench.build_case("seed_mlp", "tiny", seed=0, device="cpu")


def _sd(w, **change):
    sd = w.scaler.state_dict()
    sd.update(change)
    return sd


def _sd_without(w, key):
    sd = w.scaler.state_dict()
    del sd[key]
    return sd


# --------------------------------------------------------------------------- the catalogue
@dataclasses.dataclass(frozen=True)
class Case:
    id: str
    target: str  # the public name or Class.method it exercises
    call: Callable[[World], Any]
    exc: type
    names: str  # a regex the message must contain: the bad value, or the broken order
    setup: Callable[[World], Any] | None = None


def C(id, target, call, exc, names, setup=None):
    return Case(id, target, call, exc, names, setup)


T = torch.tensor
CASES = [
    # ampkit.autocast: construction, enter/exit order, decorator
    C("autocast-device-int", "autocast", lambda w: ampkit.autocast(3), ValueError, r"got 3"),
    C("autocast-device-unknown", "autocast", lambda w: ampkit.autocast("tpu"), ValueError, r"'tpu' is not supported.*cpu, cuda"),
    C("autocast-dtype-float64", "autocast", lambda w: ampkit.autocast("cpu", dtype=torch.float64), ValueError, r"torch.float64.*valid: torch.float16, torch.bfloat16"),
    C("autocast-dtype-str", "autocast", lambda w: ampkit.autocast("cpu", dtype="bfloat16"), ValueError, r"'bfloat16'"),
    C("autocast-enabled-str", "autocast", lambda w: ampkit.autocast("cpu", enabled="yes"), ValueError, r"'yes'"),
    C("autocast-cache-int", "autocast", lambda w: ampkit.autocast("cpu", cache_enabled=1), ValueError, r"got 1"),
    C("autocast-policy-unknown", "autocast", lambda w: ampkit.autocast("cpu", policy="nope"), ampkit.PolicyError, r"'nope'"),
    C("autocast-policy-int", "autocast", lambda w: ampkit.autocast("cpu", policy=5), ampkit.PolicyError, r"got 5"),
    C("autocast-enter-while-active", "autocast.__enter__", lambda w: w.extra["cm"].__enter__(), RuntimeError, r"already active", _active_region),
    C("autocast-exit-never-entered", "autocast.__exit__", lambda w: ampkit.autocast("cpu").__exit__(None, None, None), RuntimeError, r"never entered"),
    C("autocast-exit-never-entered-inside-a-region", "autocast.__exit__", lambda w: ampkit.autocast("cpu", dtype=torch.float16).__exit__(None, None, None), RuntimeError, r"never entered", _active_region),
    C("autocast-decorate-non-callable", "autocast.__call__", lambda w: ampkit.autocast("cpu")(3), TypeError, r"got 3"),
    # trace
    C("trace-enter-while-active", "trace.__enter__", lambda w: w.extra["cm"].__enter__(), RuntimeError, r"already active", _active_trace),
    C("trace-exit-never-entered", "trace.__exit__", lambda w: ampkit.trace().__exit__(None, None, None), RuntimeError, r"never entered"),
    C("trace-exit-never-entered-inside-a-trace", "trace.__exit__", lambda w: ampkit.trace().__exit__(None, None, None), RuntimeError, r"never entered", _active_trace),
    C("trace-exit-outer-before-inner", "trace.__exit__", lambda w: w.extra["cm"].__exit__(None, None, None), RuntimeError, r"not the innermost", _outer_then_inner_trace),
    C("cast-trace-table-rules-int", "CastTrace.table", lambda w: ampkit.CastTrace().table(rules=5), TypeError, r"got 5"),
    C("cast-trace-table-rules-str", "CastTrace.table", lambda w: ampkit.CastTrace().table(rules="fp32"), TypeError, r"got 'fp32'"),
    C("cast-trace-table-rules-unknown", "CastTrace.table", lambda w: ampkit.CastTrace().table(rules={"fp33"}), ValueError, r"'fp33'"),
    # autocast queries
    C("is-autocast-enabled-unknown-device", "is_autocast_enabled", lambda w: ampkit.is_autocast_enabled("tpu"), RuntimeError, r"'tpu'"),
    C("is-autocast-enabled-none", "is_autocast_enabled", lambda w: ampkit.is_autocast_enabled(None), TypeError, r"got None"),
    C("get-autocast-dtype-unknown-device", "get_autocast_dtype", lambda w: ampkit.get_autocast_dtype("tpu"), RuntimeError, r"'tpu'"),
    C("get-autocast-dtype-int", "get_autocast_dtype", lambda w: ampkit.get_autocast_dtype(3), TypeError, r"got 3"),
    # checkpoint, custom_fwd/bwd, op
    C("checkpoint-non-callable", "checkpoint", lambda w: ampkit.checkpoint(3, torch.ones(1)), TypeError, r"got 3"),
    C("checkpoint-use-reentrant-str", "checkpoint", lambda w: ampkit.checkpoint(w.model, torch.ones(1, 4), use_reentrant="no"), TypeError, r"'no'"),
    C("custom-fwd-device-none", "custom_fwd", lambda w: ampkit.custom_fwd(device_type=None), ValueError, r"got None"),
    C("custom-fwd-cast-inputs-str", "custom_fwd", lambda w: ampkit.custom_fwd(device_type="cpu", cast_inputs="float32"), ValueError, r"'float32'"),
    C("custom-fwd-cast-inputs-int-dtype", "custom_fwd", lambda w: ampkit.custom_fwd(device_type="cpu", cast_inputs=torch.int32), ValueError, r"torch.int32"),
    C("custom-bwd-device-int", "custom_bwd", lambda w: ampkit.custom_bwd(device_type=3), ValueError, r"got 3"),
    C("op-non-callable", "op", lambda w: ampkit.op(3, name="three"), TypeError, r"got 3"),
    C("op-name-not-identifier", "op", lambda w: ampkit.op(_second_function, name="not a name"), ValueError, r"'not a name'"),
    C("op-name-of-a-torch-op", "op", lambda w: ampkit.op(_second_function, name="linear"), ValueError, r"'linear' already names a torch op"),
    C("op-name-taken", "op", lambda w: ampkit.op(_second_function, name="misuse_catalogue_op"), ValueError, r"'misuse_catalogue_op' is already registered.*replace=True", _taken_op),
    C("op-replace-str", "op", lambda w: ampkit.op(_second_function, name="misuse_catalogue_op", replace="yes"), TypeError, r"'yes'"),
    # policies
    C("load-policy-int", "load_policy", lambda w: ampkit.load_policy(5), ampkit.PolicyError, r"got 5"),
    C("load-policy-unknown-name", "load_policy", lambda w: ampkit.load_policy("nope"), ampkit.PolicyError, r"'nope'.*shipped: fp8, torch_default"),
    C("load-policy-missing-file", "load_policy", lambda w: ampkit.load_policy("/no/such/policy.yaml"), ampkit.PolicyError, r"/no/such/policy.yaml"),
    C("load-policy-not-utf8", "load_policy", lambda w: ampkit.load_policy(w.extra["path"]), ampkit.PolicyError, r"latin1.yaml:1: .*not UTF-8", _non_utf8_policy),
    C("policy-name-int", "Policy", lambda w: ampkit.Policy(name=3, devices=()), ampkit.PolicyError, r"got 3"),
    C("policy-devices-int", "Policy", lambda w: ampkit.Policy(name="p", devices=5), ampkit.PolicyError, r"got 5"),
    C("policy-description-none", "Policy", lambda w: ampkit.Policy(name="p", devices=(), description=None), ampkit.PolicyError, r"got None"),
    C("with-ops-none", "Policy.with_ops", lambda w: w.policy.with_ops(fp32=None), ampkit.PolicyError, r"fp32= .*got None"),
    C("with-ops-str", "Policy.with_ops", lambda w: w.policy.with_ops(fp32="mm"), ampkit.PolicyError, r"'mm'"),
    C("with-ops-device-int", "Policy.with_ops", lambda w: w.policy.with_ops(3, fp32=["mm"]), ampkit.PolicyError, r"device must be .*got 3"),
    C("with-ops-device-unknown", "Policy.with_ops", lambda w: w.policy.with_ops("tpu", fp32=["mm"]), ampkit.PolicyError, r"'tpu'"),
    C("with-ops-unknown-category", "Policy.with_ops", lambda w: w.policy.with_ops(fp16=["mm"]), ampkit.PolicyError, r"'fp16'"),
    C("with-ops-unknown-op", "Policy.with_ops", lambda w: w.policy.with_ops(fp32=["matmull"]), ampkit.PolicyError, r"'matmull'.*did you mean"),
    C("with-ops-op-in-two-categories", "Policy.with_ops", lambda w: w.policy.with_ops(fp32=["mm"], promote=["mm"]), ampkit.PolicyError, r"'mm'"),
    C("without-ops-unlisted", "Policy.without_ops", lambda w: w.policy.without_ops("relu"), ampkit.PolicyError, r"'relu' is in no category"),
    C("without-ops-device-int", "Policy.without_ops", lambda w: w.policy.without_ops("mm", device=3), ampkit.PolicyError, r"got 3"),
    C("with-fp8-recipe-unknown-scaling", "Policy.with_fp8_recipe", lambda w: w.policy.with_fp8_recipe(scaling="blockwise"), ampkit.PolicyError, r"'blockwise' is not one of tensorwise, rowwise, delayed"),
    C("with-fp8-recipe-unknown-key", "Policy.with_fp8_recipe", lambda w: w.policy.with_fp8_recipe(history=4), ampkit.PolicyError, r"unknown fp8_recipe key 'history'"),
    C("with-fp8-recipe-device-unknown", "Policy.with_fp8_recipe", lambda w: w.policy.with_fp8_recipe("tpu", scaling="rowwise"), ampkit.PolicyError, r"'tpu'"),
    C("with-dtype-float64", "Policy.with_dtype", lambda w: w.policy.with_dtype("cpu", torch.float64), ampkit.PolicyError, r"float64"),
    C("with-dtype-device-unknown", "Policy.with_dtype", lambda w: w.policy.with_dtype("tpu", torch.bfloat16), ampkit.PolicyError, r"'tpu'"),
    C("with-name-empty", "Policy.with_name", lambda w: w.policy.with_name(""), ampkit.PolicyError, r"got ''"),
    C("with-name-int", "Policy.with_name", lambda w: w.policy.with_name(3), ampkit.PolicyError, r"got 3"),
    C("rules-device-unknown", "Policy.rules", lambda w: w.policy.rules("tpu"), ampkit.PolicyError, r"'tpu'.*it has: cpu, cuda"),
    C("category-device-unknown", "Policy.category", lambda w: w.policy.category("tpu", "mm"), ampkit.PolicyError, r"'tpu'"),
    C("category-op-int", "Policy.category", lambda w: w.policy.category("cpu", 3), ampkit.PolicyError, r"got 3"),
    C("decomposes-op-none", "Policy.decomposes", lambda w: w.policy.decomposes("cpu", None), ampkit.PolicyError, r"got None"),
    # GradScaler: construction
    C("scaler-growth-factor-1", "GradScaler", lambda w: ampkit.GradScaler("cpu", growth_factor=1.0), ValueError, r"growth_factor=1.0"),
    C("scaler-backoff-1.5", "GradScaler", lambda w: ampkit.GradScaler("cpu", backoff_factor=1.5), ValueError, r"backoff_factor=1.5"),
    C("scaler-interval-0", "GradScaler", lambda w: ampkit.GradScaler("cpu", growth_interval=0), ValueError, r"growth_interval=0"),
    C("scaler-interval-float", "GradScaler", lambda w: ampkit.GradScaler("cpu", growth_interval=2.5), TypeError, r"2.5"),
    C("scaler-init-scale-nan", "GradScaler", lambda w: ampkit.GradScaler("cpu", init_scale=float("nan")), ValueError, r"init_scale=nan"),
    C("scaler-enabled-str", "GradScaler", lambda w: ampkit.GradScaler("cpu", enabled="yes"), TypeError, r"'yes'"),
    C("scaler-device-int", "GradScaler", lambda w: ampkit.GradScaler(3), TypeError, r"got 3"),
    C("scaler-device-unknown", "GradScaler", lambda w: ampkit.GradScaler("gpu0"), ValueError, r"'gpu0'"),
    C("scaler-hysteresis-0", "GradScaler", lambda w: ampkit.GradScaler("cpu", hysteresis=0), ValueError, r"hysteresis=0"),
    C("scaler-clamps-crossed", "GradScaler", lambda w: ampkit.GradScaler("cpu", init_scale=3.0, min_scale=4.0, max_scale=2.0), ValueError, r"min_scale=4.0 is larger than max_scale=2.0"),
    C("scaler-found-inf-list", "GradScaler.found_inf", lambda w: w.scaler.found_inf([torch.ones(2)], True), TypeError, r"found_inf\(\) takes .*got list"),
    C("autocast-available-int", "is_autocast_available", lambda w: ampkit.is_autocast_available(3), TypeError, r"got 3"),
    C("scaler-group-without-init", "GradScaler", lambda w: ampkit.GradScaler("cpu", process_group="world"), RuntimeError, r"process_group='world'.*init_process_group"),
    C("cuda-scaler-device", "cuda_amp_grad_scaler", lambda w: ampkit.cuda_amp_grad_scaler(device="cpu"), TypeError, r"device='cpu'"),
    C("cuda-scaler-interval-0", "cuda_amp_grad_scaler", lambda w: ampkit.cuda_amp_grad_scaler(growth_interval=0), ValueError, r"growth_interval=0"),
    # GradScaler: methods, values and order
    C("scale-float", "GradScaler.scale", lambda w: w.scaler.scale(3.0), TypeError, r"float \(3.0\)"),
    C("scale-dict", "GradScaler.scale", lambda w: w.scaler.scale({"loss": torch.ones(())}), TypeError, r"is dict"),
    C("unscale-not-an-optimizer", "GradScaler.unscale_", lambda w: w.scaler.unscale_(object()), TypeError, r"unscale_\(\) expected a torch.optim.Optimizer.*got <object object"),
    C("unscale-twice", "GradScaler.unscale_", lambda w: w.scaler.unscale_(w.opt), RuntimeError, r"unscale_\(\) was already called.*reset_iteration", _unscaled),
    C("unscale-after-step", "GradScaler.unscale_", lambda w: w.scaler.unscale_(w.opt), RuntimeError, r"unscale_\(\) was called after step\(\)", _stepped),
    C("step-not-an-optimizer", "GradScaler.step", lambda w: w.scaler.step("opt"), TypeError, r"step\(\) expected a torch.optim.Optimizer.*got 'opt'"),
    C("step-closure", "GradScaler.step", lambda w: w.scaler.step(w.opt, closure=lambda: 0), RuntimeError, r"closure", lambda w: w.backward()),
    C("step-twice", "GradScaler.step", lambda w: w.scaler.step(w.opt), RuntimeError, r"step\(\) was already called", _stepped),
    C("step-after-a-stale-unscale", "GradScaler.step", lambda w: w.scaler.step(w.opt), RuntimeError, r"not the ones unscale_\(\) unscaled.*reset_iteration", _stale_unscale),
    C("update-without-step", "GradScaler.update", lambda w: w.scaler.update(), RuntimeError, r"no inf/NaN checks", lambda w: w.backward()),
    C("update-new-scale-nan", "GradScaler.update", lambda w: w.scaler.update(new_scale=float("nan")), ValueError, r"new_scale=nan", _stepped),
    C("update-new-scale-tensor-nan", "GradScaler.update", lambda w: w.scaler.update(new_scale=T(float("nan"))), ValueError, r"new_scale=tensor\(nan\)", _stepped),
    C("update-new-scale-tensor-negative", "GradScaler.update", lambda w: w.scaler.update(new_scale=T(-2.0)), ValueError, r"new_scale=tensor\(-2.0\)", _stepped),
    C("update-new-scale-tensor-zero", "GradScaler.update", lambda w: w.scaler.update(new_scale=T(0.0)), ValueError, r"new_scale=tensor\(0.0\)", _stepped),
    C("update-new-scale-inf", "GradScaler.update", lambda w: w.scaler.update(new_scale=float("inf")), ValueError, r"new_scale=inf", _stepped),
    C("update-new-scale-str", "GradScaler.update", lambda w: w.scaler.update(new_scale="big"), TypeError, r"'big'", _stepped),
    C("update-new-scale-two-elements", "GradScaler.update", lambda w: w.scaler.update(new_scale=torch.ones(2)), ValueError, r"shape \(2,\)", _stepped),
    C("set-growth-factor-below-1", "GradScaler.set_growth_factor", lambda w: w.scaler.set_growth_factor(0.9), ValueError, r"0.9"),
    C("set-backoff-factor-2", "GradScaler.set_backoff_factor", lambda w: w.scaler.set_backoff_factor(2), ValueError, r"backoff_factor=2"),
    C("set-growth-interval-0", "GradScaler.set_growth_interval", lambda w: w.scaler.set_growth_interval(0), ValueError, r"growth_interval=0"),
    C("set-growth-interval-str", "GradScaler.set_growth_interval", lambda w: w.scaler.set_growth_interval("3"), TypeError, r"'3'"),
    C("stage-not-an-optimizer", "GradScaler.stage", lambda w: w.scaler.stage(3), TypeError, r"got 3"),
    C("is-sync-free-not-an-optimizer", "GradScaler.is_sync_free", lambda w: w.scaler.is_sync_free("sgd"), TypeError, r"got 'sgd'"),
    C("load-state-dict-list", "GradScaler.load_state_dict", lambda w: w.scaler.load_state_dict([("scale", 1.0)]), TypeError, r"got list"),
    C("load-state-dict-empty", "GradScaler.load_state_dict", lambda w: w.scaler.load_state_dict({}), ValueError, r"empty dict"),
    C("load-state-dict-missing-key", "GradScaler.load_state_dict", lambda w: w.scaler.load_state_dict(_sd_without(w, "scale")), ValueError, r"\['scale'\]"),
    C("load-state-dict-tracker-at-interval", "GradScaler.load_state_dict", lambda w: w.scaler.load_state_dict(_sd(w, _growth_tracker=3)), ValueError, r"'_growth_tracker'\]=3 .*\[0, 2\]"),
    C("load-state-dict-tracker-negative", "GradScaler.load_state_dict", lambda w: w.scaler.load_state_dict(_sd(w, _growth_tracker=-1)), ValueError, r"'_growth_tracker'\]=-1"),
    C("load-state-dict-scale-str", "GradScaler.load_state_dict", lambda w: w.scaler.load_state_dict(_sd(w, scale="1.0")), TypeError, r"'scale'\].*'1.0'"),
    C("load-state-dict-hysteresis-left-past", "GradScaler.load_state_dict", lambda w: w.scaler.load_state_dict(_sd(w, _hysteresis_left=9)), ValueError, r"'_hysteresis_left'\]=9"),
    # make_train_step and the step it returns
    C("step-model-str", "make_train_step", lambda w: ampkit.make_train_step("m", torch.nn.functional.mse_loss, w.opt), TypeError, r"got str"),
    C("step-loss-int", "make_train_step", lambda w: ampkit.make_train_step(w.model, 3, w.opt), TypeError, r"got int"),
    C("step-optimizer-none", "make_train_step", lambda w: ampkit.make_train_step(w.model, torch.nn.functional.mse_loss, None), TypeError, r"got NoneType"),
    C("step-scaler-torch", "make_train_step", lambda w: ampkit.make_train_step(w.model, torch.nn.functional.mse_loss, w.opt, scaler=torch.amp.GradScaler("cpu")), TypeError, r"torch.amp.grad_scaler.GradScaler"),
    C("step-autocast-str", "make_train_step", lambda w: ampkit.make_train_step(w.model, torch.nn.functional.mse_loss, w.opt, autocast="cpu"), TypeError, r"got 'cpu'"),
    C("step-autocast-unknown-key", "make_train_step", lambda w: ampkit.make_train_step(w.model, torch.nn.functional.mse_loss, w.opt, autocast=dict(dtyp=torch.float16)), ValueError, r"'dtyp'"),
    C("step-autocast-device-unknown", "make_train_step", lambda w: ampkit.make_train_step(w.model, torch.nn.functional.mse_loss, w.opt, autocast=dict(device_type="tpu")), ValueError, r"'tpu'"),
    C("step-autocast-float64", "make_train_step", lambda w: ampkit.make_train_step(w.model, torch.nn.functional.mse_loss, w.opt, autocast=dict(dtype=torch.float64)), ValueError, r"torch.float64.*valid: torch.float16, torch.bfloat16"),
    C("step-autocast-enabled-str", "make_train_step", lambda w: ampkit.make_train_step(w.model, torch.nn.functional.mse_loss, w.opt, autocast=dict(enabled="yes")), ValueError, r"'yes'"),
    C("step-autocast-policy-unknown", "make_train_step", lambda w: ampkit.make_train_step(w.model, torch.nn.functional.mse_loss, w.opt, autocast=dict(policy="nope")), ampkit.PolicyError, r"'nope'"),
    C("step-capture-str", "make_train_step", lambda w: ampkit.make_train_step(w.model, torch.nn.functional.mse_loss, w.opt, capture="yes"), ValueError, r"'yes'"),
    C("step-warmup-0", "make_train_step", lambda w: ampkit.make_train_step(w.model, torch.nn.functional.mse_loss, w.opt, warmup=0), ValueError, r"warmup=0"),
    C("step-warmup-float", "make_train_step", lambda w: ampkit.make_train_step(w.model, torch.nn.functional.mse_loss, w.opt, warmup=1.5), TypeError, r"1.5"),
    C("step-call-inputs-str", "TrainStep.__call__", lambda w: w.step("batch", torch.zeros(3, 2)), TypeError, r"got str"),
    C("step-call-targets-int", "TrainStep.__call__", lambda w: w.step(torch.zeros(3, 4), (torch.zeros(3, 2), 3)), TypeError, r"targets\[1\].*got int"),
    C("step-call-wrong-shape", "TrainStep.__call__", lambda w: w.step(torch.zeros(3, 5), torch.zeros(3, 2)), RuntimeError, r"3x5"),
    # the benchmark package's entry points
    C("bench-batch-size-0", "bench.load_case", lambda w: bench.load_case(w.extra["path"]), bench.BenchSpecError, r"seed_mlp.*batch_size.*got 0", lambda w: _bench_case(w, batch_size=0)),
    C("bench-batch-size-float", "bench.load_case", lambda w: bench.load_case(w.extra["path"]), bench.BenchSpecError, r"seed_mlp.*batch_size.*got 2.5", lambda w: _bench_case(w, batch_size=2.5)),
    C("bench-batch-size-negative", "bench.load_case", lambda w: bench.load_case(w.extra["path"]), bench.BenchSpecError, r"seed_mlp.*batch_size.*got -4", lambda w: _bench_case(w, batch_size=-4)),
    C("bench-batch-size-str", "bench.load_case", lambda w: bench.load_case(w.extra["path"]), bench.BenchSpecError, r"seed_mlp.*batch_size.*got '8'", lambda w: _bench_case(w, batch_size="8")),
    C("bench-num-layers-0", "bench.load_case", lambda w: bench.load_case(w.extra["path"]), bench.BenchSpecError, r"seed_mlp.*num_layers.*got 0", lambda w: _bench_case(w, num_layers=0)),
    C("bench-run-variant-name", "bench.run_variant", lambda w: bench.run_variant(w.extra["built"], "fp32"), TypeError, r"got 'fp32'.*load_variants\(\)\['fp32'\]", _bench_built),
    # policies per module
    C("scope-pin-float16", "Policy.with_module", lambda w: w.policy.with_module("head", pin="float16"), ampkit.PolicyError, r"pin must be one of float32.*'float16'"),
    C("scope-empty-glob", "Policy.with_module", lambda w: w.policy.with_module("", pin="float32"), ampkit.PolicyError, r"got ''"),
    C("scope-unknown-op", "Policy.with_module", lambda w: w.policy.with_module("x", fp32=["no_such_op"]), ampkit.PolicyError, r"no_such_op"),
    C("scope-twice", "Policy.with_module", lambda w: w.policy.with_module("x", pin="float32").with_module("x", fp32=["mm"]), ampkit.PolicyError, r"'x' is already in the policy"),
    C("scope-remove-absent", "Policy.without_module", lambda w: w.policy.without_module("x"), ampkit.PolicyError, r"no scope 'x'"),
    C("scope-apply-no-match", "Policy.apply", lambda w: w.policy.with_module("encoder", pin="float32").apply(w.model), ampkit.PolicyError, r"'encoder' matches no module"),
    C("scope-apply-not-a-module", "Policy.apply", lambda w: w.policy.apply("model"), TypeError, r"got str"),
    # the numerics doctor
    # fp8 auto
    C("calibrate-not-a-module", "calibrate_fp8", lambda w: ampkit.calibrate_fp8(w.policy, torch.ones(2, 4)),
      TypeError, r"model must be a torch.nn.Module, got Policy"),
    C("calibrate-max-error", "calibrate_fp8", lambda w: ampkit.calibrate_fp8(w.model, torch.ones(2, 4), max_error=-0.1),
      ValueError, r"max_error must be a finite number > 0, got -0.1"),
    C("calibrate-no-linear", "calibrate_fp8", lambda w: ampkit.calibrate_fp8(torch.nn.ReLU(), torch.ones(2, 4)),
      ValueError, r"the ReLU has no torch.nn.Linear"),
    C("doctor-every-0", "doctor", lambda w: ampkit.doctor(w.model, every=0), ValueError, r"every must be a positive integer.*got 0"),
    C("doctor-every-float", "doctor", lambda w: ampkit.doctor(w.model, every=2.5), ValueError, r"got 2.5"),
    C("doctor-every-bool", "doctor", lambda w: ampkit.doctor(w.model, every=True), ValueError, r"got True"),
    C("doctor-not-a-module", "doctor", lambda w: ampkit.doctor("model"), TypeError, r"got str"),
    C("doctor-armed-twice", "doctor", lambda w: ampkit.doctor(w.model), RuntimeError, r"already armed on this Linear", lambda w: w.stack.enter_context(ampkit.doctor(w.model))),
]

# Public names with no call to misuse, and public methods whose only arguments are none.
NOTHING_TO_MISUSE = {
    "CATEGORIES": "a tuple constant",
    "PolicyError": "an exception class",
    "CastTrace": "built by trace(); its constructor takes no arguments",
    "trace": "takes no arguments (its __enter__/__exit__ have cases)",
    "CastTrace.as_rows": "takes no arguments and is valid in every state",
    "Fp8Calibration": "a result value built by calibrate_fp8()",
    "Fp8Decision": "a report row built by calibrate_fp8()",
    "Policy.device_types": "takes no arguments",
    "Policy.to_dict": "takes no arguments",
    "Policy.to_yaml": "takes no arguments",
    "GradScaler.get_scale": "takes no arguments and is valid in every state",
    "GradScaler.get_growth_factor": "takes no arguments",
    "GradScaler.get_backoff_factor": "takes no arguments",
    "GradScaler.get_growth_interval": "takes no arguments",
    "GradScaler.is_enabled": "takes no arguments",
    "GradScaler.reset_iteration": "takes no arguments and is valid in every state",
    "GradScaler.state_dict": "takes no arguments and is valid in every state",
    "GradScaler.stats": "takes no arguments and is valid in every state",
    "CastRecord": "a result type: trace records are built by the engine, read by users",
    "DeviceRules": "a result type: Policy.rules() builds it from a validated policy",
    "OptState": "an enum of the scaler's stages, returned by GradScaler.stage()",
    "ScalerStats": "a result type, returned by GradScaler.stats()",
    "is_autocast_cache_enabled": "takes no arguments",
    "CastTrace.record_call": "the engine's hook, called by the engine with the op it runs",
    "CastTrace.note_fp8": "the fp8 category's hook, called by the engine while an fp8 op runs",
    "CastTrace.record_fp8_backward": "the fp8 category's hook, called by an fp8 op's backward",
    "Policy.without_modules": "takes no arguments",
    "Finding": "a result type, returned by doctor.first_nonfinite()",
    "ModuleScope": "a result type: Policy.with_module() builds it from validated rules",
    "ModuleScopes": "a result type, returned by Policy.apply() (which has cases)",
}
_LINEAR = torch.nn.Linear(1, 1)
_STEP_CLASS = type(ampkit.make_train_step(_LINEAR, torch.nn.functional.mse_loss,
                                          torch.optim.SGD(_LINEAR.parameters(), lr=0.1),
                                          capture=False))
CLASSES = {"GradScaler": ampkit.GradScaler, "Policy": ampkit.Policy, "CastTrace": ampkit.CastTrace,
           "autocast": ampkit.autocast, "trace": ampkit.trace,
           # what make_train_step returns (not exported by name)
           "TrainStep": _STEP_CLASS}
DUNDERS = ("__enter__", "__exit__", "__call__")


def _public_methods(name, cls):
    own = {}
    for klass in reversed(cls.__mro__):
        if klass.__module__.startswith("ampkit"):
            own.update(vars(klass))
    return sorted(f"{name}.{m}" for m, v in own.items()
                  if inspect.isfunction(v) and (not m.startswith("_") or m in DUNDERS))


def _uncovered(names, classes, cases) -> list:
    targets = {c.target for c in cases}
    missing = [n for n in names
               if n not in NOTHING_TO_MISUSE and n not in targets
               and not any(t.startswith(n + ".") for t in targets)]
    for name, cls in classes.items():
        missing += [m for m in _public_methods(name, cls)
                    if m not in targets and m not in NOTHING_TO_MISUSE]
    return missing


def test_every_public_name_has_cases():
    missing = _uncovered(ampkit.__all__, CLASSES, CASES)
    assert not missing, f"public names/methods without misuse cases: {missing}"
    assert len({c.id for c in CASES}) == len(CASES), "case ids must be unique"


def test_the_coverage_check_sees_a_new_name_and_a_new_method():
    class Grown(ampkit.GradScaler):
        def new_knob(self, value):
            pass

    Grown.__module__ = "ampkit._scaler"
    missing = _uncovered([*ampkit.__all__, "brand_new"], {**CLASSES, "GradScaler": Grown}, CASES)
    assert missing == ["brand_new", "GradScaler.new_knob"]


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_misuse_raises_a_clear_error_and_changes_nothing(case, tmp_path):
    w = make_world(tmp_path)
    with w.stack:
        if case.setup is not None:
            case.setup(w)
        before = state_of(w)
        with pytest.raises(case.exc, match=case.names):
            case.call(w)
        assert_same_state(state_of(w), before)
    # The thread is left usable: a region behaves as torch's, and nothing stays active.
    assert not ampkit.is_autocast_enabled("cpu") and torch._C._len_torch_function_stack() == 0
    with ampkit.autocast("cpu", dtype=torch.bfloat16):
        assert torch.mm(torch.ones(2, 2), torch.ones(2, 2)).dtype == torch.bfloat16
