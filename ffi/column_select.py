"""Token rounding's selection as a CuTe DSL kernel: per expert, its counts[e] highest-ranked
tokens, as a threshold key and the row of the last tie taken.

Input: keys [E, T] int32, one row per expert: the ranking values' float32 bits as int32 keys in
the order of the values (negative floats with their magnitude bits flipped), so that each
expert's tokens are contiguous. Tiling: one CTA per expert, THREADS threads; thread i holds
rows i, i + THREADS, i + 2 THREADS, ... (per_thread keys in registers: T <= MAX_TOKENS), read
from memory once. Two searches on the registers, each step one block-wide count (each warp's
redux.sync add, the warps' sums through SMEM, double-buffered so that one barrier a step
suffices):
  1. over the 32-bit keys: the largest key v with count(keys >= v) >= counts[e] (the
     counts[e]-th largest key), 32 steps;
  2. over rows: with ties_needed = counts[e] - count(keys > v), the row of the
     ties_needed-th key equal to v (ties are taken in row order), ROW_STEPS steps.
Output per expert: v and that row (-1 where no tie is taken). The tokens selected are those
with keys > v, and those with keys == v in rows <= that row: exactly counts[e] of them, the
choice of a stable descending sort.
"""
from __future__ import annotations

import cutlass
import cutlass.cute as cute
import jax
import jax.numpy as jnp

from ffi import xla_call

THREADS = 1024
WARPS = THREADS // 32
MAX_PER_THREAD = 32          # keys a thread holds in registers
MAX_TOKENS = THREADS * MAX_PER_THREAD
ROW_STEPS = (MAX_TOKENS - 1).bit_length()   # a bisection over rows 0 .. MAX_TOKENS - 1
_KEY_MIN, _KEY_MAX = -2**31, 2**31 - 1
_MAGNITUDE_BITS = 0x7FFFFFFF


def unsupported(num_tokens: int):
  """Why the kernel cannot take this many tokens, or None."""
  if num_tokens > MAX_TOKENS:
    return f"T={num_tokens} is above {MAX_TOKENS} ({MAX_PER_THREAD} keys per thread)"
  return None


def ordered_keys(values):
  """int32 keys in the order of the float32 values (finite; -0.0 ties with 0.0)."""
  values = values.astype(jnp.float32)
  bits = jax.lax.bitcast_convert_type(jnp.where(values == 0, 0.0, values), jnp.int32)
  return jnp.where(bits < 0, bits ^ _MAGNITUDE_BITS, bits)


@cute.jit
def _block_sum(value, partials: cute.Tensor, parity):
  """The sum of value over the CTA's threads (every thread gets it). parity alternates
  between consecutive calls: the warps' sums of one call and of the next use different halves
  of `partials`, so a thread still reading one call's sums is never overwritten."""
  warp_sum = cute.arch.warp_redux_sync(value, "add")
  warp = cute.arch.make_warp_uniform(cute.arch.warp_idx())
  if cute.arch.lane_idx() == 0:
    partials[parity * WARPS + warp] = warp_sum
  cute.arch.sync_threads()
  total = cutlass.Int32(0)
  for w in cutlass.range_constexpr(WARPS):
    total += partials[parity * WARPS + w]
  return total


@cute.kernel
def _select_kernel(keys: cute.Tensor, counts: cute.Tensor, threshold: cute.Tensor,
                   last_row: cute.Tensor, per_thread: cutlass.Constexpr):
  tidx, _, _ = cute.arch.thread_idx()
  expert, _, _ = cute.arch.block_idx()
  num_rows = keys.shape[1]
  smem = cutlass.memory.SmemAllocator()
  partials = smem.allocate_tensor(cutlass.Int32, cute.make_layout(2 * WARPS), 16)

  mine = cute.make_rmem_tensor((per_thread,), cutlass.Int32)
  for i in cutlass.range_constexpr(per_thread):
    row = tidx + THREADS * i
    mine[i] = cutlass.Int32(_KEY_MIN)
    if row < num_rows:
      mine[i] = keys[expert, row]
  wanted = counts[expert]
  parity = cutlass.Int32(0)

  # 1. the largest key v with count(keys >= v) >= wanted; invariant: lo satisfies it
  lo = cutlass.Int64(_KEY_MIN)
  hi = cutlass.Int64(_KEY_MAX)
  for _ in range(32):
    mid = lo + (hi - lo + 1) // 2
    mid32 = cutlass.Int32(mid)
    count = cutlass.Int32(0)
    for i in cutlass.range_constexpr(per_thread):
      if tidx + THREADS * i < num_rows and mine[i] >= mid32:
        count += 1
    if _block_sum(count, partials, parity) >= wanted:
      lo = mid
    else:
      hi = mid - 1
    parity = 1 - parity
  key = cutlass.Int32(lo)

  # 2. the row of the ties_needed-th key equal to v: the smallest r with that many at or before
  count = cutlass.Int32(0)
  for i in cutlass.range_constexpr(per_thread):
    if tidx + THREADS * i < num_rows and mine[i] > key:
      count += 1
  ties_needed = wanted - _block_sum(count, partials, parity)
  parity = 1 - parity
  row_lo = cutlass.Int32(0)
  row_hi = num_rows - 1
  for _ in range(ROW_STEPS):
    row_mid = (row_lo + row_hi) // 2
    count = cutlass.Int32(0)
    for i in cutlass.range_constexpr(per_thread):
      row = tidx + THREADS * i
      if row <= row_mid and mine[i] == key:
        count += 1
    if _block_sum(count, partials, parity) >= ties_needed:
      row_hi = row_mid
    else:
      row_lo = row_mid + 1
    parity = 1 - parity

  if tidx == 0:
    threshold[expert] = key
    last_row[expert] = row_lo
    if ties_needed <= 0:
      last_row[expert] = cutlass.Int32(-1)


@cute.jit
def _select(stream, keys: cute.Tensor, counts: cute.Tensor, threshold: cute.Tensor,
            last_row: cute.Tensor, per_thread: cutlass.Constexpr):
  _select_kernel(keys, counts, threshold, last_row, per_thread).launch(
      grid=(keys.shape[0], 1, 1), block=(THREADS, 1, 1), stream=stream)


def top_per_column(values, counts):
  """select [T, E] bool: the counts[e] largest values of column e, ties to the lower row (as
  routing's reference selection). values: [T, E] float32 (finite), T <= MAX_TOKENS;
  counts: [E] int, 0 <= counts[e] <= T."""
  if values.ndim != 2:
    raise ValueError(f"cute top_per_column: values must be [T, E]; got shape {values.shape}")
  num_rows, num_cols = values.shape
  reason = unsupported(num_rows)
  if reason:
    raise ValueError(f"cute top_per_column: {reason}")
  keys = ordered_keys(values)
  threshold, last_row = xla_call.call(
      _select, [keys.T, counts.astype(jnp.int32)],
      [jax.ShapeDtypeStruct((num_cols,), jnp.int32), jax.ShapeDtypeStruct((num_cols,), jnp.int32)],
      per_thread=max(1, -(-num_rows // THREADS)))
  rows = jnp.arange(num_rows, dtype=jnp.int32)[:, None]
  return (keys > threshold[None, :]) | ((keys == threshold[None, :]) & (rows <= last_row[None, :]))
