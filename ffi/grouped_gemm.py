"""Varlen-M grouped GEMMs for Hopper as CuTe DSL kernels behind XLA FFI calls.

out[rows of M tile m] = lhs[rows of M tile m] @ rhs[tile_expert[m]] (grouped_matmul), or with
the SwiGLU epilogue H = [gate | up] and A = silu(gate) * up (up_proj), for a routing plan aligned
to BLOCK_M rows per expert (every M tile has one expert; tiles past the last group, marked
tile_expert >= E, store zeros). lhs [P, K] rows in slot order, rhs [E, K, N], out [P, N].

Tiling (one CTA per BLOCK_M x block_n output tile, grid (P / BLOCK_M, N / block_n)):
  warps    : WARPGROUPS consumer warpgroups, each owning BLOCK_M / WARPGROUPS rows of the tile;
             warp 0 also issues the TMA loads (not warp-specialized)
  mainloop : lhs[m, kk] (K-major) and rhs_e[kk, n] (N- or K-major) tiles of BLOCK_K by TMA
             through a `stages`-deep mbarrier pipeline; one k step's wgmmas stay in flight
             while the next step's are issued, and a stage is refilled once its wgmmas are done
  gather   : up_proj with gather_index (not yet run on a GPU): lhs is X and A's stages leave
             the TMA pipeline; each warpgroup cp.async-copies its own rows of step kk + stages
             - 1 into the stage step kk - 1 read, once that step's wgmmas are done
             (_gather_step), then waits, fences (async proxy) and syncs before its wgmmas
  epilogue : from registers, in out's dtype: _store_epilogue (out = acc) or _swiglu_epilogue
             (two accumulators: W1's gate columns c and up columns n + c, loaded as two rhs
             tiles per stage)
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
GATHER_CHUNKS = BLOCK_K * 2 // 16                      # 16-byte cp.async chunks per bf16 row
GATHER_ROWS_PER_THREAD = (BLOCK_M // WARPGROUPS) * GATHER_CHUNKS // 128


def _stages(block_n: int, num_rhs: int, itemsize: int) -> int:
  """Pipeline depth: as many stages (an lhs tile and num_rhs rhs tiles) as fit in SMEM (at most
  8), 1 KiB left for the barriers."""
  per_stage = (BLOCK_M + num_rhs * block_n) * BLOCK_K * itemsize
  return min(8, (SMEM_BYTES - 1024) // per_stage)


def _load_stage(loads, state, operands):
  """Warp 0: TMA loads of k step state.count of each (atom, gmem tiles, smem stages) operand
  into stage state.index, completing on that stage's mbarrier."""
  loads.producer_acquire(state)
  bar = loads.producer_get_barrier(state)
  for atom, src, dst in operands:
    cute.copy(atom, src[(None, state.count)], dst[(None, state.index)], tma_bar_ptr=bar)
  loads.producer_commit(state)


@cute.jit
def _store_tile(values, out_tile, thr_mma):
  """This thread's fragment of a tile (fp32 TensorSSA), in out's dtype, to its elements."""
  dst = thr_mma.partition_C(out_tile)
  frag = cute.make_rmem_tensor(dst.shape, out_tile.element_type)
  frag.store(values.to(out_tile.element_type))
  cute.autovec_copy(frag, dst)


@cute.jit
def _store_epilogue(accs, out_tiles, thr_mma):
  """Plain epilogue: out = acc."""
  _store_tile(accs[0].load(), out_tiles[0], thr_mma)


@cute.jit
def _swiglu_epilogue(accs, out_tiles, thr_mma):
  """SwiGLU epilogue: H's gate and up tiles = the two accumulators, A = silu(gate) * up."""
  gate, up = accs[0].load(), accs[1].load()
  _store_tile(gate, out_tiles[0], thr_mma)
  _store_tile(up, out_tiles[1], thr_mma)
  _store_tile(gate / (1.0 + cute.math.exp(-gate)) * up, out_tiles[2], thr_mma)


