"""Persistent versions of grouped_gemm.py's GEMMs (CuTe DSL), with the same operands, outputs
and bits: the gathering weight gradients (grouped_gemm.weight_grad with gather_index: dW1 =
X_e^T dH_e with X's rows gathered, dW2^T = dO_e^T A'_e with dO's), the varlen-M store GEMM
(grouped_gemm.grouped_matmul: down_proj and dx_tilde where their tiles are 256 wide) and dH
(grouped_gemm.dh with h_smem and tma_store: dA' = dO_e W2_e^T and its dSwiGLU epilogue).
grouped_gemm launches one CTA per output tile, and each tile's pipeline fill and
its epilogue (BLOCK_M x block_n fp32 to bf16, stored by TMA) run with the tensor cores idle:
8-10% of a weight-gradient tile at 30B-n256 (32 k steps a tile; benchmarks/NOTES.md, "The
weight gradients' 9%"). Here each CTA loops over tiles and its producer runs on into the next
tile's stages while the MMA warpgroups run the epilogue.

Schedule:
  grid      : min(tiles, num_ctas) CTAs (num_ctas: the GPU's SMs); CTA c takes tiles c,
              c + grid, ...; kind "wgrad": tile t is expert t // (m_tiles n_tiles), then M
              tile, then column tile (an expert's tiles together: its rows from L2); kind
              "store": M tile t // n_tiles, column tile t % n_tiles (an M tile's column tiles
              on neighbouring CTAs: its lhs rows from L2)
  producer  : warpgroup 0 (grouped_gemm's PRODUCER_REGISTERS), its ring state running on
              across tiles: "wgrad", as grouped_gemm's gathering producer (gather_stage: each
              k step's BLOCK_K rows gathered, the tile's BLOCK_M columns of them; an expert
              without rows loads nothing); "store" and "dh", its warp 0 TMA-loading the lhs
              and rhs tiles of every k step (a tile past the last group loads nothing), or
              "dh" gathering dO's rows as grouped_gemm's gathering dH (the M tile's tokens
              read once per tile)
  MMA       : warpgroups 1 and 2 (BLOCK_M / 2 rows of a tile each), per tile: zero the
              accumulators, the mainloop, release the tile's last stage, the epilogue through
              SMEM buffers of its own (EPI_STAGES x EPI_TILE, not over the stages, which the
              producer is refilling) and TMA stores (grouped_gemm._tma_store_epilogue; M-major
              for a transposed weight gradient); a tile without k steps stores zeros
  dH        : kind "dh" (tiles ordered as "store"'s over n's column tiles): its epilogue buffers
              hold H's gate and up tiles and A''s (DH_EPILOGUE_TILES x BLOCK_M x block_n), so
              block_n is at most 128. The MMA warpgroups' leader TMA-loads a tile's H as soon as
              the previous tile's stores have read the buffers (the first tile's before the
              loop): H lands under the mainloop. The epilogue (grouped_gemm._dh_outputs) writes
              dH over H's tiles and A' into the third, the leader stores all three by TMA.
"""
from __future__ import annotations

import cutlass
import cutlass.cute as cute
import cutlass.memory
import cutlass.pipeline as pipeline
import cutlass.utils.hopper_helpers as sm90_utils
from cutlass.cute.nvgpu import cpasync, warpgroup
from cutlass.tensor_utils import LayoutEnum

from ffi import grouped_gemm as gg
from ffi.grouped_gemm import BLOCK_K, BLOCK_M, EPI_TILE, THREADS

NUM_SMS = 132     # H100 / H200 SXM: the default grid (fewer SMs only queue CTAs)
MAX_STAGES = 8
DH_EPILOGUE_TILES = 3   # dH's epilogue buffers: H's gate and up tiles (dH over them), A''s
DH_MAX_BLOCK_N = 128    # 3 x 128 x 128 bf16 (96 KiB) beside 4 stages of 32 KiB


