"""Spawned ranks for the distributed tests (spawned processes import this): CPU ranks over
gloo, or one rank a GPU over NCCL.

``spawn_ranks`` runs a worker in ``world`` processes (two by default), bounded in time, and
returns what each rank pickled; ``run_rank`` is the rank's side: join the group, run the
body, pickle its result (or its traceback) to ``out_dir/rank<r>.pkl`` (a file, not a pipe:
a full pipe would block the rank).
"""

from __future__ import annotations

import os
import pickle
import socket
import traceback
from pathlib import Path

import pytest
import torch
import torch.distributed as dist


def run_rank(rank: int, world: int, port: int, out_dir: str, body, backend: str = "gloo") -> None:
    """``body(rank)`` in a group of ``world`` processes, its result pickled. ``backend``:
    ``"gloo"``, or ``"nccl"`` (rank r on GPU r)."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    try:
        if backend == "nccl":
            torch.cuda.set_device(rank)
        dist.init_process_group(backend, rank=rank, world_size=world)
        result = body(rank)
    except Exception:  # noqa: BLE001 - the test reports the rank's traceback
        result = traceback.format_exc()
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    with open(os.path.join(out_dir, f"rank{rank}.pkl"), "wb") as f:
        pickle.dump(result, f)


def spawn_ranks(target, out_dir, timeout_s: float, world: int = 2) -> list:
    """``target(rank, world, port, out_dir)`` in ``world`` spawned processes; each rank's
    result. Fails the test, naming the rank, when one has not ended within ``timeout_s``
    (it is killed: a collective hung), wrote nothing, or raised."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = torch.multiprocessing.get_context("spawn")
    procs = [ctx.Process(target=target, args=(r, world, port, str(out_dir))) for r in range(world)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout_s)
    hung = [i for i, p in enumerate(procs) if p.is_alive()]
    for p in procs:
        if p.is_alive():
            p.kill()
    if hung:
        pytest.fail(f"ranks {hung} did not finish within {timeout_s} s (a collective hung?)")
    results = []
    for rank in range(world):
        path = Path(out_dir) / f"rank{rank}.pkl"
        if not path.exists():
            pytest.fail(f"rank {rank} wrote no result (exit code {procs[rank].exitcode})")
        result = pickle.loads(path.read_bytes())
        if isinstance(result, str):
            pytest.fail(f"rank {rank} raised:\n{result}")
        results.append(result)
    return results
