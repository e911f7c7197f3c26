"""Varlen-M grouped GEMM over an expert-aligned routing plan, with fused epilogues.

Rows of `lhs` are the plan's slots; every M tile of `block_m` rows belongs to one expert
(`tile_expert[m]`, see schedule.py), so a tile multiplies by that expert's weight matrix and
stores full tiles (padding rows are zero in, zero out). Tiles past the last group run no GEMM
and store zeros through the same epilogue.

Tiling (one work item = one block_m x block_n output tile):
  grid      : (num_m_tiles * num_col_tiles,) work items, row-major (consecutive items share
              the lhs rows and the expert), visited by a persistent loop over the SMs
  warps     : warp-specialized: one memory warpgroup issues the TMA loads of lhs[m, kk] and
              rhs_e[kk, col] through a `stages`-deep pipeline; NUM_CONSUMERS compute
              warpgroups each own block_m / NUM_CONSUMERS rows of the tile:
                acc_j[rows of wg] += lhs[rows of wg, kk] @ rhs_e[kk, col_j]
              (one accumulator per rhs column block; the up-projection uses two: gate and up)
  gather    : with gather_index (the up-projection), lhs rows are not in the TMA pipeline:
              each compute warpgroup cp.async-copies its rows lhs[gather_index[r], kk] into a
              ring of `stages` swizzled tiles, stages - 1 k steps ahead (row_gather.py)
  epilogue  : per compute warpgroup on its rows: `prefetch` (loads the epilogue needs, issued
              before the mainloop so they overlap it) and `finish` (math and TMA stores; the
              stores drain while the next tile's mainloop runs)

Epilogues: `store` (Y = A W2, dX~ = dH W1^T), `swiglu` (H and A = silu(gate) * up) and
`dswiglu` (the dH kernel: dS partials, dH, A' from dA', H and the scores).
"""
from __future__ import annotations

import dataclasses
import math
from typing import Callable, Sequence

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels import config as cfg_lib
from pallas_kernels import row_gather
from pallas_kernels.config import TileConfig

_F32 = jnp.float32
NUM_CONSUMERS = 2           # compute warpgroups per CTA, splitting the tile's rows
MEMORY_REGISTERS = 40       # registers per thread of the memory (TMA-issuing) warpgroup
SMEM_BYTES = 227 * 1024     # usable shared memory per CTA on Hopper


def _annotate(x, layout):
  """A layout hint for Mosaic GPU's layout inference (interpret mode has no layouts)."""
  return x if cfg_lib.interpret_mode() is not None else plgpu.layout_cast(x, layout)


def _store_async(bufs, tiles_and_dsts):
  """TMA-store register tiles through dedicated SMEM buffers without waiting for the copies:
  they drain during the next tile's mainloop. First waits until the previous tile's stores
  have read these buffers."""
  plgpu.wait_smem_to_gmem(0, wait_read_only=True)
  for buf, (tile, _) in zip(bufs, tiles_and_dsts):
    buf[...] = tile.astype(buf.dtype)
  plgpu.commit_smem()
  for buf, (_, dst) in zip(bufs, tiles_and_dsts):
    plgpu.copy_smem_to_gmem(buf, dst)


