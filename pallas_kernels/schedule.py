"""Which expert owns each M tile: computed once per plan in XLA, read by the kernels."""
from __future__ import annotations

import jax.numpy as jnp


def tile_experts(plan, block_m: int):
  """[num_slots // block_m] int32: the expert whose aligned group holds each tile, or E for
  tiles past the last group (the kernels write zeros there)."""
  if plan.align % block_m:
    raise ValueError(f"plan rows must be aligned to the kernel tile {block_m}; got align={plan.align}")
  starts = jnp.arange(plan.num_slots // block_m, dtype=jnp.int32) * block_m
  return jnp.searchsorted(plan.group_offsets[1:], starts, side="right").astype(jnp.int32)
