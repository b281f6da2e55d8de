"""build_case: one case at one profile, built the same way for the Python and the R runner."""

from __future__ import annotations

import dataclasses
import inspect
from typing import Any

import torch

from ampkit.bench import _models
from ampkit.bench._spec import Case, load_cases


def _kwargs_for(fn, sizes: dict) -> dict:
    names = inspect.signature(fn).parameters
    return {k: v for k, v in sizes.items() if k in names}


@dataclasses.dataclass
class BuiltCase:
    """A case ready to train: the data (built once), and fresh seeded models on demand.

    >>> b = build_case("seed_mlp", "tiny", seed=0)
    >>> model = b.new_model(); opt = b.new_optimizer(model)
    >>> x, y = b.batches[0]
    >>> loss = b.loss_fn(model(x), y); loss.backward(); opt.step()
    """

    case: Case
    profile: str
    seed: int
    device: str
    sizes: dict
    num_batches: int
    repeats: int
    warmup_steps: int
    batches: list
    loss_fn: Any

    @property
    def name(self) -> str:
        return self.case.name

    def new_model(self) -> torch.nn.Module:
        """The case's model with the same seeded weights every time, on the device, in train mode."""
        torch.manual_seed(self.seed)
        fn = _models.MODELS[self.case.model]
        with torch.device(self.device):
            model = fn(**_kwargs_for(fn, self.sizes))
        return model.train()

    def new_optimizer(self, model: torch.nn.Module, fused: bool = False) -> torch.optim.Optimizer:
        """The case's optimizer; fused=True asks for torch's fused (and, for AdamW, capturable) kernels."""
        opts = {k: v for k, v in self.case.optimizer.items() if k != "name"}
        if fused:
            opts["fused"] = True
        return _models.OPTIMIZERS[self.case.optimizer["name"]](model.parameters(), **opts)

    def total_steps(self) -> int:
        return self.warmup_steps + self.repeats * self.num_batches

    def mean_loss(self, losses) -> float:
        """Mean of a list of (detached) loss tensors, read once after the clock stops."""
        return float(torch.stack([l.detach().float() for l in losses]).mean().item())


def resolve_device(device: str = "auto") -> str:
    """'auto' -> 'cuda' when a GPU is visible, else 'cpu'; 'cpu' and 'cuda' are checked."""
    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if device not in ("cpu", "cuda"):
        raise ValueError("device must be 'auto', 'cpu' or 'cuda', got %r" % (device,))
    if device == "cuda" and not torch.cuda.is_available():
        raise ValueError("device 'cuda' asked for but torch.cuda.is_available() is False; use --device cpu")
    return device


def build_case(case, profile: str, seed: int = 0, device: str = "auto", repeats=None) -> BuiltCase:
    """Build one case (a name or a Case) at a profile: seeded data on the device, model factory, loss.

    `repeats` overrides the profile's number of timed repeats (None keeps it).
    """
    if isinstance(case, str):
        cases = load_cases()
        if case not in cases:
            raise ValueError("unknown case %r; valid cases: %s" % (case, ", ".join(cases)))
        case = cases[case]
    device = resolve_device(device)
    prof = case.profile(profile)
    if repeats is not None:
        repeats = int(repeats)
        if repeats < 1:
            raise ValueError("repeats must be >= 1, got %r" % (repeats,))
    gen = torch.Generator(device=device).manual_seed(int(seed) + 1)
    data_fn = _models.DATA[case.data]
    batches = data_fn(prof["num_batches"], device=device, generator=gen, **_kwargs_for(data_fn, prof["sizes"]))
    return BuiltCase(case=case, profile=profile, seed=int(seed), device=device, sizes=prof["sizes"],
                     num_batches=prof["num_batches"], repeats=repeats or prof["repeats"],
                     warmup_steps=prof["warmup_steps"], batches=batches, loss_fn=_models.LOSSES[case.loss])
