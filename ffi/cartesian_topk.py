"""The OmniMoE router's exact top-k over the implicit rows x cols grid as a CuTe DSL kernel.

Per token: its row scores sorted descending (row_vals [T, kr] with their ids row_ids, kr =
min(k, rows)) and its column scores likewise (col_vals, col_ids [T, kc], kc = min(k, cols)).
The pair at row rank a and column rank b scores row_vals[a] + col_vals[b]; every pair at
lower or equal ranks beats it, so row rank a holds at most cap(a) = min(kc, k // (a + 1)) of
the top k, always a prefix of the column ranks (models/omnimoe.py derives this).

Tiling: one CTA of THREADS threads per token. Thread i holds row ranks i R .. i R + R - 1
(R = ceil(kr / THREADS)) in registers; the token's column scores and ids sit in SMEM.
  1. The k-th largest pair score's key (float32 bits as an int32 in the order of the values),
     by bisection between the least candidate's key and the best pair's (32 steps): a step
     counts, for each row rank, the column ranks whose pair reaches the probe (a binary search
     within its cap, in SMEM) and sums the counts over the CTA (block.reduce).
  2. Each row rank takes its pairs above that key and, in row-rank order, the ties still
     needed (block.exclusive_scan over the ties): its count; a scan of the counts gives each
     row rank's last output slot (SMEM `ends`).
  3. Output slot s (the CTA's threads in turn: coalesced stores): its row rank (a binary
     search over ends), its column rank (s minus the row rank's first slot) and the pair's
     expert id row_id * cols + col_id.
Pairs and order as models/omnimoe.py's bisection (row ranks in order, each a prefix of its
column ranks): its ids element for element, ties at the k-th score to the lower row rank, then
column rank. The caller gathers the pairs' scores (differentiably).
"""
from __future__ import annotations

import cutlass
import cutlass.cute as cute
import jax
import jax.numpy as jnp

from ffi import block, topk, xla_call

THREADS = 1024
WARPS = THREADS // 32
MAX_RANKS = 2048               # kr and kc: two row ranks a thread, 16 KB of column ranks in SMEM
_LARGEST_KEY = 2**31 - 1
_NEGATIVE_ZERO = -2**31


def unsupported(rows: int, cols: int, k: int):
  """Why the kernel cannot take a rows x cols grid at this k, or None."""
  if not 1 <= k <= rows * cols:
    return f"k={k} must be between 1 and rows * cols = {rows * cols}"
  if min(k, rows) > MAX_RANKS or min(k, cols) > MAX_RANKS:
    return f"min(k, rows) and min(k, cols) must be at most {MAX_RANKS}; got {rows} x {cols}, k={k}"
  return None


@cute.jit
def _key(value):
  """An int32 key in the order of the float32 value (topk.ordered_key of its bits; -0.0 ties
  with 0.0, as routing.ordered_bits)."""
  bits = value.bitcast(cutlass.Int32)
  if bits == cutlass.Int32(_NEGATIVE_ZERO):
    bits = cutlass.Int32(0)
  return topk.ordered_key(bits)


@cute.jit
def _reaching(row_val, cap, col_s: cute.Tensor, threshold, steps: cutlass.Constexpr):
  """How many of the first cap column ranks pair with row_val to a key >= threshold: a prefix
  (col_s descends), found by binary search."""
  count = cutlass.Int32(0)
  for j in cutlass.range_constexpr(steps):
    probe = count + (1 << (steps - 1 - j))
    if probe <= cap:
      if _key(row_val + col_s[probe - 1]) >= threshold:
        count = probe
  return count


