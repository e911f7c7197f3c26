"""Persistent versions of grouped_gemm.py's gathering kernels (CuTe DSL): the up-projection
with its SwiGLU epilogue and dH with its dSwiGLU epilogue, X's (or dO's) rows gathered by a
producer warpgroup, the same operands, outputs and bits as grouped_gemm.up_proj / .dh with
gather_index. grouped_gemm launches one CTA per output tile, so every tile pays its pipeline's
fill (the gathered rows' latency) and its epilogue with the tensor cores idle; at the 7B
configs (24 k steps a tile, 12-25 waves) that is a large share. Here each CTA loops over
tiles and its producer runs on into the next tile's stages while the MMA warpgroups run the
epilogue.

Schedule:
  grid      : min(tiles, NUM_SMS) CTAs; CTA c takes tiles c, c + grid, ...; tile t is M tile
              t // (n / block_n), column tile t % (n / block_n) (an M tile's column tiles on
              neighbouring CTAs, its rows from L2)
  producer  : warpgroup 0 (grouped_gemm's PRODUCER_REGISTERS), as grouped_gemm's gathering
              producer (gather_stage) for every k step of every tile of its CTA, its ring state
              running on across tiles (tiles past the last group load nothing)
  MMA       : warpgroups 1 and 2 (BLOCK_M / 2 rows of a tile each), per tile: zero the
              accumulators, the mainloop, release the tile's last stage, the epilogue:
              up_proj through SMEM buffers of its own (EPI_STAGES x EPI_TILE, not over the
              stages, which the producer is refilling) and TMA stores
              (grouped_gemm._tma_store_epilogue); dh from registers (grouped_gemm._dh_outputs,
              register stores; H loaded DH_LOAD_AHEAD column groups ahead)
"""
from __future__ import annotations

import cutlass
import cutlass.cute as cute
import jax
import cutlass.memory
import cutlass.pipeline as pipeline
import cutlass.utils.hopper_helpers as sm90_utils
from cutlass.cute.nvgpu import cpasync, warpgroup
from cutlass.tensor_utils import LayoutEnum

from ffi import grouped_gemm as gg
from ffi.grouped_gemm import BLOCK_K, BLOCK_M, EPI_TILE, THREADS, WARPGROUPS

NUM_SMS = 132               # H100 / H200 SXM: the persistent grid (fewer SMs only queue CTAs)
# dH's epilogue loads H this many column groups ahead of its math (grouped_gemm's 8 at block_n
# 256 spilled 24 bytes here, the tile loop's state taking registers; 6 does not)
DH_LOAD_AHEAD = 6
MAX_STAGES = 8


def epilogue_bytes(itemsize: int) -> int:
  """SMEM of the up-projection's own TMA-store buffers."""
  return gg.EPI_STAGES * EPI_TILE[0] * EPI_TILE[1] * itemsize


def stages_that_fit(block_n: int, num_rhs: int, itemsize: int) -> int:
  """The ring's deepest (at most MAX_STAGES): dh (num_rhs 1) keeps no other SMEM, up_proj
  (num_rhs 2) its epilogue's buffers."""
  reserved = epilogue_bytes(itemsize) if num_rhs == 2 else 0
  return min(MAX_STAGES, gg._stages_that_fit(block_n, num_rhs, itemsize, reserved=reserved))


