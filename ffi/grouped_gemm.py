"""Varlen-M grouped GEMMs for Hopper as CuTe DSL kernels behind XLA FFI calls.

out[rows of M tile m] = lhs[rows of M tile m] @ rhs[tile_expert[m]] (grouped_matmul), with
the SwiGLU epilogue H = [gate | up] and A = silu(gate) * up (up_proj), or with the dSwiGLU
epilogue (dh: dH, A' = s A and dS parts from dA' = dOg W2_e^T, H and the scores), for a routing
plan aligned to BLOCK_M rows per expert (every M tile has one expert; tiles past the last group,
marked tile_expert >= E, store zeros). lhs [P, K] rows in slot order, rhs [E, K, N], out [P, N].
The same kernel computes the varlen-K weight gradients (weight_grad: out[e] = lhs_e^T rhs_e over
expert e's rows, one grid plane per expert, lhs read M-major and rhs N-major by TMA; or lhs's
rows gathered in the kernel, _gather_k_step, the producer copying both MMA warpgroups' 64
columns of the stage's 64 gathered rows; out [E, M, N], or with transpose_out [E, N, M] stored
by the same epilogue M-major).

Tiling (one CTA per BLOCK_M x block_n output tile, grid (N / block_n, P / BLOCK_M): an M tile's
column tiles run next to each other, so its lhs rows are read from HBM once and then from L2):
  warps    : WARPGROUPS MMA warpgroups, each owning BLOCK_M / WARPGROUPS rows of the tile;
             their warp 0 also issues the TMA loads, but in the gathering kernels (below) and
             with warp_specialized, where a third warpgroup, the producer, loads every stage
  mainloop : lhs[m, kk] (K-major) and rhs_e[kk, n] (N- or K-major) tiles of BLOCK_K by TMA
             through a `stages`-deep mbarrier pipeline; one k step's wgmmas stay in flight
             while the next step's are issued, and a stage is refilled once its wgmmas are done
  gather   : with gather_index (up_proj, dh, weight_grad) lhs is X (or dO) and A's stages are
             filled by 16-byte cp.async copies of the rows it names: a third warpgroup,
             warpgroup 0, is the producer (its registers lowered by setmaxnreg, the MMA
             warpgroups' raised): it copies every stage's rows for both MMA warpgroups and
             TMA-loads the rhs tiles, the copies completing on the stage's mbarrier
             (_produce_gathered), and the MMA warpgroups wait for full stages and fence (the
             copies are generic-proxy writes) before their wgmmas. (The MMA warpgroups
             issuing the copies between their wgmmas, the design before, ran up_proj and dW1
             1.06-1.24x slower on the H200, dh and dW2 up to 5% faster at 30B-n256: session
             14.)
  epilogue : _epilogue_values gives the output tiles' values (out = acc; or SwiGLU's H gate,
             H up and A from two accumulators: W1's gate columns c and up columns n + c,
             loaded as two rhs tiles per stage); _tma_store_epilogue writes them through SMEM
             buffers over A's stages and TMA stores (each thread storing its fragments from
             registers took 1.4-1.7x as long in down_proj and dx_tilde at 30B-n256 and up to
             10% longer in up_proj, 2% shorter at one of its 8 tiles: session 6's sweep). dh
             first computes its dH and A' tiles in registers (_dh_outputs: it loads H a few
             column groups ahead of their math, and writes dS's parts), then stores them from
             registers (register_store), or (dh(tma_store=True): bitwise the same) the same TMA
             way. dh(h_smem=True) reads H from SMEM instead, its tile TMA-loaded over the rhs
             stages once the mainloop is done, and with tma_store writes dH over it and A'
             over the lhs stages, stored by TMA from there.
"""
from __future__ import annotations

import cutlass
import cutlass.cute as cute
import cutlass.memory
import cutlass.pipeline as pipeline
import cutlass.utils.hopper_helpers as sm90_utils
import jax
import jax.numpy as jnp
from cutlass.cute.nvgpu import cpasync, warpgroup
from cutlass.tensor_utils import LayoutEnum

from ffi import xla_call
from sonicmoe_jax import routing