@cute.kernel
def _topk_kernel(row_vals: cute.Tensor, row_ids: cute.Tensor, col_vals: cute.Tensor,
                 col_ids: cute.Tensor, out_ids: cute.Tensor, k: cutlass.Constexpr,
                 cols: cutlass.Constexpr, kr: cutlass.Constexpr, kc: cutlass.Constexpr,
                 per_thread: cutlass.Constexpr):
  tidx, _, _ = cute.arch.thread_idx()
  token, _, _ = cute.arch.block_idx()
  smem = cutlass.memory.SmemAllocator()
  col_s = smem.allocate_tensor(cutlass.Float32, cute.make_layout(kc), 16)
  col_id_s = smem.allocate_tensor(cutlass.Int32, cute.make_layout(kc), 16)
  ends = smem.allocate_tensor(cutlass.Int32, cute.make_layout(kr), 16)
  scratch = smem.allocate_tensor(cutlass.Int32, cute.make_layout(WARPS), 16)
  for c in cutlass.range(tidx, kc, THREADS):
    col_s[c] = col_vals[token, c]
    col_id_s[c] = col_ids[token, c]
  cute.arch.sync_threads()

  # this thread's row ranks: their scores and caps (cap 0 past kr)
  first = tidx * per_thread
  vals = cute.make_rmem_tensor((per_thread,), cutlass.Float32)
  caps = cute.make_rmem_tensor((per_thread,), cutlass.Int32)
  least = cutlass.Int32(_LARGEST_KEY)
  for i in cutlass.range_constexpr(per_thread):
    vals[i] = cutlass.Float32(0.0)
    caps[i] = cutlass.Int32(0)
    if first + i < kr:
      vals[i] = row_vals[token, first + i]
      caps[i] = cutlass.min(cutlass.Int32(kc), cutlass.Int32(k) // (first + i + 1))
      least = cutlass.min(least, _key(vals[i] + col_s[caps[i] - 1]))

  # 1. the k-th largest key: the largest in [lo, hi] that at least k pairs reach
  steps = kc.bit_length()
  lo = cutlass.Int64(block.reduce(least, scratch, "min"))
  hi = cutlass.Int64(_key(row_vals[token, 0] + col_s[0]))
  for _ in cutlass.range(32, unroll=1):
    gap = hi - lo
    mid = lo + (gap >> 1) + (gap & 1)
    count = cutlass.Int32(0)
    for i in cutlass.range_constexpr(per_thread):
      count += _reaching(vals[i], caps[i], col_s, cutlass.Int32(mid), steps)
    if block.reduce(count, scratch, "add") >= k:
      lo = mid
    else:
      hi = mid - 1
  threshold = cutlass.Int32(lo)

  # 2. each row rank's pairs: those above the threshold, then the ties still needed in order
  above = cute.make_rmem_tensor((per_thread,), cutlass.Int32)
  ties = cute.make_rmem_tensor((per_thread,), cutlass.Int32)
  my_above = cutlass.Int32(0)
  my_ties = cutlass.Int32(0)
  for i in cutlass.range_constexpr(per_thread):
    above[i] = _reaching(vals[i], caps[i], col_s, threshold + 1, steps)
    ties[i] = _reaching(vals[i], caps[i], col_s, threshold, steps) - above[i]
    my_above += above[i]
    my_ties += ties[i]
  needed = k - block.reduce(my_above, scratch, "add")
  ties_before, _ = block.exclusive_scan(my_ties, scratch)
  taken = cute.make_rmem_tensor((per_thread,), cutlass.Int32)
  my_taken = cutlass.Int32(0)
  for i in cutlass.range_constexpr(per_thread):
    taken[i] = above[i] + cutlass.max(0, cutlass.min(needed - ties_before, ties[i]))
    ties_before += ties[i]
    my_taken += taken[i]
  end, _ = block.exclusive_scan(my_taken, scratch)
  for i in cutlass.range_constexpr(per_thread):
    end += taken[i]
    if first + i < kr:
      ends[first + i] = end
  cute.arch.sync_threads()

  # 3. the output slots: row rank a = how many row ranks end at or before s
  row_steps = kr.bit_length()
  for s in cutlass.range(tidx, k, THREADS):
    a = cutlass.Int32(0)
    for j in cutlass.range_constexpr(row_steps):
      probe = a + (1 << (row_steps - 1 - j))
      if probe <= kr:
        if ends[probe - 1] <= s:
          a = probe
    start = cutlass.Int32(0)
    if a > 0:
      start = ends[a - 1]
    b = s - start
    out_ids[token, s] = row_ids[token, a] * cols + col_id_s[b]


@cute.jit
def _topk(stream, row_vals: cute.Tensor, row_ids: cute.Tensor, col_vals: cute.Tensor,
          col_ids: cute.Tensor, out_ids: cute.Tensor, k: cutlass.Constexpr,
          cols: cutlass.Constexpr, kr: cutlass.Constexpr, kc: cutlass.Constexpr,
          per_thread: cutlass.Constexpr):
  _topk_kernel(row_vals, row_ids, col_vals, col_ids, out_ids, k, cols, kr, kc,
               per_thread).launch(grid=(row_vals.shape[0], 1, 1), block=(THREADS, 1, 1),
                                  stream=stream)


def cartesian_topk(row_vals, row_ids, col_vals, col_ids, k: int, rows: int, cols: int):
  """The expert ids [T, k] int32 (row id * cols + column id) of each token's k best pairs on a
  rows x cols grid, in the order models/omnimoe.py's bisection gives them.
  row_vals [T, min(k, rows)] float32 sorted descending with their ids row_ids (int32),
  col_vals and col_ids [T, min(k, cols)] likewise; `unsupported` names the limits."""
  reason = unsupported(rows, cols, k)
  if reason is None and (row_vals.ndim != 2 or row_vals.shape != row_ids.shape
                         or row_vals.shape[1] != min(k, rows)):
    reason = (f"row_vals and row_ids must be [T, min(k, rows) = {min(k, rows)}]; got "
              f"{row_vals.shape} and {row_ids.shape}")
  if reason is None and (col_vals.shape != col_ids.shape
                         or col_vals.shape != (row_vals.shape[0], min(k, cols))):
    reason = (f"col_vals and col_ids must be [T = {row_vals.shape[0]}, min(k, cols) = "
              f"{min(k, cols)}]; got {col_vals.shape} and {col_ids.shape}")
  if reason:
    raise ValueError(f"cute cartesian_topk: {reason}")
  num_tokens, kr = row_vals.shape
  ids, = xla_call.call(
      _topk, [row_vals.astype(jnp.float32), row_ids.astype(jnp.int32),
              col_vals.astype(jnp.float32), col_ids.astype(jnp.int32)],
      [jax.ShapeDtypeStruct((num_tokens, k), jnp.int32)],
      k=k, cols=cols, kr=kr, kc=col_vals.shape[1], per_thread=max(1, -(-kr // THREADS)))
  return ids
