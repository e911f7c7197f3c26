"""Which group owns each M tile: computed once per plan in XLA, read by the kernels."""
from __future__ import annotations

import jax.numpy as jnp

from sonicmoe_jax.core import routing


def tile_owners(group_offsets, num_rows: int, block_m: int):
  """[num_rows // block_m] int32: the group whose rows (group_offsets[g] .. group_offsets[g+1],
  starts multiples of block_m) hold each tile, or G for tiles past the last group (the kernels
  write zeros there)."""
  starts = jnp.arange(num_rows // block_m, dtype=jnp.int32) * block_m
  return routing.group_of_slot(group_offsets, starts)


def _check_aligned(plan, rows: int, what: str):
  """ValueError unless the plan's groups start on multiples of `rows` (the kernel's `what`)."""
  if plan.align % rows:
    raise ValueError(f"plan rows must be aligned to the {what} {rows}; got align={plan.align}")


def tile_experts(plan, block_m: int):
  """tile_owners of a routing plan: the expert of each M tile, E past the last group."""
  _check_aligned(plan, block_m, "kernel tile")
  return tile_owners(plan.group_offsets, plan.num_slots, block_m)


def pair_slot_entries(num_tiles: int, num_groups: int) -> int:
  """pair_slots' slots (before its count): num_tiles M tiles, at most one more for each of the
  num_groups groups and the rows past them, rounded up to whole pairs."""
  return -(-(num_tiles + num_groups + 1) // 2) * 2


def pair_slots(tile_owner, num_groups: int):
  """M tiles in pairs of one owner, for kernels whose clusters of 2 CTAs share a group's rhs:
  each group's tiles in order (tile_owner ascending, num_groups or more past the last group,
  whose tiles count as one more group), an odd count's last tile twice (both CTAs of that pair
  compute it and store the same bits). Returns [pair_slot_entries + 1] int32: slot s's M tile
  (0 past the last pair), then the count of pairs."""
  num_tiles = tile_owner.shape[0]
  owner = jnp.minimum(tile_owner.astype(jnp.int32), num_groups)
  counts = jnp.zeros((num_groups + 1,), jnp.int32).at[owner].add(1)
  first_tile = jnp.cumsum(counts) - counts
  padded = counts + counts % 2
  slot_ends = jnp.cumsum(padded)
  slot = jnp.arange(pair_slot_entries(num_tiles, num_groups), dtype=jnp.int32)
  group = routing.count_below(slot_ends, slot, inclusive=True)   # num_groups + 1: past the last
  used = group <= num_groups
  group = jnp.minimum(group, num_groups)
  in_group = slot - (slot_ends - padded)[group]
  tile = first_tile[group] + jnp.minimum(in_group, counts[group] - 1)
  return jnp.concatenate([jnp.where(used, tile, 0),
                          (slot_ends[-1] // 2)[None]]).astype(jnp.int32)


ROW_TILE_FIELDS = 3   # a row tile's entry: (first row, group, rows to store)


def row_tile_entries(num_rows: int, num_groups: int, tile_m: int) -> int:
  """row_tiles' entries: enough for num_rows rows cut at tile_m and at each of num_groups + 1
  part starts (each part's last tile may be partial)."""
  return -(-num_rows // tile_m) + num_groups + 1


def row_tiles(group_offsets, num_rows: int, tile_m: int):
  """Tiles of tile_m rows that need not start on a multiple of tile_m: each group's rows
  (group_offsets[g] .. group_offsets[g+1]) cut from its start, then the rows past the last
  group (group G: the kernels store zeros there), the last tile of each clipped at its end.
  Returns [ROW_TILE_FIELDS * row_tile_entries(num_rows, G, tile_m)] int32, tile i's (first row,
  group, rows to store) at 3 i .. 3 i + 2; entries past the last tile have group G and 0 rows
  (nothing to load or store). A kernel storing blocks of rows needs the offsets and num_rows
  multiples of its block (plan_row_tiles checks a plan's)."""
  num_groups = group_offsets.shape[0] - 1
  starts = group_offsets.astype(jnp.int32)                        # G + 1: the tail's start last
  ends = jnp.concatenate([starts[1:], jnp.full((1,), num_rows, jnp.int32)])
  sizes = ends - starts
  counts = (sizes + tile_m - 1) // tile_m                         # each part's tiles
  tile_ends = jnp.cumsum(counts)
  tile = jnp.arange(row_tile_entries(num_rows, num_groups, tile_m), dtype=jnp.int32)
  part = routing.count_below(tile_ends, tile, inclusive=True)     # G + 1: past the last tile
  used = part <= num_groups
  part = jnp.minimum(part, num_groups)
  row0 = (tile - (tile_ends - counts)[part]) * tile_m             # in its part
  first_row = jnp.where(used, starts[part] + row0, 0)
  rows = jnp.where(used, jnp.minimum(sizes[part] - row0, tile_m), 0)
  return jnp.stack([first_row, part, rows], axis=1).reshape(-1).astype(jnp.int32)


def plan_row_tiles(plan, tile_m: int, row_block: int):
  """row_tiles of a routing plan whose kernel stores blocks of row_block rows: the plan's
  groups must start on multiples of row_block (else a group's last block would reach into the
  next group's rows, which another tile stores)."""
  _check_aligned(plan, row_block, "kernel's row block")
  return row_tiles(plan.group_offsets, plan.num_slots, tile_m)