def for_each_tile(tile_expert_ref, num_m_tiles: int, num_col_tiles: int, num_experts: int,
                  run_tile, empty_tile):
  """The persistent loop over (m tile, column tile) work items, row-major (consecutive items
  share the lhs rows and the expert): run_tile(m, col, expert, first, last) where the tile
  belongs to an expert (first, last: this SM's first and last such tile), empty_tile(m, col)
  for tiles past the last group (they come last, so an SM's real tiles precede its empty ones)."""
  num_items = num_m_tiles * num_col_tiles

  @plgpu.nd_loop((num_items,), collective_axes="sm")
  def _work_item(info):
    item = info.index[0]
    m, col = item // num_col_tiles, item % num_col_tiles
    expert = tile_expert_ref[m]
    following = item + lax.axis_size("sm")  # this SM's next item
    following_m = jnp.minimum(following // num_col_tiles, num_m_tiles - 1)
    first = info.local_index == 0
    last = (following >= num_items) | (tile_expert_ref[following_m] >= num_experts)
    pl.when(expert < num_experts)(lambda: run_tile(m, col, expert, first, last))
    pl.when(expert >= num_experts)(lambda: empty_tile(m, col))


@dataclasses.dataclass(frozen=True)
class Epilogue:
  """What a compute warpgroup does with its rows of a finished tile.

  scratch: SMEM (shape, dtype) buffers the epilogue uses, one set per compute warpgroup;
  num_barriers: barriers per warpgroup for its prefetches (passed as barriers(i));
  prefetch(rows, col, extra_refs, scratch, barriers): issued before the tile's mainloop;
  finish(rows, col, accs, extra_refs, out_refs, scratch, barriers): after it."""
  scratch: tuple
  finish: Callable
  prefetch: Callable | None = None
  num_barriers: int = 0


_START, _STEADY, _STOP = (int(s) for s in plgpu.PipelinePipeline)


def _pipelined_stages(num_k: int, stages: int):
  """Pipeline depth for chaining a tile's pipeline into the next (the depth must divide the
  k steps), or None: then each tile's pipeline drains before the next starts."""
  for s in range(stages, 1, -1):
    if num_k % s == 0:
      return s
  return None


def _smem_bytes(cfg: TileConfig, num_rhs: int, rhs_block: tuple, dtype, epilogue: Epilogue):
  itemsize = jnp.dtype(dtype).itemsize
  stage = cfg.block_m * cfg.block_k * itemsize + num_rhs * rhs_block[0] * rhs_block[1] * itemsize
  scratch = sum(math.prod(shape) * jnp.dtype(dt).itemsize
                for shape, dt in epilogue.scratch)
  return cfg.stages * stage + NUM_CONSUMERS * scratch


def varlen_m(lhs, rhs, tile_expert, extra_inputs: Sequence[jax.Array], *, col_blocks: Callable,
             num_col_tiles: int, transpose_rhs: bool, epilogue: Epilogue, out_types,
             cfg: TileConfig, gather_index=None):
  """Runs the persistent warp-specialized grouped GEMM (see the module docstring).

  gather_index (GPU only): lhs is then the source [N, K] and slot
  row r reads lhs[gather_index[r]]. Each compute warpgroup gathers its own rows by cp.async
  (row_gather.py) into a ring of `stages` swizzled tiles, stages - 1 k steps ahead of its
  wgmma; only the rhs goes through the TMA pipeline."""
  gathering = gather_index is not None
  num_slots = gather_index.shape[0] if gathering else lhs.shape[0]
  k_dim = lhs.shape[1]
  num_experts = rhs.shape[0]
  bm, bn, bk = cfg.block_m, cfg.block_n, cfg.block_k
  wg_rows = bm // NUM_CONSUMERS
  num_m_tiles, num_k = num_slots // bm, k_dim // bk
  if k_dim % bk:
    raise ValueError(f"contraction dim {k_dim} must be a multiple of block_k={bk}")
  stages = _pipelined_stages(num_k, cfg.stages)
  cfg = dataclasses.replace(cfg, stages=stages or cfg.stages)
  num_rhs = len(col_blocks(0))
  rhs_block = (bn, bk) if transpose_rhs else (bk, bn)
  smem = _smem_bytes(cfg, num_rhs, rhs_block, lhs.dtype, epilogue)
  if smem > SMEM_BYTES:
    raise ValueError(f"tile config {cfg} needs {smem} bytes of shared memory (limit {SMEM_BYTES})")
  num_extra = len(extra_inputs)

  def mma(a, rhs_smems, accs):
    for acc, rhs_smem in zip(accs, rhs_smems):
      plgpu.wgmma(acc, a, rhs_smem.transpose((1, 0)) if transpose_rhs else rhs_smem)
    # Wait for this step's MMAs before the pipeline releases its buffers: with one warpgroup's
    # MMA in flight the other's runs, and a delayed release would leave the last step's
    # buffers unguarded when the next tile's pipeline starts refilling them.
    plgpu.wgmma_wait(0)
    return accs

  def piped_lhs_step(_, lhs_smem, *rhs_smems_and_accs):
    *rhs_smems, accs = rhs_smems_and_accs
    wg = lax.axis_index("wg")
    return mma(lhs_smem.at[pl.ds(wg * wg_rows, wg_rows)], rhs_smems, accs)

  ring = cfg.stages  # gathered lhs tiles per compute warpgroup

  def gathered_lhs_step(gather, lhs_ring):
    """The pipeline body when lhs rows are gathered: gather(kk) issues step kk's rows into
    lhs_ring[kk % ring] as one cp.async group (an empty group past the last step)."""
    def step(indices, *rhs_smems_and_accs):
      *rhs_smems, accs = rhs_smems_and_accs
      kk = indices[0]
      gather(kk + ring - 1)
      row_gather.wait_gathers(ring - 1)   # of the ring - 1 + kk + 1 groups, step kk's landed
      plgpu.commit_smem()                 # cp.async writes -> visible to wgmma (async proxy)
      return mma(lhs_ring.at[kk % ring], rhs_smems, accs)
    return step

  def make_pipeline(body, compute_context, state=None):
    spec = plgpu.BlockSpec
    rhs_index = (lambda kk: (0, kk)) if transpose_rhs else (lambda kk: (kk, 0))
    lhs_specs = [] if gathering else [spec((bm, bk), lambda kk: (0, kk))]
    return plgpu.emit_pipeline_warp_specialized(
        body, grid=(num_k,), memory_registers=MEMORY_REGISTERS,
        in_specs=[*lhs_specs, *[spec(rhs_block, rhs_index)] * num_rhs],
        wg_axis="wg", num_compute_wgs=NUM_CONSUMERS, max_concurrent_steps=cfg.stages,
        compute_context=compute_context, pipeline_state=state)

  def rhs_views(rhs_e, col):
    cols = lambda c: pl.ds(c * bn, bn)
    return [rhs_e.at[cols(c)] if transpose_rhs else rhs_e.at[:, cols(c)] for c in col_blocks(col)]

  def body(tile_expert_ref, lhs_ref, rhs_ref, *refs):
    index_ref, refs = (refs[0], refs[1:]) if gathering else (None, refs)
    extra_refs, out_refs = refs[:num_extra], refs[num_extra:]
    ignore = lambda *_, **__: None
    piped_lhs = [] if gathering else [lhs_ref.at[pl.ds(0, bm)]]
    allocs = make_pipeline(ignore, ignore).get_allocations(*piped_lhs, *rhs_views(rhs_ref.at[0], 0))

    def scope(pipeline_allocs, barriers, *scratch):
      if gathering:
        *scratch, lhs_rings = scratch
      wg = lax.axis_index("wg")
      is_compute = wg < NUM_CONSUMERS

      def my_scratch():
        return [buf.at[wg] for buf in scratch]

      def my_barriers():
        return lambda i: barriers.at[wg * epilogue.num_barriers + i]

      def wg_rows_of(m):
        return pl.ds(m * bm + wg * wg_rows, wg_rows)

      def prefetch(m, col):
        if epilogue.prefetch is not None:
          epilogue.prefetch(wg_rows_of(m), col, extra_refs, my_scratch(), my_barriers())

      def finish(m, col, accs):
        epilogue.finish(wg_rows_of(m), col, accs, extra_refs, out_refs, my_scratch(),
                        my_barriers())

      def gatherer(m):
        """gather(kk): this warpgroup's rows of tile m, k step kk, into its ring slot kk % ring."""
        def gather(kk):
          row_gather.issue_ring_step(kk, num_k, ring, lambda slot: row_gather.issue_gather(
              lhs_ref.at[:, pl.ds(kk * bk, bk)], index_ref.at[wg_rows_of(m)],
              lhs_rings.at[wg, slot], lhs.shape[0]))
        return gather

      def run_tile(m, col, expert, first, last):
        gather = gatherer(m) if gathering else None

        def compute_context(eval_pipeline):
          prefetch(m, col)
          if gathering:  # the ring's first ring - 1 steps, before the pipeline's first step
            for kk in range(ring - 1):
              gather(jnp.int32(kk))

          def acc_scope(*acc_refs):
            eval_pipeline(acc_refs)
            return tuple(acc[...] for acc in acc_refs)
          finish(m, col, pl.run_scoped(acc_scope, *[plgpu.ACC((wg_rows, bn), _F32)] * num_rhs))

        def run_pipeline(state):
          step = gathered_lhs_step(gather, lhs_rings.at[wg]) if gathering else piped_lhs_step
          piped = [] if gathering else [lhs_ref.at[pl.ds(m * bm, bm)]]
          make_pipeline(step, compute_context, state)(
              *piped, *rhs_views(rhs_ref.at[expert], col), allocations=pipeline_allocs)

        # One pipeline across this SM's tiles (START, STEADY..., STOP): the memory warpgroup
        # fetches the next tile's first blocks while the compute warpgroups finish this one.
        # An SM with a single tile, or a depth that does not divide the k steps, drains per tile.
        if stages is None:
          run_pipeline(None)
        else:
          single = first & last
          pl.when(single)(lambda: run_pipeline(None))
          state = jnp.where(first, _START, jnp.where(last, _STOP, _STEADY)).astype(jnp.int32)
          pl.when(~single)(lambda: run_pipeline(state))

      def empty_tile(m, col):  # past the last group: no GEMM, zeros through the same epilogue
        @pl.when(is_compute)
        def _():
          prefetch(m, col)
          finish(m, col, tuple(jnp.zeros((wg_rows, bn), _F32) for _ in range(num_rhs)))

      for_each_tile(tile_expert_ref, num_m_tiles, num_col_tiles, num_experts, run_tile, empty_tile)

      @pl.when(is_compute)
      def _():
        plgpu.wait_smem_to_gmem(0)

    num_bars = max(1, NUM_CONSUMERS * epilogue.num_barriers)
    rings = [plgpu.SMEM((NUM_CONSUMERS, ring, wg_rows, bk), lhs.dtype,
                        transforms=row_gather.TILE_TRANSFORMS)] if gathering else []
    pl.run_scoped(scope, allocs, plgpu.Barrier(num_barriers=num_bars),
                  *[plgpu.SMEM((NUM_CONSUMERS, *shape), dt) for shape, dt in epilogue.scratch],
                  *rings, collective_axes="wg")

  kernel = plgpu.kernel(body, out_type=out_types, grid=(cfg_lib.num_sms(),), grid_names=("sm",),
                        num_threads=NUM_CONSUMERS + 1, thread_name="wg",
                        compiler_params=cfg_lib.compiler_params(),
                        interpret=cfg_lib.interpret_mode())
  index = [gather_index.astype(jnp.int32)] if gathering else []
  return kernel(tile_expert, lhs, rhs, *index, *extra_inputs)


# ----------------------------------------------------------------------------- epilogues

def store_epilogue(cfg: TileConfig, out_dtype):
  """out[rows, col tile] = acc."""
  bn = cfg.block_n
  rows_per_wg = cfg.block_m // NUM_CONSUMERS

  def finish(rows, col, accs, _extra, outs, scratch, _bars):
    (acc,), (out_ref,) = accs, outs
    _store_async(scratch, [(acc, out_ref.at[rows, pl.ds(col * bn, bn)])])
  return Epilogue(scratch=(((rows_per_wg, bn), out_dtype),), finish=finish)


def _silu_parts(gate):
  sig = 1.0 / (1.0 + jnp.exp(-gate))
  return sig, gate * sig


def swiglu_epilogue(cfg: TileConfig, n: int, out_dtype):
  """H[:, gate cols] = g, H[:, n + cols] = u, A[:, cols] = silu(g) * u."""
  bn = cfg.block_n
  tile = ((cfg.block_m // NUM_CONSUMERS, bn), out_dtype)

  def finish(rows, col, accs, _extra, outs, scratch, _bars):
    gate, up = accs
    h_ref, a_ref = outs
    _, silu = _silu_parts(gate)
    _store_async(scratch, [(gate, h_ref.at[rows, pl.ds(col * bn, bn)]),
                           (up, h_ref.at[rows, pl.ds(n + col * bn, bn)]),
                           (silu * up, a_ref.at[rows, pl.ds(col * bn, bn)])])
  return Epilogue(scratch=(tile, tile, tile), finish=finish)


def dswiglu_epilogue(cfg: TileConfig, n: int, out_dtype):
  """From dA' (the accumulator), H and the scores s of the tile's rows:
  dS partial = sum over the tile's columns of dA' * A (A recomputed from H),
  dH = dSwiGLU(s dA', H) into both halves, A' = s A. H and s are prefetched during the
  mainloop; the dH halves are stored from the buffers the H halves arrived in (once read into
  registers), which saves two tiles of shared memory per warpgroup."""
  bn = cfg.block_n
  rows_per_wg = cfg.block_m // NUM_CONSUMERS
  tile = ((rows_per_wg, bn), out_dtype)
  column = ((rows_per_wg,), _F32)

  def prefetch(rows, col, extra, scratch, bars):
    h_ref, scores_ref = extra
    gate_smem, up_smem, s_smem = scratch[:3]
    plgpu.wait_smem_to_gmem(0, wait_read_only=True)  # the last tile's dH stores read them
    plgpu.copy_gmem_to_smem(h_ref.at[rows, pl.ds(col * bn, bn)], gate_smem, bars(0))
    plgpu.copy_gmem_to_smem(h_ref.at[rows, pl.ds(n + col * bn, bn)], up_smem, bars(1))
    plgpu.copy_gmem_to_smem(scores_ref.at[rows], s_smem, bars(2))

  def finish(rows, col, accs, _extra, outs, scratch, bars):
    (da_prime,) = accs
    dh_ref, a_scaled_ref, ds_ref = outs
    gate_smem, up_smem, s_smem, a_scaled_smem, ds_smem = scratch
    for i in range(3):
      plgpu.barrier_wait(bars(i))
    wgmma = plgpu.Layout.WGMMA
    gate = _annotate(gate_smem[...], wgmma).astype(_F32)
    up = _annotate(up_smem[...], wgmma).astype(_F32)
    s = _annotate(s_smem[...], wgmma.reduce(1))
    sig, silu = _silu_parts(gate)
    a = silu * up
    s_tile = jax.lax.broadcast_in_dim(s, da_prime.shape, [0])
    ds = jnp.sum(da_prime * a, axis=1)
    da = s_tile * da_prime
    dgate = da * up * sig * (1.0 + gate * (1.0 - sig))
    dup = da * silu
    gate_cols, up_cols = pl.ds(col * bn, bn), pl.ds(n + col * bn, bn)
    _store_async([gate_smem, up_smem, a_scaled_smem, ds_smem],
                 [(dgate, dh_ref.at[rows, gate_cols]), (dup, dh_ref.at[rows, up_cols]),
                  (s_tile * a, a_scaled_ref.at[rows, gate_cols]), (ds, ds_ref.at[col, rows])])
  return Epilogue(scratch=(tile, tile, column, tile, column), prefetch=prefetch,
                  finish=finish, num_barriers=3)


# ----------------------------------------------------------------------------- kernels

def up_proj(xg, w1, tile_expert, cfg: TileConfig = cfg_lib.UP_PROJ, gather_index=None):
  """H = Xg W1_e (both halves) and A = SwiGLU(H); Xg: [P, d] rows in slot order, or with
  gather_index (see varlen_m) X [T, d] and Xg = X[gather_index] gathered in the kernel."""
  xg, gather_index = row_gather.gather_off_gpu(xg, gather_index)
  num_slots = xg.shape[0] if gather_index is None else gather_index.shape[0]
  n = w1.shape[2] // 2
  num_cols = n // cfg.block_n
  out_types = (jax.ShapeDtypeStruct((num_slots, 2 * n), xg.dtype),
               jax.ShapeDtypeStruct((num_slots, n), xg.dtype))
  return varlen_m(xg, w1, tile_expert, (), col_blocks=lambda c: (c, num_cols + c),
                  num_col_tiles=num_cols, transpose_rhs=False,
                  epilogue=swiglu_epilogue(cfg, n, xg.dtype), out_types=out_types, cfg=cfg,
                  gather_index=gather_index)


def _transposed_in_xla(rhs, transpose_rhs: bool):
  """Mosaic GPU interpret mode cannot transpose SMEM refs in wgmma: transpose in XLA there."""
  if transpose_rhs and cfg_lib.interpret_mode() is not None:
    return jnp.swapaxes(rhs, 1, 2), False
  return rhs, transpose_rhs


def matmul(lhs, rhs, tile_expert, *, transpose_rhs: bool, cfg: TileConfig | None = None,
           gather_index=None):
  """out = lhs_e rhs_e (rhs [E, K, N]) or lhs_e rhs_e^T (rhs [E, N, K] with transpose_rhs);
  with gather_index (see varlen_m) lhs is the source of the rows, out row r = lhs[gather_index[r]]
  times its expert's matrix (zeros for an index past lhs's rows). cfg: MATMUL, or with
  gather_index the gathering tiles (config.up_proj_gather_tiles)."""
  lhs, gather_index = row_gather.gather_off_gpu(lhs, gather_index)
  num_rows = lhs.shape[0] if gather_index is None else gather_index.shape[0]
  n_out = rhs.shape[1] if transpose_rhs else rhs.shape[2]
  if cfg is None:
    cfg = cfg_lib.MATMUL if gather_index is None else cfg_lib.up_proj_gather_tiles(n_out)
  rhs, transpose_rhs = _transposed_in_xla(rhs, transpose_rhs)
  out_type = jax.ShapeDtypeStruct((num_rows, n_out), lhs.dtype)
  return varlen_m(lhs, rhs, tile_expert, (), col_blocks=lambda c: (c,),
                  num_col_tiles=n_out // cfg.block_n, transpose_rhs=transpose_rhs,
                  epilogue=store_epilogue(cfg, lhs.dtype), out_types=out_type, cfg=cfg,
                  gather_index=gather_index)


def dh(dout_g, w2, h, scores, tile_expert, cfg: TileConfig = cfg_lib.DH):
  """dA' = dOg W2_e^T fused with dSwiGLU: returns dH [P, 2n], A' [P, n], dS partials
  [n // block_n, P] fp32 (sum over axis 0 gives dS). dOg: [P, d] rows in slot order."""
  num_slots = h.shape[0]
  n = w2.shape[1]
  num_cols = n // cfg.block_n
  out_types = (jax.ShapeDtypeStruct((num_slots, 2 * n), h.dtype),
               jax.ShapeDtypeStruct((num_slots, n), h.dtype),
               jax.ShapeDtypeStruct((num_cols, num_slots), _F32))
  w2, transpose = _transposed_in_xla(w2, True)
  return varlen_m(dout_g, w2, tile_expert, (h, scores.astype(_F32)), col_blocks=lambda c: (c,),
                  num_col_tiles=num_cols, transpose_rhs=transpose,
                  epilogue=dswiglu_epilogue(cfg, n, h.dtype), out_types=out_types, cfg=cfg)
