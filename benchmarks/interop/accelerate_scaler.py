"""ampkit's scaler inside Hugging Face accelerate (tried, not a test: accelerate is not a dependency).

    pip install accelerate && python benchmarks/interop/accelerate_scaler.py

Accelerator(mixed_precision="fp16") builds torch's scaler on a GPU and none on the CPU;
setting ``accelerator.scaler`` before ``prepare`` hands ampkit's to accelerate's backward,
clip_grad_norm_ (unscale_) and optimizer wrapper. An inf batch at step 1 must be skipped.
"""
import torch
import ampkit
from accelerate import Accelerator
acc = Accelerator(mixed_precision="fp16", cpu=True)
print("accelerate scaler:", type(acc.scaler), "native amp", acc.native_amp)
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
opt = torch.optim.SGD(model.parameters(), lr=0.1)
acc.scaler = ampkit.GradScaler("cpu", init_scale=1024.0, growth_interval=2)
model, opt = acc.prepare(model, opt)
for step in range(4):
    x = torch.randn(4, 8)
    if step == 1: x[0, 0] = float("inf")
    opt.zero_grad()
    with acc.autocast():
        loss = model(x).float().pow(2).mean()
    acc.backward(loss)
    acc.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()
    print(step, "scale", acc.scaler.get_scale(), "skipped", opt.step_was_skipped, "stats", acc.scaler.stats().skipped)
