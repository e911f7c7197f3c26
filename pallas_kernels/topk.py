"""Router top-K as one Mosaic GPU kernel: each CTA takes BLOCK_T tokens' logits into registers
and finds their k largest experts by k rounds of (row max, lowest index at the max, mask it).

Tiling: token block b reads logits[b*BLOCK_T : (b+1)*BLOCK_T, :E] by one TMA copy into SMEM,
then into registers in the wgmma row layout (a row is spread over 4 threads, so a row max is
two shuffles). Floats are compared as order-preserving int32 keys, so -inf logits stay
selectable and a taken expert is masked with INT32_MIN, below every key. Results of round j
land in column j of a [BLOCK_T, k_pad] tile (k rounded up to the layout's 8 columns) that one
TMA store writes back. Same result as jax.lax.top_k, ties included (the lower expert first).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels import config as cfg_lib

BLOCK_T = 64          # tokens per CTA: the rows of one warpgroup's wgmma layout
COLUMN_TILE = 8       # the layout's column tile: E and the output width are multiples of it
MAX_EXPERTS = 256     # a [64, E] block is E / 2 registers per thread (keys) plus the
                      # expert iota; 256 is the largest E tested on a GPU
_INT_MIN = jnp.iinfo(jnp.int32).min


def unsupported(num_experts: int, k: int):
  """Why this kernel cannot take logits with this many experts and this k, or None."""
  if num_experts % COLUMN_TILE:
    return f"E={num_experts} is not a multiple of {COLUMN_TILE}"
  if num_experts > MAX_EXPERTS:
    return f"E={num_experts} is above {MAX_EXPERTS}"
  if k > num_experts:
    return f"k={k} is above E={num_experts}"
  return None


def _ordered_key(x):
  """int32 keys in the order of the float32 values (negative floats: flip the magnitude bits)."""
  bits = jax.lax.bitcast_convert_type(x, jnp.int32)
  return jnp.where(bits < 0, bits ^ jnp.int32(0x7FFFFFFF), bits)


def _key_value(key):
  """The float32 value of an _ordered_key (the map is its own inverse)."""
  return jax.lax.bitcast_convert_type(jnp.where(key < 0, key ^ jnp.int32(0x7FFFFFFF), key),
                                      jnp.float32)


def _smem(shape, dtype):
  """An SMEM tile the wgmma layout loads and stores without bank conflicts (swizzled)."""
  if cfg_lib.interpret_mode() is not None:
    return plgpu.SMEM(shape, dtype)
  return plgpu.SMEM(shape, dtype, transforms=cfg_lib.swizzled_tile(shape[1], dtype))


def _iota(shape, dim):
  layout = None if cfg_lib.interpret_mode() is not None else plgpu.Layout.WGMMA
  if layout is None:
    return jax.lax.broadcasted_iota(jnp.int32, shape, dim)
  return plgpu.broadcasted_iota(jnp.int32, shape, dim, layout=layout)


def _select_round(keys, experts, num_experts: int):
  """One round: each row's largest key and its lowest expert; that expert is masked."""
  best = jnp.max(keys, axis=1)
  at_best = keys == jax.lax.broadcast_in_dim(best, keys.shape, (0,))
  expert = jnp.min(jnp.where(at_best, experts, num_experts), axis=1)
  taken = experts == jax.lax.broadcast_in_dim(expert, keys.shape, (0,))
  return jnp.where(taken, _INT_MIN, keys), best, expert


def _place_column(tile, column, j, row_values):
  """tile[:, j] = row_values (a register tile has no column stores)."""
  return jnp.where(column == j, jax.lax.broadcast_in_dim(row_values, tile.shape, (0,)), tile)


def top_k(logits, k: int):
  """(values [T, k] f32, experts [T, k] int32) of the k largest logits per row, as jax.lax.top_k.

  logits: [T, E] float32, E a multiple of 8 and at most 256 (see `unsupported`).
  """
  num_tokens, num_experts = logits.shape
  reason = unsupported(num_experts, k)
  if reason:
    raise ValueError(f"pallas top_k: {reason}")
  if logits.dtype != jnp.float32:
    raise TypeError(f"pallas top_k: logits must be float32; got {logits.dtype}")
  padded_tokens = pl.cdiv(num_tokens, BLOCK_T) * BLOCK_T
  if padded_tokens != num_tokens:
    logits = jnp.pad(logits, ((0, padded_tokens - num_tokens), (0, 0)))
  k_pad = pl.cdiv(k, COLUMN_TILE) * COLUMN_TILE
  tile_shape = (BLOCK_T, num_experts)
  out_shape = (BLOCK_T, k_pad)

  def body(logits_gmem, values_gmem, experts_gmem):
    rows = pl.ds(jax.lax.axis_index("block") * BLOCK_T, BLOCK_T)

    def scoped(logits_smem, values_smem, experts_smem, loaded):
      plgpu.copy_gmem_to_smem(logits_gmem.at[rows], logits_smem, loaded)
      plgpu.barrier_wait(loaded)
      if cfg_lib.interpret_mode() is None:
        x = plgpu.load(logits_smem, (), layout=plgpu.Layout.WGMMA)
      else:
        x = logits_smem[...]
      keys = _ordered_key(x)
      experts = _iota(tile_shape, 1)
      column = _iota(out_shape, 1)
      values = jnp.zeros(out_shape, jnp.int32)
      chosen = jnp.zeros(out_shape, jnp.int32)
      for j in range(k):
        keys, best, expert = _select_round(keys, experts, num_experts)
        values = _place_column(values, column, j, best)
        chosen = _place_column(chosen, column, j, expert)
      values_smem[...] = _key_value(values)
      experts_smem[...] = chosen
      plgpu.commit_smem()
      plgpu.copy_smem_to_gmem(values_smem, values_gmem.at[rows])
      plgpu.copy_smem_to_gmem(experts_smem, experts_gmem.at[rows])
      plgpu.wait_smem_to_gmem(0)

    pl.run_scoped(scoped, _smem(tile_shape, jnp.float32), _smem(out_shape, jnp.float32),
                  _smem(out_shape, jnp.int32), plgpu.Barrier())

  kernel = plgpu.kernel(
      body,
      out_type=(jax.ShapeDtypeStruct((padded_tokens, k_pad), jnp.float32),
                jax.ShapeDtypeStruct((padded_tokens, k_pad), jnp.int32)),
      grid=(padded_tokens // BLOCK_T,), grid_names=("block",),
      interpret=cfg_lib.interpret_mode())
  values, experts = kernel(logits)
  return values[:num_tokens, :k], experts[:num_tokens, :k]
