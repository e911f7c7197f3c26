"""A synthetic language the project generates itself (no downloads).

Tokens follow a fixed random sparse Markov chain of order 2: after each pair of tokens only a few
next tokens are likely. Its entropy rate is known exactly, so a training run can print how
close its loss gets to the best achievable loss.
"""
from __future__ import annotations

import dataclasses

import numpy as np


@dataclasses.dataclass(frozen=True)
class MarkovCorpus:
  vocab_size: int
  transitions: np.ndarray  # [V, V, V] float64: P(next | prev2, prev1)

  @classmethod
  def make(cls, vocab_size: int = 64, branching: int = 4, seed: int = 0) -> "MarkovCorpus":
    rng = np.random.default_rng(seed)
    v = vocab_size
    probs = np.zeros((v, v, v))
    for a in range(v):
      for b in range(v):
        nxt = rng.choice(v, size=branching, replace=False)
        probs[a, b, nxt] = rng.dirichlet(np.full(branching, 0.7))
    return cls(vocab_size, probs)

  def sample(self, num_sequences: int, length: int, seed: int) -> np.ndarray:
    """[num_sequences, length] int32 token sequences."""
    rng = np.random.default_rng(seed)
    v = self.vocab_size
    out = np.empty((num_sequences, length), np.int32)
    out[:, :2] = rng.integers(0, v, size=(num_sequences, 2))
    cdf = np.cumsum(self.transitions, axis=-1)
    for i in range(2, length):
      u = rng.random(num_sequences)[:, None]
      row = cdf[out[:, i - 2], out[:, i - 1]]
      out[:, i] = np.minimum((u > row).sum(-1), v - 1)
    return out

  def entropy_rate(self, num_sequences: int = 2048, seed: int = 1) -> float:
    """Monte-Carlo estimate of the conditional entropy (nats/token): the best achievable loss."""
    seq = self.sample(num_sequences, 66, seed)
    p = self.transitions[seq[:, :-2].reshape(-1), seq[:, 1:-1].reshape(-1)]  # [N, V]
    logp = np.log(np.where(p > 0, p, 1.0))
    return float(np.mean(-np.sum(p * logp, axis=-1)))
