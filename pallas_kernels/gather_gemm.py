"""Up-projection with the row gather fused into the loads (experimental, GPU only).

Hopper has no TMA row gather, so each stage copies its block_m rows of X one by one: a
(1, block_k) TMA box per row into a plain (unswizzled) SMEM tile, all arriving on one barrier
(block_m arrivals). The tile is then read into registers and fed to wgmma as the A operand,
while the W1 gate and up blocks come by ordinary TMA into swizzled SMEM. Padding slots hold the
token index T: their boxes are out of bounds and TMA fills them with zeros.

Tiling (one work item = one m tile x one column tile of A):
  prologue : token ids of the tile -> SMEM; issue stages 0..S-1
  loop kk  : wait stage kk % S; A regs <- rows; gate += A @ W1g; up += A @ W1u; wait wgmma;
             issue stage kk + S into the freed slot
  epilogue : grouped_gemm.swiglu_epilogue (H halves and A)

Mosaic GPU interpret mode cannot run wgmma with a register operand, so this kernel is only
lowered on CPU (tests) and runs on the GPU; select it with SONICMOE_PALLAS_GATHER=tma_rows.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels import config as cfg_lib
from pallas_kernels.config import TileConfig
from pallas_kernels.grouped_gemm import _zeros, for_each_tile, swiglu_epilogue


def up_proj_gathered(x, w1, token_index, tile_expert, cfg: TileConfig = cfg_lib.UP_PROJ):
  """H [P, 2n] and A [P, n] from X [T, d] gathered by token_index [P] inside the kernel."""
  if cfg_lib.interpret_mode() is not None:
    raise NotImplementedError("the gather-fused up-projection runs only on the GPU "
                              "(interpret mode has no register-operand wgmma)")
  num_slots = token_index.shape[0]
  d = x.shape[1]
  n = w1.shape[2] // 2
  num_experts = w1.shape[0]
  bm, bn, bk, stages = cfg.block_m, cfg.block_n, cfg.block_k, cfg.stages
  num_m_tiles, num_cols, num_k = num_slots // bm, n // bn, d // bk
  stages = min(stages, num_k)
  swizzle = plgpu.find_swizzle(bn * jnp.dtype(w1.dtype).itemsize * 8)
  w_transforms = (plgpu.TilingTransform((8, swizzle // jnp.dtype(w1.dtype).itemsize)),
                  plgpu.SwizzleTransform(swizzle))
  epilogue = swiglu_epilogue(cfg, n)

  def body(tile_expert_ref, token_ref, x_ref, w1_ref, h_ref, a_ref):
    def run_tile(m, col, expert):
      def scope(tok_smem, a_stage, wg_smem, wu_smem, tok_bar, rows_bar, w_bar):
        plgpu.copy_gmem_to_smem(token_ref.at[pl.ds(m * bm, bm)], tok_smem, tok_bar.at[0])
        plgpu.barrier_wait(tok_bar.at[0])

        def issue(kk, slot):
          for r in range(bm):
            plgpu.copy_gmem_to_smem(x_ref.at[pl.ds(tok_smem[r], 1), pl.ds(kk * bk, bk)],
                                    a_stage.at[slot, pl.ds(r, 1)], rows_bar.at[slot])
          w_e = w1_ref.at[expert, pl.ds(kk * bk, bk)]
          plgpu.copy_gmem_to_smem(w_e.at[:, pl.ds(col * bn, bn)], wg_smem.at[slot], w_bar.at[slot])
          plgpu.copy_gmem_to_smem(w_e.at[:, pl.ds(n + col * bn, bn)], wu_smem.at[slot], w_bar.at[slot])

        for s in range(stages):
          issue(s, s)

        def acc_scope(gate_acc, up_acc):
          def step(kk, carry):
            slot = lax.rem(kk, stages)
            plgpu.barrier_wait(rows_bar.at[slot])
            plgpu.barrier_wait(w_bar.at[slot])
            a = a_stage.at[slot][...]
            plgpu.wgmma(gate_acc, a, wg_smem.at[slot])
            plgpu.wgmma(up_acc, a, wu_smem.at[slot])
            plgpu.wgmma_wait(0)

            @pl.when(kk + stages < num_k)
            def _():
              issue(kk + stages, slot)
            return carry

          lax.fori_loop(0, num_k, step, None)
          return gate_acc[...], up_acc[...]

        accs = pl.run_scoped(acc_scope, plgpu.ACC((bm, bn), jnp.float32),
                             plgpu.ACC((bm, bn), jnp.float32))
        epilogue(m, col, accs, (), (h_ref, a_ref))

      pl.run_scoped(
          scope,
          plgpu.SMEM((bm,), jnp.int32),
          plgpu.SMEM((stages, bm, bk), x.dtype),
          plgpu.SMEM((stages, bk, bn), w1.dtype, transforms=w_transforms),
          plgpu.SMEM((stages, bk, bn), w1.dtype, transforms=w_transforms),
          plgpu.Barrier(num_barriers=1),
          plgpu.Barrier(num_arrivals=bm, num_barriers=stages),
          plgpu.Barrier(num_arrivals=2, num_barriers=stages))

    def empty_tile(m, col):
      epilogue(m, col, (_zeros(cfg), _zeros(cfg)), (), (h_ref, a_ref))

    for_each_tile(tile_expert_ref, num_m_tiles, num_cols, num_experts, run_tile, empty_tile)

  out_types = (jax.ShapeDtypeStruct((num_slots, 2 * n), x.dtype),
               jax.ShapeDtypeStruct((num_slots, n), x.dtype))
  kernel = plgpu.kernel(body, out_type=out_types, grid=(cfg_lib.num_sms(),), grid_names=("sm",),
                        compiler_params=cfg_lib.compiler_params())
  return kernel(tile_expert, token_index.astype(jnp.int32), x, w1)