BLOCK_M = 128
BLOCK_K = 64
WARPGROUPS = 2
THREADS = 128 * WARPGROUPS
SMEM_BYTES = 227 * 1024
BARRIER_BYTES = 1024        # SMEM kept for the pipeline's mbarriers
EPI_TILE = (BLOCK_M, 64)    # the TMA-store epilogue's SMEM buffer: a (BLOCK_M, 64) column slice
EPI_STAGES = 2              # its buffers (they reuse A's pipeline stages, at least 2)
MAX_GRID_Y = 65535          # CUDA's limit on the grid's second dimension (the M tiles)
MAX_REGISTER_ADDRESSED = 2**31 - 1   # elements of an operand read or written by 32-bit offsets
LOG2E = 1.4426950408889634   # log2(e): e^x = 2^(x log2 e)
ROW_MODES = (1, 2, 0)       # how the kernel sees a [1, P, C] operand: (P, C, 1)
EPILOGUE_BARRIER = 3        # named barrier id of the MMA warpgroups' epilogue syncs
# dH's tiles up to this wide can run two CTAs per SM (reading dOg in slot order, 3 stages, at
# most 128 registers); wider ones run one whatever their stages and registers.
DH_TWO_CTAS_MAX_BLOCK_N = 128
# dH's epilogue: H's column groups loaded this many groups ahead of their math. Wide tiles take
# 8 (block_n 256: 174 -> 210 registers); two-CTA ones 2, where 8 took block_n 128 from 112 to
# 146 registers, no longer two CTAs per SM, and spilled in the ping-pong dH.
DH_LOAD_AHEAD_WIDE, DH_LOAD_AHEAD_NARROW = 8, 2
# dh(h_smem=True): H's gate and up tiles (2 x BLOCK_M x block_n) over the rhs stages (stages x
# block_n x BLOCK_K) need this many
H_SMEM_MIN_STAGES = 2 * BLOCK_M // BLOCK_K
WGMMA_MAX_N = 256           # the widest N of one Hopper wgmma: dH's widest column tile
# up_proj's widest column tile: its two accumulators (gate and up) of a 256-wide tile need 256
# fp32 registers a thread and spill (session 24: a 2040-byte stack, 20x slower)
UP_PROJ_MAX_BLOCK_N = 128
GATHER_CHUNKS = BLOCK_K * 2 // 16                      # 16-byte cp.async chunks per bf16 row
GATHER_ROWS_PER_THREAD = (BLOCK_M // WARPGROUPS) * GATHER_CHUNKS // 128
# the weight gradient's gather (rows along K): a warpgroup's 8-column chunks of a row, and each
# thread's (row, chunk) copies per k step
K_CHUNKS_PER_WG = BLOCK_M // WARPGROUPS // 8
K_GATHERS_PER_THREAD = BLOCK_K * K_CHUNKS_PER_WG // 128
# gathering, a third warpgroup (warpgroup 0) loads every stage; a stage's full barrier
# completes on the TMA bytes and PRODUCER_ARRIVALS arrivals (the TMA warp's, then two per
# producer thread: its cp.async copies landed, its padding rows' plain stores released)
PRODUCER_ARRIVALS = 1 + 2 * 128   # (ffi/pingpong.py's gathering producer too)
# setmaxnreg budgets (producer, MMA warpgroups): 128 x 56 + 256 x 224 = 64512, what the CTA gets
# at launch (384 threads x 168 registers; an increase past it waits for ever)
PRODUCER_REGISTERS, MMA_REGISTERS = 56, 224


def smem_bytes(block_n: int, num_rhs: int, itemsize: int, stages: int, rows: int = BLOCK_M) -> int:
  """A CTA's SMEM: `stages` pipeline stages (a `rows`-row lhs tile and num_rhs rhs tiles each)
  and 1 KiB for the barriers (the epilogue's buffers reuse the lhs stages)."""
  per_stage = (rows + num_rhs * block_n) * BLOCK_K * itemsize
  return stages * per_stage + BARRIER_BYTES


def _stages_that_fit(block_n: int, num_rhs: int, itemsize: int, rows: int = BLOCK_M,
                     reserved: int = 0) -> int:
  """How many pipeline stages fit in SMEM (smem_bytes) beside `reserved` other bytes."""
  per_stage = smem_bytes(block_n, num_rhs, itemsize, 1, rows) - BARRIER_BYTES
  return (SMEM_BYTES - BARRIER_BYTES - reserved) // per_stage


def _pipeline_depth(block_n: int, num_rhs: int, itemsize: int, k_steps: int, stages) -> int:
  """The stages a kernel runs: `stages` if given (fewer leave SMEM for a second CTA per SM),
  else as many as fit, at most 8 and at most the k steps (at least 2). Raises ValueError,
  naming the limit, if the given ones do not fit."""
  fit = _stages_that_fit(block_n, num_rhs, itemsize)
  if stages is None:
    return max(2, min(8, fit, k_steps))
  if not 2 <= stages <= fit:
    raise ValueError(f"stages={stages} must be between 2 and {fit} (what fits in SMEM at "
                     f"block_n={block_n})")
  return stages


def epi_tma_views(atom, s_epi, tile, epi_tile=EPI_TILE):
  """(SMEM part, global part) of a TMA atom over epi_tile buffers s_epi (indexed [None,
  buffer]) and a tile of its TMA tensor cut into epi_tile chunks (indexed [None, (row block,
  chunk)]: (0, chunk) where the buffers span the tile's rows)."""
  return cpasync.tma_partition(atom, 0, cute.make_layout(1), cute.group_modes(s_epi, 0, 2),
                               cute.zipped_divide(tile, epi_tile))


@cute.jit
def prefetch_descriptors(warp, tma_a, tma_b, gather: cutlass.Constexpr):
  """Warp 0: the operands' TMA descriptors into the cache (A's only where it is not gathered)."""
  if warp == 0:
    if cutlass.const_expr(not gather):
      cpasync.prefetch_descriptor(tma_a)
    cpasync.prefetch_descriptor(tma_b)


@cute.jit
def load_pipeline(storage, stages: cutlass.Constexpr, stage_bytes: cutlass.Constexpr,
                  gather: cutlass.Constexpr, consumer_threads: cutlass.Constexpr, tidx,
                  extra_barriers: cutlass.Constexpr = 0, cluster_m: cutlass.Constexpr = 1,
                  cluster_n: cutlass.Constexpr = 1):
  """The kernels' load ring: a PipelineTmaAsync over storage's first 2 x stages mbarriers (it
  initialises them, fences and syncs the CTA, or the cluster). A full barrier completes on the
  stage's TMA bytes and, gathering, every producer thread's copies (PRODUCER_ARRIVALS); an
  empty one on each of the consumer_threads' warps. In a cluster of 2 CTAs, along M
  (cluster_m 2: neighbouring row tiles sharing the rhs's stages by multicast: tma_operand) or
  along N (cluster_n 2: neighbouring column tiles of one row tile sharing the lhs's stages), it
  counts each of both CTAs' consumer warps, lane r of a warp arriving on CTA r's barrier (a
  stage is refilled in both CTAs at once). Thread tidx 0 first initialises extra_barriers more
  after them: a count (one arrival each: an epilogue's H loads) or a tuple of each one's
  arrivals. Returns (the pipeline, the first extra barrier's pointer)."""
  extra = storage.barriers.data_ptr() + 2 * stages
  arrivals = ((1,) * extra_barriers if isinstance(extra_barriers, int) else tuple(extra_barriers))
  if cutlass.const_expr(len(arrivals) > 0):
    if tidx == 0:
      for i in cutlass.range_constexpr(len(arrivals)):
        cute.arch.mbarrier_init(extra + i, arrivals[i])
  consumers, multicast = consumer_threads // 32, {}   # one arrival per consumer warp
  if cutlass.const_expr(cluster_m * cluster_n > 1):   # (the pipeline counts the warps of both CTAs)
    consumers = consumer_threads
    # the multicast mode names the tile coordinate the cluster's CTAs share: N along M, M along N
    multicast = dict(tidx=tidx, mcast_mode_mn=(0, 1) if cluster_m > 1 else (1, 0),
                     enable_multicast_signaling=True)
  loads = pipeline.PipelineTmaAsync.create(
      barrier_storage=storage.barriers.data_ptr(), num_stages=stages,
      producer_group=pipeline.CooperativeGroup(
          pipeline.Agent.Thread, PRODUCER_ARRIVALS if gather else 1),
      consumer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, consumers),
      tx_count=stage_bytes, cta_layout_vmnk=cute.make_layout((1, cluster_m, cluster_n, 1)),
      **multicast)
  return loads, extra


def tma_operand(atom, smem, gmem, cluster_rank=0, cluster_size: int = 1):
  """(atom, gmem tiles by k step, smem stages, multicast mask) of a TMA-loaded operand:
  load_stage's operand. With cluster_size 2 (atom made with num_multicast=2) this CTA, rank
  cluster_rank, loads its half of each tile into both CTAs of the cluster; else the mask is
  None (a plain load)."""
  s_part, g_part = cpasync.tma_partition(atom, cluster_rank, cute.make_layout(cluster_size),
                                         cute.group_modes(smem, 0, 2),
                                         cute.group_modes(gmem, 0, 2))
  mask = None if cluster_size == 1 else cutlass.Int16((1 << cluster_size) - 1)
  return atom, g_part, s_part, mask


def tma_load(operand, k, stage, bar):
  """TMA-load k step k of a tma_operand into SMEM stage `stage`, completing on mbarrier bar
  (with its multicast mask: in every CTA of the cluster, each on its own barrier)."""
  atom, src, dst, mask = operand
  if mask is None:
    cute.copy(atom, src[(None, k)], dst[(None, stage)], tma_bar_ptr=bar)
  else:
    cute.copy(atom, src[(None, k)], dst[(None, stage)], tma_bar_ptr=bar, mcast_mask=mask)


@cute.jit
def issue_k_step(tiled_mma, accs, frag_a, frag_bs, stage):
  """One k step's wgmmas on SMEM stage `stage` (each accumulator with its rhs fragments),
  committed as one group."""
  warpgroup.fence()
  for kb in cutlass.range(cute.size(frag_a, mode=[2]), unroll_full=True):
    for acc, frag_b in zip(accs, frag_bs):
      cute.gemm(tiled_mma, acc, frag_a[None, None, kb, stage], frag_b[None, None, kb, stage], acc)
  warpgroup.commit_group()


@cute.jit
def consume_tile(loads, consume, release, tiled_mma, accs, frag_a, frag_bs, num_k,
                 gather: cutlass.Constexpr):
  """A consumer warpgroup's mainloop of one tile of a persistent kernel: accs zeroed, then
  each of its num_k ring stages waited for (gathered stages fenced for the async proxy first),
  its wgmmas issued, the previous step's stage released once they are done. Returns the
  advanced states; the last stage is still held and its wgmmas may be running
  (release_last_stage)."""
  for acc in accs:
    acc.fill(0.0)
  for kk in cutlass.range(num_k, unroll=1):
    loads.consumer_wait(consume)
    if cutlass.const_expr(gather):   # the gathered rows are generic-proxy writes
      cute.arch.fence_proxy("async.shared", space="cta")
    issue_k_step(tiled_mma, accs, frag_a, frag_bs, consume.index)
    consume.advance()
    warpgroup.wait_group(1)   # step kk - 1's wgmmas are done, so its stage is free
    if kk > 0:
      loads.consumer_release(release)
      release.advance()
  return consume, release


@cute.jit
def release_last_stage(loads, release, num_k):
  """Once a tile's wgmmas are done, its last stage back to the producer (which is already
  filling the others). Returns the advanced release state."""
  warpgroup.wait_group(0)
  if num_k > 0:
    loads.consumer_release(release)
    release.advance()
  return release


