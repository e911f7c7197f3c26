"""A persistent version of grouped_gemm.py's gathering weight-gradient kernel (CuTe DSL): the
same operands, outputs and bits as grouped_gemm.weight_grad with gather_index (dW1 = X_e^T dH_e
with X's rows gathered; dW2^T = dO_e^T A'_e with dO's). grouped_gemm launches one CTA per
output tile, and each tile's pipeline fill (its first stages' gathered rows) and its epilogue
(BLOCK_M x block_n fp32 to bf16, stored by TMA) run with the tensor cores idle: 8-10% of a
tile at 30B-n256 (32 k steps a tile; benchmarks/NOTES.md, "The weight gradients' 9%"), the
measured gap to the PyTorch SonicMoE's persistent kernels. Here each CTA loops over tiles and
its producer runs on into the next tile's stages while the MMA warpgroups run the epilogue.

Schedule:
  grid      : min(tiles, num_ctas) CTAs (num_ctas: the GPU's SMs); CTA c takes tiles c,
              c + grid, ...; tile t is expert t // (m_tiles n_tiles), then M tile, then column
              tile (an expert's tiles run together: its gathered rows and rhs rows from L2)
  producer  : warpgroup 0 (grouped_gemm's PRODUCER_REGISTERS), as grouped_gemm's gathering
              producer (gather_stage, kind "wgrad": each k step's BLOCK_K rows gathered, the
              tile's BLOCK_M columns of them) for every k step of every tile of its CTA, its
              ring state running on across tiles (an expert without rows loads nothing)
  MMA       : warpgroups 1 and 2 (BLOCK_M / 2 rows of a tile each), per tile: zero the
              accumulators, the mainloop, release the tile's last stage, the epilogue through
              SMEM buffers of its own (EPI_STAGES x EPI_TILE, not over the stages, which the
              producer is refilling) and TMA stores (grouped_gemm._tma_store_epilogue; M-major
              for a transposed output); an expert without rows stores zeros
"""
from __future__ import annotations

import cutlass
import cutlass.cute as cute
import cutlass.memory
import cutlass.pipeline as pipeline
import cutlass.utils.hopper_helpers as sm90_utils
import jax
from cutlass.cute.nvgpu import cpasync, warpgroup
from cutlass.tensor_utils import LayoutEnum

from ffi import grouped_gemm as gg
from ffi.grouped_gemm import BLOCK_K, BLOCK_M, EPI_TILE, THREADS

NUM_SMS = 132     # H100 / H200 SXM: the default grid (fewer SMs only queue CTAs)
MAX_STAGES = 8


def epilogue_bytes(itemsize: int) -> int:
  """SMEM of the epilogue's own TMA-store buffers."""
  return gg.EPI_STAGES * EPI_TILE[0] * EPI_TILE[1] * itemsize


def stages_that_fit(block_n: int, itemsize: int) -> int:
  """The ring's deepest beside the epilogue's buffers (at most MAX_STAGES)."""
  return min(MAX_STAGES, gg._stages_that_fit(block_n, 1, itemsize,
                                             reserved=epilogue_bytes(itemsize)))


def tile_coords(t, num_m_tiles, num_n_tiles):
  """(expert, M tile, column tile) of tile t: experts outermost, column tiles innermost."""
  per_expert = num_m_tiles * num_n_tiles
  rest = t % per_expert
  return t // per_expert, rest // num_n_tiles, rest % num_n_tiles


