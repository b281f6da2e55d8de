"""ampkit's scaler inside PyTorch Lightning's precision plugin (tried, not a test: Lightning is
not a dependency).

    pip install lightning && python benchmarks/interop/lightning_scaler.py

``MixedPrecision("16-mixed", "cpu", scaler=...)`` takes the scaler it is given (its type
hint says ``torch.amp.GradScaler``; nothing checks it) and drives it: ``scale(loss)`` before
backward, ``unscale_`` (unless the optimizer is fused), ``step``, ``update``, and
``state_dict``/``load_state_dict`` in checkpoints. The same training runs twice, with
torch's scaler and with ampkit's, float16 autocast on the CPU, an inf planted in batch 1:
both must skip that step and back off, and end with bitwise the same parameters and scale.
"""
import torch
import lightning.pytorch as pl
from lightning.pytorch.plugins.precision import MixedPrecision

import ampkit

STEPS, INF_AT = 5, 1


class Model(pl.LightningModule):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.net = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
        self.trace = []

    def training_step(self, batch, i):
        x, y = batch
        return (self.net(x).float() - y).pow(2).mean()

    def on_train_batch_end(self, outputs, batch, i):
        scaler = self.trainer.precision_plugin.scaler
        self.trace.append((float(scaler.get_scale()), [p.detach().clone() for p in self.parameters()]))

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def data():
    g = torch.Generator().manual_seed(1)
    xs, ys = torch.randn(STEPS * 4, 8, generator=g), torch.randn(STEPS * 4, 4, generator=g)
    xs[INF_AT * 4, 0] = float("inf")
    return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(xs, ys), batch_size=4)


def train(scaler):
    model = Model()
    plugin = MixedPrecision("16-mixed", "cpu", scaler=scaler)
    trainer = pl.Trainer(accelerator="cpu", devices=1, plugins=[plugin], max_steps=STEPS, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(model, data())
    assert trainer.precision_plugin.scaler is scaler
    return model.trace, plugin.state_dict()


def main():
    kw = dict(init_scale=1024.0, growth_interval=2)
    ref, ref_state = train(torch.amp.GradScaler("cpu", **kw))
    ours, our_state = train(ampkit.GradScaler("cpu", **kw))
    for i, ((s_ref, p_ref), (s_ours, p_ours)) in enumerate(zip(ref, ours)):
        same = all(torch.equal(a, b) for a, b in zip(p_ref, p_ours))
        print("step %d: scale torch %g, ampkit %g, parameters bitwise equal: %s" % (i, s_ref, s_ours, same))
    skipped = all(torch.equal(a, b) for a, b in zip(ours[INF_AT - 1][1], ours[INF_AT][1]))
    print("inf batch %d skipped by ampkit: %s; scale %g -> %g" % (INF_AT, skipped, ours[INF_AT - 1][0], ours[INF_AT][0]))
    print("state_dict keys: torch %s, ampkit %s" % (sorted(ref_state), sorted(our_state)))
    ok = skipped and all(s == t and all(torch.equal(a, b) for a, b in zip(p, q))
                         for (s, p), (t, q) in zip(ref, ours))
    print("ampkit's scaler in Lightning's MixedPrecision: %s" % ("same as torch's" if ok else "DIFFERS"))
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
