"""Persistent, warp-specialized ping-pong grouped GEMMs for Hopper (CuTe DSL), beside
grouped_gemm.py's kernels with the same operands, outputs and epilogue math: dh (the dSwiGLU
epilogue, epilogue.dh_outputs; dO's rows read in slot order or gathered), up_proj
gathering X's rows (the SwiGLU epilogue) and grouped_matmul (out = lhs_e rhs_e: down_proj,
dx_tilde), storing their outputs from registers or (dh and grouped_matmul) through SMEM by TMA
stores (tma_store: each consumer's own buffers).
grouped_gemm's kernel runs its epilogue after its mainloop with the tensor cores idle, and its
MMA warpgroups issue the gather's copies between their wgmmas; here one consumer warpgroup's
epilogue runs while the other's mainloop does, and a producer warpgroup does all the loading.

Schedule:
  work tile : TILE_M (128: one M tile of the plan, one expert) rows x block_n columns of the
              GEMM (and so of dH's or H's gate and up columns and of A' or A; the store
              kernels' last one clipped where block_n does not divide N), all of it one
              consumer warpgroup's (two m64 wgmmas per 16-deep k slice; accumulators of
              TILE_M x block_n / 128 fp32 registers per thread each: block_n <= 192 for the
              store kernels' one, <= 128 for dh's, <= 64 for SwiGLU's two:
              MAX_ACCUMULATOR_REGISTERS); tile t is M tile t // (n / block_n), column block
              t % (n / block_n): an M tile's column tiles run next to each other, on
              neighbouring CTAs (their shared rows from L2). The store kernels with TMA stores
              also take ROW_TILE_M (192) rows a tile, 128 columns at most: three m64 wgmmas,
              row tile r the r-th entry of schedule.row_tiles' table (tiles from each expert's
              start, its last one stored down to the expert's end) in place of M tile r
  grid      : min(tiles, NUM_SMS) persistent CTAs; CTA c takes tiles c, c + grid, c + 2 grid..
              The store kernels may run in clusters of 2 (cluster_n): CTAs 2i and 2i + 1 then
              take neighbouring column tiles of one row tile and share its lhs stages (each
              TMA-loads half and multicasts it into both; a stage refilled once both CTAs'
              consumers released it)
  producer  : warpgroup 0, its registers lowered by setmaxnreg (REGISTERS), fills a
              `stages`-deep ring running ahead across tiles (tiles past the last group load
              nothing). dh: warp 0 TMA-loads dOg [128, 64] and W2_e^T [block_n, 64].
              Gathering (up_proj; dh given gather_index): warp 0 TMA-loads the weight tiles
              (W1's gate and up tiles, or W2_e^T's) and all 128 threads cp.async-copy the 128
              gathered rows (row_gather.gather_stage, as grouped_gemm's gathering
              producer: 8 rows' 16-byte chunks each); a stage's full barrier then completes on
              the TMA bytes and mainloop.PRODUCER_ARRIVALS arrivals (per thread:
              cp.async.mbarrier.arrive.noinc for its copies, a release arrive for its padding
              rows' plain zero stores)
  consumers : warpgroups 1 and 2, registers raised, take the CTA's tiles in turn (its i-th
              tile is warpgroup 1 + i % 2's). A consumer waits for its turn (named barrier
              TURN_BARRIER + its index, which the other arrives at once it has waited for all
              its tile's stages: the two read the ring in tile order, so a stage's phase bit is
              never read one lap early), runs the wgmma mainloop (one k step in flight, each
              stage released once its wgmmas are done; gathered stages fenced for the async
              proxy first), hands the turn over, then runs the epilogue (registers to global,
              or through its own SMEM buffers (epilogue_buffers) and TMA stores, synced on
              named barrier EPILOGUE_BARRIER + its index) while the other warpgroup's
              mainloop runs.
              The other's tiles it steps over.
"""
from __future__ import annotations

import cutlass
import cutlass.cute as cute
import cutlass.memory
import cutlass.pipeline as pipeline
import cutlass.utils.hopper_helpers as sm90_utils
from cutlass.cute.nvgpu import cpasync, warpgroup
from cutlass.tensor_utils import LayoutEnum

from ffi import calls, epilogue, grouped_gemm, mainloop, row_gather
from ffi.epilogue import EPI_TILE
from ffi.mainloop import BLOCK_K, BLOCK_M
from sonicmoe_jax.core import schedule

TILE_M = BLOCK_M            # a work tile's rows: one M tile of the plan (one expert's rows)
MMA_M = 64                  # one wgmma's rows: a consumer warpgroup covers TILE_M in TILE_M / 64
# The store kernels' other work tile: ROW_TILE_M rows from any multiple of MMA_M (three m64
# wgmmas per k slice), read from a table of row tiles (schedule.row_tiles: first row, expert,
# rows to store) instead of the plan's M tiles; its epilogue buffers hold one wgmma's rows
# (ROW_TILE_EPI) and store a tile's row blocks down to its rows to store
ROW_TILE_M = 192
ROW_TILE_EPI = (MMA_M, EPI_TILE[1])
TILE_MS = (TILE_M, ROW_TILE_M)
# The store kernels' CTAs per cluster along N: 1 (none) or 2 neighbouring column tiles of one
# row tile sharing its lhs tiles by TMA multicast (half the lhs's L2-to-SMEM traffic)
CLUSTER_NS = (1, 2)
# fp32 accumulator registers per consumer thread (of its 232), all its accumulators', by kernel
# kind: the store kernels' epilogue converts and stores one EPI_TILE column chunk at a time, so
# 192 (block_n 192) compile without stack, register or TMA stores (sm_90a cubins);
# dh's and SwiGLU's epilogues keep more values live
MAX_ACCUMULATOR_REGISTERS = {"store": 192, "dh": 128, "swiglu": 128}
NUM_SMS = 132               # H100 / H200 SXM: the persistent grid (fewer SMs only queue CTAs)
THREADS = 3 * 128           # the producer warpgroup and two consumer warpgroups
# setmaxnreg budgets (producer, consumers): 128 x producer + 256 x consumer may not pass what
# the CTA got at launch, 384 threads x 168 registers = 64512 (a consumer's increase past it
# waits for ever: 48 / 232 hangs). By whether the producer gathers (it
# then keeps its rows' token ids and copy addresses in registers: grouped_gemm's gathering
# producer's budgets)
REGISTERS = {False: (40, 232),
             True: (mainloop.PRODUCER_REGISTERS, mainloop.MMA_REGISTERS)}
