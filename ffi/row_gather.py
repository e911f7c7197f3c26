"""The gathering kernels' producers: the rows of X (or dO) that a routing plan names, copied
into the lhs stages by the producer warpgroup, so that no [T*K, d] gathered copy is made
(grouped_gemm.py's, pingpong.py's and persistent.py's gathering kernels).

  K-major rows (up_proj, dh: an M tile's BLOCK_M rows, the same for every k step): gather_stage
      with gather_tokens' rows, each of the producer's 128 threads copying 16-byte cp.async
      chunks (GATHER_CHUNKS a row) for both MMA warpgroups in turn.
  M-major rows (the weight gradients: a k step's BLOCK_K rows are the contraction):
      produce_wgrad_steps, cp.async chunks of 8 columns, the tokens read a step ahead; or
      produce_wgrad_steps_tma, one TMA box (ROW_BOX columns) a row issued by one lane
      (row_tma_atom, row_lines, row_boxes).
Padding slots (an index of T or more) come back as zeros (plain stores, or TMA's out-of-bounds
fill). A copying producer's stage completes on mainloop.PRODUCER_ARRIVALS arrivals: the TMA
warp's and two per producer thread (its copies landed; its plain stores released).
"""
from __future__ import annotations

import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline
from cutlass.cute.nvgpu import cpasync

from ffi import mainloop
from ffi.mainloop import BLOCK_K, BLOCK_M, WARPGROUPS

