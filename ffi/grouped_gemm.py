"""Varlen-M grouped GEMMs for Hopper as CuTe DSL kernels behind XLA FFI calls.

out[rows of M tile m] = lhs[rows of M tile m] @ rhs[tile_expert[m]] (grouped_matmul), with
the SwiGLU epilogue H = [gate | up] and A = silu(gate) * up (up_proj), or with the dSwiGLU
epilogue (dh: dH, A' = s A and dS parts from dA' = dOg W2_e^T, H and the scores), for a routing
plan aligned to BLOCK_M rows per expert (every M tile has one expert; tiles past the last group,
marked tile_expert >= E, store zeros). lhs [P, K] rows in slot order, rhs [E, K, N], out [P, N].
The same kernel computes the varlen-K weight gradients (weight_grad: out[e] = lhs_e^T rhs_e over
expert e's rows, one grid plane per expert, lhs read M-major and rhs N-major by TMA; or lhs's
rows gathered in the kernel (row_gather.py), the producer copying both MMA warpgroups' 64
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
             (mainloop.py)
  gather   : with gather_index (up_proj, dh, weight_grad) lhs is X (or dO) and A's stages are
             filled by 16-byte cp.async copies of the rows it names: a third warpgroup,
             warpgroup 0, is the producer (its registers lowered by setmaxnreg, the MMA
             warpgroups' raised): it copies every stage's rows for both MMA warpgroups and
             TMA-loads the rhs tiles, the copies completing on the stage's mbarrier
             (row_gather.produce_gathered), and the MMA warpgroups wait for full stages and
             fence (the copies are generic-proxy writes) before their wgmmas, which no longer
             wait on copies of their own
  epilogue : (epilogue.py) epilogue_values gives the output tiles' values (out = acc; or
             SwiGLU's H gate, H up and A from two accumulators: W1's gate columns c and up
             columns n + c, loaded as two rhs tiles per stage); tma_store_epilogue writes them
             through SMEM buffers over A's stages and TMA stores (faster than each thread
             storing its fragments from registers, most of all in the store GEMMs). dh first
             computes its dH and A' tiles in registers (dh_outputs: it loads H a few column
             groups ahead of their math, and writes dS's parts), then stores them from
             registers (register_store), or
             (dh(tma_store=True): bitwise the same) the same TMA way. dh(h_smem=True) reads H
             from SMEM instead, its tile TMA-loaded over the rhs stages once the mainloop is
             done, and with tma_store writes dH over it and A' over the lhs stages, stored by
             TMA from there.
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

from ffi import calls, epilogue, mainloop, row_gather
from ffi.epilogue import EPI_STAGES, EPI_TILE, EPILOGUE_BARRIER
from ffi.mainloop import (BLOCK_K, BLOCK_M, MMA_REGISTERS, PRODUCER_REGISTERS, THREADS,
                          WARPGROUPS)
from sonicmoe_jax.core import routing

# dh(h_smem=True): H's gate and up tiles (2 x BLOCK_M x block_n) over the rhs stages (stages x
# block_n x BLOCK_K) need this many
H_SMEM_MIN_STAGES = 2 * BLOCK_M // BLOCK_K
# up_proj's widest column tile: its two accumulators (gate and up) of a 256-wide tile need 256
# fp32 registers a thread and spill to a 2 KB stack, many times slower
UP_PROJ_MAX_BLOCK_N = 128


def pipeline_depth(block_n: int, num_rhs: int, itemsize: int, k_steps: int, stages) -> int:
  """The stages a kernel runs: `stages` if given (fewer leave SMEM for a second CTA per SM),
  else as many as fit, at most 8 and at most the k steps (at least 2). Raises ValueError,
  naming the limit, if the given ones do not fit."""
  fit = mainloop.stages_that_fit(block_n, num_rhs, itemsize)
  if stages is None:
    return max(2, min(8, fit, k_steps))
  if not 2 <= stages <= fit:
    raise ValueError(f"stages={stages} must be between 2 and {fit} (what fits in SMEM at "
                     f"block_n={block_n})")
  return stages


@cute.kernel
def _kernel(tma_a: cute.CopyAtom, m_a: cute.Tensor, tma_b: cute.CopyAtom, m_b: cute.Tensor,
            tma_b_up: cute.CopyAtom, m_b_up: cute.Tensor,
            m_out: cute.Tensor, m_out_up: cute.Tensor, m_out2: cute.Tensor,
            tma_out: cute.CopyAtom, m_out_tma: cute.Tensor, tma_out_up: cute.CopyAtom,
            m_out_up_tma: cute.Tensor, tma_out2: cute.CopyAtom, m_out2_tma: cute.Tensor,
            m_h: cute.Tensor, m_h_up: cute.Tensor, m_scores: cute.Tensor, m_ds: cute.Tensor,
            tma_h: cute.CopyAtom, m_h_tma: cute.Tensor, tma_h_up: cute.CopyAtom,
            m_h_up_tma: cute.Tensor, h_smem_staged: cute.ComposedLayout, chunk_mma: cute.TiledMma,
            tile_expert: cute.Tensor, gather_index: cute.Tensor, tiled_mma: cute.TiledMma,
            a_smem_staged: cute.ComposedLayout, b_smem_staged: cute.ComposedLayout,
            c_smem_staged: cute.ComposedLayout, num_experts: cutlass.Int32,
            shared_storage: cutlass.Constexpr, block_n: cutlass.Constexpr,
            stages: cutlass.Constexpr, stage_bytes: cutlass.Constexpr, kind: cutlass.Constexpr,
            gather: cutlass.Constexpr, register_store: cutlass.Constexpr,
            out_m_major: cutlass.Constexpr, producer: cutlass.Constexpr,
            h_smem: cutlass.Constexpr, tma_gather: cutlass.Constexpr,
            k_steps: cutlass.Constexpr, num_m_tiles: cutlass.Constexpr,
            num_n_tiles: cutlass.Constexpr, band_m_tiles: cutlass.Constexpr):
  swiglu = kind == "swiglu"
  copies = gather and not tma_gather   # A's rows copied by the producer's threads (cp.async)
  # with a producer warpgroup (always when gathering) warpgroup 0 loads and warpgroups 1, 2
  # compute: their threads' and warps' indices in the MMA warpgroups (else those are the CTA's)
  first_mma_warp = 4 if producer else 0
  tidx, _, _ = cute.arch.thread_idx()
  n_tile, m_tile, z_tile = cute.arch.block_idx()
  if cutlass.const_expr(band_m_tiles > 0):   # grid x: the tiles in bands of M tiles
    m_tile, n_tile = banded_tile(n_tile, num_m_tiles, num_n_tiles, band_m_tiles)
  warp = cute.arch.make_warp_uniform(cute.arch.warp_idx())
  mainloop.prefetch_descriptors(warp, tma_a, tma_b, copies)
  if cutlass.const_expr(swiglu):
    if warp == 0:
      cpasync.prefetch_descriptor(tma_b_up)

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
  # rhs column blocks: one, or SwiGLU's gate and up blocks (column tile n_tile of W1's gate
  # and up views: columns c and n + c of W1)
  rhs_halves = [(tma_b, m_b), (tma_b_up, m_b_up)] if cutlass.const_expr(swiglu) else [(tma_b, m_b)]
  g_bs = [tile_of(m, n_tile, rhs_l, (None, 1, 1)) for _, m in rhs_halves]   # (bN, bK, k) each

  smem = cutlass.memory.SmemAllocator()
  storage = smem.allocate(shared_storage)
  s_a = storage.s_a.get_tensor(a_smem_staged.outer, swizzle=a_smem_staged.inner)
  s_bs = [buf.get_tensor(b_smem_staged.outer, swizzle=b_smem_staged.inner)
          for buf in ([storage.s_b, storage.s_b2] if cutlass.const_expr(swiglu) else [storage.s_b])]
  # (h_smem: h_bar, H's tile landed)
  loads, h_bar = mainloop.load_pipeline(storage, stages, stage_bytes, copies, THREADS, tidx,
                               1 if h_smem else 0)

  operands = [mainloop.tma_operand(atom, sb, gb)
              for (atom, _), sb, gb in zip(rhs_halves, s_bs, g_bs)]
  if cutlass.const_expr(not gather):   # else A's stages are filled by the gathers
    g_a = tile_of(m_a, n_tile, 0, (1, None, 1))                     # (bM, bK, k)
    operands = [mainloop.tma_operand(tma_a, s_a, g_a)] + operands
  cute.arch.sync_threads()   # barriers initialised before anyone waits on them

  if warp < first_mma_warp:   # the producer warpgroup (none without `producer`)
    if cutlass.const_expr(producer):
      cute.arch.setmaxregister_decrease(PRODUCER_REGISTERS)
      if cutlass.const_expr(gather):
        rows_by_tma = None   # (tma_gather: the rows' boxes and their lines in the stages)
        if cutlass.const_expr(tma_gather):
          rows_by_tma = row_gather.row_boxes(tma_a, m_a, storage.s_a, a_smem_staged)
        row_gather.produce_gathered(loads, operands, m_a, gather_index, s_a, num_k, m_tile,
                                    k_begin, tidx, stages, kind, rows_by_tma)
      elif warp == 0:   # TMA loads only: its warp 0 issues every stage's
        produce = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, stages)
        for _ in cutlass.range(num_k, unroll=1):
          mainloop.load_stage(loads, produce, operands, k_begin + produce.count)
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
          mainloop.load_stage(loads, produce, operands, k_begin + produce.count)
          produce.advance()

    for kk in cutlass.range(num_k, unroll=1):
      loads.consumer_wait(consume)
      if cutlass.const_expr(copies):   # the copied rows are generic-proxy writes
        cute.arch.fence_proxy("async.shared", space="cta")
      mainloop.issue_k_step(tiled_mma, accs, frag_a, frag_bs, consume.index)
      consume.advance()
      warpgroup.wait_group(1)   # step kk - 1's wgmmas are done, so its stage is free
      if kk > 0:
        loads.consumer_release(release)
        release.advance()
        if cutlass.const_expr(not producer):
          if leader and produce.count < num_k:
            mainloop.load_stage(loads, produce, operands, k_begin + produce.count)
            produce.advance()
    warpgroup.wait_group(0)

    # out's tile (or H's, or dH's, gate and up tiles, then A's or A''s): (TMA atom, its TMA
    # tensor, the output, column tile)
    outputs = [(tma_out, m_out_tma, m_out, n_tile)]
    if cutlass.const_expr(swiglu or kind == "dh"):   # the gate view's, the up view's, out2's
      outputs = outputs + [(tma_out_up, m_out_up_tma, m_out_up, n_tile),
                           (tma_out2, m_out2_tma, m_out2, n_tile)]
    tiles = accs
    if cutlass.const_expr(kind == "dh"):   # dH's and A''s tiles in registers from H and scores
      h_tiles = [tile_of(t, n_tile, 0, (1, 1, None)) for t in (m_h, m_h_up)]
      # each row's score broadcast along the tile's columns (stride 0)
      scores = cute.make_tensor(m_scores.iterator, cute.make_layout(
          (cute.size(m_scores), block_n, 1), stride=(1, 0, 0)))
      h_srcs = epilogue.acc_chunks(h_tiles, thr_mma)
      out_dsts = None   # (TMA stores from registers: the tiles returned)
      if cutlass.const_expr(register_store):
        out_dsts = epilogue.acc_chunks(
            [tile_of(t, c, out_l, (1, 1, None)) for _, _, t, c in outputs], thr_mma)
      chunks = block_n // EPI_TILE[1]
      if cutlass.const_expr(h_smem):   # H's tile by TMA over rhs's stages, once all are read
        cute.arch.barrier(barrier_id=EPILOGUE_BARRIER, number_of_threads=THREADS)
        s_h = cute.make_tensor(cute.recast_ptr(s_bs[0].iterator, h_smem_staged.inner,
                                               dtype=m_h.element_type), h_smem_staged.outer)
        if leader:
          epilogue.load_h_tile([tma_h, tma_h_up],
                               [tile_of(t, n_tile, 0, (1, 1, None)) for t in (m_h_tma, m_h_up_tma)],
                               s_h, h_bar, 2 * BLOCK_M * block_n * m_h.element_type.width // 8)
        cute.arch.mbarrier_wait(h_bar, 0)
        h_srcs = epilogue.smem_chunks(s_h, chunk_mma, mma_tidx, [0, chunks], chunks)
        if cutlass.const_expr(not register_store):
          # dH written over H's buffers (each thread's own values, read before), A' over A's
          # stages, then all three stored by TMA
          s_a_out = cute.make_tensor(cute.recast_ptr(s_a.iterator, h_smem_staged.inner,
                                                     dtype=m_out2.element_type),
                                     h_smem_staged.outer)
          out_dsts = h_srcs + epilogue.smem_chunks(s_a_out, chunk_mma, mma_tidx, [0], chunks)
      tiles = epilogue.dh_outputs(accs[0], h_srcs, tile_of(scores, 0, 0, (1, 1, None)), m_ds,
                                  thr_mma, mma_tidx, m_tile * BLOCK_M, n_tile, m_out.element_type,
                                  out_dsts, block_n, BLOCK_M)
      if cutlass.const_expr(h_smem and not register_store):
        cute.arch.fence_proxy("async.shared", space="cta")   # visible to the TMA engine
        cute.arch.barrier(barrier_id=EPILOGUE_BARRIER, number_of_threads=THREADS)
        if leader:
          bufs = [(s_h, 0), (s_h, chunks), (s_a_out, 0)]
          epilogue.store_tiles_tma([(atom, buf, first, tile_of(t, c, out_l, (1, 1, None)))
                            for (atom, t, _, c), (buf, first) in zip(outputs, bufs)], chunks)
    if cutlass.const_expr(not register_store and not (kind == "dh" and h_smem)):
      # (register stores: dh only, done above; dh with h_smem stored its TMA way above)
      # every warpgroup's wgmmas are done with A's stages: reuse them
      cute.arch.barrier(barrier_id=EPILOGUE_BARRIER, number_of_threads=THREADS)
      s_c = cute.make_tensor(cute.recast_ptr(s_a.iterator, c_smem_staged.inner, dtype=m_out.element_type),
                             c_smem_staged.outer)
      stores = [(atom, tile_of(t, c, out_l, (1, 1, None))) for atom, t, _, c in outputs]
      epilogue.tma_store_epilogue(tiles, stores, s_c, tiled_mma, mma_tidx, leader, swiglu,
                          m_major=out_m_major)


def rhs_window(rhs: cute.Tensor, out: cute.Tensor, first_col: int) -> cute.Tensor:
  """rhs (N, K, E)'s columns first_col .. as many as out (P, W, 1) has: the columns a window of
  the product reads (a view, its TMA descriptor starting at that column; first_col a multiple
  of 8: 16 bytes). rhs itself for the whole product. The FFI call passes the whole of rhs: a
  slice of it in XLA may start off the 16-byte alignment the call requires."""
  if cutlass.const_expr(first_col == 0 and cute.size(rhs, mode=[0]) == cute.size(out, mode=[1])):
    return rhs
  return mode_view(rhs, 0, first_col, cute.size(out, mode=[1]))


def mode_view(tensor: cute.Tensor, mode: int, first: int, count: int,
              align: int = 16) -> cute.Tensor:
  """tensor's entries first .. first + count - 1 along `mode` (the other modes whole) as a view
  with the same strides, its start assumed aligned to `align` bytes (a TMA descriptor's
  address: 16)."""
  start = tensor.iterator + first * tensor.stride[mode]
  shape = tuple(count if i == mode else extent for i, extent in enumerate(tensor.shape))
  return cute.make_tensor(cute.make_ptr(tensor.element_type, start.toint(), cute.AddressSpace.gmem,
                                        assumed_align=align),
                          cute.make_layout(shape, stride=tensor.stride))


def halves(tensor: cute.Tensor, mode: int):
  """The gate and up halves of a [.., 2n, ..] tensor along `mode` (W1's columns, H's and dH's):
  two views n entries long, the up half's from entry n (n a multiple of 8: 16 bytes). Each
  half's TMA descriptor ends at n, so that a column tile reaching past n reads zeros and
  stores nothing there instead of touching the other half."""
  n = cute.size(tensor, mode=[mode]) // 2
  return mode_view(tensor, mode, 0, n), mode_view(tensor, mode, n, n)


@cute.jit
def _matmul(stream, lhs: cute.Tensor, rhs: cute.Tensor, tile_expert: cute.Tensor,
            out: cute.Tensor, block_n: cutlass.Constexpr, stages: cutlass.Constexpr,
            warp_specialized: cutlass.Constexpr = False, first_col: cutlass.Constexpr = 0,
            band_m_tiles: cutlass.Constexpr = 0):
  """lhs (P, K, 1) K-major, rhs (N, K, E) N- or K-major, out (P, W, 1) (logical modes): out's
  columns are the product's from first_col on (rhs_window; all of them by default);
  band_m_tiles: _launch's."""
  _launch(stream, lhs, rhs_window(rhs, out, first_col), tile_expert, tile_expert, out, out, None,
          block_n, stages, "store", False, False, warp_specialized, band_m_tiles=band_m_tiles)


@cute.jit
def _gathered_matmul(stream, lhs: cute.Tensor, rhs: cute.Tensor, tile_expert: cute.Tensor,
                     gather_index: cute.Tensor, out: cute.Tensor, block_n: cutlass.Constexpr,
                     stages: cutlass.Constexpr, first_col: cutlass.Constexpr = 0,
                     band_m_tiles: cutlass.Constexpr = 0):
  """_matmul with lhs (T, K, 1) the source rows and slot r reading lhs[gather_index[r]]."""
  _launch(stream, lhs, rhs_window(rhs, out, first_col), tile_expert, gather_index, out, out,
          None, block_n, stages, "store", True, False, band_m_tiles=band_m_tiles)


@cute.jit
def _up_proj(stream, x: cute.Tensor, w1: cute.Tensor, tile_expert: cute.Tensor, h: cute.Tensor,
             a: cute.Tensor, block_n: cutlass.Constexpr, stages: cutlass.Constexpr,
             warp_specialized: cutlass.Constexpr = False, band_m_tiles: cutlass.Constexpr = 0):
  """x (P, d, 1), w1 (2n, d, E) N-major, H (P, 2n, 1), A (P, n, 1) (logical modes)."""
  _launch(stream, x, w1, tile_expert, tile_expert, h, a, None, block_n, stages, "swiglu", False,
          False, warp_specialized, band_m_tiles=band_m_tiles)


@cute.jit
def _gathered_up_proj(stream, x: cute.Tensor, w1: cute.Tensor, tile_expert: cute.Tensor,
                      gather_index: cute.Tensor, h: cute.Tensor, a: cute.Tensor,
                      block_n: cutlass.Constexpr, stages: cutlass.Constexpr,
                      band_m_tiles: cutlass.Constexpr = 0):
  """_up_proj with x (T, d, 1) the source rows and slot r reading x[gather_index[r]]."""
  _launch(stream, x, w1, tile_expert, gather_index, h, a, None, block_n, stages, "swiglu", True,
          False, band_m_tiles=band_m_tiles)


@cute.jit
def _dh(stream, dout_g: cute.Tensor, w2: cute.Tensor, tile_expert: cute.Tensor, h: cute.Tensor,
        scores: cute.Tensor, dh: cute.Tensor, a_scaled: cute.Tensor, ds_parts: cute.Tensor,
        block_n: cutlass.Constexpr, stages: cutlass.Constexpr, register_store: cutlass.Constexpr,
        warp_specialized: cutlass.Constexpr = False, h_smem: cutlass.Constexpr = False,
        band_m_tiles: cutlass.Constexpr = 0):
  """dOg (P, d, 1), w2 (n, d, E) K-major, H (P, 2n, 1), scores (P,), dH (P, 2n, 1), A' (P, n, 1),
  dS parts (n / block_n, P)."""
  _launch(stream, dout_g, w2, tile_expert, tile_expert, dh, a_scaled, (h, scores, ds_parts),
          block_n, stages, "dh", False, register_store, warp_specialized, h_smem,
          band_m_tiles=band_m_tiles)


@cute.jit
def _gathered_dh(stream, dout: cute.Tensor, w2: cute.Tensor, tile_expert: cute.Tensor,
                 gather_index: cute.Tensor, h: cute.Tensor, scores: cute.Tensor, dh: cute.Tensor,
                 a_scaled: cute.Tensor, ds_parts: cute.Tensor, block_n: cutlass.Constexpr,
                 stages: cutlass.Constexpr, register_store: cutlass.Constexpr,
                 h_smem: cutlass.Constexpr = False, band_m_tiles: cutlass.Constexpr = 0):
  """_dh with dout (T, d, 1) the source rows and slot r reading dout[gather_index[r]]."""
  _launch(stream, dout, w2, tile_expert, gather_index, dh, a_scaled, (h, scores, ds_parts),
          block_n, stages, "dh", True, register_store, False, h_smem, band_m_tiles=band_m_tiles)


@cute.jit
def _weight_grad(stream, lhs: cute.Tensor, rhs: cute.Tensor, group_rows: cute.Tensor,
                 out: cute.Tensor, block_n: cutlass.Constexpr, stages: cutlass.Constexpr,
                 warp_specialized: cutlass.Constexpr = False, band_m_tiles: cutlass.Constexpr = 0):
  """lhs (M, P, 1) M-major, rhs (N, P, 1) N-major, group_rows (2 E,)
  (routing.group_row_ranges), out (M, N, E)."""
  _launch(stream, lhs, rhs, group_rows, group_rows, out, out, None, block_n, stages,
          "wgrad", False, False, warp_specialized, band_m_tiles=band_m_tiles)


@cute.jit
def _gathered_weight_grad(stream, x: cute.Tensor, rhs: cute.Tensor, group_rows: cute.Tensor,
                          gather_index: cute.Tensor, out: cute.Tensor, block_n: cutlass.Constexpr,
                          stages: cutlass.Constexpr, tma_gather: cutlass.Constexpr = False,
                          band_m_tiles: cutlass.Constexpr = 0):
  """_weight_grad with x (T, M, 1) the source rows and slot r reading x[gather_index[r]]
  (tma_gather: loaded by TMA)."""
  _launch(stream, x, rhs, group_rows, gather_index, out, out, None, block_n, stages, "wgrad",
          True, False, tma_gather=tma_gather, band_m_tiles=band_m_tiles)


def banded_tile(t, num_m_tiles: int, num_n_tiles: int, band: int):
  """(M tile, column tile) of launch-order tile t in bands of `band` M tiles (the last band
  the rest): a band's tiles column tile by column tile, its M tiles neighbouring within each.
  The CTAs in flight then cover a few M tiles and many column tiles of each, so that a band
  reads each rhs column block once; in plain launch order (an M tile's column tiles
  neighbouring) an output of many column tiles has the CTAs in flight on about one M tile,
  and every M tile reads all of rhs again."""
  first_m = t // (band * num_n_tiles) * band
  rows = cutlass.min(band, num_m_tiles - first_m)
  rest = t - first_m * num_n_tiles
  return first_m + rest % rows, rest // rows


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
            tma_gather: cutlass.Constexpr = False, band_m_tiles: cutlass.Constexpr = 0):
  """The grid over (output column tiles, M tiles[, experts]), or with band_m_tiles over
  (tiles[, experts]) in bands of that many M tiles (banded_tile), and the kernel's static
  configuration. kind: "store" (out = lhs rhs), "swiglu" (out H (P, 2n), out2 A (P, n); rhs
  W1's gate and up columns), "dh" (out dH (P, 2n), out2 A' (P, n), dh_inputs (H, scores, dS
  parts)); for those two the grid covers n's columns; or "wgrad" (lhs (M, P, 1) M-major, rhs
  (N, P, 1), out (M, N, E) N- or M-major: out[e] = lhs_e rhs_e^T over expert e's rows,
  tile_expert holding group_rows: routing.group_row_steps). With gather lhs is the source of
  the rows gather_index names (A's stages filled by a third, producer warpgroup:
  row_gather.produce_gathered; by its threads' cp.async, or, the weight gradient's, with
  tma_gather by TMA, a box a row: row_gather.row_tma_atom).
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
  b_tile = cute.slice_(b_smem_staged, (None, None, 0))
  # SwiGLU's rhs W1 (2n, d, E) as its gate and up halves (each its own TMA descriptor)
  rhs_gate, rhs_up = halves(rhs, 0) if swiglu else (rhs, rhs)
  tma_b, m_b = cpasync.make_tiled_tma_atom(cpasync.CopyBulkTensorTileG2SOp(), rhs_gate, b_tile,
                                           (block_n, BLOCK_K))
  tma_b_up, m_b_up = cpasync.make_tiled_tma_atom(cpasync.CopyBulkTensorTileG2SOp(), rhs_up,
                                                 b_tile, (block_n, BLOCK_K))
  if cutlass.const_expr(gather and tma_gather):   # A's rows by TMA, a box a row
    tma_a, m_a = row_gather.row_tma_atom(lhs, a_smem_staged)
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
  # H's or dH's (P, 2n, 1) as its gate and up halves, and H's for dh's epilogue
  out_gate, out_up = halves(out, 1) if swiglu or kind == "dh" else (out, out)
  h_gate, h_up = halves(m_h, 1) if kind == "dh" else (m_h, m_h)
  tma_out, m_out_tma = cpasync.make_tiled_tma_atom(cpasync.CopyBulkTensorTileS2GOp(), out_gate,
                                                   c_tile, EPI_TILE)
  tma_out_up, m_out_up_tma = cpasync.make_tiled_tma_atom(cpasync.CopyBulkTensorTileS2GOp(),
                                                         out_up, c_tile, EPI_TILE)
  tma_out2, m_out2_tma = cpasync.make_tiled_tma_atom(cpasync.CopyBulkTensorTileS2GOp(), out2,
                                                     c_tile, EPI_TILE)
  # (h_smem) H's gate and up tiles as EPI_TILE buffers over rhs's stages, their TMA atom, and
  # the kernel's wgmma on EPI_TILE's columns to partition them (made for every kind: the
  # kernel takes them, unused elsewhere)
  h_smem_staged = sm90_utils.make_smem_layout_epi(dtype, LayoutEnum.ROW_MAJOR, EPI_TILE,
                                                  2 * (block_n // EPI_TILE[1]))
  h_tile = cute.slice_(h_smem_staged, (None, None, 0))
  tma_h, m_h_tma = cpasync.make_tiled_tma_atom(cpasync.CopyBulkTensorTileG2SOp(), h_gate, h_tile,
                                               EPI_TILE)
  tma_h_up, m_h_up_tma = cpasync.make_tiled_tma_atom(cpasync.CopyBulkTensorTileG2SOp(), h_up,
                                                     h_tile, EPI_TILE)
  chunk_mma = sm90_utils.make_trivial_tiled_mma(
      dtype, dtype, a_major.sm90_mma_major_mode(), b_major.sm90_mma_major_mode(),
      cutlass.Float32, (WARPGROUPS, 1, 1), tiler_mn=(64, EPI_TILE[1]))
  num_barriers = stages * 2 + (1 if h_smem else 0)   # the pipeline's, (h_smem) H's

  stage_bytes = num_rhs * cute.size_in_bytes(dtype, b_tile)
  if cutlass.const_expr(not gather or tma_gather):   # TMA brings A's tile too
    stage_bytes += cute.size_in_bytes(dtype, cute.slice_(a_smem_staged, (None, None, 0)))
  # the output's tiles (of out_gate's columns: H's, dH's gate half), the last of each mode
  # clipped where BLOCK_M or block_n does not divide it (TMA fills its loads past the
  # operands' ends with zeros and stores nothing past the output's: calls.unsupported)
  num_m_tiles = calls.column_tiles(cute.size(out, mode=[0]), BLOCK_M)
  num_n_tiles = calls.column_tiles(cute.size(out_gate, mode=[1]), block_n)
  num_z = cute.size(out, mode=[2]) if kind == "wgrad" else 1   # wgrad: one per expert
  # (but wgrad) the contraction's k steps: lhs's columns
  k_steps = cute.size(lhs, mode=[1]) // BLOCK_K
  storage = mainloop.shared_storage(dtype, num_barriers, cute.cosize(a_smem_staged), b_elems,
                                    num_rhs)
  producer = gather or warp_specialized   # a producer warpgroup loads the stages
  _kernel.set_name_prefix(kernel_label(kind, gather), remove_cutlass_symbol=True)
  _kernel(tma_a, lhs if gather and not tma_gather else m_a, tma_b, m_b, tma_b_up, m_b_up,
          out_gate, out_up, out2, tma_out, m_out_tma, tma_out_up, m_out_up_tma, tma_out2,
          m_out2_tma, h_gate, h_up, m_scores, m_ds, tma_h, m_h_tma, tma_h_up, m_h_up_tma,
          h_smem_staged, chunk_mma, tile_expert, gather_index, tiled_mma, a_smem_staged,
          b_smem_staged, c_smem_staged,
          cute.size(rhs, mode=[2]), storage, block_n, stages, stage_bytes, kind, gather,
          register_store, out_layout.is_m_major_c(), producer, h_smem, tma_gather,
          k_steps, num_m_tiles, num_n_tiles, band_m_tiles).launch(
              grid=((num_n_tiles * num_m_tiles, 1, num_z) if band_m_tiles > 0
                    else (num_n_tiles, num_m_tiles, num_z)),
              block=(THREADS + (128 if producer else 0), 1, 1), stream=stream)


def grouped_matmul(lhs, rhs, tile_expert, *, transpose_rhs: bool = False, block_n: int = 128,
                   stages: int | None = None, warp_specialized: bool = False, cols=None,
                   gather_index=None, band_m_tiles: int = 0):
  """out [P, N] = lhs_e rhs_e per M tile (module docstring), rhs [E, K, N]; with transpose_rhs
  rhs is [E, N, K] and out = lhs_e rhs_e^T (read K-major, no transposed copy).
  tile_expert: [P / BLOCK_M] int32, E or more past the last group. stages: the TMA pipeline's
  depth (default: as many as fit in SMEM, at most 8). warp_specialized: a producer warpgroup
  issues the TMA loads (bitwise the same result; one CTA per SM). cols=(lo, hi): out is the
  product's columns lo .. hi - 1 only (out [P, hi - lo]; lo a multiple of 8, hi - lo of 64).
  block_n need not divide the output's columns: the last column tile is clipped
  (calls.column_tiles). With gather_index [P], lhs is the source [T, K] and slot r reads
  lhs[gather_index[r]] (zeros where it is T or more), gathered inside the kernel by its
  producer warpgroup's cp.async (no [P, K] copy; warp_specialized does not apply).
  band_m_tiles: the tiles in bands of that many M tiles (banded_tile; 0: an M tile's column
  tiles launched together); the same bits."""
  band = calls.band_config(band_m_tiles, "grouped_matmul")
  reason = calls.unsupported(calls.rows_read(lhs, gather_index),
                             calls.rhs_as_ekn(rhs, transpose_rhs), block_n, cols,
                             clipped_last_tile=True)
  if reason:
    raise ValueError(f"cute grouped_matmul: {reason}")
  stages = pipeline_depth(block_n, 1, lhs.dtype.itemsize, lhs.shape[1] // BLOCK_K, stages)
  if gather_index is not None:
    return calls.matmul_call(_gathered_matmul, lhs, rhs, tile_expert, transpose_rhs, cols,
                             gather_index=gather_index, block_n=block_n, stages=stages, **band)
  return calls.matmul_call(_matmul, lhs, rhs, tile_expert, transpose_rhs, cols, block_n=block_n,
                           stages=stages, **calls.warp_specialized_config(warp_specialized),
                           **band)


def up_proj(xg, w1, tile_expert, block_n: int = 128, gather_index=None,
            stages: int | None = None, warp_specialized: bool = False, band_m_tiles: int = 0):
  """H = Xg W1_e (gate and up halves) and A = silu(gate) * up per M tile: xg [P, d] rows in
  slot order, w1 [E, d, 2n]; returns H [P, 2n], A [P, n] (the SwiGLU epilogue). With
  gather_index [P], xg is X [T, d] and slot r reads X[gather_index[r]] (zeros where it is T or
  more), gathered inside the kernel by cp.async (by a producer warpgroup). stages and
  warp_specialized (without gather_index): as grouped_matmul's. block_n need not divide n (a
  multiple of 64): the last column tile is clipped, W1's and H's gate and up halves each
  read and written through a TMA descriptor of its own (halves). band_m_tiles: as
  grouped_matmul's."""
  band = calls.band_config(band_m_tiles, "up_proj")
  n = w1.shape[2] // 2
  reason = calls.unsupported(calls.rows_read(xg, gather_index),
                             jax.ShapeDtypeStruct((*w1.shape[:2], n), w1.dtype), block_n,
                             clipped_last_tile=True)
  if block_n > UP_PROJ_MAX_BLOCK_N:
    reason = (f"block_n={block_n} is wider than {UP_PROJ_MAX_BLOCK_N} (its gate and up "
              f"accumulators would not fit in registers)")
  if reason:
    raise ValueError(f"cute up_proj: {reason}")
  stages = pipeline_depth(block_n, 2, xg.dtype.itemsize, xg.shape[1] // BLOCK_K, stages)
  return calls.up_proj_call((_up_proj, _gathered_up_proj), xg, w1, tile_expert, gather_index,
                            block_n=block_n, stages=stages,
                            **calls.warp_specialized_config(warp_specialized, gather_index), **band)


def dh(dout_g, w2, h, scores, tile_expert, block_n: int = 64, stages: int | None = None,
       tma_store: bool = False, gather_index=None, over_h: bool = True,
       warp_specialized: bool = False, h_smem: bool = False, band_m_tiles: int = 0):
  """dA' = dOg W2_e^T per M tile fused with dSwiGLU: dOg [P, d] rows in slot order, w2 [E, n, d]
  (read K-major), H [P, 2n] and scores [P] of the forward. Returns dH [P, 2n], A' = s A [P, n]
  and dS parts [n / block_n, P] fp32 (their sum over axis 0 is dS = rowsum(dA' A)).
  The epilogue math runs in registers (it loads H ahead of the math, epilogue.dh_outputs); dH
  and A' are stored straight from registers, or with tma_store through SMEM by TMA stores (bitwise the
  same). stages as grouped_matmul's. With gather_index [P], dout_g is dO [T, d]
  and slot r reads dO[gather_index[r]] (zeros where it is T or more), gathered in the kernel
  by cp.async as up_proj gathers X. over_h: dH written over H's buffer (dh_call).
  warp_specialized (without gather_index): as grouped_matmul's. h_smem: the epilogue reads H
  from SMEM, its tile TMA-loaded over the rhs stages once the mainloop is done (coalesced,
  where the per-thread global loads read 16 of each 32-byte sector); with tma_store too, dH
  is written over H's tile there and A' over the lhs stages, all three then stored by TMA
  (no register tiles of the outputs). Needs stages >= H_SMEM_MIN_STAGES (the rhs stages hold
  H's 2 x BLOCK_M x block_n tile, the lhs stages A''s BLOCK_M x block_n). Bitwise the same
  outputs either way. With h_smem and tma_store (H loaded and every output stored by TMA)
  block_n need not divide n (a multiple of 64): the last column tile is clipped, the dS
  parts are [column tiles, P], and H may pass 2^31 elements (the register paths' offsets are
  32-bit). band_m_tiles: as grouped_matmul's."""
  band = calls.band_config(band_m_tiles, "dh")
  reason = calls.dh_unsupported(calls.rows_read(dout_g, gather_index), w2, h, scores, block_n,
                                clipped_last_tile=h_smem and tma_store)
  if reason:
    raise ValueError(f"cute dh: {reason}")
  k_steps = dout_g.shape[1] // BLOCK_K
  if h_smem and stages is None:   # (a ring deeper than the k steps holds H's tile)
    k_steps = max(k_steps, H_SMEM_MIN_STAGES)
  stages = pipeline_depth(block_n, 1, dout_g.dtype.itemsize, k_steps, stages)
  if h_smem and stages < H_SMEM_MIN_STAGES:
    raise ValueError(f"cute dh: h_smem needs stages >= {H_SMEM_MIN_STAGES} (H's tile over the "
                     f"rhs stages); got stages={stages}")
  option = dict(h_smem=True) if h_smem else {}   # (off: the targets leave it out)
  return calls.dh_call((_dh, _gathered_dh), dout_g, w2, h, scores, tile_expert, gather_index,
                       over_h, block_n=block_n, stages=stages, register_store=not tma_store,
                       **calls.warp_specialized_config(warp_specialized, gather_index), **option,
                       **band)


def weight_grad(lhs, rhs, group_offsets, num_experts: int, block_n: int = 128,
                stages: int | None = None, gather_index=None, transpose_out: bool = False,
                warp_specialized: bool = False, group_sizes=None, tma_gather: bool = False,
                band_m_tiles: int = 0):
  """out[e] = lhs[rows of e]^T rhs[rows of e] ([E, M, N] in lhs's dtype, fp32 accumulation):
  lhs [P, M] and rhs [P, N] rows in slot order, expert e's rows group_offsets[e] ..
  group_offsets[e + 1] (multiples of BLOCK_M, an aligned plan; an expert without rows gets
  zeros). group_sizes [E] (the plan's): expert e's rows end at group_offsets[e] +
  group_sizes[e] (clamped to its group), and the kernel skips the k steps (BLOCK_K rows) wholly
  past that end; the padding rows it still reads, in the last step, must be zeros (as the
  plan's). dW1 = weight_grad(Xg, dH), dW2 = weight_grad(A', dOg). With gather_index [P], lhs
  is X [T, M] and slot r reads X[gather_index[r]] (zeros where it is T or more), gathered inside
  the kernel by cp.async (bitwise equal to gathering first), or with
  tma_gather by TMA, a box a row and warpgroup half (the same bits). With
  transpose_out the kernel stores out[e]^T: [E, N, M] (its epilogue writes M-major tiles; no
  separate transpose). warp_specialized (without gather_index) and band_m_tiles (each expert's
  tiles in bands): as grouped_matmul's."""
  band = calls.band_config(band_m_tiles, "weight_grad")
  slots = calls.rows_read(lhs, gather_index)   # the rows the GEMM reads
  reason = calls.weight_grad_unsupported(slots, rhs, group_offsets, num_experts, block_n,
                                         group_sizes,
                                         clipped_last_tile=gather_index is None or tma_gather)
  if reason:
    raise ValueError(f"cute weight_grad: {reason}")
  stages = pipeline_depth(block_n, 1, lhs.dtype.itemsize, slots.shape[0] // BLOCK_K, stages)
  group_rows = routing.group_row_ranges(group_offsets, group_sizes)
  return calls.weight_grad_call(
      (_weight_grad, _gathered_weight_grad), lhs, rhs, group_rows, num_experts, gather_index,
      transpose_out, block_n=block_n, stages=stages,
      **calls.warp_specialized_config(warp_specialized, gather_index),
      **calls.tma_gather_config(tma_gather, gather_index, "weight_grad"), **band)


