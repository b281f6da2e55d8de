"""Policies as values, loading and every bad-input case, and the drift check."""

from __future__ import annotations

import io
import textwrap

import pytest
import torch
import yaml

import ampkit
from ampkit import drift
from ampkit._policy import parse_policy

DEFAULT = ampkit.load_policy("torch_default")


def write(tmp_path, text, name="p.yaml"):
    p = tmp_path / name
    p.write_text(textwrap.dedent(text))
    return p


GOOD = """\
schema_version: 1
name: mine
description: a test policy
devices:
  cpu:
    lower_precision_dtype: bfloat16
    lower_precision_fp: [linear, matmul]
    fp32: [mse_loss]
    fp32_output: [sum]
    promote: [cat]
    banned: {binary_cross_entropy: "use the logits version"}
"""


# --------------------------------------------------------------------- values
def test_categories_constant():
    assert ampkit.CATEGORIES == ("lower_precision_fp", "fp32", "fp32_output", "promote", "fp8", "banned")


def test_shipped_spec_writes_every_category_for_both_devices():
    raw = yaml.safe_load(open(DEFAULT.source, encoding="utf-8").read())
    assert raw["schema_version"] == 1
    for dev in ("cpu", "cuda"):
        assert set(raw["devices"][dev]) == {"lower_precision_dtype", *ampkit.CATEGORIES, "decompose"}
    assert DEFAULT.rules("cpu").lower_precision_dtype == torch.bfloat16
    assert DEFAULT.rules("cuda").lower_precision_dtype == torch.float16
    assert DEFAULT.category("cuda", "binary_cross_entropy") == "banned"
    assert DEFAULT.category("cuda", "softmax") == "fp32_output"
    assert DEFAULT.category("cpu", "cat") == "promote"


def test_policy_is_an_immutable_comparable_value():
    again = parse_policy(DEFAULT.to_yaml(), "copy")
    assert again == DEFAULT and hash(again) == hash(DEFAULT) and again is not DEFAULT
    assert ampkit.load_policy("torch_default") is DEFAULT  # an unchanged file is loaded once
    with pytest.raises(AttributeError):
        DEFAULT.name = "x"
    assert "Policy 'torch_default'" in str(DEFAULT) and "lower_precision_fp" in str(DEFAULT)


def test_with_ops_moves_an_op_and_leaves_the_original():
    p = DEFAULT.with_ops(fp32=["linear"], banned={"einsum": "no einsum here"})
    assert p.category("cpu", "linear") == "fp32" and p.category("cuda", "linear") == "fp32"
    assert "linear" not in p.rules("cpu").ops("lower_precision_fp")
    assert p.rules("cpu").ban_message("einsum") == "no einsum here"
    assert DEFAULT.category("cpu", "linear") == "lower_precision_fp"
    assert p != DEFAULT
    q = DEFAULT.with_ops("cpu", promote=["add"]).without_ops("add")
    assert q == DEFAULT
    assert DEFAULT.with_ops("cpu", banned=["mm"]).rules("cpu").ban_message("mm").startswith("mm is banned")


def test_policy_pickles_and_copies():
    import copy
    import pickle

    hash(DEFAULT)
    again = pickle.loads(pickle.dumps(DEFAULT))
    assert again == DEFAULT and "_hash" not in again.__dict__ and hash(again) == hash(DEFAULT)
    assert copy.deepcopy(DEFAULT) == DEFAULT


def test_with_dtype_and_name():
    p = DEFAULT.with_dtype("cpu", "float16").with_name("half_cpu", "cpu in float16")
    assert p.rules("cpu").lower_precision_dtype == torch.float16 and p.name == "half_cpu"
    with ampkit.autocast("cpu", policy=p):
        assert torch.nn.functional.linear(torch.randn(2, 3), torch.randn(4, 3)).dtype == torch.float16
    assert DEFAULT.with_dtype("cpu", torch.bfloat16) == DEFAULT



