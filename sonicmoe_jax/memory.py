"""Memory: what a function keeps for its backward pass (the residuals of jax.vjp), and how much
of the GPU JAX may take."""
from __future__ import annotations

import dataclasses
import os

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


# JAX reserves 75% of each GPU up front by default. A layer whose weights, their gradients and
# the step need more (a DeepSeek-V3-size layer, T = 16384, d = 7168, n = 2048, E = 256, K = 8,
# holds 45 GB of bf16 weights and gradients and a 23 GiB step) runs out of memory on an 80 GB
# card with that default.
GPU_MEMORY_FRACTION = 0.95


def take_gpu_memory_as_needed(fraction: float = GPU_MEMORY_FRACTION) -> None:
  """Lets this process's JAX take up to `fraction` of each GPU, as it needs it (no reservation
  up front), where the environment does not say otherwise (XLA_PYTHON_CLIENT_MEM_FRACTION and
  XLA_PYTHON_CLIENT_PREALLOCATE, which the user's settings keep). JAX reads them when it first
  uses the GPU: call this before that (first thing in a program's main)."""
  if not 0 < fraction <= 1:
    raise ValueError(f"fraction must be in (0, 1]; got {fraction}")
  os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
  os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", str(fraction))