@cute.kernel
def _kernel(m_x: cute.Tensor, tma_b: cute.CopyAtom, m_b: cute.Tensor, tma_out: cute.CopyAtom,
            m_out_tma: cute.Tensor, group_offsets: cute.Tensor, gather_index: cute.Tensor,
            tiled_mma: cute.TiledMma, a_smem_staged: cute.ComposedLayout,
            b_smem_staged: cute.ComposedLayout, c_smem_staged: cute.ComposedLayout,
            shared_storage: cutlass.Constexpr, block_n: cutlass.Constexpr,
            stages: cutlass.Constexpr, stage_bytes: cutlass.Constexpr,
            num_m_tiles: cutlass.Constexpr, num_n_tiles: cutlass.Constexpr,
            num_tiles: cutlass.Constexpr, out_m_major: cutlass.Constexpr):
  """m_x X (T, M, 1) the gathered rows' source, m_b the rhs (N, P, 1) N-major, the output
  (M, N, E) through its TMA atom, group_offsets (E + 1,) (expert e's k range), gather_index
  (P,)."""
  tidx, _, _ = cute.arch.thread_idx()
  cta, _, _ = cute.arch.block_idx()
  num_ctas = cute.arch.grid_dim()[0]
  warp = cute.arch.make_warp_uniform(cute.arch.warp_idx())
  if warp == 0:
    cpasync.prefetch_descriptor(tma_b)
  tile_mnk = (BLOCK_M, block_n, BLOCK_K)

  smem = cutlass.memory.SmemAllocator()
  storage = smem.allocate(shared_storage)
  s_a = storage.s_a.get_tensor(a_smem_staged.outer, swizzle=a_smem_staged.inner)
  s_b = storage.s_b.get_tensor(b_smem_staged.outer, swizzle=b_smem_staged.inner)
  loads = pipeline.PipelineTmaAsync.create(   # (initialises the barriers, then syncs the CTA)
      barrier_storage=storage.barriers.data_ptr(), num_stages=stages,
      producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, gg.PRODUCER_ARRIVALS),
      consumer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, THREADS // 32),
      tx_count=stage_bytes, cta_layout_vmnk=cute.make_layout((1, 1, 1, 1)))

  if warp < 4:   # the producer warpgroup
    cute.arch.setmaxregister_decrease(gg.PRODUCER_REGISTERS)
    produce = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, stages)
    for t in cutlass.range(cta, num_tiles, num_ctas, unroll=1):
      expert, m_tile, n_tile = tile_coords(t, num_m_tiles, num_n_tiles)
      k_begin = group_offsets[expert] // BLOCK_K
      num_k = group_offsets[expert + 1] // BLOCK_K - k_begin
      operands = [gg.tma_operand(tma_b, s_b, cute.local_tile(
          m_b, tile_mnk, (m_tile, n_tile, None, 0), proj=(None, 1, 1)))]
      for step in cutlass.range(num_k, unroll=1):
        k = k_begin + step
        tokens = gg._k_step_tokens(cute.local_tile(gather_index, (BLOCK_K,), (k,)), tidx)
        gg.gather_stage(loads, produce, m_x, tokens, s_a, operands, k, tidx, m_tile * BLOCK_M,
                        "wgrad")
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
    for t in cutlass.range(cta, num_tiles, num_ctas, unroll=1):
      expert, m_tile, n_tile = tile_coords(t, num_m_tiles, num_n_tiles)
      num_k = group_offsets[expert + 1] // BLOCK_K - group_offsets[expert] // BLOCK_K
      acc.fill(0.0)
      for kk in cutlass.range(num_k, unroll=1):
        loads.consumer_wait(consume)
        cute.arch.fence_proxy("async.shared", space="cta")   # gathered: generic-proxy writes
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
      # the previous tile's stores have read the buffers (its leader waited) before any
      # thread writes them again
      cute.arch.barrier(barrier_id=gg.EPILOGUE_BARRIER, number_of_threads=THREADS)
      out_tile = cute.local_tile(m_out_tma, tile_mnk, (m_tile, n_tile, None, expert),
                                 proj=(1, 1, None))
      gg._tma_store_epilogue([acc], [(tma_out, out_tile)], s_c, tiled_mma, mma_tidx, leader,
                             False, m_major=out_m_major)