GATHER_CHUNKS = BLOCK_K * 2 // 16                      # 16-byte cp.async chunks per bf16 row
GATHER_ROWS_PER_THREAD = (BLOCK_M // WARPGROUPS) * GATHER_CHUNKS // 128
# the weight gradient's gather (rows along K): a warpgroup's 8-column chunks of a row, and each
# thread's (row, chunk) copies per k step
K_CHUNKS_PER_WG = BLOCK_M // WARPGROUPS // 8
K_GATHERS_PER_THREAD = BLOCK_K * K_CHUNKS_PER_WG // 128


@cute.jit
def _copy_row_chunk(x, token, chunk, dst):
  """dst (8 SMEM elements) = x[token, 8 chunk : 8 chunk + 8] by one 16-byte cp.async, or zeros
  where token is outside x (a padding slot)."""
  if token < cute.size(x, mode=[0]):
    atom = cute.make_copy_atom(cpasync.CopyG2SOp(cpasync.LoadCacheMode.GLOBAL), x.element_type,
                               num_bits_per_copy=128)
    # the row's offset in 64 bits: T * d may pass 2^31 elements
    cute.copy(atom, cute.local_tile(x[cutlass.Int64(token), None, 0], (8,), (chunk,)), dst)
  else:
    dst.fill(0.0)


def _gather_row(tidx, j: int):
  """The M tile's row that thread tidx copies a chunk of, its j-th: each warpgroup covers its
  own BLOCK_M / WARPGROUPS rows, GATHER_CHUNKS threads per row."""
  wg, t = tidx // 128, tidx % 128
  return wg * (BLOCK_M // WARPGROUPS) + t // GATHER_CHUNKS + j * (128 // GATHER_CHUNKS)


@cute.jit
def gather_tokens(gather_index, m_tile, tidx):
  """The source rows (x's row indices) of this thread's GATHER_ROWS_PER_THREAD rows of the M
  tile, read once per tile into registers: every k step copies the same rows' next columns."""
  tokens = cute.make_rmem_tensor((GATHER_ROWS_PER_THREAD,), cutlass.Int32)
  for j in cutlass.range_constexpr(GATHER_ROWS_PER_THREAD):
    tokens[j] = gather_index[m_tile * BLOCK_M + _gather_row(tidx, j)]
  return tokens


@cute.jit
def _gather_step(x, tokens, a_stage, k0, tidx):
  """Thread tidx's share of its warpgroup's BLOCK_M / WARPGROUPS rows of one k step (a
  producer thread acts as each MMA warpgroup's thread in turn):
  a_stage[r, k0 : k0 + BLOCK_K] = x[token of row r, ...] in 16-byte cp.async chunks
  (GATHER_CHUNKS per row, one per thread of a group of them; tokens from gather_tokens); rows
  of indices outside x (padding slots) are written as zeros."""
  chunk = tidx % 128 % GATHER_CHUNKS
  for j in cutlass.range_constexpr(GATHER_ROWS_PER_THREAD):
    _copy_row_chunk(x, tokens[j], k0 // 8 + chunk,
                    cute.local_tile(a_stage[_gather_row(tidx, j), None], (8,), (chunk,)))


def _gather_k_slot(tidx, j: int):
  """(row of the k step, 8-column chunk) of thread tidx's j-th copy in the weight gradient's
  gather: 8 threads cover 128 contiguous bytes of a row, each warpgroup its own columns."""
  wg, i = tidx // 128, tidx % 128 + 128 * j
  return i // K_CHUNKS_PER_WG, wg * K_CHUNKS_PER_WG + i % K_CHUNKS_PER_WG


@cute.jit
def _read_k_step_tokens(tokens, gather_index, k, tidx):
  """tokens (K_GATHERS_PER_THREAD registers) = the source rows of thread tidx's copies of k
  step k: gather_index[k * BLOCK_K + r] for each copy's row r of the step."""
  rows = cute.local_tile(gather_index, (BLOCK_K,), (k,))
  for j in cutlass.range_constexpr(K_GATHERS_PER_THREAD):
    tokens[j] = rows[_gather_k_slot(tidx, j)[0]]


@cute.jit
def _gather_k_step(x, tokens, a_stage, col0, tidx):
  """The weight gradient's A stage (M-major: BLOCK_M columns of X by BLOCK_K gathered rows, the
  rows being the contraction): a_stage[c, r] = x[row r's token, col0 + c], each warpgroup
  filling the BLOCK_M / WARPGROUPS columns its wgmmas read, in 16-byte cp.async chunks of 8
  columns (tokens: _read_k_step_tokens); rows of indices outside x are zeros."""
  for j in cutlass.range_constexpr(K_GATHERS_PER_THREAD):
    r, chunk = _gather_k_slot(tidx, j)
    _copy_row_chunk(x, tokens[j], col0 // 8 + chunk,
                    cute.local_tile(a_stage[None, r], (8,), (chunk,)))


@cute.jit
def gather_stage(loads, state, x, tokens, s_a, rhs_operands, k, ptid, col0,
                 kind: cutlass.Constexpr):
  """A gathering producer warpgroup's k step k into stage state.index, by all 128 of its
  threads (ptid): start_stage (the stage free, the rhs tiles TMA-loaded); every thread
  cp.async-copies its share of A's gathered rows for both MMA warpgroups, as if it were each
  of their threads in turn (rows of the M tile, _gather_step, tokens a list of each
  warpgroup's rows' tokens; or kind "wgrad", the weight gradient's BLOCK_K rows of the k step
  at columns col0.., _gather_k_step, tokens from _read_k_step_tokens; padding rows it writes as
  zeros by plain stores), then arrives on the full barrier twice: once its copies land
  (cp.async's noinc arrive) and once at once (a release arrive publishing its plain stores).
  The barrier counts PRODUCER_ARRIVALS."""
  bar = mainloop.start_stage(loads, state, rhs_operands, k, ptid < 32)
  stage = s_a[None, None, state.index]
  for wg in cutlass.range_constexpr(WARPGROUPS):
    if cutlass.const_expr(kind == "wgrad"):
      _gather_k_step(x, tokens, stage, col0, ptid + 128 * wg)
    else:
      _gather_step(x, tokens[wg], stage, k * BLOCK_K, ptid + 128 * wg)
  cute.arch.cp_async_mbarrier_arrive_noinc(bar)
  cute.arch.mbarrier_arrive(bar)


ROW_BOX = 64   # a gathered row's columns per TMA box (one 128-byte line of a swizzle atom)
ROWS_PER_WARP = BLOCK_K // 4   # the TMA-gathering weight gradient: each producer warp's k rows


def row_tma_atom(x, a_smem_staged):
  """(TMA atom, its coordinate tensor (columns, rows)) loading ROW_BOX columns of one row of X
  (T, C, 1) at a time, swizzled as the weight gradient's M-major A stages: a box is one
  128-byte line of their swizzle atom, and TMA swizzles by the destination address, so a box
  written at the line's start lands as the stage holds it (row_lines)."""
  rows, cols = cute.size(x, mode=[0]), cute.size(x, mode=[1])
  x_cols_rows = cute.make_tensor(x.iterator, cute.make_layout(
      (cols, rows), stride=(1, x.layout.stride[0])))
  box = cute.make_composed_layout(a_smem_staged.inner, 0,
                                  cute.make_layout((ROW_BOX, 1), stride=(1, ROW_BOX)))
  return cpasync.make_tiled_tma_atom(cpasync.CopyBulkTensorTileG2SOp(), x_cols_rows, box,
                                     (ROW_BOX, 1))


def row_lines(s_a_storage, a_smem_staged):
  """The weight gradient's M-major A stages (k rows gathered) seen unswizzled, element 0 of
  each box at its 128-byte line's start (where row_tma_atom's boxes go): ((ROW_BOX, 1) box, M
  half, k row, stage), the stage layout's M mode being (ROW_BOX, WARPGROUPS), each
  warpgroup's columns one swizzle atom wide."""
  outer = a_smem_staged.outer
  (box, halves), (one, half_stride) = outer.shape[0], outer.stride[0]
  assert box == ROW_BOX and halves == WARPGROUPS and one == 1, outer
  layout = cute.make_layout(((box, 1), halves, outer.shape[1], outer.shape[2]),
                            stride=((1, 0), half_stride, outer.stride[1], outer.stride[2]))
  return s_a_storage.get_tensor(layout)


def row_boxes(atom, m_a, s_a_storage, a_smem_staged):
  """(atom, its coordinate tiles (box, 1, column box, row)) and the stages' lines
  (row_lines, partitioned alike) of row_tma_atom's loads: the TMA producer's operands."""
  lines, tiles = cpasync.tma_partition(atom, 0, cute.make_layout(1),
                                       row_lines(s_a_storage, a_smem_staged),
                                       cute.local_tile(m_a, (ROW_BOX, 1), (None, None)))
  return (atom, tiles), lines


@cute.jit
def produce_wgrad_steps_tma(loads, produce, row_tiles, gather_index, lines, rhs_operands,
                            k_begin, num_k, ptid, col0):
  """produce_wgrad_steps with the gathered rows loaded by TMA (row_tma_atom: its partitioned
  coordinate tiles, row_tiles (box, 1, column box, row); lines: row_lines partitioned): each warp
  ROWS_PER_WARP rows of every k step, lane l holding row l mod ROWS_PER_WARP's token (read a
  step ahead), each row's token shuffled to the whole warp and its WARPGROUPS boxes issued
  (one lane each, by cute.copy); a padding row's token (T or more) reads as zeros (TMA's out of
  bounds fill). The full barrier completes on warp 0's arrive and the TMA bytes, A's included
  (its expected bytes count both operands), so the MMA warpgroups need no proxy fence."""
  atom, tiles = row_tiles
  warp, lane = ptid // 32, ptid % 32
  last = cute.size(gather_index) // BLOCK_K - 1
  my_row = warp * ROWS_PER_WARP + lane % ROWS_PER_WARP
  ahead = cute.local_tile(gather_index, (BLOCK_K,), (cutlass.min(k_begin, last),))[my_row]
  for step in cutlass.range(num_k, unroll=1):
    k = k_begin + step
    token = ahead
    ahead = cute.local_tile(gather_index, (BLOCK_K,), (cutlass.min(k + 1, last),))[my_row]
    bar = mainloop.start_stage(loads, produce, rhs_operands, k, warp == 0)
    for j in cutlass.range_constexpr(ROWS_PER_WARP):
      row_token = cute.arch.shuffle_sync(token, j)
      for half in cutlass.range_constexpr(WARPGROUPS):
        cute.copy(atom, tiles[(None, 0, col0 // ROW_BOX + half, row_token)],
                  lines[(None, half, warp * ROWS_PER_WARP + j, produce.index)], tma_bar_ptr=bar)
    produce.advance()
  return produce


@cute.jit
def produce_wgrad_steps(loads, produce, x, gather_index, s_a, rhs_operands, k_begin, num_k, ptid,
                        col0):
  """The weight gradient's gathering producer (thread ptid of 128) over one output tile's k
  steps k_begin .. k_begin + num_k - 1 (gather_stage; A's columns col0..): each step's tokens
  are read from gather_index one step ahead, so that their load's latency passes under the
  previous step's copies instead of stalling the cp.asyncs that need them (without it the
  producer's samples wait on that load and the MMA warpgroups on full stages). The reads ahead are
  clamped to gather_index's last k step (a tile of an expert without rows has no steps).
  Returns the advanced pipeline state."""
  last = cute.size(gather_index) // BLOCK_K - 1
  tokens = cute.make_rmem_tensor((K_GATHERS_PER_THREAD,), cutlass.Int32)
  ahead = cute.make_rmem_tensor((K_GATHERS_PER_THREAD,), cutlass.Int32)
  _read_k_step_tokens(ahead, gather_index, cutlass.min(k_begin, last), ptid)
  for step in cutlass.range(num_k, unroll=1):
    k = k_begin + step
    for j in cutlass.range_constexpr(K_GATHERS_PER_THREAD):
      tokens[j] = ahead[j]
    _read_k_step_tokens(ahead, gather_index, cutlass.min(k + 1, last), ptid)
    gather_stage(loads, produce, x, tokens, s_a, rhs_operands, k, ptid, col0, "wgrad")
    produce.advance()
  return produce


@cute.jit
def produce_gathered(loads, rhs_operands, x, gather_index, s_a, num_k, m_tile, k_begin, ptid,
                      stages: cutlass.Constexpr, kind: cutlass.Constexpr, rows_by_tma=None):
  """The gathering kernels' producer warpgroup (thread ptid of 128): fills the `stages`-deep
  ring with every k step's tiles (gather_stage), the M tile's rows' tokens read once per
  tile; or the weight gradient's (produce_wgrad_steps). rows_by_tma (the weight gradient
  only): row_boxes' operands, the rows then loaded by TMA (produce_wgrad_steps_tma)."""
  produce = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, stages)
  if cutlass.const_expr(rows_by_tma is not None):
    row_tiles, lines = rows_by_tma
    produce_wgrad_steps_tma(loads, produce, row_tiles, gather_index, lines, rhs_operands,
                            k_begin, num_k, ptid, m_tile * BLOCK_M)
  elif cutlass.const_expr(kind == "wgrad"):
    produce_wgrad_steps(loads, produce, x, gather_index, s_a, rhs_operands, k_begin, num_k, ptid,
                        m_tile * BLOCK_M)
  else:   # rows of the M tile: the same for every k step
    tile_tokens = [gather_tokens(gather_index, m_tile, ptid + 128 * wg)
                   for wg in range(WARPGROUPS)]
    for step in cutlass.range(num_k, unroll=1):
      gather_stage(loads, produce, x, tile_tokens, s_a, rhs_operands, k_begin + step, ptid, 0,
                   kind)
      produce.advance()
