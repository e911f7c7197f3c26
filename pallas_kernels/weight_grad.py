"""Varlen-K grouped GEMM for the weight gradients: out[e] = lhs_e^T rhs_e over expert e's rows.

dW1_e = Xg_e^T dH_e (lhs [P, d], rhs [P, 2n]) and dW2_e = A'_e^T dOg_e (lhs [P, n], rhs [P, d]).
The token dimension is reduced and ragged: expert e owns the aligned rows
group_offsets[e] .. group_offsets[e+1] (padding rows are zero), so its pipeline runs
(group_offsets[e+1] - group_offsets[e]) / block_k steps, or with the plan's group_sizes only
the steps up to the one holding its last row; an expert with no tokens stores zeros.

Tiling: work items (e, m tile of lhs columns, n tile of rhs columns) over a persistent loop;
  acc[bm, bn] += lhs[rows kk, m tile]^T @ rhs[rows kk, n tile], rows block_k at a time by TMA.
With gather_index (dW1 on X itself, no gathered copy in HBM), lhs rows are not in the TMA
pipeline: the warpgroup cp.async-copies lhs[gather_index[rows kk], m tile] as bm / 64 column
blocks of [block_k, 64] into a ring of `stages` swizzled tiles, stages - 1 k steps ahead
(row_gather.py), one accumulator [64, bn] per column block.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels import config as cfg_lib
from pallas_kernels import row_gather
from pallas_kernels.config import TileConfig
from sonicmoe_jax.core import routing

GATHER_COLS = row_gather.BLOCK_COLS   # lhs columns per gathered tile (128 bytes of bf16)


def _store_tile(tile, dst):
  """Stage a register tile in SMEM and TMA-store it to the GMEM view dst."""
  def scope(smem):
    smem[...] = tile.astype(smem.dtype)
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(smem, dst)
    plgpu.wait_smem_to_gmem(0, wait_read_only=True)

  pl.run_scoped(scope, plgpu.SMEM(tile.shape, dst.dtype))


def weight_grad(lhs, rhs, group_offsets, num_experts: int, out_dtype,
                cfg: TileConfig = cfg_lib.WEIGHT_GRAD, gather_index=None, group_sizes=None):
  """[E, lhs cols, rhs cols] in out_dtype (fp32 accumulation).

  gather_index (GPU only; off the GPU it gathers in XLA first): lhs is then the source [N, m]
  and slot row r reads lhs[gather_index[r]], zeros for indices outside [0, N). group_sizes [E]
  (the plan's): expert e's rows end at group_offsets[e] + group_sizes[e] (clamped to its
  group) and the k steps wholly past that end, its padding, are skipped (the padding rows of
  the last step it runs must be zeros, as the plan's)."""
  reason = routing.group_sizes_mismatch(group_sizes, num_experts)
  if reason:
    raise ValueError(f"weight gradient {reason}")
  group_rows = routing.group_row_ranges(group_offsets, group_sizes)
  lhs, gather_index = row_gather.gather_off_gpu(lhs, gather_index)
  if gather_index is not None:
    return _gathered_weight_grad(lhs, rhs, gather_index, group_rows, num_experts, out_dtype, cfg)
  num_slots, m_dim = lhs.shape
  n_dim = rhs.shape[1]
  bm = cfg.block_m if m_dim % cfg.block_m == 0 else 64
  bn = cfg.block_n if n_dim % cfg.block_n == 0 else 64
  bk = cfg.block_k
  if m_dim % bm or n_dim % bn:
    raise ValueError(f"weight gradient dims ({m_dim}, {n_dim}) must be multiples of ({bm}, {bn})")
  grid_m, grid_n = m_dim // bm, n_dim // bn
  # Mosaic GPU interpret mode cannot transpose SMEM refs in wgmma: transpose lhs in XLA there.
  lhs_t = cfg_lib.interpret_mode() is not None
  if lhs_t:
    lhs = lhs.T

  def body(group_rows_ref, lhs_ref, rhs_ref, out_ref):
    @plgpu.nd_loop((num_experts, grid_m * grid_n), collective_axes="sm")
    def _work_item(info):
      e = info.index[0]
      mi, ni = info.index[1] // grid_n, info.index[1] % grid_n
      first_step, num_steps = routing.group_row_steps(group_rows_ref, e, bk)
      rows = pl.ds(pl.multiple_of(first_step * bk, bk), num_slots)  # only the first num_steps blocks are read

      def acc_scope(acc_ref):
        def step(_, lhs_smem, rhs_smem):
          a = lhs_smem if lhs_t else lhs_smem.transpose((1, 0))
          plgpu.wgmma(acc_ref, a, rhs_smem)

        if lhs_t:
          lhs_spec = plgpu.BlockSpec((bm, bk), lambda kk: (mi, kk), delay_release=1)
          lhs_view = lhs_ref.at[:, rows]
        else:
          lhs_spec = plgpu.BlockSpec((bk, bm), lambda kk: (kk, mi), delay_release=1)
          lhs_view = lhs_ref.at[rows]

        @pl.when(num_steps > 0)
        def _():
          plgpu.emit_pipeline(
              step, grid=(num_steps,),
              in_specs=[lhs_spec, plgpu.BlockSpec((bk, bn), lambda kk: (kk, ni), delay_release=1)],
              max_concurrent_steps=cfg.stages,
          )(lhs_view, rhs_ref.at[rows])
        return acc_ref[...]

      acc = pl.run_scoped(acc_scope, plgpu.ACC((bm, bn), jnp.float32))
      _store_tile(acc, out_ref.at[e, pl.ds(mi * bm, bm), pl.ds(ni * bn, bn)])

  kernel = plgpu.kernel(
      body, out_type=jax.ShapeDtypeStruct((num_experts, m_dim, n_dim), out_dtype),
      grid=(cfg_lib.num_sms(),), grid_names=("sm",), compiler_params=cfg_lib.compiler_params(),
      interpret=cfg_lib.interpret_mode())
  return kernel(group_rows, lhs, rhs)


def _gathered_weight_grad(source, rhs, gather_index, group_rows, num_experts, out_dtype,
                          cfg: TileConfig):
  """weight_grad with lhs = source[gather_index] gathered inside the kernel (module docstring)."""
  num_source, m_dim = source.shape
  num_slots, n_dim = rhs.shape
  bm, bn, bk, ring = cfg.block_m, cfg.block_n, cfg.block_k, cfg.stages
  if m_dim % bm or n_dim % bn:
    raise ValueError(f"weight gradient dims ({m_dim}, {n_dim}) must be multiples of ({bm}, {bn})")
  if bm % GATHER_COLS or bk % row_gather.ROWS_PER_PASS:
    raise ValueError(f"gathered weight gradient needs block_m % {GATHER_COLS} == 0 and block_k "
                     f"% {row_gather.ROWS_PER_PASS} == 0; got {cfg}")
  num_blocks = bm // GATHER_COLS   # gathered column blocks (and accumulators) per lhs tile
  grid_m, grid_n = m_dim // bm, n_dim // bn

  def body(group_rows_ref, source_ref, index_ref, rhs_ref, out_ref):
    pl.run_scoped(lambda ring_ref: work(group_rows_ref, source_ref, index_ref, rhs_ref, out_ref, ring_ref),
                  plgpu.SMEM((ring, num_blocks, bk, GATHER_COLS), source.dtype,
                             transforms=row_gather.TILE_TRANSFORMS))

  def work(group_rows_ref, source_ref, index_ref, rhs_ref, out_ref, ring_ref):
    @plgpu.nd_loop((num_experts, grid_m * grid_n), collective_axes="sm")
    def _work_item(info):
      e = info.index[0]
      mi, ni = info.index[1] // grid_n, info.index[1] % grid_n
      first_step, num_steps = routing.group_row_steps(group_rows_ref, e, bk)
      start = pl.multiple_of(first_step * bk, bk)

      def gather(kk):
        """Step kk's rows into ring slot kk % ring: num_blocks cp.async groups, one per
        GATHER_COLS columns."""
        rows = index_ref.at[pl.ds(start + kk * bk, bk)]

        def issue_into(slot):
          for j in range(num_blocks):
            cols = pl.ds(mi * bm + j * GATHER_COLS, GATHER_COLS)
            row_gather.issue_gather(source_ref.at[:, cols], rows, ring_ref.at[slot, j], num_source)
        row_gather.issue_ring_step(kk, num_steps, ring, issue_into, groups_per_step=num_blocks)

      def step(indices, rhs_smem, accs):
        kk = indices[0]
        gather(kk + ring - 1)    # into the slot step kk - 1 read: its wgmma has completed
        row_gather.wait_gathers(num_blocks * (ring - 1))   # step kk's groups have landed
        plgpu.commit_smem()      # cp.async writes -> visible to wgmma (async proxy)
        for j, acc in enumerate(accs):
          plgpu.wgmma(acc, ring_ref.at[kk % ring, j].transpose((1, 0)), rhs_smem)
        plgpu.wgmma_wait(0)   # before the pipeline refills rhs_smem and the next gather this slot

      def acc_scope(*accs):
        @pl.when(num_steps > 0)
        def _():
          for kk in range(ring - 1):
            gather(jnp.int32(kk))
          plgpu.emit_pipeline(
              lambda indices, rhs_smem: step(indices, rhs_smem, accs), grid=(num_steps,),
              in_specs=[plgpu.BlockSpec((bk, bn), lambda kk: (kk, ni))],
              max_concurrent_steps=ring,
          )(rhs_ref.at[pl.ds(start, num_slots)])
        return [acc[...] for acc in accs]

      tiles = pl.run_scoped(acc_scope, *[plgpu.ACC((GATHER_COLS, bn), jnp.float32)] * num_blocks)
      for j, tile in enumerate(tiles):
        _store_tile(tile, out_ref.at[e, pl.ds(mi * bm + j * GATHER_COLS, GATHER_COLS),
                                     pl.ds(ni * bn, bn)])

  kernel = plgpu.kernel(
      body, out_type=jax.ShapeDtypeStruct((num_experts, m_dim, n_dim), out_dtype),
      grid=(cfg_lib.num_sms(),), grid_names=("sm",), compiler_params=cfg_lib.compiler_params())
  return kernel(group_rows, source, gather_index.astype(jnp.int32), rhs)