# dh's SMEM epilogue (tma_store) with a gathering producer: its consumers spill at 224
# registers (sm_90a cubin, block_n 128), none at 232; (24, 240) spills 8 bytes and runs slower.
# Every ping-pong kernel is launched with min_blocks_per_mp 1 (PTX .minnctapersm): without it
# ptxas ignores setmaxnreg (warning C7508)
SMEM_EPILOGUE_GATHER_REGISTERS = (40, 232)
TURN_BARRIER = 4            # named barriers 4 and 5: consumer 0's and 1's turn
EPILOGUE_BARRIER = 6        # named barriers 6 and 7: consumer 0's and 1's TMA-store epilogue
MAX_STAGES = 8
# dh's SMEM epilogue (tma_store): each consumer's EPI_TILE buffers, one column chunk at a time:
# H's gate and up chunks (TMA-loaded; dH's written over them) and A''s chunk
OUTPUT_BUFFERS = 3


def epilogue_buffers(kind: str) -> int:
  """EPI_TILE buffers of each consumer's TMA-store epilogue: dh's (a chunk's three outputs:
  OUTPUT_BUFFERS) or the store kernels' (epilogue.EPI_STAGES)."""
  return OUTPUT_BUFFERS if kind == "dh" else epilogue.EPI_STAGES


def epi_tile(tile_m: int):
  """The TMA-store epilogue's buffer shape for tile_m-row tiles."""
  return EPI_TILE if tile_m == TILE_M else ROW_TILE_EPI


def epilogue_bytes(itemsize: int, kind: str = "store", tile_m: int = TILE_M) -> int:
  """SMEM of the TMA-store epilogue: epilogue_buffers(kind) epi_tile(tile_m) buffers per
  consumer."""
  rows, cols = epi_tile(tile_m)
  return 2 * epilogue_buffers(kind) * rows * cols * itemsize


def stages_that_fit(block_n: int, itemsize: int, num_rhs: int = 1, tma_store: bool = False,
                    kind: str = "store", tile_m: int = TILE_M) -> int:
  """The ring's deepest: stages of a [tile_m, BLOCK_K] lhs tile and num_rhs [block_n,
  BLOCK_K] rhs tiles that fit in SMEM (beside the epilogue's buffers with tma_store), at most
  MAX_STAGES."""
  reserved = epilogue_bytes(itemsize, kind, tile_m) if tma_store else 0
  return min(MAX_STAGES, mainloop.stages_that_fit(block_n, num_rhs, itemsize, tile_m, reserved))


def widest_block_n(num_rhs: int, kind: str, tile_m: int = TILE_M) -> int:
  """The widest block_n whose num_rhs accumulators (tile_m x block_n fp32, over a
  warpgroup's 128 threads) fit in kind's MAX_ACCUMULATOR_REGISTERS per thread."""
  return MAX_ACCUMULATOR_REGISTERS[kind] * 128 // (num_rhs * tile_m)


@cute.jit
def row_tile(tiles, r, tile_m: cutlass.Constexpr):
  """(first row, expert, rows to store) of row tile r: M tile r of the plan (tiles:
  tile_expert) or, for ROW_TILE_M rows, entry r of schedule.row_tiles' table (tiles)."""
  if cutlass.const_expr(tile_m == TILE_M):
    return r * TILE_M, tiles[r], TILE_M
  fields = schedule.ROW_TILE_FIELDS
  return tiles[fields * r], tiles[fields * r + 1], tiles[fields * r + 2]


def tile_at(m, tile_mnk, r, first_row, c, proj):
  """Row tile r's tile (tile_mnk, projected by proj) of an operand m (P, C, 1) with out's rows,
  at column tile c: from row first_row for ROW_TILE_M rows (TMA fills rows past P with zeros
  and clips stores there), else M tile r."""
  if tile_mnk[0] == TILE_M:
    return cute.local_tile(m, tile_mnk, (r, c, None, 0), proj=proj)
  return cute.local_tile(cute.domain_offset((first_row, 0, 0), m), tile_mnk, (0, c, None, 0),
                         proj=proj)


def row_tiles_of(tiles, out, tile_m: int):
  """How many row tiles the kernel walks: out's M tiles, or the table's entries."""
  if tile_m == TILE_M:
    return cute.size(out, mode=[0]) // TILE_M
  return cute.size(tiles) // schedule.ROW_TILE_FIELDS


def cluster_fits(cluster_n: int, num_cols: int, block_n: int) -> bool:
  """Whether an output num_cols wide splits into whole clusters of cluster_n column tiles."""
  return calls.column_tiles(num_cols, block_n) % cluster_n == 0


@cute.jit
def skip_tile(consume, release, num_k):
  """The other consumer's tile: this one's ring states stepped over its num_k stages."""
  for _ in cutlass.range(num_k, unroll=1):
    consume.advance()
    release.advance()
  return consume, release


@cute.jit
def wait_turn(me, i):
  """Consumer me before the CTA's i-th tile: the other has waited for all of its own tile's
  stages (the two read the ring in tile order, so a stage's phase bit is never read one lap
  early), and all 128 of me's threads are here (its previous epilogue's stores issued)."""
  if i > 0:
    cute.arch.barrier(barrier_id=TURN_BARRIER + me, number_of_threads=256)


