"""The CuTe GEMM kernels' epilogues (grouped_gemm.py's, pingpong.py's and persistent.py's): the
output tiles' values from the fp32 accumulators, and their way to global memory.

  values : epilogue_values: out = acc, or SwiGLU's H gate, H up and A = silu(gate) * up from the
           two accumulators (the sigmoid by ex2.approx and rcp.approx: sigmoid); dH's
           (dh_outputs): dH = dSwiGLU(s dA', H) and A' = s A one 8-column group at a time
           (dswiglu), H read from global memory or SMEM (load_h_tile), and this column tile's
           part of dS = rowsum(dA' A) (add_row_sums, store_ds_part).
  stores : tma_store_epilogue: EPI_TILE column slices at a time through EPI_STAGES SMEM buffers
           (stmatrix), each stored by TMA by the leader warp (rolling, a persistent CTA's: a
           buffer's last store waited for only when it is written again, the tile's last stores
           reading on under the next tile, store_tail); store_tiles_tma: tiles already in SMEM
           (dH's written over H's buffer) stored by TMA.
"""
from __future__ import annotations

import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline
import cutlass.utils.hopper_helpers as sm90_utils
from cutlass.cute.nvgpu import cpasync
from cutlass.tensor_utils import LayoutEnum

from ffi.mainloop import BLOCK_M, THREADS

EPI_TILE = (BLOCK_M, 64)    # the TMA-store epilogue's SMEM buffer: a (BLOCK_M, 64) column slice
EPI_STAGES = 2              # its buffers (they reuse A's pipeline stages, at least 2)
LOG2E = 1.4426950408889634   # log2(e): e^x = 2^(x log2 e)
EPILOGUE_BARRIER = 3        # named barrier id of the MMA warpgroups' epilogue syncs
# dH's tiles up to this wide can run two CTAs per SM (reading dOg in slot order, 3 stages, at
# most 128 registers); wider ones run one whatever their stages and registers.
DH_TWO_CTAS_MAX_BLOCK_N = 128
# dH's epilogue: H's column groups loaded this many groups ahead of their math. Wide tiles take
# 8 (block_n 256: 174 -> 210 registers); two-CTA ones 2, where 8 took block_n 128 from 112 to
# 146 registers, no longer two CTAs per SM, and spilled in the ping-pong dH.
DH_LOAD_AHEAD_WIDE, DH_LOAD_AHEAD_NARROW = 8, 2


def epi_tma_views(atom, s_epi, tile, epi_tile=EPI_TILE):
  """(SMEM part, global part) of a TMA atom over epi_tile buffers s_epi (indexed [None,
  buffer]) and a tile of its TMA tensor cut into epi_tile chunks (indexed [None, (row block,
  chunk)]: (0, chunk) where the buffers span the tile's rows)."""
  return cpasync.tma_partition(atom, 0, cute.make_layout(1), cute.group_modes(s_epi, 0, 2),
                               cute.zipped_divide(tile, epi_tile))


def sigmoid(x):
  """1 / (1 + e^-x) of fp32 vectors by the special function unit: ex2.approx of -x log2(e),
  then rcp.approx of 1 + that (relative error about 2^-21, far below the bf16 outputs'
  rounding). The precise forms (a range-split e^x, an IEEE divide with its slow-path branch)
  make the SwiGLU epilogues the bound of dH."""
  return cute.math.rcp(1.0 + cute.math.exp2(x * -LOG2E, fastmath=True), approx=True,
                       ftz=True)


@cute.jit
def epilogue_values(vals, swiglu: cutlass.Constexpr):
  """The output tiles' values (fp32) from the register tiles' (matching the stores' order):
  plain, one output per tile (out = acc; dh's dH gate, dH up and A' tiles as computed);
  SwiGLU, H's gate and up tiles = the two accumulators and A = silu(gate) * up."""
  if cutlass.const_expr(swiglu):
    gate, up = vals
    return [gate, up, gate * sigmoid(gate) * up]
  return list(vals)


