"""Baselines for the OmniMoE comparison: a coarse DeepSeekMoE-style layer (a shared SwiGLU MLP
plus routed SwiGLU experts through our SonicMoE layer) and a dense SwiGLU MLP."""
from __future__ import annotations

import jax.numpy as jnp
from flax import nnx

from sonicmoe_jax import SonicMoE
from sonicmoe_jax.core import swiglu


class DenseMLP(nnx.Module):
  """SwiGLU MLP: x -> W_out (silu(x W_gate) * x W_up)."""

  def __init__(self, d_model: int, d_hidden: int, *, rngs: nnx.Rngs):
    self.w_in = nnx.Linear(d_model, 2 * d_hidden, use_bias=False, rngs=rngs)
    self.w_out = nnx.Linear(d_hidden, d_model, use_bias=False, rngs=rngs)

  def __call__(self, x):
    return self.w_out(swiglu.forward(self.w_in(x)).astype(x.dtype))


class DeepSeekMoE(nnx.Module):
  """Shared expert(s) as one SwiGLU MLP of width d_shared, plus E routed SwiGLU experts of width
  d_expert, top-k, through sonicmoe_jax.SonicMoE. Returns (y, RouterStats)."""

  def __init__(self, d_model: int, d_shared: int, num_experts: int, k: int, d_expert: int, *,
               rounding=None, tile: int = 128, backend="auto", dtype=jnp.bfloat16, rngs: nnx.Rngs):
    self.shared = DenseMLP(d_model, d_shared, rngs=rngs)
    self.routed = SonicMoE(d_model, d_expert, num_experts, k, rounding=rounding, tile=tile,
                           backend=backend, dtype=dtype, rngs=rngs)

  def __call__(self, x):
    y, stats = self.routed(x)
    return self.shared(x) + y.astype(x.dtype), stats
