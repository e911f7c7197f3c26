"""Argument checks shared by the public API: each error names the argument and the limit."""
from __future__ import annotations

import jax.numpy as jnp

FLOAT_DTYPES = (jnp.bfloat16, jnp.float16, jnp.float32)
SCORE_FUNCTIONS = ("softmax_topk", "softmax_all")
ROUNDING_MODES = ("nearest", "stochastic", "up", "down", "balanced")
MAX_TILE = 1024


def check_rank(name: str, array, rank: int, layout: str) -> None:
  if array.ndim != rank:
    raise ValueError(f"{name} must have rank {rank} ({layout}); got shape {tuple(array.shape)}")


def check_float_dtype(name: str, array) -> None:
  if not any(array.dtype == jnp.dtype(d) for d in FLOAT_DTYPES):
    allowed = ", ".join(jnp.dtype(d).name for d in FLOAT_DTYPES)
    raise TypeError(f"{name} must have a floating dtype ({allowed}); got {array.dtype}")


def check_dim(name: str, got: int, want: int, what: str) -> None:
  if got != want:
    raise ValueError(f"{name}: {what} must be {want}; got {got}")


def check_k(k, num_experts: int) -> None:
  if not isinstance(k, int) or isinstance(k, bool):
    raise TypeError(f"k must be a Python int; got {type(k).__name__}")
  if not 1 <= k <= num_experts:
    raise ValueError(f"k must satisfy 1 <= k <= E (number of experts = {num_experts}); got k={k}")


def check_tile(tile, name: str = "tile") -> None:
  if not isinstance(tile, int) or isinstance(tile, bool):
    raise TypeError(f"{name} must be a Python int; got {type(tile).__name__}")
  if tile < 1 or tile > MAX_TILE or tile & (tile - 1):
    raise ValueError(f"{name} must be a power of two in [1, {MAX_TILE}]; got {tile}")


def check_choice(name: str, value, choices) -> None:
  if value not in choices:
    raise ValueError(f"{name} must be one of {', '.join(map(repr, choices))}; got {value!r}")
