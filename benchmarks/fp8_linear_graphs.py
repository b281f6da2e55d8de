"""The forward and backward graphs of one fp8 linear under torch.compile, on the CPU, to count
the passes each makes over its operands. Never a test.

    PYTHONPATH=$PWD/python python3 benchmarks/fp8_linear_graphs.py [--emulated] [--no-bias]

A LayerNorm(64) feeding Linear(64, 96) and a gelu (the MLP's first half), x (4, 32, 64) in
float32, the shipped fp8 policy (tensorwise), compiled by aot_autograd with inductor's
partitioner (min-cut, so what the forward saves and what the backward recomputes are
inductor's choices) and no code generation: printed, the forward graph, what it saves
for the backward (dtype, shape), the backward graph, and per graph a count of the ops that
pass over a tensor. The GPU's _scaled_mm path is turned on for the CPU (unless
``--emulated``), as tests/python/test_fp8.py does.
"""
import argparse
import collections

import torch
from functorch.compile import make_boxed_func, min_cut_rematerialization_partition
from torch._dynamo.backends.common import aot_autograd

import ampkit
from ampkit import _fp8

NOT_PASSES = {"aten.view.default", "aten.t.default", "aten.detach.default", "aten._unsafe_view.default",
              "<built-in function getitem>", "aten.permute.default", "aten.transpose.int"}


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--emulated", action="store_true")
    ap.add_argument("--no-bias", action="store_true")
    args = ap.parse_args()
    if not args.emulated:
        _fp8.SCALED_MM_DEVICES = {"cuda", "cpu"}
    graphs = {}

    def keep(tag):
        def compiler(gm, _):
            graphs[tag] = gm
            return make_boxed_func(gm.forward)
        return compiler

    backend = aot_autograd(fw_compiler=keep("forward"), bw_compiler=keep("backward"),
                           partition_fn=min_cut_rematerialization_partition)
    torch.manual_seed(0)
    ln, lin = torch.nn.LayerNorm(64), torch.nn.Linear(64, 96, bias=not args.no_bias)
    policy = ampkit.load_policy("fp8")

    def mlp_half(h):
        with ampkit.autocast("cpu", policy=policy):
            return torch.nn.functional.gelu(lin(ln(h)))

    h = torch.randn(4, 32, 64, requires_grad=True)
    torch.compile(mlp_half, backend=backend)(h).float().sum().backward()
    for tag in ("forward", "backward"):
        gm = graphs[tag]
        print("==== %s\n%s" % (tag, gm.code.strip()))
        if tag == "forward":
            out = next(n for n in gm.graph.nodes if n.op == "output").args[0]
            print("saved for the backward:", ", ".join("%s %s%s" % (n, str(n.meta["val"].dtype).replace("torch.", ""),
                                                                     tuple(n.meta["val"].shape)) for n in out[1:]))
        ops = collections.Counter(str(n.target) for n in gm.graph.nodes if n.op == "call_function")
        print("%s ops (views and getitems left out): %s" % (tag, ", ".join(
            "%s %d" % (k.replace("aten.", "").replace(".default", ""), v) for k, v in sorted(ops.items())
            if k not in NOT_PASSES)))


if __name__ == "__main__":
    main()
