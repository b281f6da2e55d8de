"""A CPU stand-in for CUDA's peak memory: the bytes a stretch of code allocates above what
was allocated when it started, at its high point, read from torch's own allocation records.

On the GPU the benchmark's runners read ``torch.cuda.max_memory_allocated()``; on the CPU
there is no such counter, but torch's profiler with ``profile_memory=True`` records every
CPU tensor allocation and free (``[memory]`` events, signed bytes) made while it runs. Their
running sum, in time order, is what the stretch holds above its start; its maximum is the
peak the stretch adds. A tensor that was allocated before the stretch and freed in it counts
negative, so a runner that still holds the previous step's logits when the next step starts
(R, until it lets go of them) shows them as a later free, and one that keeps them through
backward shows a higher peak: the same quantity for either runner, as long as both start
from the same point (here: after their warm-up, before their first timed step).

    >>> import torch
    >>> with Census() as c:
    ...     a = torch.empty(1 << 20, dtype=torch.uint8); b = torch.empty(1 << 20, dtype=torch.uint8)
    ...     del a, b
    >>> c.peak_bytes >= 2 << 20, c.net_bytes <= 0
    (True, True)

Used from R by benchmarks/r/peak_census.R, which compares R's loop with Python's.
"""

from __future__ import annotations

import torch


class Census:
    """Profile CPU allocations while entered; after exit ``peak_bytes`` (the running sum's
    maximum, >= 0) and ``net_bytes`` (what is still held at the end, above the start)."""

    def __init__(self):
        self.peak_bytes = self.net_bytes = None
        self._prof = None

    def __enter__(self):
        self._prof = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU],
                                            profile_memory=True)
        self._prof.__enter__()
        return self

    def __exit__(self, *exc):
        self._prof.__exit__(*exc)
        # the raw records (the op table folds allocations into the ops that made them)
        records = sorted((e.start_ns(), e.nbytes()) for e in self._prof.profiler.kineto_results.events()
                         if e.name() == "[memory]")
        held = peak = 0
        for _, nbytes in records:
            held += nbytes
            peak = max(peak, held)
        self.peak_bytes, self.net_bytes = int(peak), int(held)
        self._prof = None
        return False


def python_peak(built, variant, epochs: int = 2) -> dict:
    """The Python runner's own code (``ampkit.bench.VariantRun``: build, warm-up, ``epochs``
    timed epochs) under a census, from a collected start: ``peak_bytes`` above what was allocated
    before the model was built (the case's batches), as the runners' CUDA peak reads it."""
    import gc

    from ampkit.bench import VariantRun
    run = VariantRun(built, variant, "python", None, None)
    gc.collect()
    with Census() as c:
        run.build()
        run.warm_up()
        for _ in range(int(epochs)):
            run.epoch()
    run.close()
    return dict(peak_bytes=c.peak_bytes, net_bytes=c.net_bytes)