def load_stage(loads, state, operands, k):
  """The producer: TMA loads (tma_load) of k step k of each operand (tma_operand) into stage
  state.index, completing on that stage's mbarrier."""
  loads.producer_acquire(state)
  bar = loads.producer_get_barrier(state)
  for operand in operands:
    tma_load(operand, k, state.index, bar)
  loads.producer_commit(state)


def sigmoid(x):
  """1 / (1 + e^-x) of fp32 vectors by the special function unit: ex2.approx of -x log2(e),
  then rcp.approx of 1 + that (relative error about 2^-21, far below the bf16 outputs'
  rounding). The precise forms (a range-split e^x, an IEEE divide with its slow-path branch)
  made the SwiGLU epilogues bound dH (session 24: dH 8-17% and the step's kernels 3-6% faster
  this way)."""
  return cute.math.rcp(1.0 + cute.math.exp2(x * -LOG2E, fastmath=True), approx=True,
                       ftz=True)


@cute.jit
def _epilogue_values(vals, swiglu: cutlass.Constexpr):
  """The output tiles' values (fp32) from the register tiles' (matching the stores' order):
  plain, one output per tile (out = acc; dh's dH gate, dH up and A' tiles as computed);
  SwiGLU, H's gate and up tiles = the two accumulators and A = silu(gate) * up."""
  if cutlass.const_expr(swiglu):
    gate, up = vals
    return [gate, up, gate * sigmoid(gate) * up]
  return list(vals)


@cute.jit
def _group_fp32(src):
  """A small global (or register) slice loaded into registers, in fp32."""
  return _load_group(src).to(cutlass.Float32)


@cute.jit
def _load_group(src):
  """A small global (or register) slice loaded into registers, in its own dtype."""
  frag = cute.make_rmem_tensor(src.shape, src.element_type)
  cute.autovec_copy(src, frag)
  return frag.load()


