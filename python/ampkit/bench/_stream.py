"""A token stream with a known entropy floor: fidelity curves that end where real training does.

The token cases' own data (``tokens``) give each token one fixed target, the next id, over a
few batches taken epoch after epoch: the models memorise them and the loss falls towards 0
(the transformer's full profile reaches 0.005 in 500 steps), where a relative gap says how
close to zero each precision gets rather than whether it trains as well; and the GPT-2
shape, whose head is tied to its embedding, learns that one-to-one map by a sudden drop
whose step varies from seed to seed (the seed-to-seed spread at step 500 was 84% of the
loss on an H200). Language-model training never nears zero: its loss falls towards the
entropy of the text.

``TokenStream`` is such a text in miniature. Each input id ``x`` (uniform over the first
``inputs`` ids of the vocabulary) has ``successors`` distinct target ids, fixed once for
every seed and variant (one "language"); a token's target is its ``j``-th successor with
probability ``q[j]`` proportional to ``1 / (j + 1)``. No model can average below the entropy
of ``q`` (``floor``, in nats), and none can memorise the data: every step draws a fresh batch
from the seed's own generator, so seed ``s`` of every variant sees the same stream.

>>> s = TokenStream(vocab=64, batch_size=2, seq_len=8, seed=0, device="cpu")
>>> ids, targets = s.batch()
>>> ids.shape, targets.shape, bool((targets.unsqueeze(-1) == s.successors[ids]).any(-1).all())
(torch.Size([2, 8]), torch.Size([2, 8]), True)
>>> round(s.floor, 3)
2.359
"""

from __future__ import annotations

import torch

SUCCESSORS = 16
INPUTS = 4096
LANGUAGE_SEED = 20261128  # the one language every seed and variant learns


def successor_probabilities(successors: int = SUCCESSORS) -> torch.Tensor:
    """q[j] proportional to 1 / (j + 1), j = 0..successors-1 (float64, summing to 1)."""
    w = 1.0 / torch.arange(1, successors + 1, dtype=torch.float64)
    return w / w.sum()


def floor(successors: int = SUCCESSORS) -> float:
    """The stream's entropy floor in nats, -sum(q log q): no model's expected loss is lower.

    >>> abs(floor(1)), round(floor(2), 4)          # one successor: no uncertainty; q = (2/3, 1/3)
    (0.0, 0.6365)
    """
    q = successor_probabilities(successors)
    return float(-(q * q.log()).sum())


class TokenStream:
    """Fresh (ids, targets) batches from one fixed stochastic token map, with its entropy floor.

    ``vocab``, ``batch_size`` and ``seq_len`` are the case's sizes; ``seed`` draws the batches
    (the language is the same for every seed). Only ids below ``min(inputs, vocab)`` appear as
    inputs, so that each input's successors are seen often enough in a few hundred steps;
    targets range over the whole vocabulary.
    """

    def __init__(self, vocab: int, batch_size: int, seq_len: int, seed: int, device,
                 successors: int = SUCCESSORS, inputs: int = INPUTS):
        vocab, successors = int(vocab), int(successors)
        if successors < 1 or successors > vocab:
            raise ValueError("successors must be in 1..vocab (%d), got %d" % (vocab, successors))
        self.vocab, self.batch_size, self.seq_len = vocab, int(batch_size), int(seq_len)
        self.inputs = min(int(inputs), vocab)
        lang = torch.Generator().manual_seed(LANGUAGE_SEED)
        perm = torch.randperm(vocab, generator=lang)
        # row x: successors consecutive entries of one permutation, so distinct within the row
        rows = (torch.arange(self.inputs).unsqueeze(1) * successors + torch.arange(successors)) % vocab
        self.successors = perm[rows].to(device)
        self.q = successor_probabilities(successors)
        self.floor = floor(successors)
        self._q = self.q.to(device=device, dtype=torch.float32)
        self._gen = torch.Generator(device=device).manual_seed(int(seed) + 1)
        self.device = device

    def batch(self):
        """The next (ids, targets), each (batch_size, seq_len) int64 on the device."""
        shape = (self.batch_size, self.seq_len)
        ids = torch.randint(0, self.inputs, shape, device=self.device, generator=self._gen)
        j = torch.multinomial(self._q, ids.numel(), replacement=True, generator=self._gen).view(shape)
        return ids, self.successors[ids, j]
