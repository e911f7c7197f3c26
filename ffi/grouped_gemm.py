"""Varlen-M grouped GEMM for Hopper as a CuTe DSL kernel behind an XLA FFI call.

out[rows of M tile m] = lhs[rows of M tile m] @ rhs[tile_expert[m]], for a routing plan aligned
to BLOCK_M rows per expert (every M tile has one expert; tiles past the last group, marked
tile_expert >= E, store zeros). lhs [P, K] rows in slot order, rhs [E, K, N], out [P, N].

Tiling (one CTA per BLOCK_M x block_n output tile, grid (P / BLOCK_M, N / block_n)):
  warps    : WARPGROUPS consumer warpgroups, each owning BLOCK_M / WARPGROUPS rows of the tile;
             warp 0 also issues the TMA loads (not warp-specialized)
  mainloop : lhs[m, kk] (K-major) and rhs_e[kk, n] (N- or K-major) tiles of BLOCK_K by TMA
             through a `stages`-deep mbarrier pipeline; one k step's wgmmas stay in flight
             while the next step's are issued, and a stage is refilled once its wgmmas are done
  epilogue : the fp32 accumulators converted to out's dtype and stored from registers
             (_store_accumulators)
"""
from __future__ import annotations

import cutlass
import cutlass.cute as cute
import cutlass.jax as cjax
import cutlass.pipeline as pipeline
import cutlass.utils.hopper_helpers as sm90_utils
import jax
import jax.numpy as jnp
from cutlass.cute.nvgpu import cpasync, warpgroup
from cutlass.tensor_utils import LayoutEnum

BLOCK_M = 128
BLOCK_K = 64
WARPGROUPS = 2
THREADS = 128 * WARPGROUPS
SMEM_BYTES = 227 * 1024


