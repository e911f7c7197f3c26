"""Which group owns each M tile: computed once per plan in XLA, read by the kernels."""
from __future__ import annotations

import jax.numpy as jnp

from sonicmoe_jax import routing


def tile_owners(group_offsets, num_rows: int, block_m: int):
  """[num_rows // block_m] int32: the group whose rows (group_offsets[g] .. group_offsets[g+1],
  starts multiples of block_m) hold each tile, or G for tiles past the last group (the kernels
  write zeros there)."""
  starts = jnp.arange(num_rows // block_m, dtype=jnp.int32) * block_m
  # the groups ending at or before each tile's start, by a binary search unrolled in Python
  # (jnp.searchsorted's is a while loop: on a GPU one host round trip per step)
  return routing.count_below(group_offsets[1:], starts, inclusive=True)


def tile_experts(plan, block_m: int):
  """tile_owners of a routing plan: the expert of each M tile, E past the last group."""
  if plan.align % block_m:
    raise ValueError(f"plan rows must be aligned to the kernel tile {block_m}; got align={plan.align}")
  return tile_owners(plan.group_offsets, plan.num_slots, block_m)