@cute.kernel
def _kernel(m_x: cute.Tensor, tma_b: cute.CopyAtom, m_b: cute.Tensor, m_out: cute.Tensor,
            m_out2: cute.Tensor, tma_out: cute.CopyAtom, m_out_tma: cute.Tensor,
            tma_out2: cute.CopyAtom, m_out2_tma: cute.Tensor, m_h: cute.Tensor,
            m_scores: cute.Tensor, m_ds: cute.Tensor, tile_expert: cute.Tensor,
            gather_index: cute.Tensor, tiled_mma: cute.TiledMma,
            a_smem_staged: cute.ComposedLayout, b_smem_staged: cute.ComposedLayout,
            c_smem_staged: cute.ComposedLayout, num_experts: cutlass.Int32,
            shared_storage: cutlass.Constexpr, block_n: cutlass.Constexpr,
            stages: cutlass.Constexpr, stage_bytes: cutlass.Constexpr, kind: cutlass.Constexpr):
  """kind "swiglu": m_x X (T, d, 1), m_b W1 (2n, d, E) (its gate and up column tiles), m_out
  H, m_out2 A. kind "dh": m_x dO (T, d, 1), m_b W2 (n, d, E), m_out dH, m_out2 A', m_h H,
  m_scores, m_ds dS parts. Rows gathered by gather_index. (Unused: m_h, m_scores, m_ds for
  swiglu; the TMA-store atoms and c_smem_staged for dh.)"""
  swiglu = kind == "swiglu"
  tidx, _, _ = cute.arch.thread_idx()
  cta, _, _ = cute.arch.block_idx()
  num_ctas = cute.arch.grid_dim()[0]
  warp = cute.arch.make_warp_uniform(cute.arch.warp_idx())
  if warp == 0:
    cpasync.prefetch_descriptor(tma_b)
  num_n_tiles = cute.size(m_out2, mode=[1]) // block_n
  num_tiles = cute.size(m_out2, mode=[0]) // BLOCK_M * num_n_tiles
  k_steps = cute.size(m_x, mode=[1]) // BLOCK_K
  tile_mnk = (BLOCK_M, block_n, BLOCK_K)

  smem = cutlass.memory.SmemAllocator()
  storage = smem.allocate(shared_storage)
  s_a = storage.s_a.get_tensor(a_smem_staged.outer, swizzle=a_smem_staged.inner)
  s_bs = [buf.get_tensor(b_smem_staged.outer, swizzle=b_smem_staged.inner)
          for buf in ([storage.s_b, storage.s_b2] if cutlass.const_expr(swiglu) else [storage.s_b])]
  loads = pipeline.PipelineTmaAsync.create(   # (initialises the barriers, then syncs the CTA)
      barrier_storage=storage.barriers.data_ptr(), num_stages=stages,
      producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, gg.PRODUCER_ARRIVALS),
      consumer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, THREADS // 32),
      tx_count=stage_bytes, cta_layout_vmnk=cute.make_layout((1, 1, 1, 1)))

  if warp < 4:   # the producer warpgroup
    cute.arch.setmaxregister_decrease(gg.PRODUCER_REGISTERS)
    produce = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, stages)
    for t in cutlass.range(cta, num_tiles, num_ctas, unroll=1):
      m_tile, n_tile = t // num_n_tiles, t % num_n_tiles
      owner = tile_expert[m_tile]
      if owner < num_experts:
        cols = [n_tile, n_tile + num_n_tiles] if cutlass.const_expr(swiglu) else [n_tile]
        operands = [gg.tma_operand(tma_b, sb, cute.local_tile(
            m_b, tile_mnk, (m_tile, c, None, owner), proj=(None, 1, 1)))
            for sb, c in zip(s_bs, cols)]
        tokens = [gg._gather_tokens(gather_index, m_tile, tidx + 128 * wg)
                  for wg in range(WARPGROUPS)]
        for k in cutlass.range(k_steps, unroll=1):
          gg.gather_stage(loads, produce, m_x, tokens, s_a, operands, k, tidx, 0, kind)
          produce.advance()
  else:   # the MMA warpgroups
    cute.arch.setmaxregister_increase(gg.MMA_REGISTERS)
    mma_tidx = tidx - 128
    leader = warp == 4
    thr_mma = tiled_mma.get_slice(mma_tidx)
    frag_a = tiled_mma.make_fragment_A(thr_mma.partition_A(s_a))
    frag_bs = [tiled_mma.make_fragment_B(thr_mma.partition_B(sb)) for sb in s_bs]
    accs = [cute.make_rmem_tensor(tiled_mma.partition_shape_C((BLOCK_M, block_n)),
                                  cutlass.Float32) for _ in s_bs]
    tiled_mma.set(warpgroup.Field.ACCUMULATE, True)
    s_c = None
    if cutlass.const_expr(swiglu):
      s_c = storage.s_c.get_tensor(c_smem_staged.outer, swizzle=c_smem_staged.inner)
    # (dh) each row's score broadcast along the tile's columns (stride 0)
    scores = cute.make_tensor(m_scores.iterator, cute.make_layout(
        (cute.size(m_scores), block_n, 1), stride=(1, 0, 0)))
    consume = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, stages)
    release = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, stages)
    for t in cutlass.range(cta, num_tiles, num_ctas, unroll=1):
      m_tile, n_tile = t // num_n_tiles, t % num_n_tiles
      num_k = cutlass.Int32(0)   # none for a tile past the last group
      if tile_expert[m_tile] < num_experts:
        num_k = k_steps
      for acc in accs:
        acc.fill(0.0)
      for kk in cutlass.range(num_k, unroll=1):
        loads.consumer_wait(consume)
        cute.arch.fence_proxy("async.shared", space="cta")   # gathered: generic-proxy writes
        gg.issue_k_step(tiled_mma, accs, frag_a, frag_bs, consume.index)
        consume.advance()
        warpgroup.wait_group(1)   # step kk - 1's wgmmas are done, so its stage is free
        if kk > 0:
          loads.consumer_release(release)
          release.advance()
      warpgroup.wait_group(0)
      if num_k > 0:   # the tile's last stage (the producer is already filling the others)
        loads.consumer_release(release)
        release.advance()
      tile_of = lambda m, c: cute.local_tile(m, tile_mnk, (m_tile, c, None, 0), proj=(1, 1, None))
      halves = [n_tile, n_tile + num_n_tiles]   # a [P, 2n] tensor's gate and up column tiles
      if cutlass.const_expr(swiglu):
        # the previous tile's stores have read the buffers (its leader waited) before any
        # thread writes them again
        cute.arch.barrier(barrier_id=gg.EPILOGUE_BARRIER, number_of_threads=THREADS)
        stores = [(tma_out, tile_of(m_out_tma, c)) for c in halves]
        stores = stores + [(tma_out2, tile_of(m_out2_tma, n_tile))]
        gg._tma_store_epilogue(accs, stores, s_c, tiled_mma, mma_tidx, leader, True)
      else:
        outs = [tile_of(m_out, halves[0]), tile_of(m_out, halves[1]), tile_of(m_out2, n_tile)]
        gg._dh_outputs(accs[0], gg.acc_chunks([tile_of(m_h, c) for c in halves], thr_mma),
                       tile_of(scores, 0), m_ds, thr_mma, mma_tidx, m_tile * BLOCK_M, n_tile,
                       m_out.element_type, gg.acc_chunks(outs, thr_mma), block_n, BLOCK_M,
                       DH_LOAD_AHEAD)


