"""Varlen-K grouped GEMM for the weight gradients: out[e] = lhs_e^T rhs_e over expert e's rows.

dW1_e = Xg_e^T dH_e (lhs [P, d], rhs [P, 2n]) and dW2_e = A'_e^T dOg_e (lhs [P, n], rhs [P, d]).
The token dimension is reduced and ragged: expert e owns the aligned rows
group_offsets[e] .. group_offsets[e+1] (padding rows are zero), so its pipeline runs
(group_offsets[e+1] - group_offsets[e]) / block_k steps; an expert with no tokens stores zeros.

Tiling: work items (e, m tile of lhs columns, n tile of rhs columns) over a persistent loop;
  acc[bm, bn] += lhs[rows kk, m tile]^T @ rhs[rows kk, n tile], rows block_k at a time by TMA.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels import config as cfg_lib
from pallas_kernels.config import TileConfig


def _store_tile(tile, dst):
  """Stage a register tile in SMEM and TMA-store it to the GMEM view dst."""
  def scope(smem):
    smem[...] = tile.astype(smem.dtype)
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(smem, dst)
    plgpu.wait_smem_to_gmem(0, wait_read_only=True)

  pl.run_scoped(scope, plgpu.SMEM(tile.shape, dst.dtype))


def weight_grad(lhs, rhs, group_offsets, num_experts: int, out_dtype,
                cfg: TileConfig = cfg_lib.WEIGHT_GRAD):
  """[E, lhs cols, rhs cols] in out_dtype (fp32 accumulation)."""
  num_slots, m_dim = lhs.shape
  n_dim = rhs.shape[1]
  bm = cfg.block_m if m_dim % cfg.block_m == 0 else 64
  bn, bk = cfg.block_n, cfg.block_k
  if m_dim % bm or n_dim % bn:
    raise ValueError(f"weight gradient dims ({m_dim}, {n_dim}) must be multiples of ({bm}, {bn})")
  grid_m, grid_n = m_dim // bm, n_dim // bn
  # Mosaic GPU interpret mode cannot transpose SMEM refs in wgmma: transpose lhs in XLA there.
  lhs_t = cfg_lib.interpret_mode() is not None
  if lhs_t:
    lhs = lhs.T

  def body(offsets_ref, lhs_ref, rhs_ref, out_ref):
    @plgpu.nd_loop((num_experts, grid_m * grid_n), collective_axes="sm")
    def _work_item(info):
      e = info.index[0]
      mi, ni = info.index[1] // grid_n, info.index[1] % grid_n
      start = offsets_ref[e]
      num_steps = (offsets_ref[e + 1] - start) // bk
      rows = pl.ds(pl.multiple_of(start, bk), num_slots)  # only the first num_steps blocks are read

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
  return kernel(group_offsets.astype(jnp.int32), lhs, rhs)