@cute.jit
def _gather_step(x, gather_index, a_stage, m_tile, k0, tidx):
  """This thread's share of its warpgroup's BLOCK_M / WARPGROUPS rows of one k step:
  a_stage[r, k0 : k0 + BLOCK_K] = x[gather_index[m_tile * BLOCK_M + r], ...] in 16-byte cp.async
  chunks (GATHER_CHUNKS per row, one per thread of a group of them); rows of indices outside x
  (padding slots) are written as zeros. Committed by the caller as one cp.async group."""
  wg, t = tidx // 128, tidx % 128
  chunk = t % GATHER_CHUNKS
  atom = cute.make_copy_atom(cpasync.CopyG2SOp(cpasync.LoadCacheMode.GLOBAL), x.element_type,
                             num_bits_per_copy=128)
  for j in cutlass.range_constexpr(GATHER_ROWS_PER_THREAD):
    r = wg * (BLOCK_M // WARPGROUPS) + t // GATHER_CHUNKS + j * (128 // GATHER_CHUNKS)
    token = gather_index[m_tile * BLOCK_M + r]
    dst = cute.local_tile(a_stage[r, None], (8,), (chunk,))
    if token < cute.size(x, mode=[0]):
      src = cute.local_tile(x[token, None, 0], (8,), (k0 // 8 + chunk,))
      cute.copy(atom, src, dst)
    else:
      dst.fill(0.0)


@cute.kernel
def _kernel(tma_a: cute.CopyAtom, m_a: cute.Tensor, tma_b: cute.CopyAtom, m_b: cute.Tensor,
            m_out: cute.Tensor, m_out2: cute.Tensor, tile_expert: cute.Tensor,
            gather_index: cute.Tensor, tiled_mma: cute.TiledMma,
            a_smem_staged: cute.ComposedLayout, b_smem_staged: cute.ComposedLayout,
            num_experts: cutlass.Int32, shared_storage: cutlass.Constexpr,
            block_n: cutlass.Constexpr, stages: cutlass.Constexpr, stage_bytes: cutlass.Constexpr,
            swiglu: cutlass.Constexpr, gather: cutlass.Constexpr):
  tidx, _, _ = cute.arch.thread_idx()
  m_tile, n_tile, num_n_tiles = cute.arch.block_idx()[0], cute.arch.block_idx()[1], cute.arch.grid_dim()[1]
  warp = cute.arch.make_warp_uniform(cute.arch.warp_idx())
  if warp == 0:
    if cutlass.const_expr(not gather):
      cpasync.prefetch_descriptor(tma_a)
    cpasync.prefetch_descriptor(tma_b)

  owner = tile_expert[m_tile]
  has_group = owner < num_experts
  expert = cutlass.min(owner, num_experts - 1)   # a valid coordinate; unused past the groups
  tile_mnk = (BLOCK_M, block_n, BLOCK_K)
  tile_of = lambda t, n, l, proj: cute.local_tile(t, tile_mnk, (m_tile, n, None, l), proj=proj)
  g_a = tile_of(m_a, n_tile, 0, (1, None, 1))                     # (bM, bK, k)
  # rhs column blocks: one, or SwiGLU's gate and up blocks (columns c and n + c of W1)
  rhs_cols = [n_tile, n_tile + num_n_tiles] if cutlass.const_expr(swiglu) else [n_tile]
  g_bs = [tile_of(m_b, c, expert, (None, 1, 1)) for c in rhs_cols]   # (bN, bK, k) each
  if cutlass.const_expr(swiglu):   # H's gate and up tiles, A's tile
    out_tiles = [tile_of(m_out, c, 0, (1, 1, None)) for c in rhs_cols] + \
                [tile_of(m_out2, n_tile, 0, (1, 1, None))]
  else:
    out_tiles = [tile_of(m_out, n_tile, 0, (1, 1, None))]
  num_k = cutlass.Int32(0)   # k steps: none for a tile past the last group
  if has_group:
    num_k = cute.size(m_a, mode=[1]) // BLOCK_K

  smem = cutlass.utils.SmemAllocator()
  storage = smem.allocate(shared_storage)
  s_a = storage.s_a.get_tensor(a_smem_staged.outer, swizzle=a_smem_staged.inner)
  s_bs = [buf.get_tensor(b_smem_staged.outer, swizzle=b_smem_staged.inner)
          for buf in ([storage.s_b, storage.s_b2] if cutlass.const_expr(swiglu) else [storage.s_b])]
  loads = pipeline.PipelineTmaAsync.create(
      barrier_storage=storage.barriers.data_ptr(), num_stages=stages,
      producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread),
      consumer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, THREADS // 32),
      tx_count=stage_bytes, cta_layout_vmnk=cute.make_layout((1, 1, 1, 1)))

  def tma_operand(atom, smem, gmem):
    s_part, g_part = cpasync.tma_partition(atom, 0, cute.make_layout(1), cute.group_modes(smem, 0, 2),
                                           cute.group_modes(gmem, 0, 2))
    return atom, g_part, s_part
  operands = [tma_operand(tma_b, sb, gb) for sb, gb in zip(s_bs, g_bs)]
  if cutlass.const_expr(not gather):   # else A's stages are filled by _gather_step
    operands = [tma_operand(tma_a, s_a, g_a)] + operands

  thr_mma = tiled_mma.get_slice(tidx)
  frag_a = tiled_mma.make_fragment_A(thr_mma.partition_A(s_a))
  frag_bs = [tiled_mma.make_fragment_B(thr_mma.partition_B(sb)) for sb in s_bs]
  accs = [cute.make_rmem_tensor(thr_mma.partition_C(out_tiles[0]).shape, cutlass.Float32)
          for _ in s_bs]
  for acc in accs:
    acc.fill(0.0)
  tiled_mma.set(warpgroup.Field.ACCUMULATE, True)
  cute.arch.sync_threads()   # barriers initialised before anyone waits on them

  produce = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, stages)
  consume = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, stages)
  release = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, stages)

  if warp == 0:
    for _ in cutlass.range(cutlass.min(stages, num_k), unroll=1):
      _load_stage(loads, produce, operands)
      produce.advance()
  if cutlass.const_expr(gather):   # A's first stages - 1 steps, one cp.async group each
    for step in cutlass.range_constexpr(stages - 1):
      if step < num_k:
        _gather_step(m_a, gather_index, s_a[None, None, step], m_tile, step * BLOCK_K, tidx)
      cute.arch.cp_async_commit_group()

  for kk in cutlass.range(num_k, unroll=1):
    loads.consumer_wait(consume)
    if cutlass.const_expr(gather):
      # of the stages - 1 + kk groups committed, step kk's (the kk + 1-th) has landed; make
      # the warpgroup's copies visible to its wgmmas (async proxy)
      cute.arch.cp_async_wait_group(stages - 2)
      cute.arch.fence_proxy("async.shared", space="cta")
      cute.arch.barrier(barrier_id=1 + tidx // 128, number_of_threads=128)
    warpgroup.fence()
    for kb in cutlass.range(cute.size(frag_a, mode=[2]), unroll_full=True):
      for acc, frag_b in zip(accs, frag_bs):
        cute.gemm(tiled_mma, acc, frag_a[None, None, kb, consume.index],
                  frag_b[None, None, kb, consume.index], acc)
    warpgroup.commit_group()
    consume.advance()
    # one step's wgmmas stay in flight: the previous step's are done, so its stage is free
    warpgroup.wait_group(1)
    if cutlass.const_expr(gather):   # step kk + stages - 1 into the stage step kk - 1 read
      ahead = kk + stages - 1
      if ahead < num_k:
        _gather_step(m_a, gather_index, s_a[None, None, ahead % stages], m_tile, ahead * BLOCK_K,
                     tidx)
      cute.arch.cp_async_commit_group()
    if kk > 0:
      loads.consumer_release(release)
      release.advance()
      if warp == 0 and produce.count < num_k:
        _load_stage(loads, produce, operands)
        produce.advance()
  warpgroup.wait_group(0)

  if cutlass.const_expr(swiglu):
    _swiglu_epilogue(accs, out_tiles, thr_mma)
  else:
    _store_epilogue(accs, out_tiles, thr_mma)


@cute.jit
def _matmul(stream, lhs: cute.Tensor, rhs: cute.Tensor, tile_expert: cute.Tensor,
            out: cute.Tensor, block_n: cutlass.Constexpr):
  """lhs (P, K, 1) K-major, rhs (N, K, E) N- or K-major, out (P, N, 1) (logical modes)."""
  _launch(stream, lhs, rhs, tile_expert, tile_expert, out, out, block_n, False, False)


@cute.jit
def _up_proj(stream, x: cute.Tensor, w1: cute.Tensor, tile_expert: cute.Tensor, h: cute.Tensor,
             a: cute.Tensor, block_n: cutlass.Constexpr):
  """x (P, d, 1), w1 (2n, d, E) N-major, H (P, 2n, 1), A (P, n, 1) (logical modes)."""
  _launch(stream, x, w1, tile_expert, tile_expert, h, a, block_n, True, False)


@cute.jit
def _gathered_up_proj(stream, x: cute.Tensor, w1: cute.Tensor, tile_expert: cute.Tensor,
                      gather_index: cute.Tensor, h: cute.Tensor, a: cute.Tensor,
                      block_n: cutlass.Constexpr):
  """_up_proj with x (T, d, 1) the source rows and slot r reading x[gather_index[r]]."""
  _launch(stream, x, w1, tile_expert, gather_index, h, a, block_n, True, True)


@cute.jit
def _launch(stream, lhs: cute.Tensor, rhs: cute.Tensor, tile_expert: cute.Tensor,
            gather_index: cute.Tensor, out: cute.Tensor, out2: cute.Tensor,
            block_n: cutlass.Constexpr, swiglu: cutlass.Constexpr, gather: cutlass.Constexpr):
  """The grid over (M tiles, output column tiles) and the kernel's static configuration; with
  swiglu out is H (P, N) and out2 A (P, N / 2), the grid covering N / 2 (gate) columns; with
  gather lhs is the source of the rows gather_index names (A's stages not in the TMA pipeline)."""
  dtype = lhs.element_type
  num_rhs = 2 if swiglu else 1
  a_major, b_major = LayoutEnum.from_tensor(lhs), LayoutEnum.from_tensor(rhs)
  stages = _stages(block_n, num_rhs, dtype.width // 8)
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
  b_elems = cute.cosize(b_smem_staged)

  @cute.struct
  class SharedStorage:
    barriers: cute.struct.MemRange[cutlass.Int64, stages * 2]
    s_a: cute.struct.Align[cute.struct.MemRange[dtype, cute.cosize(a_smem_staged)], 1024]
    s_b: cute.struct.Align[cute.struct.MemRange[dtype, b_elems], 1024]

  @cute.struct
  class SwigluSharedStorage:
    barriers: cute.struct.MemRange[cutlass.Int64, stages * 2]
    s_a: cute.struct.Align[cute.struct.MemRange[dtype, cute.cosize(a_smem_staged)], 1024]
    s_b: cute.struct.Align[cute.struct.MemRange[dtype, b_elems], 1024]
    s_b2: cute.struct.Align[cute.struct.MemRange[dtype, b_elems], 1024]

  stage_bytes = num_rhs * cute.size_in_bytes(dtype, cute.slice_(b_smem_staged, (None, None, 0)))
  if cutlass.const_expr(not gather):   # TMA brings A's tile too
    stage_bytes += cute.size_in_bytes(dtype, cute.slice_(a_smem_staged, (None, None, 0)))
  num_m_tiles = cute.size(out, mode=[0]) // BLOCK_M
  num_n_tiles = cute.size(out, mode=[1]) // (num_rhs * block_n)
  _kernel(tma_a, lhs if gather else m_a, tma_b, m_b, out, out2, tile_expert, gather_index,
          tiled_mma, a_smem_staged, b_smem_staged, cute.size(rhs, mode=[2]),
          SwigluSharedStorage if swiglu else SharedStorage, block_n, stages, stage_bytes, swiglu,
          gather).launch(
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
      _matmul,
      output_shape_dtype=jax.ShapeDtypeStruct((1, num_slots, n_out), lhs.dtype),
      input_spec=[cjax.TensorSpec(mode=(1, 2, 0)), cjax.TensorSpec(mode=rhs_mode), None],
      output_spec=cjax.TensorSpec(mode=(1, 2, 0)),
      block_n=block_n)
  return call(lhs[None], rhs, tile_expert.astype(jnp.int32))[0]


def up_proj(xg, w1, tile_expert, block_n: int = 128, gather_index=None):
  """H = Xg W1_e (gate and up halves) and A = silu(gate) * up per M tile: xg [P, d] rows in
  slot order, w1 [E, d, 2n]; returns H [P, 2n], A [P, n] (the SwiGLU epilogue). With
  gather_index [P] (NOT yet run on a GPU), xg is X [T, d] and slot r reads X[gather_index[r]]
  (zeros where it is T or more), gathered inside the kernel by cp.async."""
  n = w1.shape[2] // 2
  num_slots = xg.shape[0] if gather_index is None else gather_index.shape[0]
  slots = jax.ShapeDtypeStruct((num_slots, *xg.shape[1:]), xg.dtype)   # the rows the GEMM reads
  reason = unsupported(slots, jax.ShapeDtypeStruct((*w1.shape[:2], n), w1.dtype), block_n)
  if reason:
    raise ValueError(f"cute up_proj: {reason}")
  rows = cjax.TensorSpec(mode=(1, 2, 0))
  fn, index = (_up_proj, ()) if gather_index is None else \
      (_gathered_up_proj, (gather_index.astype(jnp.int32),))
  call = cjax.cutlass_call(
      fn, output_shape_dtype=(jax.ShapeDtypeStruct((1, num_slots, 2 * n), xg.dtype),
                              jax.ShapeDtypeStruct((1, num_slots, n), xg.dtype)),
      input_spec=[rows, cjax.TensorSpec(mode=(2, 1, 0)), None, *[None] * len(index)],
      output_spec=[rows, rows], block_n=block_n)
  h, a = call(xg[None], w1, tile_expert.astype(jnp.int32), *index)
  return h[0], a[0]
