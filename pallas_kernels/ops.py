"""Backend "pallas": the expert ops on Pallas Mosaic GPU kernels (Hopper), run in Mosaic GPU
interpret mode off the GPU.

The plan is aligned to BLOCK_M rows per expert (ALIGN) so every M tile has one expert. Rows of
X are gathered inside the up-projection kernel by cp.async (Hopper has no TMA row gather;
PallasConfig.up_proj_gather_in_kernel); rows of dO, and of X for dW1, are gathered by XLA (inside
the dH kernel it is slower; inside dW1's kernel it is slower but saves memory:
PallasConfig.dw1_gather_in_kernel); every op takes its PallasConfig as `config`; aggregation is XLA's gather-and-sum. Limits: bf16/f16 inputs, d and n multiples of 64 (64-column
tiles where they are not multiples of 128; the layer zero-pads other widths up to them).
"""
from __future__ import annotations

import warnings

import jax
import jax.numpy as jnp

from pallas_kernels import config as tiling
from pallas_kernels import grouped_gemm, topk, weight_grad
from sonicmoe_jax.core import schedule
from pallas_kernels.config import DEFAULT, PallasConfig
from sonicmoe_jax.core import xla_ops

ALIGN = tiling.BLOCK_M
CONFIG_TYPE = PallasConfig   # what backends.resolve accepts as this backend's kernel_config
unsupported = tiling.unsupported
WIDTH_MULTIPLES = tiling.WIDTH_MULTIPLES


def tiles(plan):
  return schedule.tile_experts(plan, tiling.BLOCK_M)


def top_k(logits, k, *, config: PallasConfig = DEFAULT):
  """The Mosaic GPU top-K kernel; logits it cannot take (E not a multiple of 8, or above 256)
  go to jax.lax.top_k with a warning (the result is the same)."""
  del config   # (one kernel)
  reason = topk.unsupported(logits.shape[1], k)
  if reason:
    warnings.warn(f"backend 'pallas' top_k: {reason}; using jax.lax.top_k", stacklevel=2)
    return jax.lax.top_k(logits, k)
  return topk.top_k(logits, k)


def rounded_slots(values, counts, offsets, num_slots, *, config: PallasConfig = DEFAULT):
  """Token rounding's placed selection: XLA's (xla_ops.rounded_slots; no Pallas kernel)."""
  del config
  return xla_ops.rounded_slots(values, counts, offsets, num_slots)


def up_proj(x, w1, plan, *, config: PallasConfig = DEFAULT):
  tiling.check_operands("up_proj", x=x, w1=w1)
  tiling.check_dims(x.shape[1], w1.shape[2] // 2)
  if config.up_proj_gather_in_kernel:
    return grouped_gemm.up_proj(x, w1, tiles(plan), tiling.up_proj_gather_tiles(w1.shape[2] // 2),
                                gather_index=plan.token_index)
  return grouped_gemm.up_proj(xla_ops.gather_rows(x, plan.token_index), w1, tiles(plan))


def down_proj(a, w2, plan, cols=None, *, config: PallasConfig = DEFAULT):
  """Y = A_e W2_e per expert; cols=(lo, hi): Y's columns lo .. hi - 1 (W2's columns copied)."""
  del config   # (one kernel)
  tiling.check_operands("down_proj", a=a, w2=w2)
  w2 = xla_ops.output_window(w2, cols, 2)
  tiling.check_dims(w2.shape[2], w2.shape[1])
  return grouped_gemm.matmul(a, w2, tiles(plan), transpose_rhs=False,
                             cfg=tiling.matmul_tiles(w2.shape[2]))


def aggregate(y, scores, plan, into=None, *, config: PallasConfig = DEFAULT):
  """XLA's gather-and-sum (xla_ops.aggregate)."""
  del config
  return xla_ops.aggregate(y, scores, plan, into)


def dh(dout, w2, h, scores, plan, *, config: PallasConfig = DEFAULT):
  del config   # (one kernel)
  tiling.check_operands("dh", dout=dout, w2=w2, h=h)
  tiling.check_dims(w2.shape[2], w2.shape[1])
  dh_, a_scaled, ds_parts = grouped_gemm.dh(xla_ops.gather_rows(dout, plan.token_index), w2, h,
                                            scores, tiles(plan))
  return dh_, jnp.where(plan.valid, jnp.sum(ds_parts, axis=0), 0.0), a_scaled


def dx_tilde(dh_, w1, plan, cols=None, *, config: PallasConfig = DEFAULT):
  """dX~ = dH_e W1_e^T per expert; cols as down_proj's (W1's rows copied)."""
  del config   # (one kernel)
  tiling.check_operands("dx_tilde", dh=dh_, w1=w1)
  w1 = xla_ops.output_window(w1, cols, 1)
  tiling.check_dims(w1.shape[1], w1.shape[2] // 2)
  return grouped_gemm.matmul(dh_, w1, tiles(plan), transpose_rhs=True,
                             cfg=tiling.matmul_tiles(w1.shape[1]))


def dw1(x, dh_, plan, *, config: PallasConfig = DEFAULT):
  if config.dw1_gather_in_kernel:
    return weight_grad.weight_grad(x, dh_, plan.group_offsets, plan.num_experts, x.dtype,
                                   gather_index=plan.token_index, group_sizes=plan.group_sizes)
  return weight_grad.weight_grad(xla_ops.gather_rows(x, plan.token_index), dh_,
                                 plan.group_offsets, plan.num_experts, x.dtype,
                                 group_sizes=plan.group_sizes)


def dw2(a_scaled, dout, plan, *, config: PallasConfig = DEFAULT):
  del config   # (one kernel)
  return weight_grad.weight_grad(a_scaled, xla_ops.gather_rows(dout, plan.token_index),
                                 plan.group_offsets, plan.num_experts, dout.dtype,
                                 group_sizes=plan.group_sizes)


OPS = dict(top_k=top_k, rounded_slots=rounded_slots, up_proj=up_proj, down_proj=down_proj,
           aggregate=aggregate, dh=dh, dx_tilde=dx_tilde, dw1=dw1, dw2=dw2)
