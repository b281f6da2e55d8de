"""Instructions the eager train step adds to the hand-written loop, counted by callgrind
(deterministic, unlike a shared machine's clocks). Run through eager_instructions.sh, which
builds the small callgrind control library and starts Python under valgrind:

    benchmarks/probes/eager_instructions.sh [CASES=seed_mlp,convnet] [K=20]

For each case (benchmarks/eager_step_cost.py's --shrink proxy: the full profile's structure,
the tiny profile's sizes, on the CPU, fused optimizer), after three warm-up epochs, callgrind
counts K hand-written steps, then K eager steps (make_train_step(capture=False)), twice,
each count dumped apart; the shell script prints instructions a step and eager - hand.
Figures of issue 25's stop 33 (seed_mlp 137.3K -> 116.1K added, convnet 1182K -> 926.5K)
came from this count. Never a test.
"""
import ctypes
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))
sys.path.insert(0, str(ROOT / "python"))

import torch  # noqa: E402

import ampkit.bench as bench  # noqa: E402
import eager_step_cost as esc  # noqa: E402

torch.set_num_threads(1)
ctl = ctypes.CDLL(sys.argv[1])  # cg_start, cg_dump(name), cg_stop (eager_instructions.sh builds it)
k = int(sys.argv[3])
for case in sys.argv[2].split(","):
    built = bench.build_case(esc.shrunk(bench.load_cases()[case]), "shrunk", seed=0, device="cpu")
    pair, epoch = esc.make_pair(built, torch.bfloat16, "fused")
    for _ in range(3):
        for x, y in epoch:
            pair["hand"](x, y)
            pair["eager"](x, y)
    for which in ("hand", "eager", "hand", "eager"):
        step = pair[which]
        ctl.cg_start()
        for i in range(k):
            step(*epoch[i % len(epoch)])
        ctl.cg_dump(f"{case}-{which}".encode())
        ctl.cg_stop()
