"""The cast trace: records, table, plain rows, scoping and zero cost when off."""

from __future__ import annotations

import threading

import pytest
import torch
import torch.nn.functional as F

import ampkit
from ampkit import _engine

pytestmark = pytest.mark.usefixtures("ampkit_quiet")


def step():
    lin = torch.nn.Linear(4, 3)
    x, y = torch.randn(2, 4), torch.randn(2, 3)
    return F.mse_loss(lin(x), y)


def test_records_each_listed_call_with_its_rule():
    with ampkit.trace() as tr, ampkit.autocast("cpu"):
        loss = step()
        torch.cat([torch.randn(2).to(torch.bfloat16), torch.randn(2)])
    listed = [r for r in tr.records if r.rule != "none"]
    assert [(r.op, r.rule, r.device, r.input_dtypes, r.output_dtype) for r in listed] == [
        ("linear", "lower_precision_fp", "cpu", ("float32", "float32", "float32"), "bfloat16"),
        ("mse_loss", "fp32", "cpu", ("bfloat16", "float32"), "float32"),
        ("cat", "promote", "cpu", ("bfloat16", "float32"), "float32"),
    ]
    assert loss.dtype == torch.float32
    assert all(r.op != "__get__" for r in tr.records)  # property reads are not recorded


def test_unlisted_calls_are_recorded_as_none():
    with ampkit.trace() as tr, ampkit.autocast("cpu"):
        torch.relu(torch.randn(3))
    assert [(r.op, r.rule) for r in tr.records if r.op == "relu"] == [("relu", "none")]


def test_composites_are_traced_through():
    mha = torch.nn.MultiheadAttention(8, 2, batch_first=True)
    x = torch.randn(2, 3, 8)
    with ampkit.trace() as tr, ampkit.autocast("cpu"):
        mha(x, x, x)
    ops = [(r.op, r.rule) for r in tr.records]
    assert ("multi_head_attention_forward", "composite") in ops
    assert ("linear", "lower_precision_fp") in ops
    assert ("bmm", "lower_precision_fp") in ops or ("baddbmm", "lower_precision_fp") in ops or (
        "scaled_dot_product_attention", "lower_precision_fp") in ops


def test_table_and_rows():
    with ampkit.trace() as tr, ampkit.autocast("cpu"):
        step()
    text = tr.table(rules={"lower_precision_fp", "fp32"})
    lines = text.splitlines()
    assert lines[0].split() == ["op", "rule", "device", "inputs", "output"]
    assert lines[1].split()[:3] == ["linear", "lower_precision_fp", "cpu"]
    assert lines[2].split()[:3] == ["mse_loss", "fp32", "cpu"]
    assert len({line.index("cpu") for line in lines[1:]}) == 1  # aligned columns
    assert str(tr) == tr.table()
    rows = tr.as_rows()
    assert rows[0].keys() == {"op", "rule", "device", "input_dtypes", "output_dtype", "scope", "fp8_casts", "fp8_path"}
    assert all(isinstance(v, str) for r in rows for v in r.values())
    d = tr.records[0].to_dict()
    assert isinstance(d["input_dtypes"], list)
    with pytest.raises(AttributeError):
        tr.records[0].op = "x"
    assert len(tr) == len(tr.records) and list(tr) == tr.records


def test_disabled_region_applies_no_rule():
    with ampkit.trace() as tr, ampkit.autocast("cpu", enabled=False):
        step()
    assert tr.records and {r.rule for r in tr.records} == {"none"}
    assert {r.output_dtype for r in tr.records} == {"float32"}


def test_scoping_nothing_outside_regions_or_after_exit():
    with ampkit.trace() as tr:
        step()  # no region: nothing intercepted
        with ampkit.autocast("cpu"):
            step()
        n = len(tr.records)
    with ampkit.autocast("cpu"):
        step()
    assert n > 0 and len(tr.records) == n


def test_nested_traces_record_into_the_innermost():
    with ampkit.trace() as outer, ampkit.autocast("cpu"):
        step()
        k = len(outer.records)
        with ampkit.trace() as inner:
            step()
        step()
    assert len(inner.records) == k and len(outer.records) == 2 * k


def test_trace_is_per_thread():
    other = []

    def worker():
        with ampkit.autocast("cpu"):
            other.append(step().dtype)

    with ampkit.trace() as tr, ampkit.autocast("cpu"):
        t = threading.Thread(target=worker)
        t.start()
        t.join(10)
    assert other == [torch.float32] and tr.records == []


def test_zero_cost_when_off():
    """Without a trace the handler reads the compiled table directly (no slow path)."""
    with ampkit.autocast("cpu"):
        mode = _engine.thread_engine().mode
        assert mode.table is mode.real
        with ampkit.trace():
            assert mode.table is not mode.real and len(mode.table) == 0
        assert mode.table is mode.real


def test_results_are_unchanged_by_tracing():
    torch.manual_seed(0)
    with ampkit.autocast("cpu"):
        a = step()
    torch.manual_seed(0)
    with ampkit.trace(), ampkit.autocast("cpu"):
        b = step()
    assert torch.equal(a, b)


# -- enter/exit misuse -------------------------------------------------------------------
def _tracing():
    return _engine.thread_engine().trace


def _records_linear(tr):
    return [r.op for r in tr.records if r.rule != "none"]


def test_exit_of_a_trace_never_entered_raises_and_keeps_the_enclosing_one():
    stray = ampkit.trace()
    with ampkit.trace() as outer, ampkit.autocast("cpu"):
        with pytest.raises(RuntimeError, match="never entered"):
            stray.__exit__(None, None, None)
        assert _tracing() is outer
        step()
    assert "linear" in _records_linear(outer)
    assert _tracing() is None and stray.result.records == []


def test_entering_an_active_trace_again_raises_and_changes_nothing():
    tr = ampkit.trace()
    with tr as records:
        with pytest.raises(RuntimeError, match="already active"):
            tr.__enter__()
        assert _tracing() is records
    assert _tracing() is None
    with ampkit.autocast("cpu"):  # a later region records into nothing old
        step()
    assert _records_linear(records) == []


def test_exiting_an_outer_trace_before_the_inner_one_raises_and_changes_nothing():
    outer, inner = ampkit.trace(), ampkit.trace()
    outer.__enter__()
    inner.__enter__()
    with pytest.raises(RuntimeError, match="not the innermost"):
        outer.__exit__(None, None, None)
    assert _tracing() is inner.result
    inner.__exit__(None, None, None)
    assert _tracing() is outer.result
    outer.__exit__(None, None, None)
    assert _tracing() is None


def test_exit_twice_raises_and_a_finished_trace_can_be_entered_again():
    tr = ampkit.trace()
    with tr, ampkit.autocast("cpu"):
        step()
    with pytest.raises(RuntimeError, match="never entered"):
        tr.__exit__(None, None, None)
    n = len(tr.result)
    with tr, ampkit.autocast("cpu"):
        step()
    assert len(tr.result) == 2 * n and _tracing() is None