def acc_chunks(tiles, thr_mma):
  """Tiles of global memory (the accumulator's shape) partitioned like it, one chunk each:
  _dh_outputs's sources (H's gate and up tiles) or destinations (dH's and A''s)."""
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
def _dh_outputs(acc, h_srcs, score_tile, m_ds, thr_mma, tidx, row0, n_tile, dtype, out_dsts,
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
    s = _group_fp32(s_src[((None, None, 0), m, 0)])
    ahead = [[_load_group(src) for src in h_group(k, m)] for k in range(load_ahead)]
    for k in cutlass.range_constexpr(groups):
      if cutlass.const_expr(k + load_ahead < groups):
        ahead.append([_load_group(src) for src in h_group(k + load_ahead, m)])
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
def _load_h_tile(tma_h, h_tiles, s_h, bar, nbytes: cutlass.Constexpr):
  """The leader warp: H's gate and up tiles (h_tiles, of H's TMA tensor) into s_h's EPI_TILE
  buffers (gate chunks first) by TMA, completing on mbarrier `bar` (nbytes in all)."""
  with cute.arch.elect_one():
    cute.arch.mbarrier_arrive_and_expect_tx(bar, nbytes)
  chunks = cute.size(h_tiles[0], mode=[1]) // EPI_TILE[1]
  for half in cutlass.range_constexpr(2):
    s_part, g_part = epi_tma_views(tma_h, s_h, h_tiles[half])
    for j in cutlass.range_constexpr(chunks):
      cute.copy(tma_h, g_part[None, (0, j)], s_part[None, half * chunks + j], tma_bar_ptr=bar)


@cute.jit
def _store_tiles_tma(stores, chunks: cutlass.Constexpr):
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
def _tma_store_epilogue(accs, stores, s_c, tiled_mma, tidx, leader, swiglu: cutlass.Constexpr,
                        barrier_id: cutlass.Constexpr = EPILOGUE_BARRIER,
                        threads: cutlass.Constexpr = THREADS, first_buffer=0,
                        m_major: cutlass.Constexpr = False, rolling: cutlass.Constexpr = False,
                        epi_tile: cutlass.Constexpr = EPI_TILE, row_limit=None):
  """The output tiles through SMEM: epi_tile column slices at a time, each thread writes its
  fragments' outputs to an SMEM buffer (stmatrix, swizzled; EPI_STAGES buffers of s_c from
  first_buffer: here over A's stages), then the leader warp (warp 0) stores the buffer by TMA
  and waits before a buffer is reused. stores: (TMA atom, that output's (BLOCK_M, block_n)
  tile of its TMA tensor) per output. The `threads` threads of tiled_mma (thread tidx here)
  sync on named barrier barrier_id. m_major: the outputs (and s_c) are M-major (columns
  contiguous; stmatrix writes its 8 x 8 blocks transposed). rolling (a persistent CTA's
  epilogue, its tiles' chunks a multiple of EPI_STAGES): the leader waits for a buffer's last
  store right before the buffer is written again, not after each store, and not for the tile's
  last stores, which read on under the CTA's next tile; it waits for them once (store_tail)
  before the CTA exits. epi_tile: the buffers' shape, EPI_TILE, or fewer rows than the tile
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
            frag[v] = view[_acc_coord(v, chunk, chunk_vals, chunk_m, chunk_n, row_step * chunk_m)]
          vals.append(frag.load().to(cutlass.Float32))
        outs = _epilogue_values(vals, swiglu)
        for j in cutlass.range_constexpr(len(stores)):
          buf = first_buffer + (step * len(stores) + j) % EPI_STAGES
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
  _tma_store_epilogue, or of a persistent CTA whose rolling epilogues left theirs reading)."""
  if leader:
    cute.arch.cp_async_bulk_wait_group(0, read=True)


def _acc_coord(v: int, chunk: int, chunk_vals: int, chunk_m: int, chunk_n: int,
               first_row_block: int = 0):
  """The accumulator view's coordinate ((value, column group), row block, 0) of element v of
  epilogue chunk `chunk`'s fragment (chunk_layout: values fastest, then row blocks, then column
  groups), its row blocks first_row_block onwards. The view orders column groups before row
  blocks, so with several row blocks (the ping-pong kernel's two m64 wgmmas) a chunk is not a
  contiguous range of it."""
  value, m, group = v % chunk_vals, v // chunk_vals % chunk_m, v // (chunk_vals * chunk_m)
  return ((value, chunk * chunk_n + group), first_row_block + m, 0)


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
def _gather_tokens(gather_index, m_tile, tidx):
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
  (GATHER_CHUNKS per row, one per thread of a group of them; tokens from _gather_tokens); rows
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
def start_stage(loads, state, rhs_operands, k, first_warp):
  """A gathering producer's k step k into stage state.index: each of its warps waits until the
  stage is free; its first warp (first_warp: whether this thread is in it; the whole warp: the
  arrive and the copies elect one lane with elect.sync, which one lane alone must not reach)
  arrives with the stage's expected TMA bytes and TMA-loads the rhs tiles. Returns the
  stage's full barrier."""
  loads.sync_object_empty.wait(state.index, state.phase)
  bar = loads.producer_get_barrier(state)
  if first_warp:
    loads.sync_object_full.arrive(state.index, loads.producer_mask)
    for operand in rhs_operands:
      tma_load(operand, k, state.index, bar)
  return bar


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
  bar = start_stage(loads, state, rhs_operands, k, ptid < 32)
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
    bar = start_stage(loads, produce, rhs_operands, k, warp == 0)
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
  previous step's copies instead of stalling the cp.asyncs that need them (session 24's ncu
  of dW1 at olmoe: 41% of the producer's samples waited on that load, the MMA warpgroups
  on full stages; reading ahead, dW1 6.5% and dW2 4.9% faster there). The reads ahead are
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
def _produce_gathered(loads, rhs_operands, x, gather_index, s_a, num_k, m_tile, k_begin, ptid,
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
    tile_tokens = [_gather_tokens(gather_index, m_tile, ptid + 128 * wg)
                   for wg in range(WARPGROUPS)]
    for step in cutlass.range(num_k, unroll=1):
      gather_stage(loads, produce, x, tile_tokens, s_a, rhs_operands, k_begin + step, ptid, 0,
                   kind)
      produce.advance()


@cute.kernel
def _kernel(tma_a: cute.CopyAtom, m_a: cute.Tensor, tma_b: cute.CopyAtom, m_b: cute.Tensor,
            m_out: cute.Tensor, m_out2: cute.Tensor, tma_out: cute.CopyAtom,
            m_out_tma: cute.Tensor, tma_out2: cute.CopyAtom, m_out2_tma: cute.Tensor,
            m_h: cute.Tensor, m_scores: cute.Tensor, m_ds: cute.Tensor, tma_h: cute.CopyAtom,
            m_h_tma: cute.Tensor, h_smem_staged: cute.ComposedLayout, chunk_mma: cute.TiledMma,
            tile_expert: cute.Tensor, gather_index: cute.Tensor, tiled_mma: cute.TiledMma,
            a_smem_staged: cute.ComposedLayout, b_smem_staged: cute.ComposedLayout,
            c_smem_staged: cute.ComposedLayout, num_experts: cutlass.Int32,
            shared_storage: cutlass.Constexpr, block_n: cutlass.Constexpr,
            stages: cutlass.Constexpr, stage_bytes: cutlass.Constexpr, kind: cutlass.Constexpr,
            gather: cutlass.Constexpr, register_store: cutlass.Constexpr,
            out_m_major: cutlass.Constexpr, producer: cutlass.Constexpr,
            h_smem: cutlass.Constexpr, tma_gather: cutlass.Constexpr,
            k_steps: cutlass.Constexpr):
  swiglu = kind == "swiglu"
  copies = gather and not tma_gather   # A's rows copied by the producer's threads (cp.async)
  # with a producer warpgroup (always when gathering) warpgroup 0 loads and warpgroups 1, 2
  # compute: their threads' and warps' indices in the MMA warpgroups (else those are the CTA's)
  first_mma_warp = 4 if producer else 0
  tidx, _, _ = cute.arch.thread_idx()
  n_tile, m_tile, z_tile = cute.arch.block_idx()
  num_n_tiles = cute.arch.grid_dim()[0]
  warp = cute.arch.make_warp_uniform(cute.arch.warp_idx())
  prefetch_descriptors(warp, tma_a, tma_b, copies)

  num_k = cutlass.Int32(0)   # k steps: none for a tile past the last group or an empty expert
  k_begin = cutlass.Int32(0)
  if cutlass.const_expr(kind == "wgrad"):
    # grid z: the expert, whose rows are the k range (tile_expert holds group_rows: each
    # expert's first row and end); rhs is one [P, N] tensor, out [E, M, N]
    expert = z_tile
    k_begin, num_k = routing.group_row_steps(tile_expert, expert, BLOCK_K)
    rhs_l, out_l = 0, expert
  else:
    owner = tile_expert[m_tile]
    expert = cutlass.min(owner, num_experts - 1)   # a valid coordinate; unused past the groups
    if owner < num_experts:
      num_k = k_steps
    rhs_l, out_l = expert, 0
  tile_mnk = (BLOCK_M, block_n, BLOCK_K)
  tile_of = lambda t, n, l, proj: cute.local_tile(t, tile_mnk, (m_tile, n, None, l), proj=proj)
  # rhs column blocks: one, or SwiGLU's gate and up blocks (columns c and n + c of W1)
  half_cols = [n_tile, n_tile + num_n_tiles]   # a [P, 2n] tensor's gate and up column tiles
  rhs_cols = half_cols if cutlass.const_expr(swiglu) else [n_tile]
  g_bs = [tile_of(m_b, c, rhs_l, (None, 1, 1)) for c in rhs_cols]   # (bN, bK, k) each

  smem = cutlass.memory.SmemAllocator()
  storage = smem.allocate(shared_storage)
  s_a = storage.s_a.get_tensor(a_smem_staged.outer, swizzle=a_smem_staged.inner)
  s_bs = [buf.get_tensor(b_smem_staged.outer, swizzle=b_smem_staged.inner)
          for buf in ([storage.s_b, storage.s_b2] if cutlass.const_expr(swiglu) else [storage.s_b])]
  # (h_smem: h_bar, H's tile landed)
  loads, h_bar = load_pipeline(storage, stages, stage_bytes, copies, THREADS, tidx,
                               1 if h_smem else 0)

  operands = [tma_operand(tma_b, sb, gb) for sb, gb in zip(s_bs, g_bs)]
  if cutlass.const_expr(not gather):   # else A's stages are filled by the gathers
    g_a = tile_of(m_a, n_tile, 0, (1, None, 1))                     # (bM, bK, k)
    operands = [tma_operand(tma_a, s_a, g_a)] + operands
  cute.arch.sync_threads()   # barriers initialised before anyone waits on them

  if warp < first_mma_warp:   # the producer warpgroup (none without `producer`)
    if cutlass.const_expr(producer):
      cute.arch.setmaxregister_decrease(PRODUCER_REGISTERS)
      if cutlass.const_expr(gather):
        rows_by_tma = None   # (tma_gather: the rows' boxes and their lines in the stages)
        if cutlass.const_expr(tma_gather):
          rows_by_tma = row_boxes(tma_a, m_a, storage.s_a, a_smem_staged)
        _produce_gathered(loads, operands, m_a, gather_index, s_a, num_k, m_tile, k_begin, tidx,
                          stages, kind, rows_by_tma)
      elif warp == 0:   # TMA loads only: its warp 0 issues every stage's
        produce = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, stages)
        for _ in cutlass.range(num_k, unroll=1):
          load_stage(loads, produce, operands, k_begin + produce.count)
          produce.advance()
  else:   # the MMA warpgroups: mainloop, then the epilogue (in this branch: ptxas gives them
          # the registers setmaxnreg raised)
    if cutlass.const_expr(producer):
      cute.arch.setmaxregister_increase(MMA_REGISTERS)
    mma_tidx = tidx - 32 * first_mma_warp
    leader = warp == first_mma_warp   # their first warp (TMA loads without a producer; stores)
    thr_mma = tiled_mma.get_slice(mma_tidx)
    frag_a = tiled_mma.make_fragment_A(thr_mma.partition_A(s_a))
    frag_bs = [tiled_mma.make_fragment_B(thr_mma.partition_B(sb)) for sb in s_bs]
    accs = [cute.make_rmem_tensor(thr_mma.partition_C(tile_of(m_out, n_tile, 0, (1, 1, None))).shape,
                                  cutlass.Float32)
            for _ in s_bs]
    for acc in accs:
      acc.fill(0.0)
    tiled_mma.set(warpgroup.Field.ACCUMULATE, True)

    produce = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, stages)
    consume = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, stages)
    release = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, stages)

    if cutlass.const_expr(not producer):   # without a producer, the first stages' TMA loads
      if leader:
        for _ in cutlass.range(cutlass.min(stages, num_k), unroll=1):
          load_stage(loads, produce, operands, k_begin + produce.count)
          produce.advance()

    for kk in cutlass.range(num_k, unroll=1):
      loads.consumer_wait(consume)
      if cutlass.const_expr(copies):   # the copied rows are generic-proxy writes
        cute.arch.fence_proxy("async.shared", space="cta")
      issue_k_step(tiled_mma, accs, frag_a, frag_bs, consume.index)
      consume.advance()
      warpgroup.wait_group(1)   # step kk - 1's wgmmas are done, so its stage is free
      if kk > 0:
        loads.consumer_release(release)
        release.advance()
        if cutlass.const_expr(not producer):
          if leader and produce.count < num_k:
            load_stage(loads, produce, operands, k_begin + produce.count)
            produce.advance()
    warpgroup.wait_group(0)

    # out's tile (or H's, or dH's, gate and up tiles, then A's or A''s): (TMA atom, its TMA
    # tensor, the output, column tile)
    outputs = [(tma_out, m_out_tma, m_out, c) for c in (half_cols if kind == "dh" else rhs_cols)]
    if cutlass.const_expr(swiglu or kind == "dh"):
      outputs = outputs + [(tma_out2, m_out2_tma, m_out2, n_tile)]
    tiles = accs
    if cutlass.const_expr(kind == "dh"):   # dH's and A''s tiles in registers from H and scores
      h_tiles = [tile_of(m_h, c, 0, (1, 1, None)) for c in half_cols]
      # each row's score broadcast along the tile's columns (stride 0)
      scores = cute.make_tensor(m_scores.iterator, cute.make_layout(
          (cute.size(m_scores), block_n, 1), stride=(1, 0, 0)))
      h_srcs = acc_chunks(h_tiles, thr_mma)
      out_dsts = None   # (TMA stores from registers: the tiles returned)
      if cutlass.const_expr(register_store):
        out_dsts = acc_chunks([tile_of(t, c, out_l, (1, 1, None)) for _, _, t, c in outputs],
                              thr_mma)
      chunks = block_n // EPI_TILE[1]
      if cutlass.const_expr(h_smem):   # H's tile by TMA over rhs's stages, once all are read
        cute.arch.barrier(barrier_id=EPILOGUE_BARRIER, number_of_threads=THREADS)
        s_h = cute.make_tensor(cute.recast_ptr(s_bs[0].iterator, h_smem_staged.inner,
                                               dtype=m_h.element_type), h_smem_staged.outer)
        if leader:
          _load_h_tile(tma_h, [tile_of(m_h_tma, c, 0, (1, 1, None)) for c in half_cols], s_h,
                       h_bar, 2 * BLOCK_M * block_n * m_h.element_type.width // 8)
        cute.arch.mbarrier_wait(h_bar, 0)
        h_srcs = smem_chunks(s_h, chunk_mma, mma_tidx, [0, chunks], chunks)
        if cutlass.const_expr(not register_store):
          # dH written over H's buffers (each thread's own values, read before), A' over A's
          # stages, then all three stored by TMA
          s_a_out = cute.make_tensor(cute.recast_ptr(s_a.iterator, h_smem_staged.inner,
                                                     dtype=m_out2.element_type),
                                     h_smem_staged.outer)
          out_dsts = h_srcs + smem_chunks(s_a_out, chunk_mma, mma_tidx, [0], chunks)
      tiles = _dh_outputs(accs[0], h_srcs, tile_of(scores, 0, 0, (1, 1, None)), m_ds, thr_mma,
                          mma_tidx, m_tile * BLOCK_M, n_tile, m_out.element_type, out_dsts,
                          block_n, BLOCK_M)
      if cutlass.const_expr(h_smem and not register_store):
        cute.arch.fence_proxy("async.shared", space="cta")   # visible to the TMA engine
        cute.arch.barrier(barrier_id=EPILOGUE_BARRIER, number_of_threads=THREADS)
        if leader:
          bufs = [(s_h, 0), (s_h, chunks), (s_a_out, 0)]
          _store_tiles_tma([(atom, buf, first, tile_of(t, c, out_l, (1, 1, None)))
                            for (atom, t, _, c), (buf, first) in zip(outputs, bufs)], chunks)
    if cutlass.const_expr(not register_store and not (kind == "dh" and h_smem)):
      # (register stores: dh only, done above; dh with h_smem stored its TMA way above)
      # every warpgroup's wgmmas are done with A's stages: reuse them
      cute.arch.barrier(barrier_id=EPILOGUE_BARRIER, number_of_threads=THREADS)
      s_c = cute.make_tensor(cute.recast_ptr(s_a.iterator, c_smem_staged.inner, dtype=m_out.element_type),
                             c_smem_staged.outer)
      stores = [(atom, tile_of(t, c, out_l, (1, 1, None))) for atom, t, _, c in outputs]
      _tma_store_epilogue(tiles, stores, s_c, tiled_mma, mma_tidx, leader, swiglu,
                          m_major=out_m_major)


def rhs_window(rhs: cute.Tensor, out: cute.Tensor, first_col: int) -> cute.Tensor:
  """rhs (N, K, E)'s columns first_col .. as many as out (P, W, 1) has: the columns a window of
  the product reads (a view, its TMA descriptor starting at that column; first_col a multiple
  of 8: 16 bytes). rhs itself for the whole product. The FFI call passes the whole of rhs: a
  slice of it in XLA may start off the 16-byte alignment the call requires."""
  if cutlass.const_expr(first_col == 0 and cute.size(rhs, mode=[0]) == cute.size(out, mode=[1])):
    return rhs
  return _mode0_view(rhs, first_col, cute.size(out, mode=[1]), 16)


def _mode0_view(tensor: cute.Tensor, first: int, count: int, align: int) -> cute.Tensor:
  """tensor's entries first .. first + count - 1 along mode 0 (the other modes whole) as a view
  with the same strides, its start assumed aligned to `align` bytes."""
  start = tensor.iterator + first * tensor.stride[0]
  return cute.make_tensor(cute.make_ptr(tensor.element_type, start.toint(), cute.AddressSpace.gmem,
                                        assumed_align=align),
                          cute.make_layout((count, *tensor.shape[1:]), stride=tensor.stride))


@cute.jit
def _matmul(stream, lhs: cute.Tensor, rhs: cute.Tensor, tile_expert: cute.Tensor,
            out: cute.Tensor, block_n: cutlass.Constexpr, stages: cutlass.Constexpr,
            warp_specialized: cutlass.Constexpr = False, first_col: cutlass.Constexpr = 0):
  """lhs (P, K, 1) K-major, rhs (N, K, E) N- or K-major, out (P, W, 1) (logical modes): out's
  columns are the product's from first_col on (rhs_window; all of them by default)."""
  _launch(stream, lhs, rhs_window(rhs, out, first_col), tile_expert, tile_expert, out, out, None,
          block_n, stages, "store", False, False, warp_specialized)


@cute.jit
def _up_proj(stream, x: cute.Tensor, w1: cute.Tensor, tile_expert: cute.Tensor, h: cute.Tensor,
             a: cute.Tensor, block_n: cutlass.Constexpr, stages: cutlass.Constexpr,
             warp_specialized: cutlass.Constexpr = False):
  """x (P, d, 1), w1 (2n, d, E) N-major, H (P, 2n, 1), A (P, n, 1) (logical modes)."""
  _launch(stream, x, w1, tile_expert, tile_expert, h, a, None, block_n, stages, "swiglu", False,
          False, warp_specialized)


@cute.jit
def _gathered_up_proj(stream, x: cute.Tensor, w1: cute.Tensor, tile_expert: cute.Tensor,
                      gather_index: cute.Tensor, h: cute.Tensor, a: cute.Tensor,
                      block_n: cutlass.Constexpr, stages: cutlass.Constexpr):
  """_up_proj with x (T, d, 1) the source rows and slot r reading x[gather_index[r]]."""
  _launch(stream, x, w1, tile_expert, gather_index, h, a, None, block_n, stages, "swiglu", True,
          False)


@cute.jit
def _dh(stream, dout_g: cute.Tensor, w2: cute.Tensor, tile_expert: cute.Tensor, h: cute.Tensor,
        scores: cute.Tensor, dh: cute.Tensor, a_scaled: cute.Tensor, ds_parts: cute.Tensor,
        block_n: cutlass.Constexpr, stages: cutlass.Constexpr, register_store: cutlass.Constexpr,
        warp_specialized: cutlass.Constexpr = False, h_smem: cutlass.Constexpr = False):
  """dOg (P, d, 1), w2 (n, d, E) K-major, H (P, 2n, 1), scores (P,), dH (P, 2n, 1), A' (P, n, 1),
  dS parts (n / block_n, P)."""
  _launch(stream, dout_g, w2, tile_expert, tile_expert, dh, a_scaled, (h, scores, ds_parts),
          block_n, stages, "dh", False, register_store, warp_specialized, h_smem)


@cute.jit
def _gathered_dh(stream, dout: cute.Tensor, w2: cute.Tensor, tile_expert: cute.Tensor,
                 gather_index: cute.Tensor, h: cute.Tensor, scores: cute.Tensor, dh: cute.Tensor,
                 a_scaled: cute.Tensor, ds_parts: cute.Tensor, block_n: cutlass.Constexpr,
                 stages: cutlass.Constexpr, register_store: cutlass.Constexpr,
                 h_smem: cutlass.Constexpr = False):
  """_dh with dout (T, d, 1) the source rows and slot r reading dout[gather_index[r]]."""
  _launch(stream, dout, w2, tile_expert, gather_index, dh, a_scaled, (h, scores, ds_parts),
          block_n, stages, "dh", True, register_store, False, h_smem)


@cute.jit
def _weight_grad(stream, lhs: cute.Tensor, rhs: cute.Tensor, group_rows: cute.Tensor,
                 out: cute.Tensor, block_n: cutlass.Constexpr, stages: cutlass.Constexpr,
                 warp_specialized: cutlass.Constexpr = False):
  """lhs (M, P, 1) M-major, rhs (N, P, 1) N-major, group_rows (2 E,)
  (routing.group_row_ranges), out (M, N, E)."""
  _launch(stream, lhs, rhs, group_rows, group_rows, out, out, None, block_n, stages,
          "wgrad", False, False, warp_specialized)


@cute.jit
def _gathered_weight_grad(stream, x: cute.Tensor, rhs: cute.Tensor, group_rows: cute.Tensor,
                          gather_index: cute.Tensor, out: cute.Tensor, block_n: cutlass.Constexpr,
                          stages: cutlass.Constexpr, tma_gather: cutlass.Constexpr = False):
  """_weight_grad with x (T, M, 1) the source rows and slot r reading x[gather_index[r]]
  (tma_gather: loaded by TMA)."""
  _launch(stream, x, rhs, group_rows, gather_index, out, out, None, block_n, stages, "wgrad",
          True, False, tma_gather=tma_gather)


def shared_storage(dtype, num_barriers: int, a_elems: int, b_elems: int, num_rhs: int = 1,
                   c_elems: int = 0, tile_slots: int = 0):
  """A GEMM kernel's SMEM struct: num_barriers mbarriers, with tile_slots Int32 tile ids after
  them (tile_ids), then (each 1 KiB aligned) the lhs stages (s_a), num_rhs rhs stage arrays
  (s_b, s_b2) and, with c_elems, an epilogue buffer of its own (s_c)."""
  aligned = lambda elems: cute.struct.Align[cute.struct.MemRange[dtype, elems], 1024]
  fields = dict(barriers=cute.struct.MemRange[cutlass.Int64, num_barriers])
  if tile_slots:
    fields["tile_ids"] = cute.struct.MemRange[cutlass.Int32, tile_slots]
  fields.update(s_a=aligned(a_elems), s_b=aligned(b_elems))
  if num_rhs == 2:
    fields["s_b2"] = aligned(b_elems)
  if c_elems:
    fields["s_c"] = aligned(c_elems)
  return cute.struct(type("SharedStorage", (), {"__annotations__": fields}))


KERNEL_LABELS = {"store": "matmul", "swiglu": "up_proj", "dh": "dh", "wgrad": "weight_grad"}


def kernel_label(kind: str, gather: bool, family: str = "") -> str:
  """A compiled kernel's name prefix, sonicmoe_[<family>_]<op>[_gather]: profilers list kernels
  by name, and CuTe DSL's own names (the kernel function's and its first arguments') are the
  same for every op."""
  return "_".join(filter(None, ["sonicmoe", family, KERNEL_LABELS[kind], gather and "gather"]))


@cute.jit
def _launch(stream, lhs: cute.Tensor, rhs: cute.Tensor, tile_expert: cute.Tensor,
            gather_index: cute.Tensor, out: cute.Tensor, out2: cute.Tensor, dh_inputs,
            block_n: cutlass.Constexpr, stages: cutlass.Constexpr, kind: cutlass.Constexpr,
            gather: cutlass.Constexpr, register_store: cutlass.Constexpr,
            warp_specialized: cutlass.Constexpr = False, h_smem: cutlass.Constexpr = False,
            tma_gather: cutlass.Constexpr = False):
  """The grid over (output column tiles, M tiles[, experts]) and the kernel's static
  configuration. kind: "store" (out = lhs rhs), "swiglu" (out H (P, 2n), out2 A (P, n); rhs
  W1's gate and up columns), "dh" (out dH (P, 2n), out2 A' (P, n), dh_inputs (H, scores, dS
  parts)); for those two the grid covers n's columns; or "wgrad" (lhs (M, P, 1) M-major, rhs
  (N, P, 1), out (M, N, E) N- or M-major: out[e] = lhs_e rhs_e^T over expert e's rows,
  tile_expert holding group_rows: routing.group_row_steps). With gather lhs is the source of the rows
  gather_index names (A's stages filled by a third, producer warpgroup: _produce_gathered; by
  its threads' cp.async, or, the weight gradient's, with tma_gather by TMA, a box a row:
  row_tma_atom).
  register_store (dh only): each thread stores its fragments from registers instead of the
  TMA-store epilogue. warp_specialized: a producer warpgroup issues the TMA loads of a kernel
  that does not gather too (the MMA warpgroups' first warp otherwise). h_smem (dh): the
  epilogue reads H's tile from SMEM, TMA-loaded over rhs's stages once the mainloop is done
  (dh's h_smem)."""
  dtype = lhs.element_type
  swiglu = kind == "swiglu"
  num_rhs = 2 if swiglu else 1
  m_h, m_scores, m_ds = dh_inputs if kind == "dh" else (out, tile_expert, out)   # unused
  a_major, b_major = LayoutEnum.from_tensor(lhs), LayoutEnum.from_tensor(rhs)
  if cutlass.const_expr(gather and kind == "wgrad"):   # lhs X (T, M, 1); A tiles (M, rows) M-major
    a_major = LayoutEnum.COL_MAJOR
  tile_mnk = (BLOCK_M, block_n, BLOCK_K)
  tiled_mma = sm90_utils.make_trivial_tiled_mma(
      dtype, dtype, a_major.sm90_mma_major_mode(), b_major.sm90_mma_major_mode(),
      cutlass.Float32, (WARPGROUPS, 1, 1), tiler_mn=(64, block_n))
  a_smem_staged = sm90_utils.make_smem_layout_a(a_major, tile_mnk, dtype, stages)
  b_smem_staged = sm90_utils.make_smem_layout_b(b_major, tile_mnk, dtype, stages)
  tma_b, m_b = cpasync.make_tiled_tma_atom(cpasync.CopyBulkTensorTileG2SOp(), rhs,
                                           cute.slice_(b_smem_staged, (None, None, 0)),
                                           (block_n, BLOCK_K))
  if cutlass.const_expr(gather and tma_gather):   # A's rows by TMA, a box a row
    tma_a, m_a = row_tma_atom(lhs, a_smem_staged)
  elif cutlass.const_expr(gather and kind == "wgrad"):   # no TMA for A (the kernel takes an atom: B's, unused)
    tma_a, m_a = tma_b, m_b
  else:
    tma_a, m_a = cpasync.make_tiled_tma_atom(cpasync.CopyBulkTensorTileG2SOp(), lhs,
                                             cute.slice_(a_smem_staged, (None, None, 0)),
                                             (BLOCK_M, BLOCK_K))
  b_elems = cute.cosize(b_smem_staged)
  # the TMA-store epilogue's SMEM buffers (over A's stages, laid out like out: N-major, or
  # M-major for a transposed weight gradient) and its TMA atoms for out and out2
  out_layout = LayoutEnum.from_tensor(out)
  c_smem_staged = sm90_utils.make_smem_layout_epi(dtype, out_layout, EPI_TILE, EPI_STAGES)
  c_tile = cute.slice_(c_smem_staged, (None, None, 0))
  tma_out, m_out_tma = cpasync.make_tiled_tma_atom(cpasync.CopyBulkTensorTileS2GOp(), out, c_tile,
                                                   EPI_TILE)
  tma_out2, m_out2_tma = cpasync.make_tiled_tma_atom(cpasync.CopyBulkTensorTileS2GOp(), out2,
                                                     c_tile, EPI_TILE)
  # (h_smem) H's gate and up tiles as EPI_TILE buffers over rhs's stages, their TMA atom, and
  # the kernel's wgmma on EPI_TILE's columns to partition them (made for every kind: the
  # kernel takes them, unused elsewhere)
  h_smem_staged = sm90_utils.make_smem_layout_epi(dtype, LayoutEnum.ROW_MAJOR, EPI_TILE,
                                                  2 * (block_n // EPI_TILE[1]))
  tma_h, m_h_tma = cpasync.make_tiled_tma_atom(
      cpasync.CopyBulkTensorTileG2SOp(), m_h, cute.slice_(h_smem_staged, (None, None, 0)),
      EPI_TILE)
  chunk_mma = sm90_utils.make_trivial_tiled_mma(
      dtype, dtype, a_major.sm90_mma_major_mode(), b_major.sm90_mma_major_mode(),
      cutlass.Float32, (WARPGROUPS, 1, 1), tiler_mn=(64, EPI_TILE[1]))
  num_barriers = stages * 2 + (1 if h_smem else 0)   # the pipeline's, (h_smem) H's

  stage_bytes = num_rhs * cute.size_in_bytes(dtype, cute.slice_(b_smem_staged, (None, None, 0)))
  if cutlass.const_expr(not gather or tma_gather):   # TMA brings A's tile too
    stage_bytes += cute.size_in_bytes(dtype, cute.slice_(a_smem_staged, (None, None, 0)))
  num_m_tiles = cute.size(out, mode=[0]) // BLOCK_M
  num_n_tiles = cute.size(out, mode=[1]) // ((1 if kind in ("store", "wgrad") else 2) * block_n)
  num_z = cute.size(out, mode=[2]) if kind == "wgrad" else 1   # wgrad: one per expert
  # (but wgrad) the contraction's k steps: lhs's columns
  k_steps = cute.size(lhs, mode=[1]) // BLOCK_K
  storage = shared_storage(dtype, num_barriers, cute.cosize(a_smem_staged), b_elems, num_rhs)
  producer = gather or warp_specialized   # a producer warpgroup loads the stages
  _kernel.set_name_prefix(kernel_label(kind, gather), remove_cutlass_symbol=True)
  _kernel(tma_a, lhs if gather and not tma_gather else m_a, tma_b, m_b, out, out2, tma_out,
          m_out_tma, tma_out2, m_out2_tma, m_h, m_scores, m_ds, tma_h, m_h_tma, h_smem_staged,
          chunk_mma, tile_expert, gather_index, tiled_mma, a_smem_staged, b_smem_staged, c_smem_staged,
          cute.size(rhs, mode=[2]), storage, block_n, stages, stage_bytes, kind, gather,
          register_store, out_layout.is_m_major_c(), producer, h_smem, tma_gather,
          k_steps).launch(
              grid=(num_n_tiles, num_m_tiles, num_z),
              block=(THREADS + (128 if producer else 0), 1, 1), stream=stream)


def tma_gather_config(tma_gather: bool, gather_index, name: str) -> dict:
  """The kernel option of tma_gather=True ({} for the default, which the FFI targets leave
  out); ValueError where there are no rows to gather."""
  if tma_gather and gather_index is None:
    raise ValueError(f"cute {name}: tma_gather loads gathered rows; it needs gather_index")
  return dict(tma_gather=True) if tma_gather else {}


def _warp_specialized_config(warp_specialized: bool, gather_index=None) -> dict:
  """The kernel option of a non-gathering kernel's warp_specialized=True ({} for the default,
  which the FFI targets leave out; the gathering kernels always have their producer)."""
  return dict(warp_specialized=True) if warp_specialized and gather_index is None else {}


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


def grouped_matmul(lhs, rhs, tile_expert, *, transpose_rhs: bool = False, block_n: int = 128,
                   stages: int | None = None, warp_specialized: bool = False, cols=None):
  """out [P, N] = lhs_e rhs_e per M tile (module docstring), rhs [E, K, N]; with transpose_rhs
  rhs is [E, N, K] and out = lhs_e rhs_e^T (read K-major, no transposed copy).
  tile_expert: [P / BLOCK_M] int32, E or more past the last group. stages: the TMA pipeline's
  depth (default: as many as fit in SMEM, at most 8). warp_specialized: a producer warpgroup
  issues the TMA loads (bitwise the same result; one CTA per SM). cols=(lo, hi): out is the
  product's columns lo .. hi - 1 only (out [P, hi - lo]; lo a multiple of 8, hi - lo of
  block_n)."""
  reason = unsupported(lhs, rhs_as_ekn(rhs, transpose_rhs), block_n, cols)
  if reason:
    raise ValueError(f"cute grouped_matmul: {reason}")
  stages = _pipeline_depth(block_n, 1, lhs.dtype.itemsize, lhs.shape[1] // BLOCK_K, stages)
  return matmul_call(_matmul, lhs, rhs, tile_expert, transpose_rhs, cols, block_n=block_n,
                     stages=stages, **_warp_specialized_config(warp_specialized))


def rhs_as_ekn(rhs, transpose_rhs: bool):
  """rhs's shape as [E, K, N] (with transpose_rhs it is stored [E, N, K])."""
  if not transpose_rhs:
    return rhs
  return jax.ShapeDtypeStruct((rhs.shape[0], rhs.shape[2], rhs.shape[1]), rhs.dtype)


def matmul_call(kernel, lhs, rhs, tile_expert, transpose_rhs: bool, cols=None, **config):
  """out [P, N] of a grouped-matmul kernel (grouped_matmul's operands, checked by the
  caller) as an FFI call; cols=(lo, hi): out [P, hi - lo], the product's columns lo .. hi - 1
  (the kernel views rhs from column lo: rhs_window)."""
  num_cols = rhs_as_ekn(rhs, transpose_rhs).shape[2]
  lo, hi = (0, num_cols) if cols is None else cols
  if lo:
    config["first_col"] = lo
  # the kernel sees rhs as (N, K, E): [E, K, N] is N-major there, [E, N, K] K-major
  out, = xla_call.call(
      kernel, [lhs[None], rhs, tile_expert.astype(jnp.int32)],
      [jax.ShapeDtypeStruct((1, lhs.shape[0], hi - lo), lhs.dtype)],
      modes=[ROW_MODES, (1, 2, 0) if transpose_rhs else (2, 1, 0), None, ROW_MODES], **config)
  return out[0]


def rows_read(rows, gather_index):
  """The [P, C] rows a kernel reads: `rows` itself, or the gather_index [P] rows of it."""
  num_slots = rows.shape[0] if gather_index is None else gather_index.shape[0]
  return jax.ShapeDtypeStruct((num_slots, rows.shape[1]), rows.dtype)


def up_proj(xg, w1, tile_expert, block_n: int = 128, gather_index=None,
            stages: int | None = None, warp_specialized: bool = False):
  """H = Xg W1_e (gate and up halves) and A = silu(gate) * up per M tile: xg [P, d] rows in
  slot order, w1 [E, d, 2n]; returns H [P, 2n], A [P, n] (the SwiGLU epilogue). With
  gather_index [P], xg is X [T, d] and slot r reads X[gather_index[r]] (zeros where it is T or
  more), gathered inside the kernel by cp.async (by a producer warpgroup). stages and
  warp_specialized (without gather_index): as grouped_matmul's."""
  n = w1.shape[2] // 2
  reason = unsupported(rows_read(xg, gather_index),
                       jax.ShapeDtypeStruct((*w1.shape[:2], n), w1.dtype), block_n)
  if block_n > UP_PROJ_MAX_BLOCK_N:
    reason = (f"block_n={block_n} is wider than {UP_PROJ_MAX_BLOCK_N} (its gate and up "
              f"accumulators would not fit in registers)")
  if reason:
    raise ValueError(f"cute up_proj: {reason}")
  stages = _pipeline_depth(block_n, 2, xg.dtype.itemsize, xg.shape[1] // BLOCK_K, stages)
  return up_proj_call((_up_proj, _gathered_up_proj), xg, w1, tile_expert, gather_index,
                      block_n=block_n, stages=stages,
                      **_warp_specialized_config(warp_specialized, gather_index))


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


def dh_unsupported(dout_g, w2, h, scores, block_n: int):
  """Why the dH kernels cannot run these operands (a sentence naming the limit), or None:
  dOg [P, d] (the rows read), w2 [E, n, d], H [P, 2n], scores [P]."""
  n, num_slots = w2.shape[1], dout_g.shape[0]
  if block_n > WGMMA_MAX_N:
    return f"block_n={block_n} is wider than {WGMMA_MAX_N} (one wgmma's widest N)"
  reason = unsupported(dout_g, jax.ShapeDtypeStruct((w2.shape[0], w2.shape[2], n), w2.dtype),
                       block_n)
  if reason:
    return reason
  if h.shape != (num_slots, 2 * n) or h.dtype != dout_g.dtype or scores.shape != (num_slots,):
    return (f"need H [{num_slots}, {2 * n}] in {dout_g.dtype} and scores [{num_slots}]; got "
            f"{h.shape} {h.dtype} and {scores.shape}")
  if h.size > MAX_REGISTER_ADDRESSED:
    return (f"H [{h.shape[0]}, {h.shape[1]}] has {h.size} elements; the epilogue addresses H, "
            f"dH and A' with 32-bit offsets (at most {MAX_REGISTER_ADDRESSED}): split the batch")
  return None


def dh(dout_g, w2, h, scores, tile_expert, block_n: int = 64, stages: int | None = None,
       tma_store: bool = False, gather_index=None, over_h: bool = True,
       warp_specialized: bool = False, h_smem: bool = False):
  """dA' = dOg W2_e^T per M tile fused with dSwiGLU: dOg [P, d] rows in slot order, w2 [E, n, d]
  (read K-major), H [P, 2n] and scores [P] of the forward. Returns dH [P, 2n], A' = s A [P, n]
  and dS parts [n / block_n, P] fp32 (their sum over axis 0 is dS = rowsum(dA' A)).
  The epilogue math runs in registers (it loads H ahead of the math, _dh_outputs); dH and A' are
  stored straight from registers, or with tma_store through SMEM by TMA stores (bitwise the
  same, H200 session 8). stages as grouped_matmul's. With gather_index [P], dout_g is dO [T, d]
  and slot r reads dO[gather_index[r]] (zeros where it is T or more), gathered in the kernel
  by cp.async as up_proj gathers X. over_h: dH written over H's buffer (dh_call).
  warp_specialized (without gather_index): as grouped_matmul's. h_smem: the epilogue reads H
  from SMEM, its tile TMA-loaded over the rhs stages once the mainloop is done (coalesced,
  where the per-thread global loads read 16 of each 32-byte sector); with tma_store too, dH
  is written over H's tile there and A' over the lhs stages, all three then stored by TMA
  (no register tiles of the outputs). Needs stages >= H_SMEM_MIN_STAGES (the rhs stages hold
  H's 2 x BLOCK_M x block_n tile, the lhs stages A''s BLOCK_M x block_n). Bitwise the same
  outputs either way."""
  reason = dh_unsupported(rows_read(dout_g, gather_index), w2, h, scores, block_n)
  if reason:
    raise ValueError(f"cute dh: {reason}")
  k_steps = dout_g.shape[1] // BLOCK_K
  if h_smem and stages is None:   # (a ring deeper than the k steps holds H's tile)
    k_steps = max(k_steps, H_SMEM_MIN_STAGES)
  stages = _pipeline_depth(block_n, 1, dout_g.dtype.itemsize, k_steps, stages)
  if h_smem and stages < H_SMEM_MIN_STAGES:
    raise ValueError(f"cute dh: h_smem needs stages >= {H_SMEM_MIN_STAGES} (H's tile over the "
                     f"rhs stages); got stages={stages}")
  option = dict(h_smem=True) if h_smem else {}   # (off: the targets leave it out)
  return dh_call((_dh, _gathered_dh), dout_g, w2, h, scores, tile_expert, gather_index,
                 over_h, block_n=block_n, stages=stages, register_store=not tma_store,
                 **_warp_specialized_config(warp_specialized, gather_index), **option)


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
       jax.ShapeDtypeStruct((n // block_n, num_slots), jnp.float32)],
      in_place={3 + len(index): 0} if over_h else None,
      modes=[ROW_MODES, (1, 2, 0), None, *[None] * len(index), ROW_MODES, None, ROW_MODES,
             ROW_MODES, None],
      block_n=block_n, **config)
  return dh_[0], a_scaled[0], ds_parts


def _weight_grad_unsupported(lhs, rhs, group_offsets, num_experts, block_n, group_sizes=None):
  """Why weight_grad cannot run these operands (a sentence naming the limit), or None."""
  reason = _dtype_unsupported(lhs, rhs)
  if reason:
    return reason
  if lhs.ndim != 2 or rhs.ndim != 2 or rhs.shape[0] != lhs.shape[0]:
    return f"need lhs [P, M] and rhs [P, N]; got {lhs.shape} and {rhs.shape}"
  if lhs.shape[0] % BLOCK_M:
    return f"rows P={lhs.shape[0]} must be a multiple of {BLOCK_M} (an aligned plan)"
  if lhs.shape[1] % BLOCK_M:
    return f"lhs columns M={lhs.shape[1]} must be a multiple of {BLOCK_M}"
  if rhs.shape[1] % block_n or block_n % EPI_TILE[1]:
    return f"rhs columns N={rhs.shape[1]} must be a multiple of block_n={block_n} (itself of {EPI_TILE[1]})"
  if group_offsets.shape != (num_experts + 1,):
    return f"group_offsets must be [{num_experts + 1}]; got {group_offsets.shape}"
  return routing.group_sizes_mismatch(group_sizes, num_experts)


def weight_grad(lhs, rhs, group_offsets, num_experts: int, block_n: int = 128,
                stages: int | None = None, gather_index=None, transpose_out: bool = False,
                warp_specialized: bool = False, group_sizes=None, tma_gather: bool = False):
  """out[e] = lhs[rows of e]^T rhs[rows of e] ([E, M, N] in lhs's dtype, fp32 accumulation):
  lhs [P, M] and rhs [P, N] rows in slot order, expert e's rows group_offsets[e] ..
  group_offsets[e + 1] (multiples of BLOCK_M, an aligned plan; an expert without rows gets
  zeros). group_sizes [E] (the plan's): expert e's rows end at group_offsets[e] +
  group_sizes[e] (clamped to its group), and the kernel skips the k steps (BLOCK_K rows) wholly
  past that end; the padding rows it still reads, in the last step, must be zeros (as the
  plan's). dW1 = weight_grad(Xg, dH), dW2 = weight_grad(A', dOg). With gather_index [P], lhs
  is X [T, M] and slot r reads X[gather_index[r]] (zeros where it is T or more), gathered inside
  the kernel by cp.async (bitwise equal to gathering first; H200 timings in ops.dw1), or with
  tma_gather by TMA, a box a row and warpgroup half (the same bits). With
  transpose_out the kernel stores out[e]^T: [E, N, M] (its epilogue writes M-major tiles; no
  separate transpose). warp_specialized (without gather_index): as grouped_matmul's."""
  slots = rows_read(lhs, gather_index)   # the rows the GEMM reads
  reason = _weight_grad_unsupported(slots, rhs, group_offsets, num_experts, block_n, group_sizes)
  if reason:
    raise ValueError(f"cute weight_grad: {reason}")
  stages = _pipeline_depth(block_n, 1, lhs.dtype.itemsize, slots.shape[0] // BLOCK_K, stages)
  group_rows = routing.group_row_ranges(group_offsets, group_sizes)
  return weight_grad_call((_weight_grad, _gathered_weight_grad), lhs, rhs, group_rows,
                          num_experts, gather_index, transpose_out, block_n=block_n, stages=stages,
                          **_warp_specialized_config(warp_specialized, gather_index),
                          **tma_gather_config(tma_gather, gather_index, "weight_grad"))


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