def test_a_changed_policy_prints_the_changes_after_the_name_it_came_from():
    def header(policy):
        return str(policy).splitlines()[0]

    assert header(DEFAULT).startswith("Policy 'torch_default' (") and " + " not in header(DEFAULT)
    p = DEFAULT.with_ops("cpu", fp32=["linear"])
    assert header(p) == "Policy 'torch_default' + with_ops('cpu', fp32=['linear'])"
    q = p.without_ops("mm", device="cpu").with_dtype("cuda", "bfloat16").with_module("0", pin="float32")
    assert header(q) == ("Policy 'torch_default' + with_ops('cpu', fp32=['linear']) + without_ops('mm', device='cpu')"
                         " + with_dtype('cuda', 'bfloat16') + with_module('0', pin='float32')")
    assert header(q.without_module("0")).endswith(" + with_module('0', pin='float32') + without_module('0')")
    assert "derived=(\"with_ops('cpu', fp32=['linear'])\",)" in repr(p)
    # a name the user gives replaces the history; the changes stay out of equality and hashing
    assert header(q.with_name("mine")) == "Policy 'mine'"
    undone = p.with_ops("cpu", lower_precision_fp=["linear"])
    assert undone == DEFAULT and hash(undone) == hash(DEFAULT) and header(undone) != header(DEFAULT)
    assert pickle_round_trip(q).derived == q.derived


def pickle_round_trip(value):
    import pickle

    return pickle.loads(pickle.dumps(value))

def test_yaml_round_trip(tmp_path):
    p = DEFAULT.with_ops("cpu", fp32=["softmax"])
    again = parse_policy(p.to_yaml(), "round trip")
    assert again == p
    path = write(tmp_path, p.to_yaml())
    assert ampkit.load_policy(path) == p and ampkit.load_policy(str(path)) == p


def test_load_a_user_file(tmp_path):
    path = write(tmp_path, GOOD)
    p = ampkit.load_policy(path)
    path.write_text(GOOD.replace("name: mine", "name: mine2"))  # edited: read again
    assert ampkit.load_policy(path).name == "mine2"
    assert p.name == "mine" and p.device_types() == ("cpu",)
    assert p.category("cpu", "sum") == "fp32_output"
    with pytest.raises(ampkit.PolicyError, match="has no rules for device type 'cuda'"):
        ampkit.autocast("cuda", policy=p)


def test_banned_op_raises_in_region_with_its_message():
    p = DEFAULT.with_ops("cpu", banned={"mse_loss": "mse_loss is off limits: use l1_loss"})
    a, b = torch.randn(3), torch.randn(3)
    with pytest.raises(RuntimeError, match="off limits: use l1_loss"), ampkit.autocast("cpu", policy=p):
        torch.nn.functional.mse_loss(a, b)
    with ampkit.autocast("cpu", policy=p, enabled=False):
        assert torch.equal(torch.nn.functional.mse_loss(a, b), torch.nn.functional.mse_loss(a, b))


def test_fp32_output_op_without_dtype_argument_names_the_fix():
    p = DEFAULT.with_ops("cpu", fp32_output=["exp"])
    with pytest.raises(TypeError, match="'exp' is in the fp32_output category.*list it under fp32"):
        with ampkit.autocast("cpu", policy=p):
            torch.exp(torch.randn(3))


def test_fp32_output_on_cpu_matches_cuda_semantics():
    p = DEFAULT.with_ops("cpu", fp32_output=["sum", "softmax"])
    x = torch.randn(3, 4).to(torch.bfloat16)
    with ampkit.autocast("cpu", policy=p):
        assert x.sum().dtype == torch.float32
        assert torch.equal(x.sum(), x.sum(dtype=torch.float32))
        assert x.sum(dtype=torch.bfloat16).dtype == torch.bfloat16  # an explicit dtype wins
        assert torch.nn.functional.softmax(x, -1).dtype == torch.float32
        assert torch.arange(4).sum().dtype == torch.int64  # not floating: untouched


