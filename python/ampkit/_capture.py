"""What a CUDA-graph capture of a training step needs from CUDA and from Python.

``make_train_step`` captures its step on a stream of its own (``fresh_stream``: cuBLAS's
workspace then lives in the graph's pool), with thread-local capture errors
(``CAPTURE_ERROR_MODE``) and Python's garbage collector paused (``collector_paused``); before
its first capture it learns where the parameters' gradients accumulate
(``AccumulationStreams``), which for a ``DistributedDataParallel`` model (``holds_ddp``)
built on the default stream no capture can hold.

>>> import gc
>>> with collector_paused():
...     gc.isenabled()
False
>>> gc.isenabled()
True
"""

from __future__ import annotations

import contextlib
import ctypes
import gc

import torch

from ampkit._rollback import PLAIN

# Another thread's CUDA calls (NCCL's watchdog querying its events, a DataLoader's pinning
# thread) are no error in the capture of this thread's step, as in torch.compile's graphs.
CAPTURE_ERROR_MODE = "thread_local"
capture_streams: list = []  # every stream a capture ran on: never destroyed, never reused


@contextlib.contextmanager
def collector_paused():
    """Python's cyclic garbage collector stays off while a step is captured.

    A collection inside the capture runs the finalizers of whatever dead cycles exist then
    (an earlier step's CUDA events, graphs, streams, compiled kernels), and a CUDA call made
    by one of them is illegal while this thread captures: the error, raised inside a C++
    destructor, aborts the process. Seen on an H100: an armed doctor's Triton kernel
    compiled inside a capture allocated enough to start a collection, and pytest died with
    "Fatal Python error: Aborted" while "Garbage-collecting" (one run in three). torch's
    ``torch.cuda.graph`` no longer collects before a capture, nor pauses the collector.
    The collector's state before the capture is restored after it, also on an error.
    """
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


def fresh_stream() -> torch.cuda.Stream:
    """A CUDA stream no kernel has run on: the one a step is captured on.

    cuBLAS takes its workspace from a map keyed by (handle, stream), filled at the first
    matmul on a stream and emptied by ``torch._C._cuda_clearCublasWorkspaces()``, which
    torch.compile's CUDA-graph trees call around each of their warm-ups and recordings. A
    graph captured on a stream that already had a workspace (torch's pooled streams are
    handed out again, round-robin, and the warm-up ran on one) bakes in a block of the
    general pool that the step does not own: once the trees cleared it, the block went to
    whatever allocated next, and each replay's matmuls wrote into it (issue 25: "unspecified
    launch failure" beside a reduce-overhead model). On a stream of its own the first
    matmul of the capture allocates the workspace inside the graph's private pool, which
    lives as long as the graph (a clear then frees it into that pool, reserved for the
    graph). The stream is never destroyed: a later stream at the same address would find
    the stale workspace entry, so each capture keeps its own for the life of the process.
    """
    handle = ctypes.c_void_p()
    cudart = torch.cuda.cudart()
    err = cudart.cudaStreamCreate(ctypes.addressof(handle))
    if err != cudart.cudaError.success:
        raise RuntimeError(f"cudaStreamCreate failed: {err}")
    capture_streams.append(handle.value)
    return torch.cuda.ExternalStream(handle.value)


class AccumulationStreams:
    """Records the CUDA streams the parameters' gradients accumulate on, over one step.

    autograd runs a parameter's ``AccumulateGrad`` node (and the hooks on it, such as DDP's
    copy into its buckets) on the stream that was current when the node was created. A
    step makes new nodes each forward (on the step's own streams), unless something keeps
    them: ``DistributedDataParallel`` keeps every parameter's node from its construction.
    Built on the default stream, those nodes make each backward wait on, and launch into,
    the default (legacy) stream, which no capture can hold ("operation failed due to a
    previous error during capture"). A pre-hook on each node notes the stream it runs on.
    """

    def __init__(self, params):
        self.params = [p for p in params if p.requires_grad and type(p) in PLAIN
                       and p.device.type == "cuda"]
        self.streams: set = set()
        self._handles: list = []

    def __enter__(self):
        with torch.enable_grad():
            for p in self.params:  # the node in use (a new one, made on this stream, if none is kept)
                node = p.view_as(p).grad_fn.next_functions[0][0]
                self._handles.append((node, node.register_prehook(self._note)))
        return self

    def _note(self, grad_outputs):
        self.streams.add(torch.cuda.current_stream().cuda_stream)

    def __exit__(self, *exc):
        for _, handle in self._handles:
            handle.remove()
        self._handles = []  # (the nodes go with them)
        return False

    def on_default_stream(self):
        """None, or why a capture cannot hold this step's gradient accumulation."""
        default = {torch.cuda.default_stream(d).cuda_stream
                   for d in {p.device for p in self.params}}
        if not self.streams & default:
            return None
        return ("the parameters' gradients accumulate on the default CUDA stream, which a "
                "capture cannot hold: DistributedDataParallel keeps each parameter's "
                "AccumulateGrad node from its construction, with the stream current then. "
                "Build the DDP module on a side stream: `with torch.cuda.stream("
                "torch.cuda.Stream()): model = DistributedDataParallel(model, ...)`")


def holds_ddp(model) -> bool:
    ddp = getattr(torch.nn.parallel, "DistributedDataParallel", None)
    return ddp is not None and any(isinstance(m, ddp) for m in model.modules())