def epilogue_bytes(itemsize: int) -> int:
  """SMEM of the epilogue's own TMA-store buffers."""
  return gg.EPI_STAGES * EPI_TILE[0] * EPI_TILE[1] * itemsize


def dh_epilogue_bytes(block_n: int, itemsize: int) -> int:
  """SMEM of the persistent dH's epilogue buffers (H's tiles, A''s)."""
  return DH_EPILOGUE_TILES * BLOCK_M * block_n * itemsize


def stages_that_fit(block_n: int, itemsize: int, kind: str = "store") -> int:
  """The ring's deepest beside the epilogue's buffers (at most MAX_STAGES)."""
  reserved = dh_epilogue_bytes(block_n, itemsize) if kind == "dh" else epilogue_bytes(itemsize)
  return min(MAX_STAGES, gg._stages_that_fit(block_n, 1, itemsize, reserved=reserved))


def tile_work(kind: str, t, tile_info, num_m_tiles: int, num_n_tiles: int, k_steps: int,
              num_experts):
  """Tile t's (M tile, column tile, first k step, k steps, rhs's and out's third coordinate).
  "wgrad": tile_info is group_offsets (expert e's rows, its k range), out's third coordinate
  the expert. "store" and "dh": tile_info is tile_expert (the M tile's expert, E or more past
  the last group: no k steps), rhs's third coordinate the expert."""
  if kind == "wgrad":
    per_expert = num_m_tiles * num_n_tiles
    expert, rest = t // per_expert, t % per_expert
    k_begin = tile_info[expert] // BLOCK_K
    return (rest // num_n_tiles, rest % num_n_tiles, k_begin,
            tile_info[expert + 1] // BLOCK_K - k_begin, 0, expert)
  m_tile = t // num_n_tiles
  owner = tile_info[m_tile]
  # k_steps where owner < E, else 0 (in arithmetic: no branch)
  num_k = cutlass.min(k_steps, cutlass.max(num_experts - owner, 0) * k_steps)
  return m_tile, t % num_n_tiles, 0, num_k, cutlass.min(owner, num_experts - 1), 0


@cute.kernel
def _kernel(m_a: cute.Tensor, tma_a: cute.CopyAtom, tma_b: cute.CopyAtom, m_b: cute.Tensor,
            tma_out: cute.CopyAtom, m_out_tma: cute.Tensor, tile_info: cute.Tensor,
            gather_index: cute.Tensor, tiled_mma: cute.TiledMma,
            a_smem_staged: cute.ComposedLayout, b_smem_staged: cute.ComposedLayout,
            c_smem_staged: cute.ComposedLayout, tma_out2: cute.CopyAtom,
            m_out2_tma: cute.Tensor, m_h: cute.Tensor, m_scores: cute.Tensor, m_ds: cute.Tensor,
            tma_h: cute.CopyAtom, m_h_tma: cute.Tensor, chunk_mma: cute.TiledMma,
            num_experts: cutlass.Int32,
            shared_storage: cutlass.Constexpr, block_n: cutlass.Constexpr,
            stages: cutlass.Constexpr, stage_bytes: cutlass.Constexpr,
            num_m_tiles: cutlass.Constexpr, num_n_tiles: cutlass.Constexpr,
            k_steps: cutlass.Constexpr, num_tiles: cutlass.Constexpr,
            out_m_major: cutlass.Constexpr, kind: cutlass.Constexpr,
            gather: cutlass.Constexpr):
  """kind "wgrad": m_a X (T, M, 1) the gathered rows' source, m_b the rhs (N, P, 1) N-major,
  the output (M, N, E), tile_info group_offsets (E + 1,), gather_index (P,). kind "store":
  m_a the lhs's TMA tensor (P, K, 1), m_b the rhs's (N, K, E), the output (P, N, 1),
  tile_info tile_expert (P / BLOCK_M,), gather_index unused. kind "dh": as "store" with m_b
  W2's (n, d, E), the output dH (P, 2n, 1), or with gather m_a dO (T, d, 1) the gathered rows'
  source; tma_out2 .. chunk_mma (unused elsewhere): A''s TMA atom and tensor, H, scores, dS
  parts (n / block_n, P), H's TMA atom and tensor, the wgmma on EPI_TILE's columns; c_smem_staged
  DH_EPILOGUE_TILES x block_n / EPI_TILE[1] buffers."""
  dh = kind == "dh"
  dh_epilogue = (tma_out2, m_out2_tma, m_h, m_scores, m_ds, tma_h, m_h_tma, chunk_mma)
  tidx, _, _ = cute.arch.thread_idx()
  cta, _, _ = cute.arch.block_idx()
  num_ctas = cute.arch.grid_dim()[0]
  warp = cute.arch.make_warp_uniform(cute.arch.warp_idx())
  gg.prefetch_descriptors(warp, tma_a, tma_b, gather)
  tile_mnk = (BLOCK_M, block_n, BLOCK_K)
  work = lambda t: tile_work(kind, t, tile_info, num_m_tiles, num_n_tiles, k_steps, num_experts)

  smem = cutlass.memory.SmemAllocator()
  storage = smem.allocate(shared_storage)
  s_a = storage.s_a.get_tensor(a_smem_staged.outer, swizzle=a_smem_staged.inner)
  s_b = storage.s_b.get_tensor(b_smem_staged.outer, swizzle=b_smem_staged.inner)
  # (dh: h_bar, the tile's H landed)
  loads, h_bar = gg.load_pipeline(storage, stages, stage_bytes, gather, THREADS, tidx,
                                  1 if dh else 0)

  if warp < 4:   # the producer warpgroup
    cute.arch.setmaxregister_decrease(gg.PRODUCER_REGISTERS)
    produce = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, stages)
    for t in cutlass.range(cta, num_tiles, num_ctas, unroll=1):
      m_tile, n_tile, k_begin, num_k, rhs_l, _ = work(t)
      operands = [gg.tma_operand(tma_b, s_b, cute.local_tile(
          m_b, tile_mnk, (m_tile, n_tile, None, rhs_l), proj=(None, 1, 1)))]
      if cutlass.const_expr(gather and not dh):
        for step in cutlass.range(num_k, unroll=1):
          k = k_begin + step
          tokens = gg._k_step_tokens(cute.local_tile(gather_index, (BLOCK_K,), (k,)), tidx)
          gg.gather_stage(loads, produce, m_a, tokens, s_a, operands, k, tidx,
                          m_tile * BLOCK_M, kind)
          produce.advance()
      elif cutlass.const_expr(gather):   # dh: the M tile's rows, every k step's columns
        tokens = [gg._gather_tokens(gather_index, m_tile, tidx + 128 * wg)
                  for wg in range(gg.WARPGROUPS)]
        for step in cutlass.range(num_k, unroll=1):
          gg.gather_stage(loads, produce, m_a, tokens, s_a, operands, step, tidx, 0, kind)
          produce.advance()
      elif warp == 0:   # TMA loads only: its warp 0 issues every stage's
        lhs_and_rhs = [gg.tma_operand(tma_a, s_a, cute.local_tile(
            m_a, tile_mnk, (m_tile, n_tile, None, 0), proj=(1, None, 1)))] + operands
        for step in cutlass.range(num_k, unroll=1):
          gg.load_stage(loads, produce, lhs_and_rhs, k_begin + step)
          produce.advance()
  else:   # the MMA warpgroups
    cute.arch.setmaxregister_increase(gg.MMA_REGISTERS)
    mma_tidx = tidx - 128
    leader = warp == 4
    thr_mma = tiled_mma.get_slice(mma_tidx)
    frag_a = tiled_mma.make_fragment_A(thr_mma.partition_A(s_a))
    frag_b = tiled_mma.make_fragment_B(thr_mma.partition_B(s_b))
    acc = cute.make_rmem_tensor(tiled_mma.partition_shape_C((BLOCK_M, block_n)), cutlass.Float32)
    tiled_mma.set(warpgroup.Field.ACCUMULATE, True)
    s_c = storage.s_c.get_tensor(c_smem_staged.outer, swizzle=c_smem_staged.inner)
    consume = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, stages)
    release = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, stages)
    h_phase = cutlass.Int32(0)   # (dh) the parity of this CTA's tiles so far
    if cutlass.const_expr(dh):
      if leader:   # the first tile's H (grid <= tiles: every CTA has one)
        _load_dh_h(dh_epilogue, work(cta), s_c, h_bar, tile_mnk, num_n_tiles, block_n)
    for t in cutlass.range(cta, num_tiles, num_ctas, unroll=1):
      m_tile, n_tile, _, num_k, _, out_l = work(t)
      acc.fill(0.0)
      for kk in cutlass.range(num_k, unroll=1):
        loads.consumer_wait(consume)
        if cutlass.const_expr(gather):   # the gathered rows are generic-proxy writes
          cute.arch.fence_proxy("async.shared", space="cta")
        gg.issue_k_step(tiled_mma, [acc], frag_a, [frag_b], consume.index)
        consume.advance()
        warpgroup.wait_group(1)   # step kk - 1's wgmmas are done, so its stage is free
        if kk > 0:
          loads.consumer_release(release)
          release.advance()
      warpgroup.wait_group(0)
      if num_k > 0:   # the tile's last stage (the producer is already filling the others)
        loads.consumer_release(release)
        release.advance()
      if cutlass.const_expr(dh):
        # H's tile landed (the leader loaded it once the previous tile's stores had read the
        # buffers: they are free)
        cute.arch.mbarrier_wait(h_bar, h_phase)
        h_phase = h_phase ^ 1
        _dh_epilogue(dh_epilogue, acc, s_c, tiled_mma, thr_mma, mma_tidx, leader, m_out_tma,
                     tma_out, (m_tile, n_tile), tile_mnk, num_n_tiles, block_n)
        if leader and t + num_ctas < num_tiles:   # the next tile's H, under its mainloop
          _load_dh_h(dh_epilogue, work(t + num_ctas), s_c, h_bar, tile_mnk, num_n_tiles,
                     block_n)
      else:
        # the previous tile's stores have read the buffers (its leader waited) before any
        # thread writes them again
        cute.arch.barrier(barrier_id=gg.EPILOGUE_BARRIER, number_of_threads=THREADS)
        out_tile = cute.local_tile(m_out_tma, tile_mnk, (m_tile, n_tile, None, out_l),
                                   proj=(1, 1, None))
        gg._tma_store_epilogue([acc], [(tma_out, out_tile)], s_c, tiled_mma, mma_tidx, leader,
                               False, m_major=out_m_major)


