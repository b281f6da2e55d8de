"""The numerics doctor: the first non-finite op of a run, forward or backward, and its module.

``doc = ampkit.doctor(model, every=N)`` arms it (also ``with ampkit.doctor(...) as doc:``);
``doc.close()`` disarms it. Armed, it installs a forward pre-hook and a forward hook on the
model itself and subscribes to the core's listener points (a scaler's gradient check, a
coming CUDA graph capture); every step is checked on the device for an inf or a NaN that
reaches the gradients or the outputs, and the first bad step's inputs and output gradient
are kept (``_step_watch``). Disarmed (or never armed) nothing is installed: no cost.

The op is named by the **op-level watch** (``_op_watch``), which runs only in sampled
steps (every ``every``-th, eager) and in the replay (``_replay``) of the first bad step
that ``first_nonfinite()`` runs on demand. No value is read back to the host per step:
``first_nonfinite()`` reads the records on demand, and replays the first bad step if no
sampled step named it. Under ``make_train_step``'s CUDA graph the per-step check and
keeping are kernels of the graph, and a device step counter names the replayed step.

In sampled steps the doctor also accumulates per module: the absmax of its forward outputs
and gradients, the fraction of values cast to the low dtype that underflow (nonzero in
float32, zero after the cast) and the fraction of low-precision values beyond the dtype's
range (inf); ``heatmap()`` draws them (``_plot``).
For the ops that ran in fp8 it records per module and operand the amax, the fractions that
saturated and that flushed to zero, and the scale (``_fp8_watch``; ``fp8_stats()``), and
``suggest()`` moves a module back to the region dtype where fp8 hurt it.

The modules, bottom up: ``_finding`` (what it reports), ``_replaying`` (which step is being
replayed), ``_step_watch`` (every step's check and the frozen bad step), ``_op_watch``,
``_fp8_watch``, ``_replay``, ``_plot``, ``_verdict`` (which findings the loss scaler handled: ``findings(scaler)``,
``first_harmful(scaler)``), and ``_doctor`` (the class that arms them).

>>> import torch, ampkit
>>> model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 1))
>>> with torch.no_grad():
...     _ = model[1].weight.fill_(3e4)     # fits float16; the product does not
>>> with ampkit.doctor(model) as doc, ampkit.autocast("cpu", dtype=torch.float16):
...     out = model(torch.full((2, 4), 100.0))
>>> f = doc.first_nonfinite()
>>> (f.op, f.module, f.phase, f.dtype, f.step)
('addmm', '1', 'forward', 'float16', 0)
"""

from ampkit._doctor._doctor import doctor
from ampkit._doctor._finding import Finding
from ampkit._doctor._replaying import replaying

__all__ = ["doctor", "Finding", "replaying"]