def _stages(block_n: int, itemsize: int) -> int:
  """Pipeline depth: as many lhs + rhs stages as fit in SMEM (at most 8), 1 KiB for barriers."""
  per_stage = (BLOCK_M + block_n) * BLOCK_K * itemsize
  return min(8, (SMEM_BYTES - 1024) // per_stage)


def _load_stage(loads, state, *operands):
  """Warp 0: TMA loads of k step state.count of each (atom, gmem tiles, smem stages) operand
  into stage state.index, completing on that stage's mbarrier."""
  loads.producer_acquire(state)
  bar = loads.producer_get_barrier(state)
  for atom, src, dst in operands:
    cute.copy(atom, src[(None, state.count)], dst[(None, state.index)], tma_bar_ptr=bar)
  loads.producer_commit(state)


@cute.jit
def _store_accumulators(acc, out_tile, thr_mma):
  """Epilogue: this thread's accumulator fragment, in out's dtype, to its elements of the tile."""
  dst = thr_mma.partition_C(out_tile)
  frag = cute.make_rmem_tensor(dst.shape, out_tile.element_type)
  frag.store(acc.load().to(out_tile.element_type))
  cute.autovec_copy(frag, dst)


@cute.kernel
def _kernel(tma_a: cute.CopyAtom, m_a: cute.Tensor, tma_b: cute.CopyAtom, m_b: cute.Tensor,
            m_out: cute.Tensor, tile_expert: cute.Tensor, tiled_mma: cute.TiledMma,
            a_smem_staged: cute.ComposedLayout, b_smem_staged: cute.ComposedLayout,
            num_experts: cutlass.Int32, shared_storage: cutlass.Constexpr,
            block_n: cutlass.Constexpr, stages: cutlass.Constexpr, stage_bytes: cutlass.Constexpr):
  tidx, _, _ = cute.arch.thread_idx()
  m_tile, n_tile, _ = cute.arch.block_idx()
  warp = cute.arch.make_warp_uniform(cute.arch.warp_idx())
  if warp == 0:
    cpasync.prefetch_descriptor(tma_a)
    cpasync.prefetch_descriptor(tma_b)

  owner = tile_expert[m_tile]
  has_group = owner < num_experts
  expert = cutlass.min(owner, num_experts - 1)   # a valid coordinate; unused past the groups
  tile_mnk = (BLOCK_M, block_n, BLOCK_K)
  g_a = cute.local_tile(m_a, tile_mnk, (m_tile, n_tile, None, 0), proj=(1, None, 1))    # (bM, bK, k)
  g_b = cute.local_tile(m_b, tile_mnk, (m_tile, n_tile, None, expert), proj=(None, 1, 1))  # (bN, bK, k)
  g_out = cute.local_tile(m_out, tile_mnk, (m_tile, n_tile, None, 0), proj=(1, 1, None))  # (bM, bN)
  num_k = cutlass.Int32(0)   # k steps: none for a tile past the last group
  if has_group:
    num_k = cute.size(g_a, mode=[2])

  smem = cutlass.utils.SmemAllocator()
  storage = smem.allocate(shared_storage)
  s_a = storage.s_a.get_tensor(a_smem_staged.outer, swizzle=a_smem_staged.inner)
  s_b = storage.s_b.get_tensor(b_smem_staged.outer, swizzle=b_smem_staged.inner)
  loads = pipeline.PipelineTmaAsync.create(
      barrier_storage=storage.barriers.data_ptr(), num_stages=stages,
      producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread),
      consumer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, THREADS // 32),
      tx_count=stage_bytes, cta_layout_vmnk=cute.make_layout((1, 1, 1, 1)))

  t_a_s, t_a_g = cpasync.tma_partition(tma_a, 0, cute.make_layout(1), cute.group_modes(s_a, 0, 2),
                                       cute.group_modes(g_a, 0, 2))
  t_b_s, t_b_g = cpasync.tma_partition(tma_b, 0, cute.make_layout(1), cute.group_modes(s_b, 0, 2),
                                       cute.group_modes(g_b, 0, 2))

  thr_mma = tiled_mma.get_slice(tidx)
  frag_a = tiled_mma.make_fragment_A(thr_mma.partition_A(s_a))
  frag_b = tiled_mma.make_fragment_B(thr_mma.partition_B(s_b))
  acc = cute.make_rmem_tensor(thr_mma.partition_C(g_out).shape, cutlass.Float32)
  acc.fill(0.0)
  tiled_mma.set(warpgroup.Field.ACCUMULATE, True)
  cute.arch.sync_threads()   # barriers initialised before anyone waits on them

  produce = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, stages)
  consume = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, stages)
  release = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, stages)

  if warp == 0:
    for _ in cutlass.range(cutlass.min(stages, num_k), unroll=1):
      _load_stage(loads, produce, (tma_a, t_a_g, t_a_s), (tma_b, t_b_g, t_b_s))
      produce.advance()

  for kk in cutlass.range(num_k, unroll=1):
    loads.consumer_wait(consume)
    warpgroup.fence()
    for kb in cutlass.range(cute.size(frag_a, mode=[2]), unroll_full=True):
      cute.gemm(tiled_mma, acc, frag_a[None, None, kb, consume.index],
                frag_b[None, None, kb, consume.index], acc)
    warpgroup.commit_group()
    consume.advance()
    # one step's wgmmas stay in flight: the previous step's are done, so its stage is free
    warpgroup.wait_group(1)
    if kk > 0:
      loads.consumer_release(release)
      release.advance()
      if warp == 0 and produce.count < num_k:
        _load_stage(loads, produce, (tma_a, t_a_g, t_a_s), (tma_b, t_b_g, t_b_s))
        produce.advance()
  warpgroup.wait_group(0)

  _store_accumulators(acc, g_out, thr_mma)


