"""The SonicMoE layer: routing + the expert computation as a minimal-memory custom_vjp.

Forward (per expert e over its slots): H = X_e W1_e, A = SwiGLU(H), Y = A W2_e,
O_t = sum_e s_te Y_et. The expert part is a jax.custom_vjp whose residuals are X, H, the slot
scores and the routing plan's integer arrays; Y and dY are never kept. Backward:
dA' = dO_e W2_e^T, dS = <dA', A>, dA = s dA', dH = dSwiGLU(dA, H), A' = s A, dW2 = A'^T dO_e,
dW1 = X_e^T dH, dX~ = dH W1_e^T, dX_t = sum_e dX~_et. The router (logits -> scores) is
differentiated by JAX from dS.
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Optional

import jax
import jax.numpy as jnp

from sonicmoe_jax import backends, routing, validation
from sonicmoe_jax.routing import RouterStats, RoutingPlan


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 6))
def expert_mlp(ops: backends.Ops, x, scores, w1, w2, plan: RoutingPlan, windows: int = 1):
  """O = sum over each token's slots of score * SwiGLU-MLP_e(x); see module docstring.

  `plan`'s own `scores` field is ignored: the differentiable scores come in `scores`.
  windows: the [slots, d] products (Y; dX~ in the backward) are made and summed per token one
  row window at a time (window_sum).
  """
  return _expert_mlp_fwd(ops, x, scores, w1, w2, plan, windows)[0]


def window_sum(matmul, aggregate, lhs, rhs, scores, plan: RoutingPlan, windows: int, dtype):
  """aggregate(matmul(lhs, rhs, plan), scores, plan) in `dtype`, the product made over
  routing.slot_windows one window at a time: each window's rows are summed into an fp32 [T, d]
  partial before the next window's GEMM starts (an optimization barrier orders them), so the
  [slots, d] product is never whole in memory: its peak is one window's plus the partial.
  (routing.slot_windows checks `windows`.)"""
  bounds = routing.slot_windows(plan.num_slots, windows, plan.align)
  if len(bounds) == 1:
    return aggregate(matmul(lhs, rhs, plan), scores, plan)
  partial = None
  for i, rows in enumerate(bounds):
    if partial is not None:
      partial, lhs = jax.lax.optimization_barrier((partial, lhs))
    out_dtype = dtype if i == len(bounds) - 1 else jnp.float32
    partial = aggregate(matmul(lhs, rhs, plan, rows=rows), scores, plan, rows=rows, acc=partial,
                        out_dtype=out_dtype)
  return partial


def _expert_mlp_fwd(ops, x, scores, w1, w2, plan, windows):
  h, a = ops.up_proj(x, w1, plan)
  out = window_sum(ops.down_proj, ops.aggregate, a, w2, scores, plan, windows, x.dtype)
  return out, (x, h, scores, w1, w2, plan)


def _expert_mlp_bwd(ops, windows, residuals, dout):
  x, h, scores, w1, w2, plan = residuals
  dout = dout.astype(x.dtype)
  dh, dscores, a_scaled = ops.dh(dout, w2, h, scores, plan)
  # dW2 first: A' (and dO's rows, where a backend gathers them in XLA) die before dX~ is made
  dw2 = ops.dw2(a_scaled, dout, plan).astype(w2.dtype)
  dx = window_sum(ops.dx_tilde, ops.aggregate, dh, w1, None, plan, windows, x.dtype)
  # The barrier keeps XLA from merging dW1's gather of X's rows with the forward's (when a
  # backend gathers them in XLA): merged, the gathered X [pairs, d] would be kept from the
  # forward to the backward, which is what this layer exists to avoid.
  dw1 = ops.dw1(jax.lax.optimization_barrier(x), dh, plan).astype(w1.dtype)
  plan_ct = jax.tree_util.tree_map(lambda _: None, plan)
  return dx, dscores.astype(scores.dtype), dw1, dw2, plan_ct


expert_mlp.defvjp(_expert_mlp_fwd, _expert_mlp_bwd)


@dataclasses.dataclass(frozen=True)
class MoEOutput:
  """out: [T, d]; plan: the RoutingPlan used; stats: RouterStats (counts, aux losses)."""
  out: jax.Array
  plan: RoutingPlan
  stats: RouterStats


jax.tree_util.register_dataclass(MoEOutput)


def _check_inputs(x, router_w, w1, w2):
  validation.check_rank("x", x, 2, "[T, d]")
  validation.check_rank("router_w", router_w, 2, "[d, E]")
  validation.check_rank("w1", w1, 3, "[E, d, 2n]")
  validation.check_rank("w2", w2, 3, "[E, n, d]")
  for name, arr in (("x", x), ("router_w", router_w), ("w1", w1), ("w2", w2)):
    validation.check_float_dtype(name, arr)
  t, d = x.shape
  e = router_w.shape[1]
  if t < 1:
    raise ValueError(f"x must have at least one token; got shape {tuple(x.shape)}")
  validation.check_dim("router_w", router_w.shape[0], d, "dim 0 (d, from x)")
  validation.check_dim("w1", w1.shape[0], e, "dim 0 (E, from router_w)")
  validation.check_dim("w1", w1.shape[1], d, "dim 1 (d, from x)")
  if w1.shape[2] % 2:
    raise ValueError(f"w1: dim 2 (2n: gate and up halves) must be even; got {w1.shape[2]}")
  n = w1.shape[2] // 2
  validation.check_dim("w2", w2.shape[0], e, "dim 0 (E, from router_w)")
  validation.check_dim("w2", w2.shape[1], n, "dim 1 (n, half of w1's dim 2)")
  validation.check_dim("w2", w2.shape[2], d, "dim 2 (d, from x)")
  for name, arr in (("w1", w1), ("w2", w2)):
    if arr.dtype != x.dtype:
      raise TypeError(f"{name} must have x's dtype {x.dtype}; got {arr.dtype}")


def moe(x, router_w, w1, w2, *, k: int, score_fn: str = "softmax_topk",
        renormalize: bool = False, rounding: Optional[str] = None, tile: int = 128,
        rng=None, backend: backends.BackendSpec = "auto", windows: Optional[int] = None) -> MoEOutput:
  """A SonicMoE layer: top-K routing, SwiGLU experts, minimal-memory backward.

  Args:
    x: [T, d] tokens (bf16, f16 or f32).
    router_w: [d, E] router weight (any float dtype; logits are fp32).
    w1: [E, d, 2n] expert up-projections, gate half first; x's dtype.
    w2: [E, n, d] expert down-projections; x's dtype.
    k: experts per token (1 <= k <= E).
    score_fn: "softmax_topk" (softmax over the K selected logits) or "softmax_all".
    renormalize: with "softmax_all", renormalise the chosen scores to sum to 1.
    rounding: None (plain top-K; use for evaluation) or a token-rounding mode "nearest",
      "stochastic", "up", "down", "balanced" (training). Needs T >= tile.
    tile: token-rounding tile (power of two, default 128: the kernels' M tile).
    rng: PRNG key for rounding="stochastic".
    backend: "auto", "xla", "pallas", "cute", or {op: backend}; see backends.py.
    windows: compute the expert outputs Y [slots, d] (and in the backward dX~) in this many
      row windows, each summed per token into an fp32 [T, d] partial before the next is made:
      the layer's peak memory then holds one window of them instead of all (on a [T*K, d]
      product, 1/windows of it) plus the partial, for one more read and write of the partial
      per window and one more GEMM launch. 1: no windows. At most the plan's slots over the
      kernels' row tile. None (default): the measured choice (backends.default_windows: two
      where the store GEMMs run on cute and d >= 2n, else one; never more than the plan has
      tiles).

  Returns:
    MoEOutput(out [T, d] in x's dtype, plan, stats). Differentiable in x, router_w, w1, w2.
  """
  _check_inputs(x, router_w, w1, w2)
  ops = backends.resolve(backend, dtype=x.dtype, d=x.shape[1], n=w2.shape[1],
                         num_experts=router_w.shape[1], k=k)
  logits = routing.router_logits(x, router_w)
  plan, stats = routing.route(logits, k=k, score_fn=score_fn, renormalize=renormalize,
                              rounding=rounding, tile=tile, rng=rng, align=ops.align,
                              top_k=ops.top_k)
  plan_arrays = dataclasses.replace(plan, scores=jax.lax.stop_gradient(plan.scores))
  if windows is None:
    windows = min(ops.windows, max(1, plan.num_slots // plan.align))
  out = expert_mlp(ops, x, plan.scores, w1, w2, plan_arrays, windows)
  return MoEOutput(out=out, plan=plan, stats=stats)
