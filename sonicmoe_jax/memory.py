"""Measuring what a function keeps for its backward pass (the residuals of jax.vjp)."""
from __future__ import annotations

import dataclasses

import numpy as np


@dataclasses.dataclass(frozen=True)
class Residual:
  shape: tuple
  dtype: str
  nbytes: int
  source: str  # "argument <name>" or the producing operation


def saved_residuals(fn, *args) -> list[Residual]:
  """The arrays JAX keeps between forward and backward when differentiating fn(*args).

  Uses JAX's residual analysis (the same one behind jax.ad_checkpoint.print_saved_residuals);
  residuals that are fn's own arguments are reported with source "argument ...".
  """
  from jax._src import ad_checkpoint  # the analysis is only exposed as a printer publicly
  out = []
  for aval, source in ad_checkpoint.saved_residuals(fn, *args):
    nbytes = int(np.prod(aval.shape, dtype=np.int64)) * np.dtype(aval.dtype).itemsize
    src = source.replace("from the argument", "argument")
    out.append(Residual(tuple(aval.shape), str(aval.dtype), nbytes, src))
  return out


def activation_bytes_bound(num_tokens: int, d: int, n: int, num_slots: int, itemsize: int = 2) -> int:
  """SonicMoE's bound on activations kept for backward: X [T, d] plus H [slots, 2n].

  With bf16 and plain top-K (slots = T K) this is 2Td + 4TKn bytes; the routing plan comes
  on top of it.
  """
  return itemsize * (num_tokens * d + num_slots * 2 * n)