# --------------------------------------------------------------------- bad input
BAD = {
    "malformed": ("schema_version: 1\nname: [unclosed\n", r"p\.yaml, line \d+: malformed YAML"),
    "python_tag": ("schema_version: 1\nname: !!python/object/apply:os.system ['echo hi']\n", r"line 2: malformed YAML.*no Python tags"),
    "not_mapping": ("- a\n- b\n", "must be a YAML mapping"),
    "schema_version": (GOOD.replace("schema_version: 1", "schema_version: 2"), r"line 1, key 'schema_version'.*must be 1, got 2"),
    "unknown_top_key": (GOOD + "extra: 1\n", r"key 'extra'.*unknown key 'extra'"),
    "unknown_device": (GOOD.replace("  cpu:", "  tpu:"), r"line 5, key 'devices.tpu'.*unknown device type 'tpu'; valid: cpu, cuda"),
    "unknown_category": (GOOD.replace("fp32_output:", "fp16_output:"), r"line 9, key 'devices.cpu.fp16_output'.*unknown category 'fp16_output'"),
    "missing_category": (GOOD.replace("    promote: [cat]\n", ""), r"missing key 'promote'"),
    "unknown_dtype": (GOOD.replace("dtype: bfloat16", "dtype: bfloat8"), r"line 6, key 'devices.cpu.lower_precision_dtype'.*unknown lower-precision dtype 'bfloat8'"),
    "unknown_op": (GOOD.replace("[linear, matmul]", "[linear, matmull]"), r"line 7, key 'devices.cpu.lower_precision_fp.matmull'.*unknown op 'matmull'.*did you mean 'matmul'"),
    "duplicate_op": (GOOD.replace("fp32: [mse_loss]", "fp32: [mse_loss, linear]"), r"line 8.*'linear' is listed in both 'lower_precision_fp' and 'fp32'"),
    "list_not_list": (GOOD.replace("promote: [cat]", "promote: cat"), r"promote must be a list of op names, got 'cat'"),
    "banned_not_mapping": (GOOD.replace('banned: {binary_cross_entropy: "use the logits version"}', "banned: [binary_cross_entropy]"), "banned must be a mapping op: message"),
    "banned_message": (GOOD.replace('"use the logits version"', "3"), "message of banned op 'binary_cross_entropy' must be a string, got 3"),
    "name": (GOOD.replace("name: mine", "name: ''"), "name must be a non-empty string"),
    "op_not_string": (GOOD.replace("[linear, matmul]", "[linear, 3]"), "op name must be a non-empty string, got 3"),
    "decompose_not_list": (GOOD + "    decompose: cross_entropy\n", r"key 'devices.cpu.decompose'.*decompose must be a list of op names"),
    "decompose_unknown_op": (GOOD + "    decompose: [cross_entropyy]\n", r"unknown op 'cross_entropyy'.*did you mean 'cross_entropy'"),
    "decompose_no_decomposition": (
        GOOD + "    decompose: [softmax]\n",
        r"line 12, key 'devices.cpu.decompose.softmax'.*'softmax' cannot be decomposed on cpu \(ampkit has no "
        r"decomposition of it\); decomposable on cpu: cross_entropy, pairwise_distance",
    ),
    "decompose_wrong_device": (GOOD + "    decompose: [trace]\n", r"'trace' cannot be decomposed on cpu \(its decomposition is ATen's only on cuda\)"),
    "decompose_and_listed": (
        GOOD.replace("fp32: [mse_loss]", "fp32: [mse_loss, cross_entropy]") + "    decompose: [cross_entropy]\n",
        r"'cross_entropy' is listed in 'fp32' and under decompose; an op is either in one category or decomposed",
    ),
    "decompose_twice": (GOOD + "    decompose: [cross_entropy, cross_entropy]\n", "listed twice under decompose"),
}


