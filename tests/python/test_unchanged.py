"""The change checks the eager train step keeps its findings with between calls: each
change that matters to the step makes them fail, in C++ and in the Python fallback."""

from __future__ import annotations

import pytest
import torch

import ampkit
from ampkit import _rollback
from ampkit._unchanged import SameMeta, SameSignature, dict_versions, signature


def _retype(t):
    t.data = t.data.double()


def _reshape(t):
    t.data = t.data.reshape(-1)


def _shorten(t):
    t.data = t.data[:1]


def _requires_grad(t):
    t.requires_grad_(not t.requires_grad)


# (.data cannot change a tensor's device type or layout: torch refuses)
TENSOR_CHANGES = {"dtype": _retype, "shape": _reshape, "rows": _shorten, "requires_grad": _requires_grad}


@pytest.mark.parametrize("in_cpp", [True, False], ids=["cpp", "python"])
@pytest.mark.parametrize("change", sorted(TENSOR_CHANGES))
def test_same_meta_fails_after_each_change_in_place(change, in_cpp):
    tensors = [torch.zeros(3, 2), torch.nn.Parameter(torch.ones(2, 2)), torch.zeros((), dtype=torch.int64)]
    same = SameMeta(tensors, in_cpp=in_cpp)
    assert same(tensors)
    assert same([t.clone() for t in tensors[:1]] + tensors[1:])  # (metadata, not identity)
    TENSOR_CHANGES[change](tensors[1])
    assert not same(tensors)


@pytest.mark.parametrize("in_cpp", [True, False], ids=["cpp", "python"])
def test_same_meta_fails_for_a_tensor_of_another_class_or_layout(in_cpp):
    tensors = [torch.zeros(2), torch.nn.Parameter(torch.zeros(2))]
    same = SameMeta(tensors, in_cpp=in_cpp)
    assert not same([tensors[0], torch.zeros(2)])
    assert not same([torch.nn.Parameter(torch.zeros(2)), tensors[1]])
    assert not same([torch.zeros(2).to_sparse(), tensors[1]])  # (a gradient turned sparse)


def _mutations():
    def setitem_other(d):
        d["a"] = object()

    def add(d):
        d["new"] = 1

    def delete(d):
        del d["a"]

    def pop(d):
        d.pop("a")

    def update(d):
        d.update(b=object())

    def clear(d):
        d.clear()

    def setdefault(d):
        d.setdefault("c", None)

    return {f.__name__: f for f in (setitem_other, add, delete, pop, update, clear, setdefault)}


DICT_CHANGES = _mutations()


@pytest.mark.skipif(dict_versions is None, reason="this Python's dicts have no version torch reads")
@pytest.mark.parametrize("change", sorted(DICT_CHANGES))
def test_a_dict_version_changes_with_every_change(change):
    d, other = {"a": object(), "b": 2}, {"a": 1}
    before = dict_versions([d, other])
    assert dict_versions([d, other]) == before
    DICT_CHANGES[change](d)
    after = dict_versions([d, other])
    assert after[0] != before[0] and after[1] == before[1]
    assert dict_versions([{}])[0] not in (before + after)  # (never given to two dicts)


@pytest.fixture(params=["as_shipped", "python_fallback"])
def checks(request, monkeypatch):
    """The step's checks as shipped, and as where torch has no guards or Python's dicts no
    versions (both fallbacks on): each test below runs both."""
    if request.param == "python_fallback":
        monkeypatch.setattr(_rollback, "dict_version", None)
        monkeypatch.setattr(_rollback, "SameMeta", lambda tensors: SameMeta(tensors, in_cpp=False))
    return request.param


# The step's own fault tests, with both fallbacks on (as shipped, test_train_step runs them).
import test_train_step as step_tests  # noqa: E402


@pytest.mark.parametrize("why", sorted(step_tests.HALF_WAY))
def test_a_change_between_calls_that_makes_torch_raise_half_way_changes_nothing(why, checks):
    step_tests.test_a_torch_optimizer_that_raises_half_way_changes_nothing(why)


@pytest.mark.parametrize("change", sorted(step_tests.BUFFER_CHANGES))
def test_buffers_changed_between_calls_are_put_back(change, checks):
    step_tests.test_buffers_changed_between_calls_are_put_back_by_a_failed_call(change)


