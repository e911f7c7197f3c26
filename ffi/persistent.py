"""Persistent versions of grouped_gemm.py's plain-epilogue GEMMs (CuTe DSL), with the same
operands, outputs and bits: the gathering weight gradients (grouped_gemm.weight_grad with
gather_index: dW1 = X_e^T dH_e with X's rows gathered, dW2^T = dO_e^T A'_e with dO's) and the
varlen-M store GEMM (grouped_gemm.grouped_matmul: down_proj and dx_tilde where their tiles are
256 wide). grouped_gemm launches one CTA per output tile, and each tile's pipeline fill and
its epilogue (BLOCK_M x block_n fp32 to bf16, stored by TMA) run with the tensor cores idle
(about a tenth of a weight-gradient tile of 32 k steps). Here each CTA loops over tiles and
its producer runs on into the next tile's stages while the MMA warpgroups run the epilogue.

Schedule:
  grid      : min(tiles, num_ctas) CTAs (num_ctas: the GPU's SMs); CTA c takes tiles c,
              c + grid, ...; kind "wgrad": tile t is expert t // (m_tiles n_tiles), then M
              tile, then column tile (an expert's tiles together: its rows from L2); kind
              "store": M tile t // n_tiles, column tile t % n_tiles (an M tile's column tiles
              on neighbouring CTAs: its lhs rows from L2)
  clusters  : of 2 CTAs, taking cluster tiles as a CTA takes tiles (in either order below):
              "wgrad" (cluster_m 2) the two CTAs take neighbouring M tiles of one expert and
              one column tile (cluster_tile) and each TMA-loads half of every rhs stage into
              both CTAs (multicast); "store" (cluster_n 2) they take neighbouring column
              tiles of one M tile and share its lhs stages likewise, or (cluster_m 2) one
              column tile of two M tiles of one expert (schedule.pair_slots' pairs: an odd
              count's last tile in both CTAs, which store the same bits) and share its rhs
              stages; a stage is free once both CTAs' MMA warpgroups released it
  producer  : warpgroup 0 (mainloop.PRODUCER_REGISTERS), its ring state running on
              across tiles: "wgrad", as the gathering producers of row_gather.py (each
              k step's BLOCK_K rows gathered, the tile's BLOCK_M columns of them, by its
              threads' cp.async; or with tma_gather by TMA, a box a row and warpgroup half,
              row_gather.produce_wgrad_steps_tma; an expert without rows loads nothing);
              "store", its warp 0 TMA-loading the lhs and rhs tiles of every k step (a tile
              past the last group loads nothing)
  MMA       : warpgroups 1 and 2 (BLOCK_M / 2 rows of a tile each), per tile: zero the
              accumulators, the mainloop, release the tile's last stage, the epilogue through
              SMEM buffers of its own (EPI_STAGES x EPI_TILE, not over the stages, which the
              producer is refilling) and TMA stores (epilogue.tma_store_epilogue, rolling:
              a tile's last stores read on under the next tile's mainloop; M-major for a
              transposed weight gradient); a tile without k steps stores zeros
"""
from __future__ import annotations

import cutlass
import cutlass.cute as cute
import cutlass.memory
import cutlass.pipeline as pipeline
import cutlass.utils.hopper_helpers as sm90_utils
from cutlass.cute.nvgpu import cpasync, warpgroup
from cutlass.tensor_utils import LayoutEnum

from ffi import calls, epilogue, mainloop, row_gather
from ffi import grouped_gemm as gg
from ffi.epilogue import EPI_TILE
from ffi.mainloop import BLOCK_K, BLOCK_M, THREADS
from sonicmoe_jax.core import routing, schedule

NUM_SMS = 132     # H100 / H200 SXM: the default grid (fewer SMs only queue CTAs)
MAX_STAGES = 8


def epilogue_bytes(itemsize: int) -> int:
  """SMEM of the epilogue's own TMA-store buffers."""
  return epilogue.EPI_STAGES * EPI_TILE[0] * EPI_TILE[1] * itemsize


def stages_that_fit(block_n: int, itemsize: int) -> int:
  """The ring's deepest beside the epilogue's buffers (at most MAX_STAGES)."""
  return min(MAX_STAGES, mainloop.stages_that_fit(block_n, 1, itemsize,
                                                   reserved=epilogue_bytes(itemsize)))


# CTAs per cluster: 1 (none) or 2 sharing one operand's stages, which each loads half of and
# multicasts to both (a weight gradient's rhs along M, a store GEMM's lhs along N)
CLUSTER_SIZES = (1, 2)