@cute.jit
def _weight_grad(stream, x: cute.Tensor, rhs: cute.Tensor, group_offsets: cute.Tensor,
                 gather_index: cute.Tensor, out: cute.Tensor, block_n: cutlass.Constexpr,
                 stages: cutlass.Constexpr, num_ctas: cutlass.Constexpr = NUM_SMS):
  """x (T, M, 1) the source rows, rhs (N, P, 1) N-major, group_offsets (E + 1,), gather_index
  (P,), out (M, N, E) N- or M-major: the operands of grouped_gemm._gathered_weight_grad."""
  dtype = x.element_type
  a_major, b_major = LayoutEnum.COL_MAJOR, LayoutEnum.from_tensor(rhs)   # A tiles (M, rows)
  tile_mnk = (BLOCK_M, block_n, BLOCK_K)
  tiled_mma = sm90_utils.make_trivial_tiled_mma(
      dtype, dtype, a_major.sm90_mma_major_mode(), b_major.sm90_mma_major_mode(),
      cutlass.Float32, (gg.WARPGROUPS, 1, 1), tiler_mn=(64, block_n))
  a_smem_staged = sm90_utils.make_smem_layout_a(a_major, tile_mnk, dtype, stages)
  b_smem_staged = sm90_utils.make_smem_layout_b(b_major, tile_mnk, dtype, stages)
  tma_b, m_b = cpasync.make_tiled_tma_atom(cpasync.CopyBulkTensorTileG2SOp(), rhs,
                                           cute.slice_(b_smem_staged, (None, None, 0)),
                                           (block_n, BLOCK_K))
  out_layout = LayoutEnum.from_tensor(out)
  c_smem_staged = sm90_utils.make_smem_layout_epi(dtype, out_layout, EPI_TILE, gg.EPI_STAGES)
  tma_out, m_out_tma = cpasync.make_tiled_tma_atom(
      cpasync.CopyBulkTensorTileS2GOp(), out, cute.slice_(c_smem_staged, (None, None, 0)),
      EPI_TILE)
  storage = gg.shared_storage(dtype, stages * 2, cute.cosize(a_smem_staged),
                              cute.cosize(b_smem_staged), 1, cute.cosize(c_smem_staged))
  stage_bytes = cute.size_in_bytes(dtype, cute.slice_(b_smem_staged, (None, None, 0)))
  num_m_tiles = cute.size(out, mode=[0]) // BLOCK_M
  num_n_tiles = cute.size(out, mode=[1]) // block_n
  num_tiles = num_m_tiles * num_n_tiles * cute.size(out, mode=[2])
  _kernel.set_name_prefix(gg.kernel_label("wgrad", True, "persistent"),
                          remove_cutlass_symbol=True)
  _kernel(x, tma_b, m_b, tma_out, m_out_tma, group_offsets, gather_index, tiled_mma,
          a_smem_staged, b_smem_staged, c_smem_staged, storage, block_n, stages, stage_bytes,
          num_m_tiles, num_n_tiles, num_tiles, out_layout.is_m_major_c()).launch(
              grid=(min(num_tiles, num_ctas), 1, 1), block=(THREADS + 128, 1, 1),
              stream=stream)


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
  fit = stages_that_fit(block_n, x.dtype.itemsize)
  if stages is None:
    stages = max(2, min(fit, slots.shape[0] // BLOCK_K))
  elif not 2 <= stages <= fit:
    raise ValueError(f"cute persistent weight_grad: stages={stages} must be between 2 and {fit} "
                     f"(what fits in SMEM beside the epilogue's buffers at block_n={block_n})")
  if num_ctas is not None and (not isinstance(num_ctas, int) or num_ctas < 1):
    raise ValueError(f"cute persistent weight_grad: num_ctas must be a positive int; got {num_ctas!r}")
  config = {} if num_ctas is None else dict(num_ctas=num_ctas)
  return gg.weight_grad_call((None, _weight_grad), x, rhs, group_offsets, num_experts,
                             gather_index, transpose_out, block_n=block_n, stages=stages,
                             **config)
