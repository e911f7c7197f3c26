"""Tile-aware token rounding (SonicMoE, Algorithm 4).

After top-K routing each expert e has f_e tokens. Token rounding moves every count to a
multiple of the GEMM tile, so no tile of the grouped GEMMs is padded: an expert either drops
its lowest-scoring chosen tokens (round down) or takes the highest-scoring tokens that did not
choose it (round up). Each count changes by less than one tile.

This module decides the target counts; `routing.build_plan` picks the tokens, ranking chosen
tokens before unchosen ones (unchosen scores are biased by -1).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from sonicmoe_jax.core import validation


def round_counts(counts, *, tile: int, num_tokens: int, mode: str = "nearest", rng=None):
  """Target per-expert token counts after rounding.

  Args:
    counts: [E] int32, top-K token counts f_e.
    tile: the tile size (a power of two).
    num_tokens: T. An expert cannot take more than T tokens, so rounding up is only
      possible where ceil(f_e / tile) * tile <= T; elsewhere the expert rounds down.
    mode: "nearest" (NR-f: the closer multiple, ties down), "stochastic" (SR-f: up with
      probability (f_e mod tile) / tile; needs `rng`), "up", "down", or "balanced" (the
      experts with the largest remainders round up, as many as make the total closest to
      sum(f_e): total drift at most tile/2 when enough experts can round up).
    rng: a PRNG key, required for "stochastic".

  Returns:
    [E] int32 counts, each a multiple of `tile` and within one tile of `counts`.
  """
  validation.check_tile(tile)
  validation.check_choice("rounding", mode, validation.ROUNDING_MODES)
  counts = counts.astype(jnp.int32)
  down = (counts // tile) * tile
  remainder = counts - down
  up = jnp.where(remainder > 0, down + tile, down)
  can_round_up = up <= num_tokens

  if mode == "nearest":
    go_up = (up - counts) < remainder
  elif mode == "stochastic":
    if rng is None:
      raise ValueError("rounding='stochastic' needs a PRNG key: pass rng=jax.random.key(...)")
    go_up = jax.random.uniform(rng, counts.shape) * tile < remainder
  elif mode == "up":
    go_up = remainder > 0
  elif mode == "down":
    go_up = jnp.zeros_like(can_round_up)
  else:  # balanced
    go_up = _balanced_round_up(remainder, can_round_up, tile)
  return jnp.where(go_up & can_round_up, up, down)


def _balanced_round_up(remainder, can_round_up, tile: int):
  """Round up the m experts with the largest remainders, m = round(sum(remainder) / tile)."""
  num_up = (jnp.sum(remainder) + tile // 2) // tile
  eligible = (remainder > 0) & can_round_up
  key = jnp.where(eligible, remainder, -1)
  rank = jnp.argsort(jnp.argsort(-key, stable=True), stable=True)  # 0 = largest remainder
  return eligible & (rank < num_up)
