"""What make_train_step needs to capture a DDP model built the ordinary way.

torch's CUDA-graph notes ask three things of a DDP capture: TORCH_NCCL_ASYNC_ERROR_HANDLING=0
before init_process_group, the DDP module built on a side stream, and 11 eager iterations
before the capture. This probe turns each on and off (and the capture's error mode) on a
small decoder, each combination in fresh processes, and prints whether the step captured,
its reason, and its losses against the eager step's (capture=False).

    PYTHONPATH=$PWD/python python3 benchmarks/gpu/ddp_capture_probe.py [--gpus N]

A combination is a comma-separated set of: side (DDP built on a side stream), env
(TORCH_NCCL_ASYNC_ERROR_HANDLING=0), warm3/warm11 (warmup=3/11; the default is 11 for DDP
since f3d5c15, 3 before), global (capture_error_mode "global" instead of ampkit's
"thread_local"), eager (capture=False: the reference), fsdp2 (fully_shard on each block and
the root instead of DDP).
"""
import argparse
import os
import socket
import subprocess
import sys

import torch

COMBOS = ("eager", "", "side", "side,global", "side,warm3", "fsdp2,eager", "fsdp2")
STEPS = 30


class Block(torch.nn.Module):
    def __init__(self, d, h):
        super().__init__()
        self.h = h
        self.ln1, self.ln2 = torch.nn.LayerNorm(d), torch.nn.LayerNorm(d)
        self.qkv, self.proj = torch.nn.Linear(d, 3 * d), torch.nn.Linear(d, d)
        self.fc1, self.fc2 = torch.nn.Linear(d, 4 * d), torch.nn.Linear(4 * d, d)

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, self.h, d // self.h).unbind(2)
        a = torch.nn.functional.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True)
        x = x + self.proj(a.transpose(1, 2).reshape(b, t, d))
        return x + self.fc2(torch.nn.functional.gelu(self.fc1(self.ln2(x))))


class Decoder(torch.nn.Module):
    def __init__(self, vocab=4096, d=256, h=4, layers=2, seq=128):
        super().__init__()
        self.tok, self.pos = torch.nn.Embedding(vocab, d), torch.nn.Embedding(seq, d)
        self.blocks = torch.nn.ModuleList(Block(d, h) for _ in range(layers))
        self.ln, self.head = torch.nn.LayerNorm(d), torch.nn.Linear(d, vocab)

    def forward(self, idx):
        x = self.tok(idx) + self.pos(torch.arange(idx.shape[1], device=idx.device))
        for blk in self.blocks:
            x = blk(x)
        return self.head(self.ln(x))


def child(combo):
    flags = set(filter(None, combo.split(",")))
    import torch.distributed as dist

    import ampkit
    import ampkit._train_step as ts_mod

    if "env" in flags:
        os.environ["TORCH_NCCL_ASYNC_ERROR_HANDLING"] = "0"
    if "global" in flags:
        ts_mod._CAPTURE_ERROR_MODE = "global"
    dist.init_process_group("nccl")
    rank = dist.get_rank()
    torch.cuda.set_device(rank)
    torch.manual_seed(0)
    model = Decoder().cuda()
    if "fsdp2" in flags:
        try:
            from torch.distributed.fsdp import fully_shard
        except ImportError:
            from torch.distributed._composable.fsdp import fully_shard
        for blk in model.blocks:
            fully_shard(blk)
        ddp = fully_shard(model)
    elif "side" in flags:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            ddp = torch.nn.parallel.DistributedDataParallel(model, device_ids=[rank])
        torch.cuda.current_stream().wait_stream(side)
    else:
        ddp = torch.nn.parallel.DistributedDataParallel(model, device_ids=[rank])
    opt = torch.optim.AdamW(ddp.parameters(), lr=1e-3, fused=True, capturable=True)

    def loss_fn(logits, y):
        return torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), y.flatten())

    kw = {}
    if "warm11" in flags:
        kw["warmup"] = 11
    if "warm3" in flags:
        kw["warmup"] = 3
    if "eager" in flags:
        kw["capture"] = False
    import warnings
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        step = ampkit.make_train_step(ddp, loss_fn, opt, **kw)
        g = torch.Generator(device="cuda").manual_seed(1 + rank)
        losses = []
        for _ in range(STEPS):
            x = torch.randint(0, 4096, (8, 128), device="cuda", generator=g)
            losses.append(step(x, torch.roll(x, -1, 1)))
        torch.cuda.synchronize()
    if rank == 0:
        vals = [float(v) for v in losses]
        print(f"[{combo or 'defaults'}] captured={step.captured} captures={step.captures} "
              f"replays={step.replays} reason={step.reason!r} warnings={len(caught)} "
              f"loss[-1]={vals[-1]!r} sum={sum(vals)!r}", flush=True)
    dist.destroy_process_group()


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main():
    if len(sys.argv) > 2 and sys.argv[1] == "--child":
        child(sys.argv[2])
        return
    ap = argparse.ArgumentParser()
    ap.add_argument("--gpus", type=int, default=1)
    ap.add_argument("--combos", default=";".join(COMBOS))
    args = ap.parse_args()
    for combo in args.combos.split(";"):
        env = {k: v for k, v in os.environ.items() if k != "TORCH_NCCL_ASYNC_ERROR_HANDLING"}
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(args.gpus),
               "--master-port", str(free_port()), __file__, "--child", combo]
        try:
            p = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=120)
        except subprocess.TimeoutExpired:
            print(f"[{combo or 'defaults'}] TIMEOUT", flush=True)
            continue
        lines = [ln for ln in p.stdout.splitlines() if ln.startswith("[")]
        if p.returncode == 0 and lines:
            print(lines[-1], flush=True)
        else:
            err = [ln for ln in p.stderr.splitlines() if "Error" in ln]
            print(f"[{combo or 'defaults'}] FAILED rc={p.returncode}: {' | '.join(err[-3:])[:500]}",
                  flush=True)


if __name__ == "__main__":
    main()
