"""The host side of the grouped-GEMM kernels, shared by their three schedules (grouped_gemm.py,
pingpong.py, persistent.py): operand checks that name the limit a shape misses
(*_unsupported, returning a sentence or None) and the XLA FFI calls that run a kernel on
checked operands (*_call: the operands and outputs, the modes in which the kernel sees them,
the buffers it writes in place). Nothing here runs on the GPU.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from ffi import xla_call
from ffi.epilogue import EPI_TILE
from ffi.mainloop import BLOCK_K, BLOCK_M
from sonicmoe_jax.core import routing

MAX_GRID_Y = 65535          # CUDA's limit on the grid's second dimension (the M tiles)
MAX_REGISTER_ADDRESSED = 2**31 - 1   # elements of an operand read or written by 32-bit offsets
ROW_MODES = (1, 2, 0)       # how the kernel sees a [1, P, C] operand: (P, C, 1)
WGMMA_MAX_N = 256           # the widest N of one Hopper wgmma: dH's widest column tile


def tma_gather_config(tma_gather: bool, gather_index, name: str) -> dict:
  """The kernel option of tma_gather=True ({} for the default, which the FFI targets leave
  out); ValueError where there are no rows to gather."""
  if tma_gather and gather_index is None:
    raise ValueError(f"cute {name}: tma_gather loads gathered rows; it needs gather_index")
  return dict(tma_gather=True) if tma_gather else {}


def warp_specialized_config(warp_specialized: bool, gather_index=None) -> dict:
  """The kernel option of a non-gathering kernel's warp_specialized=True ({} for the default,
  which the FFI targets leave out; the gathering kernels always have their producer)."""
  return dict(warp_specialized=True) if warp_specialized and gather_index is None else {}


def band_config(band_m_tiles: int, name: str) -> dict:
  """The kernel option of a tile order in bands of band_m_tiles M tiles ({} for 0, the launch
  order, which the FFI targets leave out); ValueError naming the argument otherwise."""
  if type(band_m_tiles) is not int or band_m_tiles < 0:   # (not a bool or a float)
    raise ValueError(f"cute {name}: band_m_tiles must be an int >= 0 (0: launch order); got "
                     f"{band_m_tiles!r}")
  return dict(band_m_tiles=band_m_tiles) if band_m_tiles else {}


def _dtype_unsupported(lhs, rhs):
  if lhs.dtype not in (jnp.bfloat16, jnp.float16) or rhs.dtype != lhs.dtype:
    return f"lhs and rhs must both be bfloat16 or float16; got {lhs.dtype} and {rhs.dtype}"
  return None


def unsupported(lhs, rhs, block_n: int, cols=None, clipped_last_tile: bool = False):
  """Why these operands cannot run (a sentence naming the limit), or None; cols=(lo, hi): the
  window of output columns made (grouped_matmul's). clipped_last_tile: the kernel's last
  column tile may reach past the output columns (TMA zero-fills its loads and clips its
  stores there), which need then only be a multiple of EPI_TILE's columns."""
  reason = _dtype_unsupported(lhs, rhs)
  if reason:
    return reason
  if lhs.ndim != 2 or rhs.ndim != 3 or rhs.shape[1] != lhs.shape[1]:
    return f"need lhs [P, K] and rhs [E, K, N]; got {lhs.shape} and {rhs.shape}"
  if lhs.shape[0] % BLOCK_M:
    return f"rows P={lhs.shape[0]} must be a multiple of {BLOCK_M} (an aligned plan)"
  if lhs.shape[1] % BLOCK_K:
    return f"contraction K={lhs.shape[1]} must be a multiple of {BLOCK_K}"
  lo, hi = (0, rhs.shape[2]) if cols is None else cols
  col_align = 16 // rhs.dtype.itemsize   # the window's first column: a 16-byte TMA address
  if not (0 <= lo < hi <= rhs.shape[2] and lo % col_align == 0):
    return (f"cols={cols} must be a range within the {rhs.shape[2]} output columns starting at a "
            f"multiple of {col_align}")
  if clipped_last_tile and (hi - lo) % EPI_TILE[1]:
    return f"output columns N={hi - lo} must be a multiple of {EPI_TILE[1]}"
  if not clipped_last_tile and (hi - lo) % block_n:
    return f"output columns N={hi - lo} must be a multiple of block_n={block_n}"
  if block_n % EPI_TILE[1]:
    return f"block_n={block_n} must be a multiple of {EPI_TILE[1]}"
  if lhs.shape[0] // BLOCK_M > MAX_GRID_Y:
    return f"rows P={lhs.shape[0]} exceed {MAX_GRID_Y * BLOCK_M} (the grid's M tiles)"
  return None


def column_tiles(num_cols: int, block_n: int) -> int:
  """The column tiles of an output num_cols wide: the last one clipped where block_n does not
  divide num_cols (the kernels' TMA loads past the columns fill zeros, their TMA stores past
  them write nothing)."""
  return -(-num_cols // block_n)


def rhs_as_ekn(rhs, transpose_rhs: bool):
  """rhs's shape as [E, K, N] (with transpose_rhs it is stored [E, N, K])."""
  if not transpose_rhs:
    return rhs
  return jax.ShapeDtypeStruct((rhs.shape[0], rhs.shape[2], rhs.shape[1]), rhs.dtype)


def matmul_call(kernel, lhs, rhs, tile_expert, transpose_rhs: bool, cols=None,
                gather_index=None, slot_tiles=None, **config):
  """out [P, N] of a grouped-matmul kernel (grouped_matmul's operands, checked by the
  caller) as an FFI call; cols=(lo, hi): out [P, hi - lo], the product's columns lo .. hi - 1
  (the kernel views rhs from column lo: rhs_window); with gather_index [P] the kernel reads
  lhs's rows through it (a gathering kernel: its operand after tile_expert); with slot_tiles
  (schedule.pair_slots) the kernel takes its M tiles in that table's pairs (its operand after
  tile_expert)."""
  num_cols = rhs_as_ekn(rhs, transpose_rhs).shape[2]
  lo, hi = (0, num_cols) if cols is None else cols
  if lo:
    config["first_col"] = lo
  index = tuple(i.astype(jnp.int32) for i in (gather_index, slot_tiles) if i is not None)
  # the kernel sees rhs as (N, K, E): [E, K, N] is N-major there, [E, N, K] K-major
  out, = xla_call.call(
      kernel, [lhs[None], rhs, tile_expert.astype(jnp.int32), *index],
      [jax.ShapeDtypeStruct((1, rows_read(lhs, gather_index).shape[0], hi - lo), lhs.dtype)],
      modes=[ROW_MODES, (1, 2, 0) if transpose_rhs else (2, 1, 0), None,
             *([None] * len(index)), ROW_MODES], **config)
  return out[0]


def rows_read(rows, gather_index):
  """The [P, C] rows a kernel reads: `rows` itself, or the gather_index [P] rows of it."""
  num_slots = rows.shape[0] if gather_index is None else gather_index.shape[0]
  return jax.ShapeDtypeStruct((num_slots, rows.shape[1]), rows.dtype)


def up_proj_call(kernels, xg, w1, tile_expert, gather_index, **config):
  """(H, A) of an up-projection kernel (up_proj's operands, checked by the caller) as an FFI
  call: kernels = (reading xg's rows, gathering them by gather_index)."""
  num_slots, n = rows_read(xg, gather_index).shape[0], w1.shape[2] // 2
  index = () if gather_index is None else (gather_index.astype(jnp.int32),)
  h, a = xla_call.call(
      kernels[len(index)], [xg[None], w1, tile_expert.astype(jnp.int32), *index],
      [jax.ShapeDtypeStruct((1, num_slots, 2 * n), xg.dtype),
       jax.ShapeDtypeStruct((1, num_slots, n), xg.dtype)],
      modes=[ROW_MODES, (2, 1, 0), None, *[None] * len(index), ROW_MODES, ROW_MODES], **config)
  return h[0], a[0]


def dh_unsupported(dout_g, w2, h, scores, block_n: int, clipped_last_tile: bool = False):
  """Why the dH kernels cannot run these operands (a sentence naming the limit), or None:
  dOg [P, d] (the rows read), w2 [E, n, d], H [P, 2n], scores [P]. clipped_last_tile: the
  kernel loads H's tiles and stores its outputs by TMA (unsupported's), addressing them by
  coordinates a dimension each: H may then pass 2^31 elements."""
  n, num_slots = w2.shape[1], dout_g.shape[0]
  if block_n > WGMMA_MAX_N:
    return f"block_n={block_n} is wider than {WGMMA_MAX_N} (one wgmma's widest N)"
  reason = unsupported(dout_g, jax.ShapeDtypeStruct((w2.shape[0], w2.shape[2], n), w2.dtype),
                       block_n, clipped_last_tile=clipped_last_tile)
  if reason:
    return reason
  if h.shape != (num_slots, 2 * n) or h.dtype != dout_g.dtype or scores.shape != (num_slots,):
    return (f"need H [{num_slots}, {2 * n}] in {dout_g.dtype} and scores [{num_slots}]; got "
            f"{h.shape} {h.dtype} and {scores.shape}")
  if h.size > MAX_REGISTER_ADDRESSED and not clipped_last_tile:
    return (f"H [{h.shape[0]}, {h.shape[1]}] has {h.size} elements; the epilogue addresses H, "
            f"dH and A' with 32-bit offsets (at most {MAX_REGISTER_ADDRESSED}): split the batch, "
            f"or load H and store the outputs by TMA (grouped_gemm.dh's h_smem and tma_store)")
  return None


def dh_call(kernels, dout_g, w2, h, scores, tile_expert, gather_index, over_h: bool, *,
            block_n: int, **config):
  """(dH, A', dS parts) of a dH kernel (dh's operands, checked by the caller) as an FFI call:
  kernels = (reading dOg's rows, gathering dO's by gather_index). With over_h, dH is written
  over H's buffer (each thread reads its fragments of H before it writes dH's there, and no
  other thread touches them); XLA copies H first where H is used later or is an argument of
  the jitted program (which per-kernel timings should avoid: over_h False)."""
  n, num_slots = w2.shape[1], h.shape[0]
  index = () if gather_index is None else (gather_index.astype(jnp.int32),)
  dh_, a_scaled, ds_parts = xla_call.call(
      kernels[len(index)], [dout_g[None], w2, tile_expert.astype(jnp.int32), *index, h[None],
                            scores.astype(jnp.float32)],
      [jax.ShapeDtypeStruct((1, num_slots, 2 * n), h.dtype),
       jax.ShapeDtypeStruct((1, num_slots, n), h.dtype),
       jax.ShapeDtypeStruct((column_tiles(n, block_n), num_slots), jnp.float32)],
      in_place={3 + len(index): 0} if over_h else None,
      modes=[ROW_MODES, (1, 2, 0), None, *[None] * len(index), ROW_MODES, None, ROW_MODES,
             ROW_MODES, None],
      block_n=block_n, **config)
  return dh_[0], a_scaled[0], ds_parts


def weight_grad_unsupported(lhs, rhs, group_offsets, num_experts, block_n, group_sizes=None,
                            clipped_last_tile: bool = False):
  """Why weight_grad cannot run these operands (a sentence naming the limit), or None.
  clipped_last_tile: the kernel loads both operands by TMA, so that its last M and column
  tiles may reach past M and N (zeros loaded, nothing stored there), which need then only be
  multiples of EPI_TILE's columns."""
  reason = _dtype_unsupported(lhs, rhs)
  if reason:
    return reason
  if lhs.ndim != 2 or rhs.ndim != 2 or rhs.shape[0] != lhs.shape[0]:
    return f"need lhs [P, M] and rhs [P, N]; got {lhs.shape} and {rhs.shape}"
  if lhs.shape[0] % BLOCK_M:
    return f"rows P={lhs.shape[0]} must be a multiple of {BLOCK_M} (an aligned plan)"
  if block_n % EPI_TILE[1]:
    return f"block_n={block_n} must be a multiple of {EPI_TILE[1]}"
  if clipped_last_tile:   # (name, width, its multiple, how the multiple is named)
    limits = [("lhs columns M", lhs.shape[1], EPI_TILE[1], EPI_TILE[1]),
              ("rhs columns N", rhs.shape[1], EPI_TILE[1], EPI_TILE[1])]
  else:
    limits = [("lhs columns M", lhs.shape[1], BLOCK_M, BLOCK_M),
              ("rhs columns N", rhs.shape[1], block_n, f"block_n={block_n}")]
  for name, width, multiple, said in limits:
    if width % multiple:
      return f"{name}={width} must be a multiple of {said}"
  if group_offsets.shape != (num_experts + 1,):
    return f"group_offsets must be [{num_experts + 1}]; got {group_offsets.shape}"
  return routing.group_sizes_mismatch(group_sizes, num_experts)


def weight_grad_call(kernels, lhs, rhs, group_rows, num_experts: int, gather_index,
                     transpose_out: bool, tile_counter: bool = False, **config):
  """out [E, M, N] (with transpose_out [E, N, M]) of a weight-gradient kernel (weight_grad's
  operands, checked by the caller; group_rows from routing.group_row_ranges) as an FFI call:
  kernels = (reading lhs's rows, gathering them by gather_index; None where a kernel has no
  such variant). tile_counter: the kernel takes one more operand after the index, an Int32
  counter starting at 0 that it counts up in place (a dynamic tile order's)."""
  M, N = lhs.shape[1], rhs.shape[1]
  rows_last = (2, 1, 0)   # [1, P, C] -> (C, P, 1): C contiguous
  if gather_index is None:
    lhs_mode, index = rows_last, ()
  else:   # X as (T, M, 1), like up_proj's gather source
    lhs_mode, index = ROW_MODES, (gather_index.astype(jnp.int32),)
  # out [E, M, N] seen as (M, N, E) N-major, or [E, N, M] as (M, N, E) M-major
  out_shape, out_mode = ((num_experts, N, M), rows_last) if transpose_out else ((num_experts, M, N), ROW_MODES)
  inputs = [lhs[None], rhs[None], group_rows, *index]
  in_modes = [lhs_mode, rows_last, None, *[None] * len(index)]
  outputs, out_modes = [jax.ShapeDtypeStruct(out_shape, lhs.dtype)], [out_mode]
  in_place = None
  if tile_counter:   # written in place: XLA gives the kernel a fresh zero each call
    in_place = {len(inputs): 1}
    inputs.append(jnp.zeros((1,), jnp.int32))
    in_modes.append(None)
    outputs.append(jax.ShapeDtypeStruct((1,), jnp.int32))
    out_modes.append(None)
  return xla_call.call(kernels[len(index)], inputs, outputs, modes=in_modes + out_modes,
                       in_place=in_place, **config)[0]