def cluster_tile(kind: str, u, rank, num_m_tiles: int, num_n_tiles: int, cluster: int,
                 along: str = "n"):
  """The tile (tile_work's t) of CTA `rank` of a cluster of `cluster` CTAs at cluster tile u,
  cluster tiles ordered as tile_work orders tiles. "wgrad": the cluster's CTAs take
  neighbouring M tiles of one expert and one column tile (the rhs tile they share); "store"
  along "n": neighbouring column tiles of one M tile (the lhs tile they share; num_n_tiles
  whole clusters); "store" along "m": neighbouring slots of schedule.pair_slots (two M tiles of
  one expert) and one column tile (the rhs tile they share). cluster 1: t = u."""
  if cluster == 1:
    return u
  if kind == "store" and along == "n":
    return u * cluster + rank
  if kind == "store":
    return ((u // num_n_tiles) * cluster + rank) * num_n_tiles + u % num_n_tiles
  per_expert = num_m_tiles // cluster * num_n_tiles
  expert, rest = u // per_expert, u % per_expert
  m_tile = rest // num_n_tiles * cluster + rank
  return (expert * num_m_tiles + m_tile) * num_n_tiles + rest % num_n_tiles


def tile_work(kind: str, t, tile_info, num_m_tiles: int, num_n_tiles: int, k_steps: int,
              num_experts, slot_tiles=None):
  """Tile t's (M tile, column tile, first k step, k steps, rhs's and out's third coordinate).
  "wgrad": tile_info is group_rows (each expert's first row and end: its k range,
  routing.group_row_steps), out's third coordinate the expert. "store": tile_info is
  tile_expert (the M tile's expert, E or more past the last group: no k steps), rhs's third
  coordinate the expert; with slot_tiles (schedule.pair_slots) t // num_n_tiles is a slot,
  its M tile slot_tiles' entry."""
  if kind == "wgrad":
    per_expert = num_m_tiles * num_n_tiles
    expert, rest = t // per_expert, t % per_expert
    k_begin, num_k = routing.group_row_steps(tile_info, expert, BLOCK_K)
    return rest // num_n_tiles, rest % num_n_tiles, k_begin, num_k, 0, expert
  m_tile = t // num_n_tiles
  if slot_tiles is not None:
    m_tile = slot_tiles[m_tile]
  owner = tile_info[m_tile]
  # k_steps where owner < E, else 0 (in arithmetic: no branch)
  num_k = cutlass.min(k_steps, cutlass.max(num_experts - owner, 0) * k_steps)
  return m_tile, t % num_n_tiles, 0, num_k, cutlass.min(owner, num_experts - 1), 0


TILE_SLOTS = 2                         # the dynamic order's tile ids in SMEM, a ring
TILE_READERS = THREADS + 128        # every thread of the CTA reads each tile id


def tile_barriers(cluster: int) -> tuple:
  """The dynamic order's mbarriers' arrivals: each slot's full barrier the publishing thread's
  (tx-counted in CTA rank 1), its empty one every reader's, of every CTA of the cluster (rank
  0's: the other ranks' readers arrive there; theirs go unused)."""
  return (1,) * TILE_SLOTS + (TILE_READERS * cluster,) * TILE_SLOTS


# The CTAs' tile order. Static: a CTA takes its index, then every grid-th. Dynamic: its index,
# then each next one grid + the count of tiles the CTAs asked for before it (an atomic add on
# a global counter), so that the tiles in flight stay a window of about two grids in tile order
# however the CTAs' speeds drift apart (every grid-th, a slow SM's CTA falls ever further
# behind the rest, and the tiles sharing its operands with it may have left L2 when it reads
# them). Dynamic, warp 0's lane 0 asks as the producer starts a tile (the atomic's latency
# under that tile's loads) and publishes the answer as it starts the next, into a ring of
# TILE_SLOTS SMEM slots (tile_ids); every thread reads it when it starts the tile after (so
# each tile is asked for two tiles ahead). A tile id past the last: done. In clusters the
# order's tiles are cluster tiles, asked for by rank 0 and published into both CTAs' rings
# (rank 1's slot by an asynchronous store into its SMEM, completing on its full barrier).


@cute.jit
def _ask_tile(counter: cute.Tensor, asked):
  """(warp 0, dynamic) lane 0 asks the counter for a tile to come: the count of tiles asked
  for before it (an atomic add; the tile is grid + that count; `asked` where lane 0 has not
  asked). Nothing reads the answer until it is published, a tile later (no arithmetic on it
  here, which would wait for it)."""
  if cute.arch.lane_idx() == 0:
    asked = cute.arch.atomic_add(counter.iterator, cutlass.Int32(1))
  return asked


@cute.jit
def _publish_tile(barriers, tile_ids: cute.Tensor, i, t, cluster: cutlass.Constexpr):
  """(warp 0 of the cluster's rank 0, dynamic) the cluster's i-th tile, t (lane 0's), into
  slot i % TILE_SLOTS of every CTA of the cluster once every thread read the slot's previous
  tile. The whole warp waits and comes back together: its lanes' elect.sync in the loads that
  follow need all 32."""
  slot, phase = i % TILE_SLOTS, (i // TILE_SLOTS) % 2
  cute.arch.mbarrier_wait(barriers + TILE_SLOTS + slot, phase ^ 1)
  if cute.arch.lane_idx() == 0:
    tile_ids[slot] = t
    cute.arch.mbarrier_arrive(barriers + slot)
    if cutlass.const_expr(cluster > 1):   # rank 1's slot: 4 bytes its full barrier counts
      cute.arch.mbarrier_arrive_and_expect_tx(barriers + slot, 4, peer_cta_rank_in_cluster=1)
      cute.arch.store_async_dsmem(tile_ids.iterator + slot, t, barriers + slot, 1)
  cute.arch.sync_warp()


@cute.jit
def _read_tile(barriers, tile_ids: cute.Tensor, i, cluster: cutlass.Constexpr):
  """(every thread, dynamic) the cluster's i-th tile; read, on rank 0's empty barrier."""
  slot, phase = i % TILE_SLOTS, (i // TILE_SLOTS) % 2
  cute.arch.mbarrier_wait(barriers + slot, phase)
  t = tile_ids[slot]
  if cutlass.const_expr(cluster > 1):
    cute.arch.mbarrier_arrive(barriers + TILE_SLOTS + slot, peer_cta_rank_in_cluster=0)
  else:
    cute.arch.mbarrier_arrive(barriers + TILE_SLOTS + slot)
  return t


@cute.jit
def _next_tile(barriers, tile_ids: cute.Tensor, i, t, stride, dynamic: cutlass.Constexpr,
               cluster: cutlass.Constexpr):
  """(every thread) the CTA's (or its cluster's) i-th tile, its (i - 1)-th being t (i = 0: t
  is the first, the CTA's or cluster's index); static, every stride-th."""
  if cutlass.const_expr(dynamic):
    t = _read_tile(barriers, tile_ids, i, cluster)
  elif i > 0:
    t = t + stride
  return t


def fills_buffers_whole(block_n: int) -> bool:
  """Whether a tile's EPI_TILE chunks fill the rolling epilogue's EPI_STAGES (2) buffers whole
  (block_n a multiple of 128), so that every tile starts on the first buffer; a 64- or
  192-wide tile's odd chunks make every other tile start on the second."""
  return (block_n // EPI_TILE[1]) % epilogue.EPI_STAGES == 0


@cute.jit
def _store_tile(acc, tma_out, out_tile, s_c, tiled_mma, mma_tidx, warp, out_m_major,
                first_chunk: cutlass.Constexpr):
  """A tile's rolling epilogue (warp 4 the leader), its first chunk on buffer first_chunk."""
  epilogue.tma_store_epilogue([acc], [(tma_out, out_tile)], s_c, tiled_mma, mma_tidx,
                              warp == 4, False, m_major=out_m_major, rolling=True,
                              first_chunk=first_chunk)


@cute.kernel
def _kernel(m_a: cute.Tensor, tma_a: cute.CopyAtom, tma_b: cute.CopyAtom, m_b: cute.Tensor,
            tma_out: cute.CopyAtom, m_out_tma: cute.Tensor, tile_info: cute.Tensor,
            gather_index: cute.Tensor, tile_counter: cute.Tensor, tiled_mma: cute.TiledMma,
            a_smem_staged: cute.ComposedLayout, b_smem_staged: cute.ComposedLayout,
            c_smem_staged: cute.ComposedLayout, num_experts: cutlass.Int32,
            shared_storage: cutlass.Constexpr, block_n: cutlass.Constexpr,
            stages: cutlass.Constexpr, stage_bytes: cutlass.Constexpr,
            num_m_tiles: cutlass.Constexpr, num_n_tiles: cutlass.Constexpr,
            k_steps: cutlass.Constexpr, num_tiles: cutlass.Constexpr,
            out_m_major: cutlass.Constexpr, kind: cutlass.Constexpr,
            dynamic: cutlass.Constexpr, cluster: cutlass.Constexpr,
            tma_gather: cutlass.Constexpr, along: cutlass.Constexpr):
  """kind "wgrad": m_a X (T, M, 1) the gathered rows' source (tma_gather: tma_a and m_a
  row_gather.row_tma_atom's, the rows loaded by TMA), m_b the rhs (N, P, 1) N-major,
  the output (M, N, E), tile_info group_rows (2 E,), gather_index (P,). kind "store":
  m_a the lhs's TMA tensor (P, K, 1), m_b the rhs's (N, K, E), the output (P, N, 1),
  tile_info tile_expert (P / BLOCK_M,), gather_index unused but in clusters along M, where it
  is schedule.pair_slots' table. dynamic: the tiles in the order the CTAs ask for them
  (tile_counter (1,) starting at 0), else every grid-th (_next_tile). cluster 2: the grid's
  clusters of 2 CTAs loop over cluster tiles (cluster_tile), the rhs's stages ("wgrad", or
  "store" along "m") or the lhs's ("store" along "n") multicast (tma_b or tma_a made for it)."""
  gather = kind == "wgrad"
  shares_rhs = gather or along == "m"   # (in clusters) the operand the CTAs share
  paired = kind == "store" and cluster > 1 and along == "m"
  copies = gather and not tma_gather   # A's rows copied by the producer's threads (cp.async)
  tidx, _, _ = cute.arch.thread_idx()
  cta, _, _ = cute.arch.block_idx()
  num_ctas = cute.arch.grid_dim()[0]
  warp = cute.arch.make_warp_uniform(cute.arch.warp_idx())
  mainloop.prefetch_descriptors(warp, tma_a, tma_b, copies)
  tile_mnk = (BLOCK_M, block_n, BLOCK_K)
  # the loop's tiles: this CTA's of the grid's, or its cluster's (rank `rank`) of the clusters'
  rank, first, stride, num_units = 0, cta, num_ctas, num_tiles
  if cutlass.const_expr(cluster > 1):
    rank = cute.arch.make_warp_uniform(cute.arch.block_idx_in_cluster())
    first, stride, num_units = cta // cluster, num_ctas // cluster, num_tiles // cluster
  slot_tiles = None
  if cutlass.const_expr(paired):   # the pairs' count last: no tile past the last pair
    slot_tiles = gather_index
    num_units = slot_tiles[cute.size(slot_tiles) - 1] * num_n_tiles
  work = lambda u: tile_work(kind, cluster_tile(kind, u, rank, num_m_tiles, num_n_tiles,
                                                cluster, along),
                             tile_info, num_m_tiles, num_n_tiles, k_steps, num_experts,
                             slot_tiles)
  # the multicast operand's (rank, cluster size): the rhs's along M, the lhs's along N
  rhs_cluster = (rank, cluster) if shares_rhs else (0, 1)
  lhs_cluster = (0, 1) if shares_rhs else (rank, cluster)

  smem = cutlass.memory.SmemAllocator()
  storage = smem.allocate(shared_storage)
  s_a = storage.s_a.get_tensor(a_smem_staged.outer, swizzle=a_smem_staged.inner)
  s_b = storage.s_b.get_tensor(b_smem_staged.outer, swizzle=b_smem_staged.inner)
  loads, tile_bars = mainloop.load_pipeline(storage, stages, stage_bytes, copies, THREADS,
                                            tidx, tile_barriers(cluster) if dynamic else 0,
                                            cluster_m=cluster if shares_rhs else 1,
                                            cluster_n=1 if shares_rhs else cluster)
  # (static: no ring; tile_counter stands in, unread)
  tile_ids = (storage.tile_ids.get_tensor(cute.make_layout(TILE_SLOTS)) if dynamic
              else tile_counter)

  if warp < 4:   # the producer warpgroup
    cute.arch.setmaxregister_decrease(mainloop.PRODUCER_REGISTERS)
    produce = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, stages)
    row_tiles, lines = None, None
    if cutlass.const_expr(tma_gather):   # the rows' boxes and their lines in the stages
      row_tiles, lines = row_gather.row_boxes(tma_a, m_a, storage.s_a, a_smem_staged)
    asked = cutlass.Int32(0)   # (dynamic, warp 0's lane 0) the count its last ask returned
    if cutlass.const_expr(dynamic):
      if warp == 0:
        if rank == 0:
          _publish_tile(tile_bars, tile_ids, 0, first, cluster)
          asked = _ask_tile(tile_counter, asked)
    i = cutlass.Int32(0)
    t = _next_tile(tile_bars, tile_ids, i, first, stride, dynamic, cluster)
    while t < num_units:
      if cutlass.const_expr(dynamic):
        if warp == 0:   # the next tile (asked for as the last one started), and ask again
          if rank == 0:
            _publish_tile(tile_bars, tile_ids, i + 1, stride + asked, cluster)
            asked = _ask_tile(tile_counter, asked)
      m_tile, n_tile, k_begin, num_k, rhs_l, _ = work(t)
      operands = [mainloop.tma_operand(tma_b, s_b, cute.local_tile(
          m_b, tile_mnk, (m_tile, n_tile, None, rhs_l), proj=(None, 1, 1)), *rhs_cluster)]
      if cutlass.const_expr(copies):
        produce = row_gather.produce_wgrad_steps(loads, produce, m_a, gather_index, s_a,
                                                 operands, k_begin, num_k, tidx,
                                                 m_tile * BLOCK_M)
      elif cutlass.const_expr(gather):
        produce = row_gather.produce_wgrad_steps_tma(loads, produce, row_tiles, gather_index,
                                                     lines, operands, k_begin, num_k, tidx,
                                                     m_tile * BLOCK_M)
      elif warp == 0:   # TMA loads only: its warp 0 issues every stage's
        lhs_and_rhs = [mainloop.tma_operand(tma_a, s_a, cute.local_tile(
            m_a, tile_mnk, (m_tile, n_tile, None, 0), proj=(1, None, 1)), *lhs_cluster)] + operands
        for step in cutlass.range(num_k, unroll=1):
          mainloop.load_stage(loads, produce, lhs_and_rhs, k_begin + step)
          produce.advance()
      i += 1
      t = _next_tile(tile_bars, tile_ids, i, t, stride, dynamic, cluster)
  else:   # the MMA warpgroups
    cute.arch.setmaxregister_increase(mainloop.MMA_REGISTERS)
    mma_tidx = tidx - 128
    thr_mma = tiled_mma.get_slice(mma_tidx)
    frag_a = tiled_mma.make_fragment_A(thr_mma.partition_A(s_a))
    frag_b = tiled_mma.make_fragment_B(thr_mma.partition_B(s_b))
    acc = cute.make_rmem_tensor(tiled_mma.partition_shape_C((BLOCK_M, block_n)), cutlass.Float32)
    tiled_mma.set(warpgroup.Field.ACCUMULATE, True)
    s_c = storage.s_c.get_tensor(c_smem_staged.outer, swizzle=c_smem_staged.inner)
    consume = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, stages)
    release = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, stages)
    i = cutlass.Int32(0)
    t = _next_tile(tile_bars, tile_ids, i, first, stride, dynamic, cluster)
    while t < num_units:
      m_tile, n_tile, _, num_k, _, out_l = work(t)
      consume, release = mainloop.consume_tile(loads, consume, release, tiled_mma, [acc],
                                               frag_a, [frag_b], num_k, copies)
      release = mainloop.release_last_stage(loads, release, num_k)
      out_tile = cute.local_tile(m_out_tma, tile_mnk, (m_tile, n_tile, None, out_l),
                                 proj=(1, 1, None))
      # rolling: before writing a buffer the leader waits for its last store, which may be
      # the previous tile's; the buffers taken in turn across tiles (fills_buffers_whole)
      if cutlass.const_expr(fills_buffers_whole(block_n)):
        _store_tile(acc, tma_out, out_tile, s_c, tiled_mma, mma_tidx, warp, out_m_major, 0)
      else:
        if i % 2 == 0:
          _store_tile(acc, tma_out, out_tile, s_c, tiled_mma, mma_tidx, warp, out_m_major, 0)
        else:
          _store_tile(acc, tma_out, out_tile, s_c, tiled_mma, mma_tidx, warp, out_m_major, 1)
      i += 1
      t = _next_tile(tile_bars, tile_ids, i, t, stride, dynamic, cluster)
    epilogue.store_tail(warp == 4)
  if cutlass.const_expr(cluster > 1):
    # no CTA exits while the other may still multicast into its SMEM or arrive on its barriers
    cute.arch.cluster_arrive()
    cute.arch.cluster_wait()


@cute.jit
def _launch(stream, lhs: cute.Tensor, rhs: cute.Tensor, tile_info: cute.Tensor,
            gather_index: cute.Tensor, tile_counter: cute.Tensor, out: cute.Tensor,
            block_n: cutlass.Constexpr, stages: cutlass.Constexpr, num_ctas: cutlass.Constexpr,
            kind: cutlass.Constexpr, dynamic: cutlass.Constexpr, cluster: cutlass.Constexpr = 1,
            tma_gather: cutlass.Constexpr = False, along: cutlass.Constexpr = "n"):
  """The persistent grid and the kernel's static configuration (_kernel's operands; the
  output's modes (rows, columns, experts or 1); tile_counter unused unless dynamic); cluster
  2: clusters of 2 CTAs, the grid whole clusters: "wgrad" along M, the rhs's TMA atom
  multicasting; "store" along `along`: "n" the lhs's, "m" the rhs's (gather_index then
  schedule.pair_slots' table, whose slots are the tiles' rows)."""
  dtype = lhs.element_type
  gather = kind == "wgrad"
  shares_rhs = gather or along == "m"
  # the weight gradient's A tiles (M, rows) are M-major (filled by the gathers)
  a_major = LayoutEnum.COL_MAJOR if gather else LayoutEnum.from_tensor(lhs)
  b_major = LayoutEnum.from_tensor(rhs)
  tile_mnk = (BLOCK_M, block_n, BLOCK_K)
  tiled_mma = sm90_utils.make_trivial_tiled_mma(
      dtype, dtype, a_major.sm90_mma_major_mode(), b_major.sm90_mma_major_mode(),
      cutlass.Float32, (mainloop.WARPGROUPS, 1, 1), tiler_mn=(64, block_n))
  a_smem_staged = sm90_utils.make_smem_layout_a(a_major, tile_mnk, dtype, stages)
  b_smem_staged = sm90_utils.make_smem_layout_b(b_major, tile_mnk, dtype, stages)
  b_stage = cute.slice_(b_smem_staged, (None, None, 0))
  if cutlass.const_expr(shares_rhs and cluster > 1):
    tma_b, m_b = cpasync.make_tiled_tma_atom(cpasync.CopyBulkTensorTileG2SMulticastOp(), rhs,
                                             b_stage, (block_n, BLOCK_K), num_multicast=cluster)
  else:
    tma_b, m_b = cpasync.make_tiled_tma_atom(cpasync.CopyBulkTensorTileG2SOp(), rhs, b_stage,
                                             (block_n, BLOCK_K))
  stage_bytes = cute.size_in_bytes(dtype, b_stage)
  a_stage_bytes = cute.size_in_bytes(dtype, cute.slice_(a_smem_staged, (None, None, 0)))
  if cutlass.const_expr(gather and tma_gather):   # A's rows by TMA, one box a row and half
    tma_a, m_a = row_gather.row_tma_atom(lhs, a_smem_staged)
    stage_bytes += a_stage_bytes
  elif cutlass.const_expr(gather):   # no TMA for A (the kernel takes an atom: B's, unused)
    tma_a, m_a = tma_b, lhs
  elif cutlass.const_expr(cluster > 1 and not shares_rhs):
    tma_a, m_a = cpasync.make_tiled_tma_atom(cpasync.CopyBulkTensorTileG2SMulticastOp(), lhs,
                                             cute.slice_(a_smem_staged, (None, None, 0)),
                                             (BLOCK_M, BLOCK_K), num_multicast=cluster)
    stage_bytes += a_stage_bytes
  else:
    tma_a, m_a = cpasync.make_tiled_tma_atom(cpasync.CopyBulkTensorTileG2SOp(), lhs,
                                             cute.slice_(a_smem_staged, (None, None, 0)),
                                             (BLOCK_M, BLOCK_K))
    stage_bytes += a_stage_bytes
  out_layout = LayoutEnum.from_tensor(out)
  c_smem_staged = sm90_utils.make_smem_layout_epi(dtype, out_layout, EPI_TILE,
                                                  epilogue.EPI_STAGES)
  tma_out, m_out_tma = cpasync.make_tiled_tma_atom(
      cpasync.CopyBulkTensorTileS2GOp(), out, cute.slice_(c_smem_staged, (None, None, 0)),
      EPI_TILE)
  ring_barriers = len(tile_barriers(cluster)) if dynamic else 0
  storage = mainloop.shared_storage(
      dtype, stages * 2 + ring_barriers, cute.cosize(a_smem_staged), cute.cosize(b_smem_staged),
      1, cute.cosize(c_smem_staged), TILE_SLOTS if dynamic else 0)
  # (the last of each clipped where BLOCK_M or block_n does not divide the output: TMA loads
  # zeros past the operands' ends and stores nothing past the output's)
  num_m_tiles = calls.column_tiles(cute.size(out, mode=[0]), BLOCK_M)
  num_n_tiles = calls.column_tiles(cute.size(out, mode=[1]), block_n)
  # whole clusters: the last's tiles past M ("wgrad") or past the columns load zeros
  if cutlass.const_expr(gather and cluster > 1):
    num_m_tiles = -(-num_m_tiles // cluster) * cluster
  if cutlass.const_expr(not shares_rhs and cluster > 1):
    num_n_tiles = -(-num_n_tiles // cluster) * cluster
  num_tiles = num_m_tiles * num_n_tiles * cute.size(out, mode=[2])
  if cutlass.const_expr(kind == "store" and shares_rhs and cluster > 1):   # pair_slots' slots
    num_tiles = (cute.size(gather_index) - 1) * num_n_tiles
  k_steps = cute.size(lhs, mode=[1]) // BLOCK_K   # (store: the contraction)
  _kernel.set_name_prefix(gg.kernel_label(kind, gather, "persistent"), remove_cutlass_symbol=True)
  kernel = _kernel(m_a, tma_a, tma_b, m_b, tma_out, m_out_tma, tile_info, gather_index,
                   tile_counter, tiled_mma, a_smem_staged, b_smem_staged, c_smem_staged,
                   cute.size(rhs, mode=[2]), storage, block_n, stages, stage_bytes, num_m_tiles,
                   num_n_tiles, k_steps, num_tiles, out_layout.is_m_major_c(), kind, dynamic,
                   cluster, tma_gather, along)
  if cutlass.const_expr(cluster > 1):   # whole clusters, at least one
    grid = max(cluster, min(num_tiles, num_ctas) // cluster * cluster)
    kernel.launch(grid=(grid, 1, 1), block=(THREADS + 128, 1, 1), cluster=(cluster, 1, 1),
                  stream=stream)
  else:
    kernel.launch(grid=(min(num_tiles, num_ctas), 1, 1), block=(THREADS + 128, 1, 1),
                  stream=stream)


@cute.jit
def _weight_grad(stream, x: cute.Tensor, rhs: cute.Tensor, group_rows: cute.Tensor,
                 gather_index: cute.Tensor, out: cute.Tensor, block_n: cutlass.Constexpr,
                 stages: cutlass.Constexpr, num_ctas: cutlass.Constexpr = NUM_SMS,
                 cluster_m: cutlass.Constexpr = 1, tma_gather: cutlass.Constexpr = False):
  """x (T, M, 1) the source rows, rhs (N, P, 1) N-major, group_rows (2 E,), gather_index (P,),
  out (M, N, E) N- or M-major: the operands of grouped_gemm._gathered_weight_grad; cluster_m:
  CTAs per cluster (_launch's cluster)."""
  _launch(stream, x, rhs, group_rows, gather_index, gather_index, out, block_n, stages,
          num_ctas, "wgrad", False, cluster_m, tma_gather)


@cute.jit
def _weight_grad_dynamic(stream, x: cute.Tensor, rhs: cute.Tensor, group_rows: cute.Tensor,
                         gather_index: cute.Tensor, tile_counter: cute.Tensor, out: cute.Tensor,
                         counter_out: cute.Tensor, block_n: cutlass.Constexpr,
                         stages: cutlass.Constexpr, num_ctas: cutlass.Constexpr = NUM_SMS,
                         cluster_m: cutlass.Constexpr = 1, tma_gather: cutlass.Constexpr = False):
  """_weight_grad's with the tiles in the order the CTAs ask for them (the dynamic tile order,
  above _ask_tile): tile_counter (1,) at 0, counted up in place (counter_out, its buffer)."""
  _launch(stream, x, rhs, group_rows, gather_index, tile_counter, out, block_n, stages,
          num_ctas, "wgrad", True, cluster_m, tma_gather)


@cute.jit
def _matmul(stream, lhs: cute.Tensor, rhs: cute.Tensor, tile_expert: cute.Tensor,
            out: cute.Tensor, block_n: cutlass.Constexpr, stages: cutlass.Constexpr,
            first_col: cutlass.Constexpr = 0, num_ctas: cutlass.Constexpr = NUM_SMS,
            cluster_n: cutlass.Constexpr = 1):
  """lhs (P, K, 1) K-major, rhs (N, K, E) N- or K-major, out (P, W, 1): the operands of
  grouped_gemm._matmul (first_col as its); cluster_n: CTAs per cluster (_launch's cluster)."""
  _launch(stream, lhs, gg.rhs_window(rhs, out, first_col), tile_expert, tile_expert,
          tile_expert, out, block_n, stages, num_ctas, "store", False, cluster_n)


@cute.jit
def _paired_matmul(stream, lhs: cute.Tensor, rhs: cute.Tensor, tile_expert: cute.Tensor,
                   slot_tiles: cute.Tensor, out: cute.Tensor, block_n: cutlass.Constexpr,
                   stages: cutlass.Constexpr, first_col: cutlass.Constexpr = 0,
                   num_ctas: cutlass.Constexpr = NUM_SMS):
  """_matmul's in clusters of 2 CTAs along M: slot_tiles (schedule.pair_slots of tile_expert)
  pairs M tiles of one expert, whose rhs stages the two CTAs share by multicast."""
  _launch(stream, lhs, gg.rhs_window(rhs, out, first_col), tile_expert, slot_tiles,
          tile_expert, out, block_n, stages, num_ctas, "store", False, 2, False, "m")


def _stages(stages, block_n: int, itemsize: int, k_steps: int, name: str) -> int:
  """`stages`, or as many as fit beside the epilogue's buffers (at most the k steps, at
  least 2); ValueError naming the limit."""
  fit = stages_that_fit(block_n, itemsize)
  if stages is None:
    return max(2, min(fit, k_steps))
  if not 2 <= stages <= fit:
    raise ValueError(f"cute persistent {name}: stages={stages} must be between 2 and {fit} "
                     f"(what fits in SMEM beside the epilogue's buffers at block_n={block_n})")
  return stages


def _tile_unsupported(block_n: int):
  """Why the kernel cannot take this column tile, or None: one wgmma's N (a multiple of
  EPI_TILE's columns, which the calls check, up to calls.WGMMA_MAX_N)."""
  if block_n > calls.WGMMA_MAX_N:
    return f"block_n={block_n} is wider than {calls.WGMMA_MAX_N} (one wgmma's widest N)"
  return None


def cluster_fits(cluster_m: int, m: int, tma_gather: bool) -> bool:
  """Whether M = m's tiles (the last maybe clipped) can run in clusters of cluster_m: whole
  clusters, or with the rows loaded by TMA (tma_gather) any number, the last cluster's tiles
  past M loading zeros (TMA's out-of-bounds fill) and storing nothing."""
  return tma_gather or calls.column_tiles(m, BLOCK_M) % cluster_m == 0


def _cluster_size_unsupported(name: str, size) -> str | None:
  """Why `size` CTAs cannot make a cluster (the argument `name`), or None."""
  if type(size) is not int or size not in CLUSTER_SIZES:   # (not a bool or a float)
    return f"{name}={size!r} must be one of {CLUSTER_SIZES}"
  return None


def _cluster_unsupported(cluster_m, m: int, tma_gather: bool) -> str | None:
  """Why the weight gradient cannot run clusters of cluster_m CTAs along its M = m, or None."""
  if reason := _cluster_size_unsupported("cluster_m", cluster_m):
    return reason
  if not cluster_fits(cluster_m, m, tma_gather):
    return (f"M={m} must make whole clusters: {calls.column_tiles(m, BLOCK_M)} M tiles of "
            f"{BLOCK_M} in clusters of cluster_m={cluster_m} (any number with tma_gather)")
  return None


def _grid_config(num_ctas, name: str) -> dict:
  """The launch option of num_ctas ({} for the default grid, which the FFI targets leave out)."""
  if num_ctas is None:
    return {}
  if not isinstance(num_ctas, int) or isinstance(num_ctas, bool) or num_ctas < 1:
    raise ValueError(f"cute persistent {name}: num_ctas must be a positive int; got {num_ctas!r}")
  return dict(num_ctas=num_ctas)


def weight_grad(x, rhs, group_offsets, num_experts: int, gather_index, block_n: int = 128,
                stages: int | None = None, transpose_out: bool = False,
                num_ctas: int | None = None, group_sizes=None, dynamic: bool = False,
                cluster_m: int = 1, tma_gather: bool = False):
  """grouped_gemm.weight_grad with gather_index on persistent CTAs (module docstring): x
  [T, M] (slot r reads X[gather_index[r]], zeros where it is T or more), rhs [P, N] rows in
  slot order, expert e's rows group_offsets[e] .. group_offsets[e + 1] (multiples of BLOCK_M),
  or with group_sizes to group_offsets[e] + group_sizes[e] (grouped_gemm.weight_grad's);
  returns out [E, M, N], out[e] = X_e^T rhs_e, or with transpose_out [E, N, M]. stages: the
  ring's depth (default: as many as fit beside the epilogue's buffers, at most the k steps of
  all rows). num_ctas: the grid's most CTAs (default NUM_SMS; in clusters rounded down to
  whole clusters, at least one). dynamic: the tiles in the order the CTAs ask for them (the
  dynamic tile order, above _ask_tile) instead of every grid-th; the same bits. cluster_m:
  CTAs per cluster (CLUSTER_SIZES; 2: neighbouring M tiles share the rhs's stages by
  multicast; M's tiles an even number, or with tma_gather any: an odd count's last cluster
  computes one tile past M, on zeros, and stores nothing); the same bits. tma_gather: the
  gathered rows loaded by TMA (row_gather.produce_wgrad_steps_tma) instead of the producer's
  cp.async; the same bits (the TMA engine writes the rows into SMEM without the producer's LSU
  time), and M and N need then only be multiples of 64: the last M and column tiles are
  clipped."""
  slots = calls.rows_read(x, gather_index)
  reason = (calls.weight_grad_unsupported(slots, rhs, group_offsets, num_experts, block_n,
                                          group_sizes, clipped_last_tile=tma_gather)
            or _tile_unsupported(block_n)
            or _cluster_unsupported(cluster_m, x.shape[1], tma_gather))
  if reason:
    raise ValueError(f"cute persistent weight_grad: {reason}")
  stages = _stages(stages, block_n, x.dtype.itemsize, slots.shape[0] // BLOCK_K, "weight_grad")
  options = dict(cluster_m=cluster_m) if cluster_m > 1 else {}
  options.update(calls.tma_gather_config(tma_gather, gather_index, "persistent weight_grad"))
  return calls.weight_grad_call((None, _weight_grad_dynamic if dynamic else _weight_grad), x, rhs,
                                routing.group_row_ranges(group_offsets, group_sizes), num_experts,
                                gather_index, transpose_out, tile_counter=dynamic, block_n=block_n,
                                stages=stages, **_grid_config(num_ctas, "weight_grad"), **options)


def grouped_matmul(lhs, rhs, tile_expert, *, transpose_rhs: bool = False, block_n: int = 128,
                   stages: int | None = None, cols=None, num_ctas: int | None = None,
                   cluster_n: int = 1, cluster_m: int = 1):
  """grouped_gemm.grouped_matmul on persistent CTAs (module docstring): out [P, N] = lhs_e
  rhs_e per M tile, rhs [E, K, N], or with transpose_rhs [E, N, K] read K-major; tile_expert
  [P / BLOCK_M] (E or more past the last group: zeros); cols=(lo, hi): out's columns lo ..
  hi - 1 only, a multiple of 64: block_n need not divide it (the last column tile is clipped).
  stages: as weight_grad's (at most the contraction's k steps). num_ctas: the grid's most CTAs
  (default NUM_SMS; in clusters rounded down to whole clusters). cluster_n: CTAs per cluster
  (CLUSTER_SIZES; 2: neighbouring column tiles of an M tile share its lhs stages by multicast;
  an odd count of column tiles takes one more, past the output, on zeros, storing nothing);
  cluster_m: CTAs per cluster along M instead (2: two M tiles of one expert, paired by
  schedule.pair_slots, share its rhs stages by multicast; an expert's odd count of M tiles
  computes its last one twice); the same bits."""
  reason = (calls.unsupported(lhs, calls.rhs_as_ekn(rhs, transpose_rhs), block_n, cols,
                             clipped_last_tile=True)
            or _tile_unsupported(block_n) or _cluster_size_unsupported("cluster_n", cluster_n)
            or _cluster_size_unsupported("cluster_m", cluster_m))
  if not reason and cluster_m > 1 and cluster_n > 1:
    reason = f"cluster_m={cluster_m} and cluster_n={cluster_n}: clusters run along one of them"
  if reason:
    raise ValueError(f"cute persistent grouped_matmul: {reason}")
  stages = _stages(stages, block_n, lhs.dtype.itemsize, lhs.shape[1] // BLOCK_K,
                   "grouped_matmul")
  grid = _grid_config(num_ctas, "grouped_matmul")
  if cluster_m > 1:
    num_experts = calls.rhs_as_ekn(rhs, transpose_rhs).shape[0]
    return calls.matmul_call(_paired_matmul, lhs, rhs, tile_expert, transpose_rhs, cols,
                             slot_tiles=schedule.pair_slots(tile_expert, num_experts),
                             block_n=block_n, stages=stages, **grid)
  options = dict(cluster_n=cluster_n) if cluster_n > 1 else {}
  return calls.matmul_call(_matmul, lhs, rhs, tile_expert, transpose_rhs, cols, block_n=block_n,
                           stages=stages, **grid, **options)