def _h_columns(n_tile, num_n_tiles: int):
  """dH's (and H's) gate and up column tiles of n's column tile n_tile."""
  return [n_tile, n_tile + num_n_tiles]


@cute.jit
def _load_dh_h(dh_epilogue, tile, s_c, h_bar, tile_mnk: cutlass.Constexpr,
               num_n_tiles: cutlass.Constexpr, block_n: cutlass.Constexpr):
  """The leader warp: tile `tile` (tile_work's)'s H gate and up tiles into s_c's first two
  thirds by TMA, completing on h_bar."""
  m_tile, n_tile = tile[0], tile[1]
  _, _, m_h, _, _, tma_h, m_h_tma, _ = dh_epilogue
  h_tiles = [cute.local_tile(m_h_tma, tile_mnk, (m_tile, c, None, 0), proj=(1, 1, None))
             for c in _h_columns(n_tile, num_n_tiles)]
  gg._load_h_tile(tma_h, h_tiles, s_c, h_bar, 2 * BLOCK_M * block_n * m_h.element_type.width // 8)


@cute.jit
def _dh_epilogue(dh_epilogue, acc, s_c, tiled_mma, thr_mma, mma_tidx, leader, m_out_tma,
                 tma_out, tile, tile_mnk: cutlass.Constexpr, num_n_tiles: cutlass.Constexpr,
                 block_n: cutlass.Constexpr):
  """dH's epilogue on acc = dA' of tile (M tile, n's column tile) with H's tiles in s_c:
  grouped_gemm._dh_outputs writes dH over them and A' into s_c's last third (and dS's part
  to global memory), then the leader stores the three by TMA and waits until they have read
  SMEM."""
  m_tile, n_tile = tile
  tma_a_scaled, m_a_scaled_tma, m_h, m_scores, m_ds, _, _, chunk_mma = dh_epilogue
  chunks = block_n // EPI_TILE[1]
  h_srcs = gg.smem_chunks(s_c, chunk_mma, mma_tidx, [0, chunks], chunks)
  out_dsts = h_srcs + gg.smem_chunks(s_c, chunk_mma, mma_tidx, [2 * chunks], chunks)
  # each row's score broadcast along the tile's columns (stride 0)
  scores = cute.make_tensor(m_scores.iterator, cute.make_layout(
      (cute.size(m_scores), block_n, 1), stride=(1, 0, 0)))
  score_tile = cute.local_tile(scores, tile_mnk, (m_tile, 0, None, 0), proj=(1, 1, None))
  gg._dh_outputs(acc, h_srcs, score_tile, m_ds, thr_mma, mma_tidx, m_tile * BLOCK_M, n_tile,
                 m_h.element_type, out_dsts, block_n, BLOCK_M)
  cute.arch.fence_proxy("async.shared", space="cta")   # visible to the TMA engine
  cute.arch.barrier(barrier_id=gg.EPILOGUE_BARRIER, number_of_threads=THREADS)
  if leader:
    out_tile = lambda m, c: cute.local_tile(m, tile_mnk, (m_tile, c, None, 0), proj=(1, 1, None))
    gate, up = _h_columns(n_tile, num_n_tiles)
    gg._store_tiles_tma([(tma_out, s_c, 0, out_tile(m_out_tma, gate)),
                         (tma_out, s_c, chunks, out_tile(m_out_tma, up)),
                         (tma_a_scaled, s_c, 2 * chunks, out_tile(m_a_scaled_tma, n_tile))],
                        chunks)


@cute.jit
def _launch(stream, lhs: cute.Tensor, rhs: cute.Tensor, tile_info: cute.Tensor,
            gather_index: cute.Tensor, out: cute.Tensor, block_n: cutlass.Constexpr,
            stages: cutlass.Constexpr, num_ctas: cutlass.Constexpr, kind: cutlass.Constexpr,
            gather: cutlass.Constexpr, dh_operands=None):
  """The persistent grid and the kernel's static configuration (_kernel's operands; the
  output's modes (rows, columns, experts or 1)). dh_operands (kind "dh"): (A' (P, n, 1), H
  (P, 2n, 1), scores (P,), dS parts (n / block_n, P))."""
  dtype = lhs.element_type
  dh = kind == "dh"
  # the weight gradient's A tiles (M, rows) are M-major (filled by the gathers)
  a_major = LayoutEnum.COL_MAJOR if kind == "wgrad" else LayoutEnum.from_tensor(lhs)
  b_major = LayoutEnum.from_tensor(rhs)
  tile_mnk = (BLOCK_M, block_n, BLOCK_K)
  tiled_mma = sm90_utils.make_trivial_tiled_mma(
      dtype, dtype, a_major.sm90_mma_major_mode(), b_major.sm90_mma_major_mode(),
      cutlass.Float32, (gg.WARPGROUPS, 1, 1), tiler_mn=(64, block_n))
  a_smem_staged = sm90_utils.make_smem_layout_a(a_major, tile_mnk, dtype, stages)
  b_smem_staged = sm90_utils.make_smem_layout_b(b_major, tile_mnk, dtype, stages)
  tma_b, m_b = cpasync.make_tiled_tma_atom(cpasync.CopyBulkTensorTileG2SOp(), rhs,
                                           cute.slice_(b_smem_staged, (None, None, 0)),
                                           (block_n, BLOCK_K))
  stage_bytes = cute.size_in_bytes(dtype, cute.slice_(b_smem_staged, (None, None, 0)))
  if cutlass.const_expr(gather):   # no TMA for A (the kernel takes an atom: B's, unused)
    tma_a, m_a = tma_b, lhs
  else:
    tma_a, m_a = cpasync.make_tiled_tma_atom(cpasync.CopyBulkTensorTileG2SOp(), lhs,
                                             cute.slice_(a_smem_staged, (None, None, 0)),
                                             (BLOCK_M, BLOCK_K))
    stage_bytes += cute.size_in_bytes(dtype, cute.slice_(a_smem_staged, (None, None, 0)))
  out_layout = LayoutEnum.from_tensor(out)
  # the epilogue's own buffers: EPI_STAGES for the TMA-store epilogue, or dH's H, dH and A'
  epi_buffers = DH_EPILOGUE_TILES * (block_n // EPI_TILE[1]) if dh else gg.EPI_STAGES
  c_smem_staged = sm90_utils.make_smem_layout_epi(dtype, out_layout, EPI_TILE, epi_buffers)
  c_tile = cute.slice_(c_smem_staged, (None, None, 0))
  tma_out, m_out_tma = cpasync.make_tiled_tma_atom(
      cpasync.CopyBulkTensorTileS2GOp(), out, c_tile, EPI_TILE)
  # dH's other operands (elsewhere stand-ins of the right kinds, unused)
  a_scaled, m_h, m_scores, m_ds = dh_operands if dh else (out, out, tile_info, out)
  tma_out2, m_out2_tma = cpasync.make_tiled_tma_atom(
      cpasync.CopyBulkTensorTileS2GOp(), a_scaled, c_tile, EPI_TILE)
  tma_h, m_h_tma = cpasync.make_tiled_tma_atom(cpasync.CopyBulkTensorTileG2SOp(), m_h, c_tile,
                                               EPI_TILE)
  chunk_mma = sm90_utils.make_trivial_tiled_mma(
      dtype, dtype, a_major.sm90_mma_major_mode(), b_major.sm90_mma_major_mode(),
      cutlass.Float32, (gg.WARPGROUPS, 1, 1), tiler_mn=(64, EPI_TILE[1]))
  storage = gg.shared_storage(dtype, stages * 2 + (1 if dh else 0), cute.cosize(a_smem_staged),
                              cute.cosize(b_smem_staged), 1, cute.cosize(c_smem_staged))
  num_m_tiles = cute.size(out, mode=[0]) // BLOCK_M
  # (dh: n's column tiles, each a gate and an up tile of dH)
  num_n_tiles = cute.size(out, mode=[1]) // ((2 if dh else 1) * block_n)
  num_tiles = num_m_tiles * num_n_tiles * cute.size(out, mode=[2])
  k_steps = cute.size(lhs, mode=[1]) // BLOCK_K   # (store, dh: the contraction)
  _kernel.set_name_prefix(gg.kernel_label(kind, gather, "persistent"), remove_cutlass_symbol=True)
  _kernel(m_a, tma_a, tma_b, m_b, tma_out, m_out_tma, tile_info, gather_index, tiled_mma,
          a_smem_staged, b_smem_staged, c_smem_staged, tma_out2, m_out2_tma, m_h, m_scores,
          m_ds, tma_h, m_h_tma, chunk_mma, cute.size(rhs, mode=[2]), storage, block_n, stages,
          stage_bytes, num_m_tiles, num_n_tiles, k_steps, num_tiles,
          out_layout.is_m_major_c(), kind, gather).launch(
              grid=(min(num_tiles, num_ctas), 1, 1), block=(THREADS + 128, 1, 1),
              stream=stream)


@cute.jit
def _weight_grad(stream, x: cute.Tensor, rhs: cute.Tensor, group_offsets: cute.Tensor,
                 gather_index: cute.Tensor, out: cute.Tensor, block_n: cutlass.Constexpr,
                 stages: cutlass.Constexpr, num_ctas: cutlass.Constexpr = NUM_SMS):
  """x (T, M, 1) the source rows, rhs (N, P, 1) N-major, group_offsets (E + 1,), gather_index
  (P,), out (M, N, E) N- or M-major: the operands of grouped_gemm._gathered_weight_grad."""
  _launch(stream, x, rhs, group_offsets, gather_index, out, block_n, stages, num_ctas, "wgrad",
          True)


@cute.jit
def _matmul(stream, lhs: cute.Tensor, rhs: cute.Tensor, tile_expert: cute.Tensor,
            out: cute.Tensor, block_n: cutlass.Constexpr, stages: cutlass.Constexpr,
            first_col: cutlass.Constexpr = 0, num_ctas: cutlass.Constexpr = NUM_SMS):
  """lhs (P, K, 1) K-major, rhs (N, K, E) N- or K-major, out (P, W, 1): the operands of
  grouped_gemm._matmul (first_col as its)."""
  _launch(stream, lhs, gg.rhs_window(rhs, out, first_col), tile_expert, tile_expert, out,
          block_n, stages, num_ctas, "store", False)


@cute.jit
def _dh(stream, dout_g: cute.Tensor, w2: cute.Tensor, tile_expert: cute.Tensor, h: cute.Tensor,
        scores: cute.Tensor, dh: cute.Tensor, a_scaled: cute.Tensor, ds_parts: cute.Tensor,
        block_n: cutlass.Constexpr, stages: cutlass.Constexpr,
        num_ctas: cutlass.Constexpr = NUM_SMS):
  """The operands of grouped_gemm._dh: dOg (P, d, 1), w2 (n, d, E) K-major, H (P, 2n, 1),
  scores (P,), dH (P, 2n, 1), A' (P, n, 1), dS parts (n / block_n, P)."""
  _launch(stream, dout_g, w2, tile_expert, tile_expert, dh, block_n, stages, num_ctas, "dh",
          False, (a_scaled, h, scores, ds_parts))


@cute.jit
def _gathered_dh(stream, dout: cute.Tensor, w2: cute.Tensor, tile_expert: cute.Tensor,
                 gather_index: cute.Tensor, h: cute.Tensor, scores: cute.Tensor,
                 dh: cute.Tensor, a_scaled: cute.Tensor, ds_parts: cute.Tensor,
                 block_n: cutlass.Constexpr, stages: cutlass.Constexpr,
                 num_ctas: cutlass.Constexpr = NUM_SMS):
  """_dh with dout (T, d, 1) the source rows and slot r reading dout[gather_index[r]]."""
  _launch(stream, dout, w2, tile_expert, gather_index, dh, block_n, stages, num_ctas, "dh",
          True, (a_scaled, h, scores, ds_parts))


def _stages(stages, block_n: int, itemsize: int, k_steps: int, name: str,
            kind: str = "store") -> int:
  """`stages`, or as many as fit beside the epilogue's buffers (at most the k steps, at
  least 2); ValueError naming the limit."""
  fit = stages_that_fit(block_n, itemsize, kind)
  if stages is None:
    return max(2, min(fit, k_steps))
  if not 2 <= stages <= fit:
    raise ValueError(f"cute persistent {name}: stages={stages} must be between 2 and {fit} "
                     f"(what fits in SMEM beside the epilogue's buffers at block_n={block_n})")
  return stages


def _grid_config(num_ctas, name: str) -> dict:
  """The launch option of num_ctas ({} for the default grid, which the FFI targets leave out)."""
  if num_ctas is None:
    return {}
  if not isinstance(num_ctas, int) or isinstance(num_ctas, bool) or num_ctas < 1:
    raise ValueError(f"cute persistent {name}: num_ctas must be a positive int; got {num_ctas!r}")
  return dict(num_ctas=num_ctas)


def weight_grad(x, rhs, group_offsets, num_experts: int, gather_index, block_n: int = 128,
                stages: int | None = None, transpose_out: bool = False,
                num_ctas: int | None = None):
  """grouped_gemm.weight_grad with gather_index on persistent CTAs (module docstring): x
  [T, M] (slot r reads X[gather_index[r]], zeros where it is T or more), rhs [P, N] rows in
  slot order, expert e's rows group_offsets[e] .. group_offsets[e + 1] (multiples of BLOCK_M);
  returns out [E, M, N], out[e] = X_e^T rhs_e, or with transpose_out [E, N, M]. stages: the
  ring's depth (default: as many as fit beside the epilogue's buffers, at most the k steps of
  all rows). num_ctas: the grid's most CTAs (default NUM_SMS)."""
  slots = gg.rows_read(x, gather_index)
  reason = gg._weight_grad_unsupported(slots, rhs, group_offsets, num_experts, block_n)
  if reason:
    raise ValueError(f"cute persistent weight_grad: {reason}")
  stages = _stages(stages, block_n, x.dtype.itemsize, slots.shape[0] // BLOCK_K, "weight_grad")
  return gg.weight_grad_call((None, _weight_grad), x, rhs, group_offsets, num_experts,
                             gather_index, transpose_out, block_n=block_n, stages=stages,
                             **_grid_config(num_ctas, "weight_grad"))


def grouped_matmul(lhs, rhs, tile_expert, *, transpose_rhs: bool = False, block_n: int = 128,
                   stages: int | None = None, cols=None, num_ctas: int | None = None):
  """grouped_gemm.grouped_matmul on persistent CTAs (module docstring): out [P, N] = lhs_e
  rhs_e per M tile, rhs [E, K, N], or with transpose_rhs [E, N, K] read K-major; tile_expert
  [P / BLOCK_M] (E or more past the last group: zeros); cols=(lo, hi): out's columns lo ..
  hi - 1 only. stages: as weight_grad's (at most the contraction's k steps). num_ctas: the
  grid's most CTAs (default NUM_SMS)."""
  reason = gg.unsupported(lhs, gg.rhs_as_ekn(rhs, transpose_rhs), block_n, cols)
  if reason:
    raise ValueError(f"cute persistent grouped_matmul: {reason}")
  stages = _stages(stages, block_n, lhs.dtype.itemsize, lhs.shape[1] // BLOCK_K,
                   "grouped_matmul")
  return gg.matmul_call(_matmul, lhs, rhs, tile_expert, transpose_rhs, cols, block_n=block_n,
                        stages=stages, **_grid_config(num_ctas, "grouped_matmul"))


def dh(dout_g, w2, h, scores, tile_expert, block_n: int = 128, stages: int | None = None,
       gather_index=None, over_h: bool = True, num_ctas: int | None = None):
  """grouped_gemm.dh(..., tma_store=True, h_smem=True) on persistent CTAs (module docstring):
  dOg [P, d] rows in slot order (or with gather_index [P], dO [T, d] and slot r reading
  dO[gather_index[r]]), w2 [E, n, d], H [P, 2n] and scores [P]; returns dH [P, 2n], A' = s A
  [P, n] and dS parts [n / block_n, P] fp32. block_n: at most DH_MAX_BLOCK_N (the epilogue's
  own buffers hold H's two tiles and A''s). stages, num_ctas: as weight_grad's. over_h: as
  grouped_gemm.dh's."""
  reason = gg.dh_unsupported(gg.rows_read(dout_g, gather_index), w2, h, scores, block_n)
  if reason is None and block_n > DH_MAX_BLOCK_N:
    reason = (f"block_n={block_n} is wider than {DH_MAX_BLOCK_N} (the epilogue's buffers of "
              f"H's tiles and A' beside the pipeline's stages)")
  if reason:
    raise ValueError(f"cute persistent dh: {reason}")
  stages = _stages(stages, block_n, dout_g.dtype.itemsize, dout_g.shape[1] // BLOCK_K, "dh",
                   "dh")
  return gg.dh_call((_dh, _gathered_dh), dout_g, w2, h, scores, tile_expert, gather_index,
                    over_h, block_n=block_n, stages=stages, **_grid_config(num_ctas, "dh"))
