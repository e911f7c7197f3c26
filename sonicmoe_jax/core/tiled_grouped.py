"""Grouped GEMMs as batched GEMMs over row tiles: the xla backend's GPU formulation.

XLA's GPU compiler rewrites `jax.lax.ragged_dot` into a dense product over every group (the
rows zero-padded per group and multiplied by all E weights), which takes E times the memory
and FLOPs and fails autotuning at production sizes. Here the rows are laid out again so that
each group starts on a multiple of TILE rows (every tile then belongs to one group), and the
product runs as batched GEMMs of tiles against their groups' weights, a chunk of tiles at a
time (lax.map), so that one chunk's gathered weights take at most chunk_bytes:

  grouped_matmul(lhs [P, K], rhs [G, K, N], sizes [G]) -> [P, N] float32
      out[r] = lhs[r] @ rhs[g] for the rows r of group g (groups laid out from row 0; rows
      past the last group give zeros), as jax.lax.ragged_dot;
  grouped_weight_grad(lhs [P, K], rhs [P, N], sizes [G]) -> [G, K, N] float32
      out[g] = lhs_g^T rhs_g over group g's rows, as ragged_dot_general with ragged K.

FLOPs are the math's plus at most one tile of padding rows per group; each tile reads its
group's weights once (the weight traffic of the matmul is tiles x K x N). Plain jnp ops:
differentiable, and vmap and shard_map apply as to any JAX code.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from sonicmoe_jax.core import routing
from sonicmoe_jax.core.varying import vary_like

_F32 = jnp.float32

TILE = 128              # rows per tile (a group's rows start on a multiple of it)
# what one chunk's gathered weights (matmul) or per-tile products (weight grad) take at most
CHUNK_BYTES = 1 << 28


class _Layout:
  """Where each of P rows of `sizes` groups goes in the tiled layout: `position[r]` its row
  there (num_tiles * TILE for rows past the last group), `tile_group[t]` each tile's group
  (G for tiles past the last group). The groups are found by routing.group_of_slot (an
  unrolled search: no device loop)."""

  def __init__(self, num_rows: int, sizes):
    num_groups = sizes.shape[0]
    starts = routing.exclusive_cumsum(sizes)                        # [G+1]
    tiled_starts = routing.aligned_offsets(sizes.astype(jnp.int32), TILE)   # [G+1]
    # each group adds at most one partly filled tile
    self.num_tiles = -(-num_rows // TILE) + num_groups
    rows = jnp.arange(num_rows, dtype=jnp.int32)
    group = routing.group_of_slot(starts, rows)
    g = jnp.minimum(group, num_groups - 1)
    self.position = jnp.where(group < num_groups, tiled_starts[g] + rows - starts[g],
                              self.num_tiles * TILE)
    self.tile_group = routing.group_of_slot(
        tiled_starts, jnp.arange(self.num_tiles, dtype=jnp.int32) * TILE)

  def tiles(self, a):
    """a [P, C] laid out as [num_tiles, TILE, C] (zeros where no row goes)."""
    out = jnp.zeros((self.num_tiles * TILE, a.shape[1]), a.dtype)
    return out.at[self.position].set(a, mode="drop").reshape(self.num_tiles, TILE, a.shape[1])

  def rows(self, tiled):
    """The inverse of tiles: [num_tiles, TILE, C] back to the P rows (zeros past the groups)."""
    flat = tiled.reshape(-1, tiled.shape[-1])
    return flat.at[self.position].get(mode="fill", fill_value=0)


def _chunking(num_tiles: int, bytes_per_tile: int, chunk_bytes: int) -> tuple[int, int]:
  """(chunks, tiles per chunk): as many tiles a chunk as chunk_bytes holds."""
  per_chunk = max(1, min(num_tiles, chunk_bytes // max(1, bytes_per_tile)))
  return -(-num_tiles // per_chunk), per_chunk


def _split(a, num_chunks: int, per_chunk: int, fill=0):
  """[num_tiles, ...] as [num_chunks, per_chunk, ...], the last chunk padded with `fill`."""
  pad = num_chunks * per_chunk - a.shape[0]
  a = jnp.pad(a, [(0, pad)] + [(0, 0)] * (a.ndim - 1), constant_values=fill)
  return a.reshape(num_chunks, per_chunk, *a.shape[1:])


def grouped_matmul(lhs, rhs, sizes, *, chunk_bytes: int = CHUNK_BYTES):
  """out[r] = lhs[r] @ rhs[g] for the rows r of group g, float32 (see module docstring)."""
  num_groups, k, n = rhs.shape
  layout = _Layout(lhs.shape[0], sizes)
  chunking = _chunking(layout.num_tiles, k * n * rhs.dtype.itemsize, chunk_bytes)

  def chunk(args):
    tiles, groups = args
    weights = rhs.at[groups].get(mode="fill", fill_value=0)            # [chunk, K, N]
    return jnp.einsum("tmk,tkn->tmn", tiles, weights, preferred_element_type=_F32)
  out = jax.lax.map(chunk, (_split(layout.tiles(lhs), *chunking),
                            _split(layout.tile_group, *chunking, fill=num_groups)))
  return layout.rows(out.reshape(-1, TILE, n)[:layout.num_tiles])


def grouped_weight_grad(lhs, rhs, sizes, *, chunk_bytes: int = CHUNK_BYTES):
  """out[g] = lhs_g^T rhs_g over group g's rows, [G, K, N] float32 (see module docstring)."""
  num_groups, k, n = sizes.shape[0], lhs.shape[1], rhs.shape[1]
  layout = _Layout(lhs.shape[0], sizes)
  chunking = _chunking(layout.num_tiles, k * n * 4, chunk_bytes)

  def step(total, args):
    lhs_tiles, rhs_tiles, groups = args
    products = jnp.einsum("tmk,tmn->tkn", lhs_tiles, rhs_tiles, preferred_element_type=_F32)
    return total.at[groups].add(products, mode="drop"), None
  chunks = (_split(layout.tiles(lhs), *chunking), _split(layout.tiles(rhs), *chunking),
            _split(layout.tile_group, *chunking, fill=num_groups))
  # (the sum starts varying over the mesh axes its terms vary over, inside shard_map)
  total = vary_like(jnp.zeros((num_groups, k, n), _F32), lhs, rhs, sizes)
  total, _ = jax.lax.scan(step, total, chunks)
  return total