@pytest.mark.parametrize("case", list(BAD))
def test_bad_policy_file(tmp_path, case):
    text, match = BAD[case]
    path = write(tmp_path, text)
    with pytest.raises(ampkit.PolicyError, match=match) as e:
        ampkit.load_policy(path)
    assert str(path) in str(e.value)  # names the file
    assert isinstance(e.value, ValueError)


def test_bad_names_and_paths(tmp_path):
    with pytest.raises(ampkit.PolicyError, match="no shipped policy named 'torch_defualt'; shipped: fp8, torch_default"):
        ampkit.load_policy("torch_defualt")
    with pytest.raises(ampkit.PolicyError, match="cannot read the policy file"):
        ampkit.load_policy(tmp_path / "missing.yaml")
    with pytest.raises(ampkit.PolicyError, match="expected a spec name or a path, got 3"):
        ampkit.load_policy(3)


def test_bad_with_calls():
    with pytest.raises(ampkit.PolicyError, match="unknown category 'fp16'.*valid: lower_precision_fp"):
        DEFAULT.with_ops(fp16=["linear"])
    with pytest.raises(ampkit.PolicyError, match="unknown op 'lineer'.*did you mean 'linear'"):
        DEFAULT.with_ops(fp32=["lineer"])
    with pytest.raises(ampkit.PolicyError, match="given for both 'fp32' and 'promote'"):
        DEFAULT.with_ops(fp32=["linear"], promote=["linear"])
    with pytest.raises(ampkit.PolicyError, match="must be a list of op names, got the string"):
        DEFAULT.with_ops(fp32="linear")
    with pytest.raises(ampkit.PolicyError, match="no rules for device type 'xpu'"):
        DEFAULT.with_ops("xpu", fp32=["linear"])
    with pytest.raises(ampkit.PolicyError, match="unknown lower-precision dtype torch.float32"):
        DEFAULT.with_dtype("cpu", torch.float32)


def test_decompose_is_shown_overridable_and_round_trips():
    assert DEFAULT.rules("cuda").decompose == ("cross_entropy", "pairwise_distance", "trace")
    assert DEFAULT.decomposes("cuda", "cross_entropy") and DEFAULT.category("cuda", "cross_entropy") is None
    assert not DEFAULT.decomposes("cpu", "cross_entropy") and DEFAULT.category("cpu", "cross_entropy") == "fp32"
    assert DEFAULT.to_dict()["devices"]["cuda"]["decompose"] == ["cross_entropy", "pairwise_distance", "trace"]
    assert DEFAULT.to_dict()["devices"]["cpu"]["decompose"] == []
    assert "decompose          cross_entropy, pairwise_distance, trace" in str(DEFAULT)
    assert "decompose=('cross_entropy', 'pairwise_distance', 'trace')" in repr(DEFAULT)
    p = DEFAULT.with_ops("cpu", decompose=["cross_entropy"])  # moved out of fp32
    assert p.decomposes("cpu", "cross_entropy") and p.category("cpu", "cross_entropy") is None
    assert p != DEFAULT and parse_policy(p.to_yaml()) == p
    q = p.with_ops("cpu", fp32=["cross_entropy"])  # and back into a category
    assert not q.decomposes("cpu", "cross_entropy") and q.rules("cpu") == DEFAULT.rules("cpu")
    assert not DEFAULT.without_ops("trace", device="cuda").decomposes("cuda", "trace")
    old = textwrap.dedent(GOOD)  # a spec without the optional decompose key loads
    assert parse_policy(old).rules("cpu").decompose == ()
    with pytest.raises(ampkit.PolicyError, match=r"with_ops: op 'linear' cannot be decomposed on cuda"):
        DEFAULT.with_ops("cuda", decompose=["linear"])
    with pytest.raises(ampkit.PolicyError, match=r"'trace' cannot be decomposed on cpu"):
        DEFAULT.with_ops(decompose=["trace"])  # all devices: cpu has no trace decomposition
    with pytest.raises(ampkit.PolicyError, match="given for both 'fp32' and 'decompose'"):
        DEFAULT.with_ops(fp32=["cross_entropy"], decompose=["cross_entropy"])


