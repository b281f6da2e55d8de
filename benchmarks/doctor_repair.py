"""A diverging float16 run repaired by the numerics doctor, end to end.

    python benchmarks/doctor_repair.py [--device cpu|cuda] [--steps 150]

The model is 14 Linear layers; one of them, ``boom``, has weights a thousand times
larger than the others (unnormalised features do this), so its float16 output exceeds
65504 and the LayerNorm after it turns the inf into NaN. Under the default policy every
step's loss is NaN and the scaler skips every step. The doctor names ``boom``'s addmm;
``suggest()`` pins ``boom`` to float32; the same run then trains like float32, with the
other 13 layers' matmuls still in float16.
"""

from __future__ import annotations

import argparse
import json

import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

import ampkit

WIDTH, DEPTH = 64, 12
_MATMULS = {"mm", "addmm", "bmm", "baddbmm"}


class RepairNet(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.inp = torch.nn.Linear(32, WIDTH)
        self.blocks = torch.nn.ModuleList(torch.nn.Linear(WIDTH, WIDTH) for _ in range(DEPTH))
        self.boom = torch.nn.Linear(WIDTH, WIDTH)
        with torch.no_grad():
            self.boom.weight.mul_(3e4)  # weights fit float16; |boom(x)| ~ 1e6: beyond float16, fine in float32
        self.norm = torch.nn.LayerNorm(WIDTH)
        self.head = torch.nn.Linear(WIDTH, 1)

    def forward(self, x):
        x = torch.relu(self.inp(x))
        for b in self.blocks:
            x = torch.relu(b(x)) + x
        return self.head(self.norm(self.boom(x)))


class MatmulFlops(TorchDispatchMode):
    """Matmul FLOPs (2 m n k) by the dtype of their inputs, counted from the aten ops run."""

    def __init__(self):
        super().__init__()
        self.flops: dict = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if name in _MATMULS:
            a, b = (args[1], args[2]) if name in ("addmm", "baddbmm") else (args[0], args[1])
            batch = a.shape[0] if a.dim() == 3 else 1
            m, k, n = a.shape[-2], a.shape[-1], b.shape[-1]
            key = str(a.dtype).replace("torch.", "")
            self.flops[key] = self.flops.get(key, 0) + 2 * batch * m * n * k
        return func(*args, **(kwargs or {}))

    def low_fraction(self):
        total = sum(self.flops.values())
        return sum(v for k, v in self.flops.items() if k in ("float16", "bfloat16")) / total if total else 0.0


def data(device, n=2048, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 32, generator=g)
    y = torch.sin(x[:, :4].sum(1, keepdim=True)) + 0.5 * torch.randn(n, 1, generator=g)  # noise floor 0.25
    return x.to(device), y.to(device)


def train(device, steps, precision, policy=None, doctor_every=None, seed=0):
    """Train RepairNet with Adam; precision: 'fp32' or 'fp16'. Returns a dict of results."""
    torch.manual_seed(seed)
    model = RepairNet().to(device)
    x, y = data(device)
    vx, vy = data(device, seed=1)  # held out: the final loss is measured there
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    # 2**10: the default 2**16 overflows the first backward passes (two skipped steps, then
    # the fp16 run is two updates behind fp32); the point here is the forward overflow
    scaler = ampkit.GradScaler(device, init_scale=2.0**10, enabled=precision == "fp16")
    doc = ampkit.doctor(model, every=doctor_every) if doctor_every else None
    scopes = policy.apply(model) if policy is not None else None
    flops = MatmulFlops()
    losses = []
    try:
        for i in range(steps):
            opt.zero_grad(set_to_none=True)
            counting = flops if i == 0 else None
            if counting:
                counting.__enter__()
            with ampkit.autocast(device, dtype=torch.float16, enabled=precision == "fp16",
                                 policy=None if policy is None else policy.without_modules()):
                loss = F.mse_loss(model(x).float(), y)
            scaler.scale(loss).backward()
            if counting:
                counting.__exit__(None, None, None)
            scaler.step(opt)
            scaler.update()
            losses.append(loss.detach())
    finally:
        if scopes is not None:
            scopes.remove()
    with torch.no_grad(), ampkit.autocast(device, dtype=torch.float16, enabled=False):
        final = F.mse_loss(model(vx), vy).item()  # the trained weights, in float32, on held-out data
    out = {"precision": precision, "steps": steps, "final_loss": final,
           "last_train_loss": losses[-1].item(), "skipped": scaler.stats().skipped if precision == "fp16" else 0,
           "low_precision_matmul_fraction": flops.low_fraction(), "doctor": doc}
    if doc is not None:
        doc.close()
    return out


def repair(device="cpu", steps=150, broken_steps=20):
    """The whole story: fp32 reference, fp16 diverging (``broken_steps`` steps: it skips them
    all), doctor + suggest, fp16 repaired; final losses on held-out data."""
    ref = train(device, steps, "fp32")
    broken = train(device, broken_steps, "fp16", doctor_every=5)
    doc = broken.pop("doctor")
    finding = doc.first_nonfinite()
    policy = doc.suggest()
    fixed = train(device, steps, "fp16", policy=policy)
    fixed.pop("doctor")
    ref.pop("doctor")
    return {"fp32": ref, "fp16_default": broken, "finding": finding.to_dict() if finding else None,
            "suggested_policy": policy.to_dict().get("modules"), "policy_yaml": policy.to_yaml(),
            "fp16_repaired": fixed, "loss_ratio": fixed["final_loss"] / ref["final_loss"]}


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--steps", type=int, default=150)
    a = ap.parse_args()
    r = repair(a.device, a.steps)
    r.pop("policy_yaml")
    print(json.dumps(r, indent=1, default=str))
