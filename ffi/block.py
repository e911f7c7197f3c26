"""CTA-wide reductions and scans of one Int32 per thread (CuTe DSL helpers for the kernels whose
CTAs work on one row of data together: column_select.py, cartesian_topk.py). Each takes a
scratch tensor in SMEM with one slot per warp of the CTA; its size gives the number of warps."""
from __future__ import annotations

import cutlass
import cutlass.cute as cute


@cute.jit
def exclusive_scan(value, warp_totals: cute.Tensor):
  """(the sum of value over the CTA's threads before this one, the sum over all of them): a
  warp's inclusive scan by shuffles, the warps' totals through SMEM."""
  lane = cute.arch.lane_idx()
  warp = cute.arch.make_warp_uniform(cute.arch.warp_idx())
  inclusive = value
  for shift in cutlass.range_constexpr(5):
    other = cute.arch.shuffle_sync_up(inclusive, 1 << shift)
    if lane >= (1 << shift):
      inclusive += other
  if lane == 31:
    warp_totals[warp] = inclusive
  cute.arch.sync_threads()
  before = inclusive - value
  total = cutlass.Int32(0)
  for w in cutlass.range_constexpr(cute.size(warp_totals)):
    count = warp_totals[w]
    if w < warp:
      before += count
    total += count
  cute.arch.sync_threads()   # (warp_totals is read by all before anyone writes it again)
  return before, total


@cute.jit
def reduce(value, warp_results: cute.Tensor, kind: cutlass.Constexpr):
  """value reduced over the CTA's threads ("add" or "min"), the same in every thread: each
  warp's by redux.sync, then the warps' through SMEM."""
  warp = cute.arch.make_warp_uniform(cute.arch.warp_idx())
  mine = cute.arch.warp_redux_sync(value, kind)
  if cute.arch.lane_idx() == 0:
    warp_results[warp] = mine
  cute.arch.sync_threads()
  result = warp_results[0]
  for w in cutlass.range_constexpr(1, cute.size(warp_results)):
    if cutlass.const_expr(kind == "add"):
      result += warp_results[w]
    else:
      result = cutlass.min(result, warp_results[w])
  cute.arch.sync_threads()   # (read by all before anyone writes it again)
  return result