@cute.jit
def group_fp32(src):
  """A small global (or register) slice loaded into registers, in fp32."""
  return load_group(src).to(cutlass.Float32)


@cute.jit
def load_group(src):
  """A small global (or register) slice loaded into registers, in its own dtype."""
  frag = cute.make_rmem_tensor(src.shape, src.element_type)
  cute.autovec_copy(src, frag)
  return frag.load()


def acc_chunks(tiles, thr_mma):
  """Tiles of global memory (the accumulator's shape) partitioned like it, one chunk each:
  dh_outputs's sources (H's gate and up tiles) or destinations (dH's and A''s)."""
  return [[thr_mma.partition_C(t)] for t in tiles]


def smem_chunks(s_epi, chunk_mma, tidx, firsts, chunks: int):
  """The same of tiles held in SMEM as `chunks` EPI_TILE buffers each (tile i's from buffer
  firsts[i] of s_epi), partitioned by chunk_mma (the kernel's wgmma on EPI_TILE's columns: a
  thread's values of a chunk are its accumulator's values of those columns)."""
  thr = chunk_mma.get_slice(tidx)
  return [[thr.partition_C(s_epi[None, None, first + j]) for j in range(chunks)]
          for first in firsts]


def _chunk_group(chunked, k: int, m: int):
  """Column group k (8 columns) of m block m of a tile split into equal column chunks
  (acc_chunks, smem_chunks)."""
  per_chunk = cute.size(chunked[0], mode=[0, 2])
  return chunked[k // per_chunk][((None, None, k % per_chunk), m, 0)]


@cute.jit
def dh_outputs(acc, h_srcs, score_tile, m_ds, thr_mma, tidx, row0, n_tile, dtype, out_dsts,
                block_n: cutlass.Constexpr, tile_m: cutlass.Constexpr,
                load_ahead: cutlass.Constexpr = None):
  """dH's epilogue math on acc = dA' = dO_e W2_e^T for H's gate and up tiles (h_srcs, in
  global memory or SMEM: acc_chunks, smem_chunks) and each row's score s: register tiles
  (acc's layout, in dtype) of dH = dSwiGLU(s dA', H) (its gate and up tiles) and A' = s A with
  A = silu(gate) up, each stored to out_dsts (dH gate, dH up, A'; global memory or SMEM, as
  h_srcs) as it is computed, or (out_dsts None) returned; writes this column tile's part of
  dS = rowsum(dA' A) to m_ds[n_tile, row] (fp32). The tile: tile_m rows from row row0.

  The fragment is ((2 columns, 2 rows r and r + 8, block_n / 8 column groups), m blocks, 1)
  (m blocks: tile_m / 64 when one warpgroup's wgmmas cover the tile's rows); it is worked
  through one column group (2 x 2 values) at a time, so that besides the accumulator only a
  few values are live: computed for the whole fragment at once, block_n 128 needed 255
  registers and a 200-byte stack frame per thread (sm_90a cubin). H's values of a group are
  loaded load_ahead (default DH_LOAD_AHEAD_WIDE, or _NARROW) groups before its math (a
  group's loads issued after the previous group's stores would each wait out a global load's
  latency); the scores, the same in every column (stride 0), once per m block."""
  s_src = thr_mma.partition_C(score_tile)
  groups = block_n // 8
  h_group = lambda k, m: [_chunk_group(src, k, m) for src in h_srcs]
  if cutlass.const_expr(load_ahead is None):
    wide = block_n > DH_TWO_CTAS_MAX_BLOCK_N
    load_ahead = DH_LOAD_AHEAD_WIDE if wide else DH_LOAD_AHEAD_NARROW
  load_ahead = min(load_ahead, groups)
  outs = []
  if cutlass.const_expr(out_dsts is None):
    outs = [cute.make_rmem_tensor(acc.shape, dtype) for _ in range(3)]
  m_blocks = cute.size(acc, mode=[1])
  row_sums = cute.make_rmem_tensor((2 * m_blocks,), cutlass.Float32)   # rows r, r + 8 per block
  row_sums.fill(0.0)
  for m in cutlass.range_constexpr(m_blocks):
    s = group_fp32(s_src[((None, None, 0), m, 0)])
    ahead = [[load_group(src) for src in h_group(k, m)] for k in range(load_ahead)]
    for k in cutlass.range_constexpr(groups):
      if cutlass.const_expr(k + load_ahead < groups):
        ahead.append([load_group(src) for src in h_group(k + load_ahead, m)])
      group = ((None, None, k), m, 0)
      gate, up = [v.to(cutlass.Float32) for v in ahead[k]]
      da = acc[group].load()
      values, a = dswiglu(gate, up, da, s)
      for q in cutlass.range_constexpr(3):
        if cutlass.const_expr(out_dsts is None):
          outs[q][group].store(values[q].to(dtype))
        else:
          frag = cute.make_rmem_tensor(acc[group].shape, dtype)
          frag.store(values[q].to(dtype))
          cute.autovec_copy(frag, _chunk_group(out_dsts[q], k, m))
      add_row_sums(row_sums, m, da * a, acc[group].shape)
  store_ds_part(row_sums, thr_mma, m_ds, tidx, row0, n_tile, block_n, tile_m)
  return outs


@cute.jit
def dswiglu(gate, up, da, s):
  """dH's epilogue math on one column group (fp32 vectors): H's gate and up values, dA' and
  the rows' score s -> ([dH gate, dH up, A' = s A], A = silu(gate) up)."""
  sig = sigmoid(gate)
  silu = gate * sig
  a = silu * up
  da_s = s * da
  return [da_s * up * sig * (1.0 + gate * (1.0 - sig)), da_s * silu, s * a], a


@cute.jit
def add_row_sums(row_sums, m: cutlass.Constexpr, prod, shape: cutlass.Constexpr):
  """Adds a column group's dA' A values (prod, rows r and r + 8 of m block m) to this
  thread's row sums (rows r, r + 8 per m block)."""
  frag = cute.make_rmem_tensor(shape, cutlass.Float32)
  frag.store(prod)
  for j in cutlass.range_constexpr(2):
    for i in cutlass.range_constexpr(2):
      row_sums[2 * m + j] += frag[i, j]


@cute.jit
def store_ds_part(row_sums, thr_mma, m_ds, tidx, row0, n_tile, block_n: cutlass.Constexpr,
                  tile_m: cutlass.Constexpr):
  """dS's part of this column tile: each row's sum over this thread's columns (row_sums),
  then over the 4 threads (a quad) sharing the row, to m_ds[n_tile, row] (fp32)."""
  rows = thr_mma.partition_C(cute.make_identity_tensor((tile_m, block_n)))
  for m in cutlass.range_constexpr(cute.size(row_sums) // 2):
    for j in cutlass.range_constexpr(2):
      total = cute.arch.warp_reduction_sum(row_sums[2 * m + j], threads_in_group=4)
      if tidx % 4 == 0:
        m_ds[n_tile, row0 + rows[(0, j, 0), m, 0][0]] = total


@cute.jit
def load_h_tile(tma_hs, h_tiles, s_h, bar, nbytes: cutlass.Constexpr):
  """The leader warp: H's gate and up tiles (h_tiles, each of its TMA tensor, loaded by its
  atom in tma_hs) into s_h's EPI_TILE buffers (gate chunks first) by TMA, completing on
  mbarrier `bar` (nbytes in all: the boxes' whole bytes, also where they reach past H's
  columns and TMA fills zeros)."""
  with cute.arch.elect_one():
    cute.arch.mbarrier_arrive_and_expect_tx(bar, nbytes)
  chunks = cute.size(h_tiles[0], mode=[1]) // EPI_TILE[1]
  for half in cutlass.range_constexpr(2):
    s_part, g_part = epi_tma_views(tma_hs[half], s_h, h_tiles[half])
    for j in cutlass.range_constexpr(chunks):
      cute.copy(tma_hs[half], g_part[None, (0, j)], s_part[None, half * chunks + j],
                tma_bar_ptr=bar)


@cute.jit
def store_tiles_tma(stores, chunks: cutlass.Constexpr):
  """The leader warp: each (TMA atom, SMEM EPI_TILE buffers, first buffer, the output's tile of
  its TMA tensor) of `stores` stored by TMA, `chunks` buffers each; returns once the stores
  have read SMEM."""
  for atom, s_epi, first, tile in stores:
    s_part, g_part = epi_tma_views(atom, s_epi, tile)
    for j in cutlass.range_constexpr(chunks):
      cute.copy(atom, s_part[None, first + j], g_part[None, (0, j)])
  cute.arch.cp_async_bulk_commit_group()
  cute.arch.cp_async_bulk_wait_group(0, read=True)


@cute.jit
def tma_store_epilogue(accs, stores, s_c, tiled_mma, tidx, leader, swiglu: cutlass.Constexpr,
                        barrier_id: cutlass.Constexpr = EPILOGUE_BARRIER,
                        threads: cutlass.Constexpr = THREADS, first_buffer=0,
                        m_major: cutlass.Constexpr = False, rolling: cutlass.Constexpr = False,
                        epi_tile: cutlass.Constexpr = EPI_TILE, row_limit=None,
                        first_chunk: cutlass.Constexpr = 0):
  """The output tiles through SMEM: epi_tile column slices at a time, each thread writes its
  fragments' outputs to an SMEM buffer (stmatrix, swizzled; EPI_STAGES buffers of s_c from
  first_buffer: here over A's stages), then the leader warp (warp 0) stores the buffer by TMA
  and waits before a buffer is reused. stores: (TMA atom, that output's (BLOCK_M, block_n)
  tile of its TMA tensor) per output. The `threads` threads of tiled_mma (thread tidx here)
  sync on named barrier barrier_id. m_major: the outputs (and s_c) are M-major (columns
  contiguous; stmatrix writes its 8 x 8 blocks transposed). rolling (a persistent CTA's
  epilogue): the leader waits for a buffer's last store right before the buffer is written
  again, not after each store, and not for the tile's last stores, which read on under the
  CTA's next tile; it waits for them once (store_tail) before the CTA exits. first_chunk
  (rolling): the buffer the tile's first chunk takes, counted from first_buffer (the CTA's
  chunks so far modulo EPI_STAGES: the buffers taken in turn across tiles whose chunks do not
  fill them whole). epi_tile: the buffers' shape, EPI_TILE, or fewer rows than the tile
  (the ping-pong kernel's 192-row tiles: (64, 64)), which are then stored one row block at a
  time down each column slice, and with row_limit (a count of rows) only the row blocks
  starting above it (the later ones are the tile's rows past its group: not stored, and,
  skipped last, never leave a buffer written under a store still reading it)."""
  dtype = s_c.element_type
  layout = LayoutEnum.COL_MAJOR if m_major else LayoutEnum.ROW_MAJOR
  r2s = cute.make_tiled_copy_S(
      sm90_utils.get_smem_store_op(layout, dtype, cutlass.Float32),
      cute.make_tiled_copy_C_atom(
          cute.make_copy_atom(cute.nvgpu.warp.StMatrix8x8x16bOp(m_major, 4), dtype), tiled_mma))
  thr_r2s = r2s.get_slice(tidx)
  s_dst = thr_r2s.partition_D(s_c)                       # (R2S, R2S_M, R2S_N, EPI_STAGES)
  # a chunk's fragment: (R2S values, R2S_M, R2S_N), an EPI_TILE's (rows, 16-column groups)
  chunk_layout = cute.make_layout(cute.shape(thr_r2s.partition_S(s_c))[:3])
  chunk_size = cute.size(chunk_layout)
  chunk_vals, chunk_m, chunk_n = (cute.size(chunk_layout, mode=[i]) for i in range(3))
  # accumulators (or dh's bf16/f16 outputs) seen as ((R2S values, 16-column groups), MMA_M, 1)
  acc_views = [r2s.retile(acc) for acc in accs]
  gmem_parts = [epi_tma_views(atom, s_c, tile, epi_tile) for atom, tile in stores]
  buffers = pipeline.PipelineTmaStore.create(
      num_stages=EPI_STAGES,
      producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, threads))
  chunks = cute.size(stores[0][1], mode=[1]) // epi_tile[1]
  # the buffers down the tile's rows: 1 where a buffer spans them, else one per row block
  row_steps = cute.size(acc_views[0], mode=[1]) // chunk_m
  rows = row_steps * epi_tile[0] if row_limit is None else row_limit   # those stored
  for row_step in cutlass.range_constexpr(row_steps):
    for chunk in cutlass.range_constexpr(chunks):
      if rows > row_step * epi_tile[0]:
        step = row_step * chunks + chunk
        vals = []
        for view in acc_views:
          frag = cute.make_rmem_tensor_like(chunk_layout, view.element_type)
          for v in cutlass.range_constexpr(chunk_size):
            frag[v] = view[acc_coord(v, chunk, chunk_vals, chunk_m, chunk_n, row_step * chunk_m)]
          vals.append(frag.load().to(cutlass.Float32))
        outs = epilogue_values(vals, swiglu)
        for j in cutlass.range_constexpr(len(stores)):
          buf = first_buffer + (first_chunk + step * len(stores) + j) % EPI_STAGES
          if cutlass.const_expr(rolling):
            if leader:
              buffers.producer_acquire()   # its last store (maybe the last tile's) read it
            cute.arch.barrier(barrier_id=barrier_id, number_of_threads=threads)
          frag = cute.make_rmem_tensor_like(chunk_layout, dtype)
          frag.store(outs[j].to(dtype))
          cute.copy(r2s, frag, s_dst[None, None, None, buf])
          cute.arch.fence_proxy("async.shared", space="cta")   # visible to the TMA engine
          cute.arch.barrier(barrier_id=barrier_id, number_of_threads=threads)
          if leader:
            s_part, g_part = gmem_parts[j]
            cute.copy(stores[j][0], s_part[None, buf], g_part[None, (row_step, chunk)])
            buffers.producer_commit()
            if cutlass.const_expr(not rolling):
              buffers.producer_acquire()   # the next buffer's last store has read it
          if cutlass.const_expr(not rolling):
            cute.arch.barrier(barrier_id=barrier_id, number_of_threads=threads)
  if cutlass.const_expr(not rolling):
    store_tail(leader)


@cute.jit
def store_tail(leader):
  """The leader: wait until every TMA store it issued has read its SMEM (the end of a
  tma_store_epilogue, or of a persistent CTA whose rolling epilogues left theirs reading)."""
  if leader:
    cute.arch.cp_async_bulk_wait_group(0, read=True)


def acc_coord(v: int, chunk: int, chunk_vals: int, chunk_m: int, chunk_n: int,
               first_row_block: int = 0):
  """The accumulator view's coordinate ((value, column group), row block, 0) of element v of
  epilogue chunk `chunk`'s fragment (chunk_layout: values fastest, then row blocks, then column
  groups), its row blocks first_row_block onwards. The view orders column groups before row
  blocks, so with several row blocks (the ping-pong kernel's two m64 wgmmas) a chunk is not a
  contiguous range of it."""
  value, m, group = v % chunk_vals, v // chunk_vals % chunk_m, v // (chunk_vals * chunk_m)
  return ((value, chunk * chunk_n + group), first_row_block + m, 0)