@cute.jit
def _grouped_gemm(stream, lhs: cute.Tensor, rhs: cute.Tensor, tile_expert: cute.Tensor,
                  out: cute.Tensor, block_n: cutlass.Constexpr):
  """lhs (P, K, 1) K-major, rhs (N, K, E) N- or K-major, out (P, N, 1) (logical modes)."""
  dtype = lhs.element_type
  a_major, b_major = LayoutEnum.from_tensor(lhs), LayoutEnum.from_tensor(rhs)
  stages = _stages(block_n, dtype.width // 8)
  tile_mnk = (BLOCK_M, block_n, BLOCK_K)
  tiled_mma = sm90_utils.make_trivial_tiled_mma(
      dtype, dtype, a_major.sm90_mma_major_mode(), b_major.sm90_mma_major_mode(),
      cutlass.Float32, (WARPGROUPS, 1, 1), tiler_mn=(64, block_n))
  a_smem_staged = sm90_utils.make_smem_layout_a(a_major, tile_mnk, dtype, stages)
  b_smem_staged = sm90_utils.make_smem_layout_b(b_major, tile_mnk, dtype, stages)
  tma_a, m_a = cpasync.make_tiled_tma_atom(cpasync.CopyBulkTensorTileG2SOp(), lhs,
                                           cute.slice_(a_smem_staged, (None, None, 0)),
                                           (BLOCK_M, BLOCK_K))
  tma_b, m_b = cpasync.make_tiled_tma_atom(cpasync.CopyBulkTensorTileG2SOp(), rhs,
                                           cute.slice_(b_smem_staged, (None, None, 0)),
                                           (block_n, BLOCK_K))

  @cute.struct
  class SharedStorage:
    barriers: cute.struct.MemRange[cutlass.Int64, stages * 2]
    s_a: cute.struct.Align[cute.struct.MemRange[dtype, cute.cosize(a_smem_staged)], 1024]
    s_b: cute.struct.Align[cute.struct.MemRange[dtype, cute.cosize(b_smem_staged)], 1024]

  stage_bytes = (cute.size_in_bytes(dtype, cute.slice_(a_smem_staged, (None, None, 0)))
                 + cute.size_in_bytes(dtype, cute.slice_(b_smem_staged, (None, None, 0))))
  num_m_tiles = cute.size(out, mode=[0]) // BLOCK_M
  num_n_tiles = cute.size(out, mode=[1]) // block_n
  _kernel(tma_a, m_a, tma_b, m_b, out, tile_expert, tiled_mma, a_smem_staged, b_smem_staged,
          cute.size(rhs, mode=[2]), SharedStorage, block_n, stages, stage_bytes).launch(
              grid=(num_m_tiles, num_n_tiles, 1), block=(THREADS, 1, 1), stream=stream)


def unsupported(lhs, rhs, block_n: int):
  """Why these operands cannot run (a sentence naming the limit), or None."""
  if lhs.dtype not in (jnp.bfloat16, jnp.float16) or rhs.dtype != lhs.dtype:
    return f"lhs and rhs must both be bfloat16 or float16; got {lhs.dtype} and {rhs.dtype}"
  if lhs.ndim != 2 or rhs.ndim != 3 or rhs.shape[1] != lhs.shape[1]:
    return f"need lhs [P, K] and rhs [E, K, N]; got {lhs.shape} and {rhs.shape}"
  if lhs.shape[0] % BLOCK_M:
    return f"rows P={lhs.shape[0]} must be a multiple of {BLOCK_M} (an aligned plan)"
  if lhs.shape[1] % BLOCK_K:
    return f"contraction K={lhs.shape[1]} must be a multiple of {BLOCK_K}"
  if rhs.shape[2] % block_n:
    return f"output columns N={rhs.shape[2]} must be a multiple of block_n={block_n}"
  return None


def grouped_matmul(lhs, rhs, tile_expert, *, transpose_rhs: bool = False, block_n: int = 128):
  """out [P, N] = lhs_e rhs_e per M tile (module docstring), rhs [E, K, N]; with transpose_rhs
  rhs is [E, N, K] and out = lhs_e rhs_e^T (read K-major, no transposed copy).
  tile_expert: [P / BLOCK_M] int32, E or more past the last group."""
  rhs_ekn = jax.ShapeDtypeStruct((rhs.shape[0], rhs.shape[2], rhs.shape[1]), rhs.dtype) \
      if transpose_rhs else rhs
  reason = unsupported(lhs, rhs_ekn, block_n)
  if reason:
    raise ValueError(f"cute grouped_matmul: {reason}")
  num_slots, n_out = lhs.shape[0], rhs_ekn.shape[2]
  # the kernel sees rhs as (N, K, E): [E, K, N] is N-major there, [E, N, K] K-major
  rhs_mode = (1, 2, 0) if transpose_rhs else (2, 1, 0)
  call = cjax.cutlass_call(
      _grouped_gemm,
      output_shape_dtype=jax.ShapeDtypeStruct((1, num_slots, n_out), lhs.dtype),
      input_spec=[cjax.TensorSpec(mode=(1, 2, 0)), cjax.TensorSpec(mode=rhs_mode), None],
      output_spec=cjax.TensorSpec(mode=(1, 2, 0)),
      block_n=block_n)
  return call(lhs[None], rhs, tile_expert.astype(jnp.int32))[0]
