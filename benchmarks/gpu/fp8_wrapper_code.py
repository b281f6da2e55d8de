"""The code inductor generates for one training step of fp8_speed.py's arms (forward and
backward graphs), written to a folder, one file per arm and graph: to read where the host's
time goes in a compiled fp8 step (its wrapper's Python between kernel launches). Never a test.

    PYTHONPATH=$PWD/python python3 benchmarks/gpu/fp8_wrapper_code.py OUTDIR [--shape gpt2]
        [--layers 2] [--arms bf16_compile,ampkit_fp8_tensorwise,torchao_tensorwise]

``--layers`` overrides the shape's number of layers (the wrapper's code per layer is the
same at any depth; fewer layers compile faster). Arms that cannot be built are skipped,
saying why.
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import fp8_speed  # noqa: E402  (this folder: the arms and shapes)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("outdir")
    ap.add_argument("--shape", default="gpt2", choices=sorted(fp8_speed.SHAPES))
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--arms", default="bf16_compile,ampkit_fp8_tensorwise,torchao_tensorwise")
    args = ap.parse_args(argv)
    from torch._inductor.utils import run_and_get_code
    os.makedirs(args.outdir, exist_ok=True)
    name, profile, sizes, batches = fp8_speed.SHAPES[args.shape]
    layers = "num_layers" if name == "seed_mlp" else "n_layers"
    fp8_speed.SHAPES[args.shape] = (name, profile, {**sizes, layers: args.layers}, batches)
    case = fp8_speed.build_shape(args.shape, False, "cuda")
    for arm_name in args.arms.split(","):
        try:
            arm = fp8_speed.build_arm(arm_name, case, "cuda", "inductor")
        except Exception as e:  # noqa: BLE001 - an arm that cannot be built is skipped
            print("%s: skipped (%s)" % (arm_name, str(e)[:300]), flush=True)
            continue
        x, y = case.batches[0]
        _, codes = run_and_get_code(lambda: arm.step(x, y))
        for i, code in enumerate(codes):
            path = os.path.join(args.outdir, "%s-%d.py" % (arm_name, i))
            with open(path, "w") as f:
                f.write(code)
            print("%s graph %d: %d lines, %d kernel launches (.run(), extern calls not counted) -> %s" % (
                arm_name, i, code.count("\n"), code.count(".run("), path), flush=True)
        torch._dynamo.reset()


if __name__ == "__main__":
    main()