def test_nothing_half_loaded(tmp_path):
    before = ampkit.load_policy("torch_default")
    text, _ = BAD["duplicate_op"]
    with pytest.raises(ampkit.PolicyError):
        ampkit.load_policy(write(tmp_path, text))
    assert ampkit.load_policy("torch_default") == before
    with ampkit.autocast("cpu"):
        assert torch.nn.functional.linear(torch.randn(2, 3), torch.randn(4, 3)).dtype == torch.bfloat16


# --------------------------------------------------------------------- drift check
def test_drift_check_passes_on_the_shipped_cpu_table():
    out = io.StringIO()
    assert drift.check("cpu", out=out) == 0, out.getvalue()
    assert "0 drifting" in out.getvalue()


def test_drift_check_reports_a_wrong_table(tmp_path):
    wrong = DEFAULT.with_ops("cpu", fp32=["linear"]).without_ops("mm", device="cpu")
    path = write(tmp_path, wrong.to_yaml())
    out = io.StringIO()
    n = drift.check("cpu", policy=str(path), ops=["linear", "mm", "relu"], out=out)
    text = out.getvalue()
    assert n == 2
    assert "linear" in text and "DRIFT" in text and "lower_precision_fp" in text
    assert drift.main(["check", "--device", "cpu", "--policy", str(path), "--ops", "linear"]) == 1
    assert drift.main(["check", "--device", "cpu", "--ops", "linear,mm"]) == 0


def test_drift_check_command_line_errors(capsys):
    assert drift.main(["check", "--policy", "nope"]) == 2
    assert "no shipped policy named 'nope'" in capsys.readouterr().err


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message shown without a GPU")
def test_drift_check_cuda_without_gpu_says_so(capsys):
    assert drift.main(["check", "--device", "cuda"]) == 2
    assert "needs a CUDA GPU" in capsys.readouterr().err


@pytest.mark.parametrize("names, device, match", [
    (("matmull",), None, "unknown op 'matmull'"),
    (("relu",), None, "op 'relu' is in no category on cpu, cuda"),
    (("cosh",), "cpu", "op 'cosh' is in no category on cpu"),  # fp32 on cuda only
])
def test_without_ops_rejects_what_is_not_listed(names, device, match):
    with pytest.raises(ampkit.PolicyError, match=match):
        DEFAULT.without_ops(*names, device=device)


def test_drift_check_tells_a_missing_kernel_from_drift(monkeypatch):
    """Native raising that this machine has no kernel (oneDNN's bf16 LSTM on an AVX2-only
    CPU) is no oracle: the op is reported as such, not as drift."""
    from ampkit import drift

    def no_primitive():
        raise RuntimeError("could not create a primitive descriptor for the LSTM forward propagation primitive")

    assert drift._outcome(no_primitive) == drift.UNAVAILABLE
    assert drift._outcome(lambda: 1 / 0) == "error:ZeroDivisionError"
    real = drift.probe

    def probe(op, device, low, pol, values=False):
        res = real(op, device, low, pol, values=values)
        if op == "linear":  # as if native had no kernel for linear here
            res = {k: (p, drift.UNAVAILABLE, a) for k, (p, n, a) in res.items()}
        return res

    monkeypatch.setattr(drift, "probe", probe)
    out = io.StringIO()
    assert drift.check("cpu", ops=["linear", "mm"], out=out) == 0
    assert "linear" in out.getvalue() and "no oracle" in out.getvalue()


def test_a_key_written_twice_anywhere_is_refused_with_both_lines():
    """YAML keeps the last of two equal keys silently; the loader refuses them instead."""
    text = ampkit.load_policy("torch_default").to_yaml().replace(
        "  cpu:\n", "  cpu:\n    fp32: [linear]\n", 1)
    with pytest.raises(ampkit.PolicyError, match=r"line \d+, key 'devices\.cpu\.fp32': written twice \(lines \d+ and \d+\)"):
        parse_policy(text, "dup.yaml")
