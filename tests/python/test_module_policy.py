"""Policies per module: scopes on qualified module names, checked against torch.autocast
with the same precision written by hand."""

import pytest
import torch
import torch.nn.functional as F

import ampkit


class Block(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.attn = torch.nn.Linear(8, 8)
        self.mlp = torch.nn.Linear(8, 8)

    def forward(self, x):
        return self.mlp(torch.softmax(self.attn(x), -1))


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = torch.nn.ModuleList([Block(), Block()])
        self.head = torch.nn.Linear(8, 3)

    def forward(self, x):
        for b in self.blocks:
            x = b(x)
        return self.head(x)


BASE = ampkit.load_policy("torch_default")


def _oracle(net, x, pin_head=False, attn_fp32=False):
    """The same forward written with torch.autocast and explicit fp32 sections."""
    with torch.autocast("cpu", dtype=torch.bfloat16):
        for b in net.blocks:
            if attn_fp32:
                with torch.autocast("cpu", enabled=False):
                    h = b.attn(x.float())
            else:
                h = b.attn(x)
            x = b.mlp(torch.softmax(h, -1))
        if pin_head:
            with torch.autocast("cpu", enabled=False):
                return net.head(x.float())
        return net.head(x)


@pytest.mark.parametrize("pin_head,attn_fp32", [(True, False), (False, True), (True, True), (False, False)])
def test_scopes_equal_hand_written_autocast(pin_head, attn_fp32):
    torch.manual_seed(0)
    net, x = Net(), torch.randn(4, 8)
    p = BASE
    if pin_head:
        p = p.with_module("head", pin="float32")
    if attn_fp32:
        p = p.with_module("blocks.*.attn", fp32=["linear"])
    want = _oracle(net, x, pin_head, attn_fp32)
    with p.apply(net), ampkit.autocast("cpu"):
        got = net(x)
    assert got.dtype == want.dtype
    assert torch.equal(got, want)
    # removed on exit: the default again
    with ampkit.autocast("cpu"):
        assert torch.equal(net(x), _oracle(net, x))


def test_gradients_match_the_oracle():
    torch.manual_seed(1)
    net, x = Net(), torch.randn(4, 8)
    p = BASE.with_module("head", pin="float32")
    with p.apply(net), ampkit.autocast("cpu"):
        out = net(x)
    out.float().sum().backward()
    got = [q.grad.clone() for q in net.parameters()]
    net.zero_grad()
    _oracle(net, x, pin_head=True).float().sum().backward()
    for a, b in zip(got, [q.grad for q in net.parameters()]):
        assert a.dtype == torch.float32 and torch.equal(a, b)


def test_innermost_scope_wins():
    torch.manual_seed(2)
    net, x = Net(), torch.randn(4, 8)
    # the whole block pinned, but its attn moved back to low precision by an inner scope
    p = BASE.with_module("blocks.*", pin="float32").with_module("blocks.*.attn", lower_precision_fp=["linear"])
    with p.apply(net), ampkit.trace() as tr, ampkit.autocast("cpu"):
        net(x)
    lin = [r for r in tr.records if r.op == "linear"]
    # per block: attn (low, decided by the inner scope), mlp (pinned: fp32, no cast); then head
    assert [(r.output_dtype, r.scope) for r in lin] == [
        ("bfloat16", "blocks.*.attn"), ("float32", "blocks.*"),
        ("bfloat16", "blocks.*.attn"), ("float32", "blocks.*"),
        ("bfloat16", "")]


def test_trace_names_the_deciding_scope():
    net, x = Net(), torch.randn(2, 8)
    p = BASE.with_module("blocks.1.attn", fp32=["linear"])
    with p.apply(net), ampkit.trace() as tr, ampkit.autocast("cpu"):
        net(x)
    got = [(r.op, r.rule, r.scope) for r in tr.records if r.op == "linear"]
    assert got == [("linear", "lower_precision_fp", ""), ("linear", "lower_precision_fp", ""),
                   ("linear", "fp32", "blocks.1.attn"), ("linear", "lower_precision_fp", ""),
                   ("linear", "lower_precision_fp", "")]
    assert "scope" in tr.table()


def test_yaml_round_trip(tmp_path):
    p = BASE.with_module("head", pin="float32").with_module("blocks.*.attn", fp32=["softmax", "linear"])
    text = p.to_yaml()
    assert "modules:" in text and "blocks.*.attn" in text
    f = tmp_path / "p.yaml"
    f.write_text(text)
    q = ampkit.load_policy(f)
    assert q == p and hash(q) == hash(p)
    assert q.modules[0].category("softmax") == "fp32"
    assert BASE.to_yaml() == BASE.without_modules().to_yaml() and "modules" not in BASE.to_yaml()


def test_no_scopes_installs_nothing():
    net = Net()
    with BASE.apply(net):
        assert all(not m._forward_pre_hooks and not m._forward_hooks for m in net.modules())


def test_glob_matching_no_module_names_close_matches():
    net = Net()
    with pytest.raises(ampkit.PolicyError, match=r"'blocks\.\*\.atn' matches no module.*blocks\.\d\.attn"):
        BASE.with_module("blocks.*.atn", pin="float32").apply(net)
    assert all(not m._forward_pre_hooks for m in net.modules())


def test_conflicting_scopes_raise_and_install_nothing():
    net = Net()
    p = BASE.with_module("head", pin="float32").with_module("blocks.0.attn", pin="float32") \
        .with_module("blocks.*.attn", fp32=["linear"])
    with pytest.raises(ampkit.PolicyError, match=r"'blocks\.0\.attn' is matched by two scopes"):
        p.apply(net)
    assert all(not m._forward_pre_hooks for m in net.modules())
    with pytest.raises(ampkit.PolicyError, match="already in the policy with other rules"):
        BASE.with_module("head", pin="float32").with_module("head", fp32=["linear"])
    with pytest.raises(ampkit.PolicyError, match="both pins"):
        BASE.with_module("head", pin="float32", fp32=["linear"])


def test_yaml_scope_written_twice_is_a_conflict(tmp_path):
    text = BASE.with_module("head", pin="float32").to_yaml() + '  head: {fp32: [linear]}\n'
    f = tmp_path / "dup.yaml"
    f.write_text(text)
    with pytest.raises(ampkit.PolicyError, match=r"line \d+, key 'modules.head'.*written twice"):
        ampkit.load_policy(f)


@pytest.mark.parametrize("kw,msg", [
    (dict(pattern="", pin="float32"), "dotted module name"),
    (dict(pattern="head", pin="float16"), "pin must be one of float32"),
    (dict(pattern="head", fp32=["no_such_op"]), "no_such_op"),
    (dict(pattern="head", banned=["linear"]), "unknown key 'banned'"),
    (dict(pattern="head"), "has no rules"),
])
def test_bad_scopes_name_the_value(kw, msg):
    pattern = kw.pop("pattern")
    with pytest.raises(ampkit.PolicyError, match=msg):
        BASE.with_module(pattern, **kw)


def test_without_module():
    p = BASE.with_module("head", pin="float32")
    assert p.without_module("head") == BASE
    with pytest.raises(ampkit.PolicyError, match="no scope 'x'"):
        p.without_module("x")


def test_scopes_work_under_make_train_step():
    torch.manual_seed(3)
    net, x, y = Net(), torch.randn(4, 8), torch.randn(4, 3)
    ref = Net()
    ref.load_state_dict(net.state_dict())
    p = BASE.with_module("head", pin="float32")
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    step = ampkit.make_train_step(net, F.mse_loss, opt, autocast=dict(device_type="cpu"), capture=False)
    with p.apply(net):
        loss = step(x, y)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        want = F.mse_loss(_oracle(ref, x, pin_head=True), y)
    assert torch.equal(loss, want.detach())


def test_a_region_refuses_a_policy_with_module_scopes_and_names_the_remedy():
    """A region sees ops, not modules: passing it a scoped policy would drop the scopes."""
    p = ampkit.load_policy("torch_default").with_module("head", pin="float32")
    with pytest.raises(ValueError, match=r"policy\.apply\(model\).*without_modules"):
        ampkit.autocast("cpu", policy=p)
    with ampkit.autocast("cpu", policy=p.without_modules()):
        assert torch.is_autocast_enabled("cpu")
    assert not torch.is_autocast_enabled("cpu")
