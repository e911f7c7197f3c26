"""Token rounding's selection as a CuTe DSL kernel: per expert, its counts[e] highest-ranked
tokens, written as their rows, in row order, into the expert's slots of the routing plan.

Input: keys [E, T] int32, one row per expert: the ranking values' float32 bits as int32 keys in
the order of the values (negative floats with their magnitude bits flipped), so that each
expert's tokens are contiguous. Tiling: one CTA per expert, THREADS threads; thread i holds the
per_thread consecutive rows from i * per_thread on, in registers (T <= MAX_TOKENS), read from
memory once.
  1. The counts[e]-th largest key v, by a radix select: 4 passes over 8-bit digits from the top,
     each a histogram of the keys that match the digits found so far (SMEM atomics), then the
     digit whose bins hold the wanted rank (each of 256 threads sums the bins from its own up).
     What is left of the rank after the last pass is ties_needed: how many keys equal to v are
     taken (ties go to the lower rows, the choice of a stable descending sort).
  2. Placing them: each thread counts its keys above v and equal to v; one block-wide exclusive
     scan of both (warp shuffles, the warps' totals through SMEM) gives the rows selected
     before each thread's; each thread then writes its selected rows, in order, to slots
     offsets[e] + rank. The slot array comes in filled with T (no token); only selected rows
     are written over it.
Seven barriers a pass of the select and three for the placement, where a bisection over the
keys and rows would take one per step (about 80).
"""
from __future__ import annotations

import cutlass
import cutlass.cute as cute
import jax
import jax.numpy as jnp

from ffi import block, xla_call

THREADS = 1024
WARPS = THREADS // 32
MAX_PER_THREAD = 32          # keys a thread holds in registers
MAX_TOKENS = THREADS * MAX_PER_THREAD
DIGIT_BITS = 8
BINS = 1 << DIGIT_BITS
_SIGN = -2**31               # the sign bit: key ^ _SIGN orders as unsigned as key does as signed


def _as_int32(bits: int) -> int:
  """A 32-bit pattern as the int32 holding it."""
  return bits - (1 << 32) if bits >= 1 << 31 else bits
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


@cute.kernel
def _select_kernel(keys: cute.Tensor, counts: cute.Tensor, offsets: cute.Tensor,
                   token_index: cute.Tensor, per_thread: cutlass.Constexpr):
  tidx, _, _ = cute.arch.thread_idx()
  expert, _, _ = cute.arch.block_idx()
  num_rows = keys.shape[1]
  first_row = tidx * per_thread
  smem = cutlass.memory.SmemAllocator()
  hist = smem.allocate_tensor(cutlass.Int32, cute.make_layout(BINS), 16)
  found = smem.allocate_tensor(cutlass.Int32, cute.make_layout(2), 16)   # digit, keys above it
  warp_totals = smem.allocate_tensor(cutlass.Int32, cute.make_layout(WARPS), 16)

  mine = cute.make_rmem_tensor((per_thread,), cutlass.Int32)
  for i in cutlass.range_constexpr(per_thread):
    mine[i] = cutlass.Int32(0)
    if first_row + i < num_rows:
      mine[i] = keys[expert, first_row + i]

  # 1. radix select of the wanted-th largest key, DIGIT_BITS at a time from the top; digits are
  # read off key ^ sign bit (unsigned order = the keys' signed order), as int32 bit patterns
  remaining = counts[expert]     # rank still to find among the keys matching the prefix
  prefix = cutlass.Int32(0)
  for p in cutlass.range_constexpr(32 // DIGIT_BITS):
    shift = 32 - DIGIT_BITS * (p + 1)
    high_mask = cutlass.Int32(_as_int32(((1 << (DIGIT_BITS * p)) - 1) << (32 - DIGIT_BITS * p)))
    if tidx < BINS:
      hist[tidx] = cutlass.Int32(0)
    cute.arch.sync_threads()
    for i in cutlass.range_constexpr(per_thread):
      if first_row + i < num_rows:
        bits = mine[i] ^ cutlass.Int32(_SIGN)
        if (bits & high_mask) == prefix:
          digit = (bits >> shift) & cutlass.Int32(BINS - 1)
          cute.arch.atomic_add(hist.iterator + digit, cutlass.Int32(1))
    cute.arch.sync_threads()
    if tidx < BINS:   # the digit whose bins, from the top, first reach the rank
      above = cutlass.Int32(0)
      for b in range(tidx + 1, BINS):
        above += hist[b]
      if above < remaining and remaining <= above + hist[tidx]:
        found[0] = tidx
        found[1] = above
    cute.arch.sync_threads()
    if remaining > 0:
      prefix = prefix | (found[0] << shift)
      remaining = remaining - found[1]
    cute.arch.sync_threads()   # (found is read by all before the next pass writes it)
  ties_needed = remaining        # keys equal to the threshold still to take, in row order
  threshold = prefix ^ cutlass.Int32(_SIGN)
  wanted = counts[expert]

  # 2. the selected rows, in row order, into the expert's slots
  above = cutlass.Int32(0)
  ties = cutlass.Int32(0)
  for i in cutlass.range_constexpr(per_thread):
    if first_row + i < num_rows and wanted > 0:
      if mine[i] > threshold:
        above += 1
      if mine[i] == threshold:
        ties += 1
  above_before, _ = block.exclusive_scan(above, warp_totals)
  ties_before, _ = block.exclusive_scan(ties, warp_totals)
  rank = above_before + cutlass.min(ties_before, ties_needed)
  slot = offsets[expert] + rank
  ties_taken = ties_before
  for i in cutlass.range_constexpr(per_thread):
    if first_row + i < num_rows and wanted > 0:
      take = cutlass.Boolean(False)
      if mine[i] > threshold:
        take = cutlass.Boolean(True)
      if mine[i] == threshold:
        if ties_taken < ties_needed:
          take = cutlass.Boolean(True)
        ties_taken += 1
      if take:
        token_index[slot] = first_row + i
        slot += 1


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
