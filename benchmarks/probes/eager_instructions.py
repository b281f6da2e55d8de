"""Instructions the eager train step adds to the hand-written loop, counted by callgrind
(deterministic, unlike a shared machine's clocks). Run through eager_instructions.sh, which
builds the small callgrind control library and starts Python under valgrind:

    benchmarks/probes/eager_instructions.sh [CASES=seed_mlp,convnet] [K=20] [MODES=eager,fallback]

For each case (benchmarks/eager_step_cost.py's --shrink proxy: the full profile's structure,
the tiny profile's sizes, on the CPU, fused optimizer) and each mode, after three warm-up
epochs, callgrind counts K hand-written steps, then K steps of the train step, twice, each
count dumped apart; the shell script prints instructions a step and step - hand. Modes:

  eager     make_train_step(capture=False): every call runs the eager step.
  fallback  the eager fallback of a captured step, beside its graph: a step stands in a
            graph as a capture keeps one (TrainStep._keep_graph with a graph that only
            counts replays: no CUDA graph on the CPU; the tests do the same), captured for
            the case's batches, then is called with batches one sample longer (as
            eager_step_cost.py's fallback setting does on CUDA with batches one shorter);
            the hand-written loop runs the same batches. Each call then takes the path of a CUDA step's
            fallback: __call__, _call's batch checks against the captured and the last
            other signature, _eager(beside_graph=True) with the graph's gradients kept.
            What differs from CUDA: the tensors are CPU tensors (why_copy reads the same
            attributes; the kernels are the CPU's) and the graph is never replayed in the
            counted steps (nor is it in eager_step_cost.py's fallback rounds).

Figures of issue 25's stop 33 (seed_mlp 137.3K -> 116.1K added, convnet 1182K -> 926.5K)
came from this count (the eager mode). Never a test.
"""
import ctypes
import sys
import warnings
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))
sys.path.insert(0, str(ROOT / "python"))

import torch  # noqa: E402

import ampkit.bench as bench  # noqa: E402
import eager_step_cost as esc  # noqa: E402


class StandInGraph:
    """What a capture keeps as its graph, for the step's host path: replays are counted."""

    replays = 0

    def replay(self):
        self.replays += 1


def beside_a_graph(step, epoch):
    """Make ``step`` (capture=False, warmed up) a captured step for ``epoch``'s batches, as
    a capture leaves it; return the batches one sample longer, on which each call runs
    its eager fallback beside the graph, and the stand-in graph."""
    x, y = epoch[0]
    step._eligible = True
    step._static_in, step._static_tg = [x.clone()], [y.clone()]
    graph = StandInGraph()
    step._keep_graph(graph, torch.zeros(()), [x], [y])
    # (one sample longer, not shorter as eager_step_cost.py's: the shrunk convnet's batch of
    # two would leave BatchNorm one value per channel)
    other = [(torch.cat([x, x[:1]]), torch.cat([y, y[:1]])) for x, y in epoch]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (the fallback's warning, once)
        step(*other[0])
    if step.captured or "graph" not in repr(step):
        raise RuntimeError("fallback: a longer batch did not run beside the graph")
    return other, graph


torch.set_num_threads(1)
ctl = ctypes.CDLL(sys.argv[1])  # cg_start, cg_dump(name), cg_stop (eager_instructions.sh builds it)
k = int(sys.argv[3])
modes = sys.argv[4].split(",") if len(sys.argv) > 4 else ["eager"]
for case in sys.argv[2].split(","):
    for mode in modes:
        built = bench.build_case(esc.shrunk(bench.load_cases()[case]), "shrunk", seed=0, device="cpu")
        pair, epoch = esc.make_pair(built, torch.bfloat16, "fused")
        for _ in range(3):
            for x, y in epoch:
                pair["hand"](x, y)
                pair["eager"](x, y)
        if mode == "fallback":
            epoch, graph = beside_a_graph(pair["eager"], epoch)
            for x, y in epoch:
                pair["hand"](x, y)
                pair["eager"](x, y)
        elif mode != "eager":
            raise SystemExit(f"unknown mode {mode!r}; use eager or fallback")
        for which in ("hand", "eager", "hand", "eager"):
            step = pair[which]
            ctl.cg_start()
            for i in range(k):
                step(*epoch[i % len(epoch)])
            ctl.cg_dump(f"{case}-{mode}-{which}".encode())
            ctl.cg_stop()
        if mode == "fallback" and (pair["eager"].captured or graph.replays or "graph" not in repr(pair["eager"])):
            raise RuntimeError("fallback: a counted call replayed the graph")