@cute.jit
def _launch(stream, x: cute.Tensor, rhs: cute.Tensor, tile_expert: cute.Tensor,
            gather_index: cute.Tensor, out: cute.Tensor, out2: cute.Tensor, dh_inputs,
            block_n: cutlass.Constexpr, stages: cutlass.Constexpr, kind: cutlass.Constexpr):
  """The persistent grid and the kernel's static configuration (see _kernel's operands)."""
  dtype = x.element_type
  swiglu = kind == "swiglu"
  num_rhs = 2 if swiglu else 1
  m_h, m_scores, m_ds = dh_inputs if kind == "dh" else (out, tile_expert, out)   # (unused)
  tiled_mma, a_smem_staged, b_smem_staged, tma_b, m_b = gg.mma_and_stages(
      dtype, LayoutEnum.from_tensor(x), LayoutEnum.from_tensor(rhs), rhs, block_n, stages)
  # the up-projection's own TMA-store buffers and its outputs' TMA atoms (made for dh too:
  # the kernel takes them, unused there)
  c_smem_staged = sm90_utils.make_smem_layout_epi(dtype, LayoutEnum.ROW_MAJOR, EPI_TILE,
                                                  gg.EPI_STAGES)
  c_tile = cute.slice_(c_smem_staged, (None, None, 0))
  tma_out, m_out_tma = cpasync.make_tiled_tma_atom(cpasync.CopyBulkTensorTileS2GOp(), out, c_tile,
                                                   EPI_TILE)
  tma_out2, m_out2_tma = cpasync.make_tiled_tma_atom(cpasync.CopyBulkTensorTileS2GOp(), out2,
                                                     c_tile, EPI_TILE)
  a_elems, b_elems = cute.cosize(a_smem_staged), cute.cosize(b_smem_staged)
  # up_proj's epilogue buffers are its own (the stages are refilled under it)
  storage = gg.shared_storage(dtype, stages * 2, a_elems, b_elems, num_rhs,
                              cute.cosize(c_smem_staged) if swiglu else 0)

  stage_bytes = num_rhs * cute.size_in_bytes(dtype, cute.slice_(b_smem_staged, (None, None, 0)))
  num_tiles = cute.size(out2, mode=[0]) // BLOCK_M * (cute.size(out2, mode=[1]) // block_n)
  _kernel(x, tma_b, m_b, out, out2, tma_out, m_out_tma, tma_out2, m_out2_tma, m_h, m_scores,
          m_ds, tile_expert, gather_index, tiled_mma, a_smem_staged, b_smem_staged,
          c_smem_staged, cute.size(rhs, mode=[2]),
          storage, block_n, stages, stage_bytes,
          kind).launch(grid=(min(num_tiles, NUM_SMS), 1, 1),
                       block=(THREADS + 128, 1, 1), stream=stream)