@pytest.mark.parametrize("change", sorted(step_tests.VERDICT_CHANGES))
def test_the_kept_verdict_follows_the_optimizer(change, checks):
    step_tests.test_the_kept_verdict_follows_the_optimizer_between_calls(change)


def test_the_kept_verdict_holds_no_state_the_optimizer_dropped(checks):
    step_tests.test_the_kept_verdict_holds_no_state_the_optimizer_dropped()


def test_the_step_trains_as_the_hand_written_loop(checks):
    step_tests.test_the_step_copies_only_where_the_optimizer_step_could_fail_half_way("adam")


def _fewer_rows(batch):
    return [batch[0][:-1], batch[1][:-1]]


def _other_dtype(batch):
    return [batch[0].double(), batch[1]]


def _other_device(batch):
    return [batch[0].to("meta"), batch[1]]


def _one_fewer(batch):
    return batch[:1]


def _one_more(batch):
    return [*batch, batch[1]]


SIGNATURE_CHANGES = {f.__name__[1:]: f for f in (_fewer_rows, _other_dtype, _other_device, _one_fewer, _one_more)}


@pytest.mark.parametrize("in_cpp", [True, False], ids=["cpp", "python"])
@pytest.mark.parametrize("change", sorted(SIGNATURE_CHANGES))
def test_the_quick_signature_check_fails_for_each_other_signature(change, in_cpp):
    batch = [torch.randn(4, 3), torch.arange(4)]
    kept = SameSignature(batch, in_cpp=in_cpp)
    assert kept.signature == signature(batch)
    assert kept.quick([torch.zeros(4, 3), torch.ones(4, dtype=torch.int64)])  # (values: no matter)
    other = SIGNATURE_CHANGES[change](batch)
    assert signature(other) != kept.signature
    assert not kept.quick(other)


def test_why_copy_takes_the_callers_gradients_only_while_the_groups_hold_its_parameters():
    """A train step beside a graph hands why_copy the gradients it read (one read a call):
    they stand for the optimizer's while its groups hold exactly the caller's parameters.
    With another parameter in one's place (same count, same group version), the verdict is
    found again, and later calls read the gradients themselves: one turned sparse decides."""
    a, b, c = (torch.nn.Parameter(torch.randn(4, 2)) for _ in range(3))
    a.grad, b.grad, c.grad = torch.randn(4, 2), torch.randn(4, 2), torch.randn(4, 2)
    opt = torch.optim.SGD([a, b], lr=0.1)
    scaler = ampkit.GradScaler("cpu", enabled=False)
    mine, kept = [a, b], {}

    def why():
        return _rollback.why_copy(opt, scaler, kept, mine, [a.grad, b.grad])

    assert why() is None and why() is None
    opt.param_groups[0]["params"][1] = c
    assert why() is None  # (found again: c's gradient is dense)
    c.grad = c.grad.to_sparse()
    assert "sparse" in (why() or "")  # (read: the caller's gradients are not c's)
    c.grad = torch.randn(4, 2).to_sparse()
    assert "sparse" in (why() or "")
    opt.param_groups[0]["params"][1] = b
    assert why() is None and why() is None


def test_zero_grads_the_graph_had_fills_only_the_parameters_that_lost_theirs():
    params = [torch.nn.Parameter(torch.randn(3)) for _ in range(3)]
    owned = [torch.randn(3), None, torch.randn(3)]
    got = params[0].grad = torch.randn(3)
    everyone = [torch.randn(3) for _ in params]
    for p, g in zip(params, everyone):
        p.grad = g
    grads, types = _rollback.zero_grads_the_graph_had(params, owned)  # (every parameter has one: untouched)
    assert all(p.grad is g for p, g in zip(params, everyone))
    assert all(g is p.grad for p, g in zip(params, grads))  # (what why_copy reads instead)
    assert types == [type(p.grad) for p in params]
    params[0].grad, params[1].grad, params[2].grad = got, None, None
    grads, types = _rollback.zero_grads_the_graph_had(params, owned)
    assert all(g is p.grad for p, g in zip(params, grads))
    assert types == [type(p.grad) for p in params]
    assert params[0].grad is got and params[1].grad is None  # (the graph had none for it)
    assert params[2].grad is not owned[2] and torch.equal(params[2].grad, torch.zeros(3))
