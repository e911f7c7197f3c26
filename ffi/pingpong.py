"""dH as a persistent, warp-specialized ping-pong grouped GEMM for Hopper (CuTe DSL), beside
grouped_gemm.dh: the same operands, outputs and epilogue (grouped_gemm._dh_outputs), another
schedule. grouped_gemm's kernel runs the dSwiGLU epilogue after its mainloop with the tensor
cores idle (at the depth that wins there, one CTA per SM); here one consumer warpgroup's
epilogue runs while the other's mainloop does.

Schedule:
  work tile : WG_ROWS (64) rows x block_n columns of dA' = dOg W2_e^T (and so of dH's gate and
              up columns and of A'); tile t is row block t // (n / block_n), column block
              t % (n / block_n): a row block's column tiles run next to each other
  grid      : min(tiles, NUM_SMS) persistent CTAs; CTA c takes tiles c, c + grid, c + 2 grid..
  producer  : warpgroup 0, its registers lowered to PRODUCER_REGS; its warp 0 TMA-loads every
              tile's k steps (dOg [64, 64] and W2_e^T [block_n, 64]) into a `stages`-deep ring,
              running ahead across tiles (tiles past the last group load nothing)
  consumers : warpgroups 1 and 2, registers raised to CONSUMER_REGS, take the CTA's tiles in
              turn (its i-th tile is warpgroup 1 + i % 2's). A consumer waits for its turn
              (named barrier TURN_BARRIER + its index, which the other arrives at once it has
              waited for all its tile's stages: the two read the ring in tile order, so a
              stage's phase bit is never read one lap early), runs the wgmma mainloop (one k
              step in flight, each stage released once its wgmmas are done), hands the turn
              over, then runs the epilogue, registers to global, while the other warpgroup's
              mainloop runs. The other's tiles it steps over in the ring.
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

from ffi import grouped_gemm, xla_call
from ffi.grouped_gemm import BARRIER_BYTES, BLOCK_K, BLOCK_M, SMEM_BYTES

WG_ROWS = 64                # a work tile's rows: one warpgroup's wgmma M
NUM_SMS = 132               # H100 / H200 SXM: the persistent grid (fewer SMs only queue CTAs)
THREADS = 3 * 128           # the producer warpgroup and two consumer warpgroups
PRODUCER_REGS = 40          # 128 x 40 + 256 x 232 <= 64K registers per SM
CONSUMER_REGS = 232
TURN_BARRIER = 4            # named barriers 4 and 5: consumer 0's and 1's turn
MAX_STAGES = 8


def stage_bytes(block_n: int, itemsize: int) -> int:
  """SMEM of one ring stage: a [WG_ROWS, BLOCK_K] dOg tile and a [block_n, BLOCK_K] W2_e^T tile."""
  return (WG_ROWS + block_n) * BLOCK_K * itemsize


def stages_that_fit(block_n: int, itemsize: int) -> int:
  return min(MAX_STAGES, (SMEM_BYTES - BARRIER_BYTES) // stage_bytes(block_n, itemsize))


@cute.kernel
def _kernel(tma_a: cute.CopyAtom, m_a: cute.Tensor, tma_b: cute.CopyAtom, m_b: cute.Tensor,
            m_dh: cute.Tensor, m_a_scaled: cute.Tensor, m_h: cute.Tensor, m_scores: cute.Tensor,
            m_ds: cute.Tensor, tile_expert: cute.Tensor, tiled_mma: cute.TiledMma,
            a_smem_staged: cute.ComposedLayout, b_smem_staged: cute.ComposedLayout,
            num_experts: cutlass.Int32, shared_storage: cutlass.Constexpr,
            block_n: cutlass.Constexpr, stages: cutlass.Constexpr,
            tx_bytes: cutlass.Constexpr):
  tidx, _, _ = cute.arch.thread_idx()
  cta, _, _ = cute.arch.block_idx()
  num_ctas = cute.arch.grid_dim()[0]
  role = cute.arch.make_warp_uniform(tidx // 128)   # 0 producer, 1 and 2 consumers
  warp = cute.arch.make_warp_uniform(cute.arch.warp_idx())
  num_n_tiles = cute.size(m_a_scaled, mode=[1]) // block_n
  num_tiles = cute.size(m_a_scaled, mode=[0]) // WG_ROWS * num_n_tiles
  my_tiles = (num_tiles - cta + num_ctas - 1) // num_ctas
  k_steps = cute.size(m_a, mode=[1]) // BLOCK_K
  tile_mnk = (WG_ROWS, block_n, BLOCK_K)

  smem = cutlass.memory.SmemAllocator()
  storage = smem.allocate(shared_storage)
  s_a = storage.s_a.get_tensor(a_smem_staged.outer, swizzle=a_smem_staged.inner)
  s_b = storage.s_b.get_tensor(b_smem_staged.outer, swizzle=b_smem_staged.inner)
  loads = pipeline.PipelineTmaAsync.create(   # (initialises the barriers, then syncs the CTA)
      barrier_storage=storage.barriers.data_ptr(), num_stages=stages,
      producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread),
      consumer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, 128 // 32),
      tx_count=tx_bytes, cta_layout_vmnk=cute.make_layout((1, 1, 1, 1)))

  if role == 0:
    cute.arch.setmaxregister_decrease(PRODUCER_REGS)
    if warp == 0:
      cpasync.prefetch_descriptor(tma_a)
      cpasync.prefetch_descriptor(tma_b)
      produce = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, stages)
      for t in cutlass.range(cta, num_tiles, num_ctas, unroll=1):
        rows, cols = t // num_n_tiles, t % num_n_tiles
        owner = tile_expert[rows * WG_ROWS // BLOCK_M]
        if owner < num_experts:
          g_a = cute.local_tile(m_a, tile_mnk, (rows, cols, None, 0), proj=(1, None, 1))
          g_b = cute.local_tile(m_b, tile_mnk, (rows, cols, None, owner), proj=(None, 1, 1))
          operands = [grouped_gemm.tma_operand(tma_a, s_a, g_a),
                      grouped_gemm.tma_operand(tma_b, s_b, g_b)]
          for k in cutlass.range(k_steps, unroll=1):
            grouped_gemm.load_stage(loads, produce, operands, k)
            produce.advance()
      loads.producer_tail(produce)
  else:
    cute.arch.setmaxregister_increase(CONSUMER_REGS)
    me = role - 1
    wg_tidx = tidx % 128
    thr_mma = tiled_mma.get_slice(wg_tidx)
    frag_a = tiled_mma.make_fragment_A(thr_mma.partition_A(s_a))
    frag_b = tiled_mma.make_fragment_B(thr_mma.partition_B(s_b))
    acc = cute.make_rmem_tensor(tiled_mma.partition_shape_C((WG_ROWS, block_n)), cutlass.Float32)
    tiled_mma.set(warpgroup.Field.ACCUMULATE, True)
    # each row's score broadcast along the tile's columns (stride 0)
    scores = cute.make_tensor(m_scores.iterator, cute.make_layout(
        (cute.size(m_scores), block_n, 1), stride=(1, 0, 0)))
    consume = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, stages)
    release = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, stages)
    i = cutlass.Int32(0)   # the tile's place among the CTA's tiles
    for t in cutlass.range(cta, num_tiles, num_ctas, unroll=1):
      rows, cols = t // num_n_tiles, t % num_n_tiles
      num_k = cutlass.Int32(0)   # none for a tile past the last group
      if tile_expert[rows * WG_ROWS // BLOCK_M] < num_experts:
        num_k = k_steps
      if i % 2 != me:   # the other consumer's tile: step over its stages
        for _ in cutlass.range(num_k, unroll=1):
          consume.advance()
          release.advance()
      else:
        if i > 0:
          cute.arch.barrier(barrier_id=TURN_BARRIER + me, number_of_threads=256)
        acc.fill(0.0)
        for kk in cutlass.range(num_k, unroll=1):
          loads.consumer_wait(consume)
          warpgroup.fence()
          for kb in cutlass.range(cute.size(frag_a, mode=[2]), unroll_full=True):
            cute.gemm(tiled_mma, acc, frag_a[None, None, kb, consume.index],
                      frag_b[None, None, kb, consume.index], acc)
          warpgroup.commit_group()
          consume.advance()
          warpgroup.wait_group(1)   # the previous step's wgmmas are done: release its stage
          if kk > 0:
            loads.consumer_release(release)
            release.advance()
        if i + 1 < my_tiles:   # every stage of this tile waited for: the other's turn
          cute.arch.barrier_arrive(barrier_id=TURN_BARRIER + 1 - me, number_of_threads=256)
        warpgroup.wait_group(0)
        if num_k > 0:
          loads.consumer_release(release)
          release.advance()
        tile_of = lambda m, c: cute.local_tile(m, tile_mnk, (rows, c, None, 0), proj=(1, 1, None))
        halves = [cols, cols + num_n_tiles]   # dH's (and H's) gate and up column tiles
        grouped_gemm._dh_outputs(
            acc, [tile_of(m_h, c) for c in halves], tile_of(scores, 0), m_ds, thr_mma, wg_tidx,
            rows * WG_ROWS, cols, m_dh.element_type,
            [tile_of(m_dh, halves[0]), tile_of(m_dh, halves[1]), tile_of(m_a_scaled, cols)],
            block_n, WG_ROWS)
      i += 1


@cute.jit
def _dh_pingpong(stream, dout_g: cute.Tensor, w2: cute.Tensor, tile_expert: cute.Tensor,
                 h: cute.Tensor, scores: cute.Tensor, dh: cute.Tensor, a_scaled: cute.Tensor,
                 ds_parts: cute.Tensor, block_n: cutlass.Constexpr, stages: cutlass.Constexpr):
  """dOg (P, d, 1), w2 (n, d, E) K-major, H (P, 2n, 1), scores (P,), dH (P, 2n, 1), A' (P, n, 1),
  dS parts (n / block_n, P): the operands of grouped_gemm._dh."""
  dtype = dout_g.element_type
  a_major, b_major = LayoutEnum.from_tensor(dout_g), LayoutEnum.from_tensor(w2)
  tile_mnk = (WG_ROWS, block_n, BLOCK_K)
  tiled_mma = sm90_utils.make_trivial_tiled_mma(
      dtype, dtype, a_major.sm90_mma_major_mode(), b_major.sm90_mma_major_mode(),
      cutlass.Float32, (1, 1, 1), tiler_mn=(WG_ROWS, block_n))
  a_smem_staged = sm90_utils.make_smem_layout_a(a_major, tile_mnk, dtype, stages)
  b_smem_staged = sm90_utils.make_smem_layout_b(b_major, tile_mnk, dtype, stages)
  tma_a, m_a = cpasync.make_tiled_tma_atom(cpasync.CopyBulkTensorTileG2SOp(), dout_g,
                                           cute.slice_(a_smem_staged, (None, None, 0)),
                                           (WG_ROWS, BLOCK_K))
  tma_b, m_b = cpasync.make_tiled_tma_atom(cpasync.CopyBulkTensorTileG2SOp(), w2,
                                           cute.slice_(b_smem_staged, (None, None, 0)),
                                           (block_n, BLOCK_K))

  @cute.struct
  class SharedStorage:
    barriers: cute.struct.MemRange[cutlass.Int64, stages * 2]
    s_a: cute.struct.Align[cute.struct.MemRange[dtype, cute.cosize(a_smem_staged)], 1024]
    s_b: cute.struct.Align[cute.struct.MemRange[dtype, cute.cosize(b_smem_staged)], 1024]

  tx_bytes = (cute.size_in_bytes(dtype, cute.slice_(a_smem_staged, (None, None, 0)))
              + cute.size_in_bytes(dtype, cute.slice_(b_smem_staged, (None, None, 0))))
  num_tiles = cute.size(a_scaled, mode=[0]) // WG_ROWS * (cute.size(a_scaled, mode=[1]) // block_n)
  _kernel(tma_a, m_a, tma_b, m_b, dh, a_scaled, h, scores, ds_parts, tile_expert, tiled_mma,
          a_smem_staged, b_smem_staged, cute.size(w2, mode=[2]), SharedStorage, block_n,
          stages, tx_bytes).launch(grid=(min(num_tiles, NUM_SMS), 1, 1), block=(THREADS, 1, 1),
                                   stream=stream)


def dh(dout_g, w2, h, scores, tile_expert, block_n: int = 128, stages: int | None = None):
  """grouped_gemm.dh (no gather, register stores) on the ping-pong schedule: the same operands
  and outputs. stages: the ring's depth (default: as many as fit, at most MAX_STAGES).
  Compiled for sm_90a; not yet run on a GPU. The cute dh op uses it with ffi.ops.DH_KERNEL =
  "pingpong"."""
  n = w2.shape[1]
  reason = grouped_gemm.dh_unsupported(dout_g, w2, h, scores, block_n)
  if reason:
    raise ValueError(f"cute ping-pong dh: {reason}")
  fit = stages_that_fit(block_n, dout_g.dtype.itemsize)
  if stages is None:
    stages = fit
  if not 2 <= stages <= fit:
    raise ValueError(f"cute ping-pong dh: stages={stages} must be between 2 and {fit} (what "
                     f"fits in SMEM at block_n={block_n})")
  num_slots = dout_g.shape[0]
  dh_, a_scaled, ds_parts = xla_call.call(
      _dh_pingpong, [dout_g[None], w2, tile_expert.astype(jnp.int32), h[None],
                     scores.astype(jnp.float32)],
      [jax.ShapeDtypeStruct((1, num_slots, 2 * n), h.dtype),
       jax.ShapeDtypeStruct((1, num_slots, n), h.dtype),
       jax.ShapeDtypeStruct((n // block_n, num_slots), jnp.float32)],
      modes=[grouped_gemm.ROW_MODES, (1, 2, 0), None, grouped_gemm.ROW_MODES, None,
             grouped_gemm.ROW_MODES, grouped_gemm.ROW_MODES, None],
      block_n=block_n, stages=stages)
  return dh_[0], a_scaled[0], ds_parts