@cute.jit
def pass_turn(me, i, my_tiles):
  """Consumer me, every stage of the CTA's i-th tile waited for: the other's turn (if the
  CTA has a next tile)."""
  if i + 1 < my_tiles:
    cute.arch.barrier_arrive(barrier_id=TURN_BARRIER + 1 - me, number_of_threads=256)


@cute.jit
def _register_outputs(accs, out_tiles, thr_mma, dtype, block_n: cutlass.Constexpr,
                      swiglu: cutlass.Constexpr):
  """The output tiles in dtype, stored from registers to out_tiles one fragment column group
  at a time: plain, out = the accumulator; SwiGLU, H's gate and up tiles (the two
  accumulators) and A = silu(gate) * up (out_tiles: H gate, H up, A)."""
  for m in cutlass.range_constexpr(cute.size(accs[0], mode=[1])):
    for k in cutlass.range_constexpr(block_n // 8):
      group = ((None, None, k), m, 0)
      values = epilogue.epilogue_values([acc[group].load() for acc in accs], swiglu)
      for q in cutlass.range_constexpr(len(out_tiles)):
        frag = cute.make_rmem_tensor(accs[0][group].shape, dtype)
        frag.store(values[q].to(dtype))
        cute.autovec_copy(frag, thr_mma.partition_C(out_tiles[q])[group])


@cute.jit
def _store_buffers(atoms, stores, first, chunk, leader, barrier_id: cutlass.Constexpr):
  """A consumer's OUTPUT_BUFFERS SMEM buffers (first onwards), written by its 128 threads,
  made visible to the TMA engine; then its leader warp stores buffer q to chunk `chunk` of
  stores[q] (epi_tma_views of an output tile) with atoms[q], as one bulk group."""
  cute.arch.fence_proxy("async.shared", space="cta")
  cute.arch.barrier(barrier_id=barrier_id, number_of_threads=128)
  if leader:
    for q in cutlass.range_constexpr(OUTPUT_BUFFERS):
      s_part, g_part = stores[q]
      cute.copy(atoms[q], s_part[None, first + q], g_part[None, (0, chunk)])
    cute.arch.cp_async_bulk_commit_group()


@cute.jit
def _dh_smem_epilogue(acc, h_tiles, out_tiles, atoms, s_c, first, chunk_mma,
                      thr_mma, score_tile, m_ds, wg_tidx, leader, h_bar, phase0, row0, n_tile,
                      block_n: cutlass.Constexpr, barrier_id: cutlass.Constexpr):
  """dh's epilogue through a consumer's own SMEM buffers (s_c's first .. first + 2), one
  EPI_TILE column chunk at a time: the leader warp TMA-loads H's gate and up chunks (h_tiles,
  of H's TMA tensor; atoms[0]) once the previous chunk's stores have read the buffers,
  completing on mbarrier h_bar (its phase phase0 + chunk); every thread computes its values of
  the chunk (epilogue.dswiglu on acc = dA''s columns of the chunk), writing dH's gate and up
  over H's and A' to the third buffer; then the leader stores the three by TMA (out_tiles: dH
  gate, dH up, A', of their TMA tensors; atoms[1:]). dS's part as epilogue.dh_outputs.
  chunk_mma: the wgmma on EPI_TILE's columns, so that a thread's values of a buffer are its
  accumulator's values of the chunk's columns."""
  groups = EPI_TILE[1] // 8   # column groups of a chunk
  # this thread's values of each buffer (one chunk: [q][0]) and the buffers' TMA views
  bufs = epilogue.smem_chunks(s_c, chunk_mma, wg_tidx,
                              [first + q for q in range(OUTPUT_BUFFERS)], 1)
  loads = [epilogue.epi_tma_views(atoms[0], s_c, t) for t in h_tiles]
  stores = [epilogue.epi_tma_views(atom, s_c, t) for atom, t in zip(atoms[1:], out_tiles)]
  s_src = thr_mma.partition_C(score_tile)
  m_blocks = cute.size(acc, mode=[1])
  # the rows' scores (the same in every column), loaded once for every chunk
  scores = [epilogue.group_fp32(s_src[((None, None, 0), m, 0)]) for m in range(m_blocks)]
  row_sums = cute.make_rmem_tensor((2 * m_blocks,), cutlass.Float32)   # rows r, r + 8 per block
  row_sums.fill(0.0)
  for c in cutlass.range_constexpr(block_n // EPI_TILE[1]):
    if leader:
      cute.arch.cp_async_bulk_wait_group(0, read=True)
      with cute.arch.elect_one():
        cute.arch.mbarrier_arrive_and_expect_tx(
            h_bar, 2 * EPI_TILE[0] * EPI_TILE[1] * s_c.element_type.width // 8)
      for half in cutlass.range_constexpr(2):
        s_part, g_part = loads[half]
        cute.copy(atoms[0], g_part[None, (0, c)], s_part[None, first + half], tma_bar_ptr=h_bar)
    cute.arch.mbarrier_wait(h_bar, (phase0 + c) % 2)
    for m in cutlass.range_constexpr(m_blocks):
      s = scores[m]
      for k in cutlass.range_constexpr(groups):
        group = ((None, None, k), m, 0)
        acc_group = ((None, None, c * groups + k), m, 0)
        gate, up = [epilogue.group_fp32(buf[0][group]) for buf in bufs[:2]]
        da = acc[acc_group].load()
        values, a = epilogue.dswiglu(gate, up, da, s)
        for q in cutlass.range_constexpr(OUTPUT_BUFFERS):
          frag = cute.make_rmem_tensor(acc[acc_group].shape, s_c.element_type)
          frag.store(values[q].to(s_c.element_type))
          cute.autovec_copy(frag, bufs[q][0][group])
        epilogue.add_row_sums(row_sums, m, da * a, acc[acc_group].shape)
    _store_buffers(atoms[1:], stores, first, c, leader, barrier_id)
  epilogue.store_ds_part(row_sums, thr_mma, m_ds, wg_tidx, row0, n_tile, block_n, TILE_M)


@cute.kernel
def _kernel(tma_a: cute.CopyAtom, m_a: cute.Tensor, tma_b: cute.CopyAtom, m_b: cute.Tensor,
            m_out: cute.Tensor, m_out2: cute.Tensor, m_h: cute.Tensor, m_scores: cute.Tensor,
            m_ds: cute.Tensor, tile_expert: cute.Tensor, gather_index: cute.Tensor,
            tiled_mma: cute.TiledMma, a_smem_staged: cute.ComposedLayout,
            b_smem_staged: cute.ComposedLayout, tma_out: cute.CopyAtom, m_out_tma: cute.Tensor,
            c_smem_staged: cute.ComposedLayout, smem_epilogue, num_experts: cutlass.Int32,
            shared_storage: cutlass.Constexpr, block_n: cutlass.Constexpr,
            stages: cutlass.Constexpr, tx_bytes: cutlass.Constexpr, kind: cutlass.Constexpr,
            gather: cutlass.Constexpr, tma_store: cutlass.Constexpr,
            tile_m: cutlass.Constexpr, cluster_n: cutlass.Constexpr):
  """kind "dh": m_a dOg (P, d, 1) by TMA, or with gather dO (T, d, 1) gathered by
  gather_index; m_b W2 (n, d, E), m_out dH, m_out2 A', m_h H, m_scores, m_ds dS parts. kind
  "swiglu" (gather always): m_a X (T, d, 1) gathered by gather_index, m_b W1 (2n, d, E) (its
  gate and up column tiles), m_out H, m_out2 A. kind "store": m_a lhs (P, K, 1) by TMA, m_b
  rhs (N, K, E), m_out = m_out2 out (P, N, 1) = lhs_e rhs_e, stored from registers or (tma_store)
  by the TMA-store epilogue (tma_out, m_out_tma: out's TMA atom and tensor; c_smem_staged: both
  consumers' epilogue buffers). kind "dh" with tma_store: its SMEM epilogue
  (_dh_smem_epilogue; tma_out, m_out_tma dH's), smem_epilogue = (A''s TMA atom and tensor,
  H's TMA atom and tensor, the wgmma on EPI_TILE's columns); () otherwise. (Unused operands:
  m_h, m_scores, m_ds outside dh; tma_out, m_out_tma, c_smem_staged without tma_store.)
  tile_m: TILE_M, or (kind "store" with tma_store) ROW_TILE_M rows a tile, tile_expert then
  schedule.row_tiles' table (row_tile). cluster_n > 1 (kind "store"): clusters of that many
  CTAs, CTA c of the grid rank c % cluster_n in its, take neighbouring column tiles of one row
  tile (CTA c's tiles are c, c + grid, ..; grid and the column tiles multiples of cluster_n)
  and share its lhs tiles: each loads 1 / cluster_n of a stage's and multicasts it to all
  (tma_a made for it)."""
  swiglu = kind == "swiglu"
  tidx, _, _ = cute.arch.thread_idx()
  cta, _, _ = cute.arch.block_idx()
  num_ctas = cute.arch.grid_dim()[0]
  role = cute.arch.make_warp_uniform(tidx // 128)   # 0 producer, 1 and 2 consumers
  warp = cute.arch.make_warp_uniform(cute.arch.warp_idx())
  num_n_tiles = calls.column_tiles(cute.size(m_out2, mode=[1]), block_n)
  num_tiles = row_tiles_of(tile_expert, m_out2, tile_m) * num_n_tiles
  my_tiles = (num_tiles - cta + num_ctas - 1) // num_ctas
  k_steps = cute.size(m_a, mode=[1]) // BLOCK_K
  tile_mnk = (tile_m, block_n, BLOCK_K)
  dh_smem_epilogue = kind == "dh" and tma_store   # its OUTPUT_BUFFERS epilogue
  producer_regs, consumer_regs = REGISTERS[gather]
  if cutlass.const_expr(dh_smem_epilogue and gather):
    producer_regs, consumer_regs = SMEM_EPILOGUE_GATHER_REGISTERS

  smem = cutlass.memory.SmemAllocator()
  storage = smem.allocate(shared_storage)
  s_a = storage.s_a.get_tensor(a_smem_staged.outer, swizzle=a_smem_staged.inner)
  s_bs = [buf.get_tensor(b_smem_staged.outer, swizzle=b_smem_staged.inner)
          for buf in ([storage.s_b, storage.s_b2] if cutlass.const_expr(swiglu) else [storage.s_b])]
  s_c = None
  if cutlass.const_expr(tma_store):   # consumer c's epilogue buffers: c * their number onwards
    s_c = storage.s_c.get_tensor(c_smem_staged.outer, swizzle=c_smem_staged.inner)
  # (dh_smem_epilogue: h_bars, each consumer's H landed; a consumer warpgroup releases a stage)
  loads, h_bars = mainloop.load_pipeline(storage, stages, tx_bytes, gather, 128, tidx,
                                         2 if dh_smem_epilogue else 0, cluster_n)
  rank = 0   # this CTA's place in its cluster
  if cutlass.const_expr(cluster_n > 1):
    rank = cute.arch.make_warp_uniform(cute.arch.block_idx_in_cluster())

  if role == 0:
    cute.arch.setmaxregister_decrease(producer_regs)
    if warp < (4 if gather else 1):   # gathering, the whole warpgroup; else warp 0
      mainloop.prefetch_descriptors(warp, tma_a, tma_b, gather)
      produce = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, stages)
      for t in cutlass.range(cta, num_tiles, num_ctas, unroll=1):
        rows, cols = t // num_n_tiles, t % num_n_tiles
        first_row, owner, _ = row_tile(tile_expert, rows, tile_m)
        if owner < num_experts:
          rhs_cols = [cols, cols + num_n_tiles] if cutlass.const_expr(swiglu) else [cols]
          operands = [mainloop.tma_operand(tma_b, sb, cute.local_tile(
              m_b, tile_mnk, (rows, c, None, owner), proj=(None, 1, 1)))
              for sb, c in zip(s_bs, rhs_cols)]
          if cutlass.const_expr(gather):
            # this thread's rows' tokens in each of grouped_gemm's warpgroups' row blocks of
            # the M tile (TILE_M = BLOCK_M: the same rows)
            tokens = [row_gather.gather_tokens(gather_index, rows, tidx + 128 * block)
                      for block in range(mainloop.WARPGROUPS)]
            for k in cutlass.range(k_steps, unroll=1):
              row_gather.gather_stage(loads, produce, m_a, tokens, s_a, operands, k, tidx, 0,
                                      kind)
              produce.advance()
          else:
            g_a = tile_at(m_a, tile_mnk, rows, first_row, cols, (1, None, 1))
            operands = [mainloop.tma_operand(tma_a, s_a, g_a, rank, cluster_n)] + operands
            for k in cutlass.range(k_steps, unroll=1):
              mainloop.load_stage(loads, produce, operands, k)
              produce.advance()
      if warp == 0:
        loads.producer_tail(produce)
  else:
    cute.arch.setmaxregister_increase(consumer_regs)
    me = role - 1
    wg_tidx = tidx % 128
    thr_mma = tiled_mma.get_slice(wg_tidx)
    frag_a = tiled_mma.make_fragment_A(thr_mma.partition_A(s_a))
    frag_bs = [tiled_mma.make_fragment_B(thr_mma.partition_B(sb)) for sb in s_bs]
    accs = [cute.make_rmem_tensor(tiled_mma.partition_shape_C((tile_m, block_n)),
                                  cutlass.Float32) for _ in s_bs]
    tiled_mma.set(warpgroup.Field.ACCUMULATE, True)
    # (dh) each row's score broadcast along the tile's columns (stride 0)
    scores = cute.make_tensor(m_scores.iterator, cute.make_layout(
        (cute.size(m_scores), block_n, 1), stride=(1, 0, 0)))
    consume = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, stages)
    release = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, stages)
    i = cutlass.Int32(0)   # the tile's place among the CTA's tiles
    for t in cutlass.range(cta, num_tiles, num_ctas, unroll=1):
      rows, cols = t // num_n_tiles, t % num_n_tiles
      first_row, owner, rows_stored = row_tile(tile_expert, rows, tile_m)
      num_k = cutlass.Int32(0)   # none for a tile past the last group
      if owner < num_experts:
        num_k = k_steps
      if i % 2 != me:
        consume, release = skip_tile(consume, release, num_k)
      else:
        wait_turn(me, i)
        consume, release = mainloop.consume_tile(loads, consume, release, tiled_mma, accs,
                                                 frag_a, frag_bs, num_k, gather)
        pass_turn(me, i, my_tiles)
        release = mainloop.release_last_stage(loads, release, num_k)
        tile_of = lambda m, c: tile_at(m, tile_mnk, rows, first_row, c, (1, 1, None))
        if cutlass.const_expr(kind == "store" and tma_store):
          epilogue.tma_store_epilogue(
              accs, [(tma_out, tile_of(m_out_tma, cols))], s_c, tiled_mma, wg_tidx, warp % 4 == 0,
              False, EPILOGUE_BARRIER + me, 128, me * epilogue.EPI_STAGES,
              epi_tile=epi_tile(tile_m), row_limit=None if tile_m == TILE_M else rows_stored)
        elif cutlass.const_expr(kind == "store"):
          _register_outputs(accs, [tile_of(m_out, cols)], thr_mma, m_out.element_type, block_n,
                            False)
        else:
          halves = [cols, cols + num_n_tiles]   # H's (and dH's) gate and up column tiles
          outs = [tile_of(m_out, halves[0]), tile_of(m_out, halves[1]), tile_of(m_out2, cols)]
          if cutlass.const_expr(swiglu):
            _register_outputs(accs, outs, thr_mma, m_out.element_type, block_n, True)
          elif cutlass.const_expr(dh_smem_epilogue):
            tma_out2, m_out2_tma, tma_h, m_h_tma, chunk_mma = smem_epilogue
            # this consumer's tiles so far: i // 2, each using its H barrier once per chunk
            _dh_smem_epilogue(
                accs[0], [tile_of(m_h_tma, c) for c in halves],
                [tile_of(m_out_tma, halves[0]), tile_of(m_out_tma, halves[1]),
                 tile_of(m_out2_tma, cols)], [tma_h, tma_out, tma_out, tma_out2], s_c,
                me * OUTPUT_BUFFERS, chunk_mma, thr_mma, tile_of(scores, 0), m_ds, wg_tidx,
                warp % 4 == 0, h_bars + me, i // 2 * (block_n // EPI_TILE[1]), rows * TILE_M,
                cols, block_n, EPILOGUE_BARRIER + me)
          else:
            epilogue.dh_outputs(
                accs[0], epilogue.acc_chunks([tile_of(m_h, c) for c in halves], thr_mma),
                tile_of(scores, 0), m_ds, thr_mma,
                wg_tidx, rows * TILE_M, cols, m_out.element_type,
                epilogue.acc_chunks(outs, thr_mma), block_n, TILE_M)
      i += 1
    if cutlass.const_expr(dh_smem_epilogue):   # the last stores have read SMEM before exit
      if warp % 4 == 0:
        cute.arch.cp_async_bulk_wait_group(0, read=True)
  if cutlass.const_expr(cluster_n > 1):
    # no CTA exits while another may still multicast into its SMEM or arrive on its barriers
    cute.arch.cluster_arrive()
    cute.arch.cluster_wait()


@cute.jit
def _launch(stream, lhs: cute.Tensor, rhs: cute.Tensor, tile_expert: cute.Tensor,
            gather_index: cute.Tensor, out: cute.Tensor, out2: cute.Tensor, dh_inputs,
            block_n: cutlass.Constexpr, stages: cutlass.Constexpr, kind: cutlass.Constexpr,
            gather: cutlass.Constexpr, tma_store: cutlass.Constexpr = False,
            tile_m: cutlass.Constexpr = TILE_M, cluster_n: cutlass.Constexpr = 1):
  """The persistent grid and the kernel's static configuration (see _kernel's operands); with
  cluster_n > 1 clusters of that many CTAs, the lhs's TMA atom multicasting."""
  dtype = lhs.element_type
  swiglu = kind == "swiglu"
  m_h, m_scores, m_ds = dh_inputs if kind == "dh" else (out, tile_expert, out)   # (unused)
  a_major, b_major = LayoutEnum.from_tensor(lhs), LayoutEnum.from_tensor(rhs)
  tile_mnk = (tile_m, block_n, BLOCK_K)
  # one warpgroup's wgmma (MMA_M rows); partitioned over tile_m rows, it repeats along M
  tiled_mma = sm90_utils.make_trivial_tiled_mma(
      dtype, dtype, a_major.sm90_mma_major_mode(), b_major.sm90_mma_major_mode(),
      cutlass.Float32, (1, 1, 1), tiler_mn=(MMA_M, block_n))
  a_smem_staged = sm90_utils.make_smem_layout_a(a_major, tile_mnk, dtype, stages)
  b_smem_staged = sm90_utils.make_smem_layout_b(b_major, tile_mnk, dtype, stages)
  tma_b, m_b = cpasync.make_tiled_tma_atom(cpasync.CopyBulkTensorTileG2SOp(), rhs,
                                           cute.slice_(b_smem_staged, (None, None, 0)),
                                           (block_n, BLOCK_K))
  tma_a, m_a = tma_b, lhs   # gathering: lhs stays the source rows, no TMA (B's atom, unused)
  if cutlass.const_expr(not gather and cluster_n > 1):
    tma_a, m_a = cpasync.make_tiled_tma_atom(cpasync.CopyBulkTensorTileG2SMulticastOp(), lhs,
                                             cute.slice_(a_smem_staged, (None, None, 0)),
                                             (tile_m, BLOCK_K), num_multicast=cluster_n)
  elif cutlass.const_expr(not gather):
    tma_a, m_a = cpasync.make_tiled_tma_atom(cpasync.CopyBulkTensorTileG2SOp(), lhs,
                                             cute.slice_(a_smem_staged, (None, None, 0)),
                                             (tile_m, BLOCK_K))
  a_elems, b_elems = cute.cosize(a_smem_staged), cute.cosize(b_smem_staged)
  # the TMA-store epilogue (kind "store" or "dh" with tma_store): epilogue_buffers(kind) per
  # consumer and out's TMA atom (made for every kind: the kernel takes them, unused elsewhere)
  c_smem_staged = sm90_utils.make_smem_layout_epi(dtype, LayoutEnum.ROW_MAJOR, epi_tile(tile_m),
                                                  2 * epilogue_buffers(kind))
  c_tile = cute.slice_(c_smem_staged, (None, None, 0))
  tma_out, m_out_tma = cpasync.make_tiled_tma_atom(cpasync.CopyBulkTensorTileS2GOp(), out, c_tile,
                                                   epi_tile(tile_m))
  # (dh with tma_store) A''s and H's TMA atoms and the wgmma on a chunk's columns
  smem_epilogue = ()
  if cutlass.const_expr(kind == "dh" and tma_store):
    smem_epilogue = (*cpasync.make_tiled_tma_atom(cpasync.CopyBulkTensorTileS2GOp(), out2, c_tile,
                                                  EPI_TILE),
                     *cpasync.make_tiled_tma_atom(cpasync.CopyBulkTensorTileG2SOp(), m_h, c_tile,
                                                  EPI_TILE),
                     sm90_utils.make_trivial_tiled_mma(
                         dtype, dtype, a_major.sm90_mma_major_mode(),
                         b_major.sm90_mma_major_mode(), cutlass.Float32, (1, 1, 1),
                         tiler_mn=(MMA_M, EPI_TILE[1])))

  # the bytes TMA brings per stage: the rhs tiles, and unless gathered the lhs tile
  rhs_bytes = cute.size_in_bytes(dtype, cute.slice_(b_smem_staged, (None, None, 0)))
  tx_bytes = (2 if swiglu else 1) * rhs_bytes
  if cutlass.const_expr(not gather):
    tx_bytes += cute.size_in_bytes(dtype, cute.slice_(a_smem_staged, (None, None, 0)))
  num_tiles = (row_tiles_of(tile_expert, out2, tile_m)
               * calls.column_tiles(cute.size(out2, mode=[1]), block_n))
  # (the TMA-store epilogue's buffers: the store kernels' and dh's with tma_store; dh's H
  # barriers, one per consumer)
  storage = mainloop.shared_storage(
      dtype, stages * 2 + (2 if kind == "dh" and tma_store else 0), a_elems, b_elems,
      2 if swiglu else 1, cute.cosize(c_smem_staged) if tma_store else 0)
  _kernel.set_name_prefix(grouped_gemm.kernel_label(kind, gather, "pingpong"),
                          remove_cutlass_symbol=True)
  kernel = _kernel(tma_a, m_a, tma_b, m_b, out, out2, m_h, m_scores, m_ds, tile_expert,
                   gather_index, tiled_mma, a_smem_staged, b_smem_staged, tma_out, m_out_tma,
                   c_smem_staged, smem_epilogue, cute.size(rhs, mode=[2]), storage, block_n,
                   stages, tx_bytes, kind, gather, tma_store, tile_m, cluster_n)
  # (the column tiles a multiple of cluster_n, and NUM_SMS even: the grid is whole clusters)
  grid = (min(num_tiles, NUM_SMS), 1, 1)
  if cutlass.const_expr(cluster_n > 1):
    kernel.launch(grid=grid, block=(THREADS, 1, 1), cluster=(cluster_n, 1, 1), stream=stream,
                  min_blocks_per_mp=1)
  else:
    kernel.launch(grid=grid, block=(THREADS, 1, 1), stream=stream, min_blocks_per_mp=1)


@cute.jit
def _dh_pingpong(stream, dout_g: cute.Tensor, w2: cute.Tensor, tile_expert: cute.Tensor,
                 h: cute.Tensor, scores: cute.Tensor, dh: cute.Tensor, a_scaled: cute.Tensor,
                 ds_parts: cute.Tensor, block_n: cutlass.Constexpr, stages: cutlass.Constexpr,
                 tma_store: cutlass.Constexpr = False):
  """dOg (P, d, 1), w2 (n, d, E) K-major, H (P, 2n, 1), scores (P,), dH (P, 2n, 1), A' (P, n, 1),
  dS parts (n / block_n, P): the operands of grouped_gemm._dh."""
  _launch(stream, dout_g, w2, tile_expert, tile_expert, dh, a_scaled, (h, scores, ds_parts),
          block_n, stages, "dh", False, tma_store)


@cute.jit
def _gathered_dh_pingpong(stream, dout: cute.Tensor, w2: cute.Tensor, tile_expert: cute.Tensor,
                          gather_index: cute.Tensor, h: cute.Tensor, scores: cute.Tensor,
                          dh: cute.Tensor, a_scaled: cute.Tensor, ds_parts: cute.Tensor,
                          block_n: cutlass.Constexpr, stages: cutlass.Constexpr,
                          tma_store: cutlass.Constexpr = False):
  """_dh_pingpong with dO (T, d, 1) the source rows, slot r reading dO[gather_index[r]]: the
  operands of grouped_gemm._gathered_dh."""
  _launch(stream, dout, w2, tile_expert, gather_index, dh, a_scaled, (h, scores, ds_parts),
          block_n, stages, "dh", True, tma_store)


@cute.jit
def _matmul_pingpong(stream, lhs: cute.Tensor, rhs: cute.Tensor, tile_expert: cute.Tensor,
                     out: cute.Tensor, block_n: cutlass.Constexpr, stages: cutlass.Constexpr,
                     tma_store: cutlass.Constexpr, first_col: cutlass.Constexpr = 0,
                     tile_m: cutlass.Constexpr = TILE_M, cluster_n: cutlass.Constexpr = 1):
  """lhs (P, K, 1) K-major, rhs (N, K, E) N- or K-major, out (P, W, 1): the operands of
  grouped_gemm._matmul (first_col as its); with tile_m ROW_TILE_M tile_expert is
  schedule.row_tiles' table; cluster_n as _kernel's."""
  _launch(stream, lhs, grouped_gemm.rhs_window(rhs, out, first_col), tile_expert, tile_expert,
          out, out, None, block_n, stages, "store", False, tma_store, tile_m, cluster_n)


@cute.jit
def _up_proj_pingpong(stream, x: cute.Tensor, w1: cute.Tensor, tile_expert: cute.Tensor,
                      gather_index: cute.Tensor, h: cute.Tensor, a: cute.Tensor,
                      block_n: cutlass.Constexpr, stages: cutlass.Constexpr):
  """x (T, d, 1) the source rows, w1 (2n, d, E) N-major, H (P, 2n, 1), A (P, n, 1): the
  operands of grouped_gemm._gathered_up_proj."""
  _launch(stream, x, w1, tile_expert, gather_index, h, a, None, block_n, stages, "swiglu", True)


def _check_tile(block_n: int, itemsize: int, num_rhs: int, stages, name: str,
                tma_store: bool = False, kind: str = "store", tile_m: int = TILE_M) -> int:
  """block_n within the accumulators' registers (widest_block_n) and the ring's depth:
  `stages`, or as many as fit (beside the TMA-store epilogue's buffers with tma_store);
  ValueError naming the limit."""
  widest = widest_block_n(num_rhs, kind, tile_m)
  if block_n > widest:
    raise ValueError(f"cute ping-pong {name}: block_n={block_n} is wider than {widest} (its "
                     f"{num_rhs} accumulator(s) of {tile_m} x block_n fp32 in "
                     f"{MAX_ACCUMULATOR_REGISTERS[kind]} registers per consumer thread)")
  fit = stages_that_fit(block_n, itemsize, num_rhs, tma_store, kind, tile_m)
  if stages is None:
    return fit
  if not 2 <= stages <= fit:
    raise ValueError(f"cute ping-pong {name}: stages={stages} must be between 2 and {fit} (what "
                     f"fits in SMEM at block_n={block_n})")
  return stages


def register_stores_fit(num_rows: int, num_cols: int) -> bool:
  """Whether an out [num_rows, num_cols] is within the register stores' 32-bit offsets."""
  return num_rows * num_cols <= calls.MAX_REGISTER_ADDRESSED


def grouped_matmul(lhs, rhs, tile_expert, *, transpose_rhs: bool = False, block_n: int = 128,
                   stages: int | None = None, tma_store: bool = False, cols=None,
                   tile_m: int = TILE_M, cluster_n: int = 1):
  """grouped_gemm.grouped_matmul on the ping-pong schedule: out [P, N] = lhs_e rhs_e per M
  tile, rhs [E, K, N], or with transpose_rhs [E, N, K] read K-major. out is stored from
  registers, or with tma_store through SMEM buffers of each consumer's own and TMA stores
  (epilogue.tma_store_epilogue; fewer ring stages fit). block_n: at most
  widest_block_n(1, "store") (192); stages: the ring's depth (default: as many as fit). ffi.ops runs
  down_proj and dx_tilde on it with STORE_KERNEL = "pingpong" / "pingpong_tma" (the default);
  both give grouped_matmul's bits. The register stores' 32-bit offsets cannot address
  an out past 2^31 elements (refused). cols: a window of the product, as grouped_matmul's.
  With tma_store block_n need not divide out's columns (a multiple of 64): the last column
  tile is clipped (calls.column_tiles). tile_m: TILE_M rows a tile (the plan's M tiles: tile_expert
  [P / 128]), or with tma_store ROW_TILE_M (three m64 wgmmas per consumer, block_n at most
  128): tile_expert is then schedule.row_tiles(group_offsets, P, ROW_TILE_M)'s table, the
  groups starting on multiples of MMA_M (schedule.plan_row_tiles checks a plan's). cluster_n:
  CTAs per cluster (CLUSTER_NS; 2: neighbouring column tiles of one row tile share its lhs
  tiles, each CTA loading half of a stage's and multicasting it; the column tiles then an even
  number)."""
  rhs_ekn = calls.rhs_as_ekn(rhs, transpose_rhs)
  reason = calls.unsupported(lhs, rhs_ekn, block_n, cols, clipped_last_tile=tma_store)
  if not reason and tile_m not in TILE_MS:
    reason = f"tile_m={tile_m} must be one of {TILE_MS}"
  if not reason and tile_m != TILE_M and not tma_store:
    reason = f"tile_m={tile_m} stores its rows by TMA only: use tma_store=True"
  if not reason and tile_m != TILE_M and (
      tile_expert.ndim != 1 or tile_expert.shape[0] % schedule.ROW_TILE_FIELDS):
    reason = (f"tile_m={tile_m} takes schedule.row_tiles' table ({schedule.ROW_TILE_FIELDS} "
              f"entries a tile) as tile_expert; got shape {tile_expert.shape}")
  out_cols = rhs_ekn.shape[2] if cols is None else cols[1] - cols[0]
  if not reason and not tma_store and not register_stores_fit(lhs.shape[0], out_cols):
    reason = (f"out [{lhs.shape[0]}, {out_cols}] has more than "
              f"{calls.MAX_REGISTER_ADDRESSED} elements, past the register stores' 32-bit "
              f"offsets: use tma_store=True")
  if not reason and (type(cluster_n) is not int or cluster_n not in CLUSTER_NS):
    reason = f"cluster_n={cluster_n!r} must be one of {CLUSTER_NS}"
  if not reason and not cluster_fits(cluster_n, out_cols, block_n):
    reason = (f"cluster_n={cluster_n} needs the column tiles in whole clusters: "
              f"{calls.column_tiles(out_cols, block_n)} tiles of block_n={block_n} in {out_cols} columns")
  if reason:
    raise ValueError(f"cute ping-pong grouped_matmul: {reason}")
  stages = _check_tile(block_n, lhs.dtype.itemsize, 1, stages, "grouped_matmul", tma_store,
                       tile_m=tile_m)
  # (the defaults left out of the call: the kernels' cache keys as before)
  option = dict(tile_m=tile_m) if tile_m != TILE_M else {}
  if cluster_n > 1:
    option["cluster_n"] = cluster_n
  return calls.matmul_call(_matmul_pingpong, lhs, rhs, tile_expert, transpose_rhs, cols,
                           block_n=block_n, stages=stages, tma_store=tma_store, **option)


def dh(dout_g, w2, h, scores, tile_expert, block_n: int = 128, stages: int | None = None,
       gather_index=None, over_h: bool = True, tma_store: bool = False):
  """grouped_gemm.dh (register stores) on the ping-pong schedule: the same operands and
  outputs; with gather_index [P], dout_g is dO [T, d] and the producer warpgroup gathers slot
  r's row dO[gather_index[r]] by cp.async (zeros where it is T or more), as up_proj gathers X.
  tma_store: each consumer's epilogue goes through SMEM buffers of its own one 64-column chunk
  at a time (_dh_smem_epilogue: H's chunks TMA-loaded, dH and A' stored by TMA; fewer ring
  stages fit; grouped_gemm.dh's bits).
  block_n: at most widest_block_n(1, "dh") (128); stages: the ring's depth (default: as many
  as fit, at most MAX_STAGES). The cute dh op uses it with CuteConfig.dh_kernel "pingpong",
  "pingpong_tma" or "auto" (where d <= CuteConfig.dh_pingpong_max_d); it
  gives grouped_gemm.dh's bits. over_h: dH written over H's buffer (calls.dh_call)."""
  reason = calls.dh_unsupported(calls.rows_read(dout_g, gather_index), w2, h,
                                       scores, block_n)
  if reason:
    raise ValueError(f"cute ping-pong dh: {reason}")
  stages = _check_tile(block_n, dout_g.dtype.itemsize, 1, stages, "dh", tma_store, "dh")
  option = dict(tma_store=True) if tma_store else {}   # (off: the targets leave it out)
  return calls.dh_call((_dh_pingpong, _gathered_dh_pingpong), dout_g, w2, h, scores,
                       tile_expert, gather_index, over_h, block_n=block_n, stages=stages,
                       **option)


def up_proj(x, w1, tile_expert, gather_index, block_n: int = 64, stages: int | None = None):
  """grouped_gemm.up_proj with gather_index on the ping-pong schedule, the producer warpgroup
  gathering X's rows by cp.async: x [T, d], w1 [E, d, 2n], gather_index [P] (slot r reads
  X[gather_index[r]], zeros where it is T or more); returns H [P, 2n] and A [P, n]. block_n:
  H's gate (and up) columns per tile, at most widest_block_n(2, "swiglu") (64). It gives
  grouped_gemm.up_proj's bits, as fast on 128-row tiles (CuteConfig.up_proj_kernel picks it)."""
  n = w1.shape[2] // 2
  reason = calls.unsupported(calls.rows_read(x, gather_index), w1, block_n) or (
      None if n % block_n == 0 else f"n={n} must be a multiple of block_n={block_n}")
  if reason:
    raise ValueError(f"cute ping-pong up_proj: {reason}")
  stages = _check_tile(block_n, x.dtype.itemsize, 2, stages, "up_proj", kind="swiglu")
  # (the ping-pong kernel always gathers: no kernel reading rows in slot order)
  return calls.up_proj_call((None, _up_proj_pingpong), x, w1, tile_expert, gather_index,
                            block_n=block_n, stages=stages)
