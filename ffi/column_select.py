"""Token rounding's selection as a CuTe DSL kernel: per expert, its counts[e] highest-ranked
tokens, written as their rows, in row order, into the expert's slots of the routing plan.

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
The tokens selected are those with keys > v and those with keys == v in rows <= that row:
exactly counts[e] of them, the choice of a stable descending sort. 3. Placing them: the CTA walks
its rows THREADS at a time (one row a thread); each selected row's rank among the expert's
selected rows is the count before it (the warp's ballot below its lane, the earlier warps'
counts through SMEM, the earlier chunks' total), and the row goes to slot offsets[e] + rank.
The slot array comes in filled with T (no token) and only selected rows are written over it.
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
def _select_kernel(keys: cute.Tensor, counts: cute.Tensor, offsets: cute.Tensor,
                   token_index: cute.Tensor, per_thread: cutlass.Constexpr):
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

  # 3. the selected rows, in row order, into the expert's slots
  last_tie = row_lo
  if ties_needed <= 0:
    last_tie = cutlass.Int32(-1)
  lane = cute.arch.lane_idx()
  warp = cute.arch.make_warp_uniform(cute.arch.warp_idx())
  slot = offsets[expert]
  for i in cutlass.range_constexpr(per_thread):
    row = tidx + THREADS * i
    take = cutlass.Boolean(False)
    if row < num_rows:
      if mine[i] > key:
        take = cutlass.Boolean(True)
      if mine[i] == key and row <= last_tie:
        take = cutlass.Boolean(True)
    ballot = cute.arch.vote_ballot_sync(take)
    if lane == 0:
      partials[parity * WARPS + warp] = cute.arch.popc(ballot)
    cute.arch.sync_threads()
    before = cute.arch.popc(ballot & ((cutlass.Uint32(1) << lane) - 1))
    chunk = cutlass.Int32(0)
    for w in cutlass.range_constexpr(WARPS):
      count = partials[parity * WARPS + w]
      if w < warp:
        before += count
      chunk += count
    if take:
      token_index[slot + before] = row
    slot += chunk
    parity = 1 - parity


@cute.jit
def _select(stream, keys: cute.Tensor, counts: cute.Tensor, offsets: cute.Tensor,
            slots_in: cute.Tensor, token_index: cute.Tensor, per_thread: cutlass.Constexpr):
  del slots_in   # (token_index is its buffer: the call aliases the two)
  _select_kernel(keys, counts, offsets, token_index, per_thread).launch(
      grid=(keys.shape[0], 1, 1), block=(THREADS, 1, 1), stream=stream)


def rounded_slots(values, counts, offsets, num_slots: int):
  """token_index [num_slots] int32: from slot offsets[e] on, the rows of the counts[e] largest
  values of column e in row order (ties to the lower row), T elsewhere; as
  routing.rounded_slots. values: [T, E] float32 (finite), T <= MAX_TOKENS; counts: [E] int,
  0 <= counts[e] <= T; offsets: [E] int32, groups that do not overlap."""
  if values.ndim != 2:
    raise ValueError(f"cute rounded_slots: values must be [T, E]; got shape {values.shape}")
  num_rows, num_cols = values.shape
  reason = unsupported(num_rows)
  if reason:
    raise ValueError(f"cute rounded_slots: {reason}")
  empty = jnp.full((num_slots,), num_rows, jnp.int32)
  token_index, = xla_call.call(
      _select, [ordered_keys(values).T, counts.astype(jnp.int32), offsets.astype(jnp.int32),
                empty],
      [jax.ShapeDtypeStruct((num_slots,), jnp.int32)], in_place={3: 0},
      per_thread=max(1, -(-num_rows // THREADS)))
  return token_index