@cute.jit
def _up_proj(stream, x: cute.Tensor, w1: cute.Tensor, tile_expert: cute.Tensor,
             gather_index: cute.Tensor, h: cute.Tensor, a: cute.Tensor,
             block_n: cutlass.Constexpr, stages: cutlass.Constexpr):
  """x (T, d, 1) the source rows, w1 (2n, d, E) N-major, H (P, 2n, 1), A (P, n, 1): the
  operands of grouped_gemm._gathered_up_proj."""
  _launch(stream, x, w1, tile_expert, gather_index, h, a, None, block_n, stages, "swiglu")


@cute.jit
def _dh(stream, dout: cute.Tensor, w2: cute.Tensor, tile_expert: cute.Tensor,
        gather_index: cute.Tensor, h: cute.Tensor, scores: cute.Tensor, dh: cute.Tensor,
        a_scaled: cute.Tensor, ds_parts: cute.Tensor, block_n: cutlass.Constexpr,
        stages: cutlass.Constexpr):
  """dO (T, d, 1) the source rows, w2 (n, d, E) K-major, H, scores, dH, A', dS parts: the
  operands of grouped_gemm._gathered_dh."""
  _launch(stream, dout, w2, tile_expert, gather_index, dh, a_scaled, (h, scores, ds_parts),
          block_n, stages, "dh")


def _check_stages(block_n: int, num_rhs: int, itemsize: int, stages, name: str) -> int:
  """`stages`, or as many as fit (stages_that_fit); ValueError naming the limit."""
  fit = stages_that_fit(block_n, num_rhs, itemsize)
  if stages is None:
    return fit
  if not 2 <= stages <= fit:
    raise ValueError(f"cute persistent {name}: stages={stages} must be between 2 and {fit} "
                     f"(what fits in SMEM at block_n={block_n})")
  return stages


def up_proj(x, w1, tile_expert, gather_index, block_n: int = 128, stages: int | None = None):
  """grouped_gemm.up_proj with gather_index on persistent CTAs (module docstring): x [T, d],
  w1 [E, d, 2n], gather_index [P] (slot r reads X[gather_index[r]], zeros where it is T or
  more); returns H [P, 2n] and A [P, n]. stages: the ring's depth (default: as many as fit
  beside the epilogue's buffers)."""
  n = w1.shape[2] // 2
  reason = gg.unsupported(gg.rows_read(x, gather_index),
                          jax.ShapeDtypeStruct((*w1.shape[:2], n), w1.dtype), block_n)
  if reason:
    raise ValueError(f"cute persistent up_proj: {reason}")
  stages = _check_stages(block_n, 2, x.dtype.itemsize, stages, "up_proj")
  return gg.up_proj_call((None, _up_proj), x, w1, tile_expert, gather_index, block_n=block_n,
                         stages=stages)


def dh(dout, w2, h, scores, tile_expert, gather_index, block_n: int = 256,
       stages: int | None = None, over_h: bool = True):
  """grouped_gemm.dh with gather_index (register stores) on persistent CTAs (module
  docstring): dO [T, d], w2 [E, n, d], H [P, 2n], scores [P], gather_index [P]; returns dH
  [P, 2n], A' [P, n] and dS parts [n / block_n, P]. over_h: dH written over H's buffer."""
  reason = gg.dh_unsupported(gg.rows_read(dout, gather_index), w2, h, scores, block_n)
  if reason:
    raise ValueError(f"cute persistent dh: {reason}")
  stages = _check_stages(block_n, 1, dout.dtype.itemsize, stages, "dh")
  return gg.dh_call((None, _dh), dout, w2, h, scores, tile_expert, gather_index, over_h,
                    block_n=block_n, stages=stages)
