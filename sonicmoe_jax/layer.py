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
from typing import Hashable, Mapping, Optional

import jax
import jax.numpy as jnp

from sonicmoe_jax import backends
from sonicmoe_jax.core import padding, routing, validation
from sonicmoe_jax.core.routing import RouterStats, RoutingPlan


@dataclasses.dataclass(frozen=True)
class LocalRows:
  """The expert computation's dispatch on one device: the plan's token_index points into the
  tokens themselves, so every move is the identity.

  A dispatch moves what the expert computation reads from the token side to the rows its plan
  indexes, and what it makes back (sharding.ExpertParallelRows is the other one: the rows
  travel to the devices that own their experts). It is a pytree (its arrays are the layer's
  integer routing data; no gradient flows into it) with:
    rows(v): token-side values [T, ...] -> the rows [R, ...] the plan's token_index points into
    slot_scores(scores, plan): the layer's scores -> one per slot of the plan
    slot_scores_grad(ds, plan): the transpose: the plan's per-slot dS -> the layer's scores' grad
    combine(ops, rows): per-row outputs [R, d] -> the token side [T, d]
    weight_grads(dw1, dw2): the expert weights' gradients summed over the devices that share
      the weights
    finish(grads, primals): the gradients as the primals' types (sharding's varying axes)
  """

  def rows(self, values):
    return values

  def slot_scores(self, scores, plan):
    return scores

  def slot_scores_grad(self, dscores, plan):
    return dscores

  def combine(self, ops, rows):
    return rows

  def weight_grads(self, dw1, dw2):
    return dw1, dw2

  def finish(self, grads, primals):
    return grads


jax.tree_util.register_dataclass(LocalRows, data_fields=[], meta_fields=[])


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 6))
def expert_mlp(ops: backends.Ops, x, scores, w1, w2, plan: RoutingPlan,
               windows: int | tuple[int, int] = 1, dispatch=LocalRows()):
  """O = sum over each token's slots of score * SwiGLU-MLP_e(x); see module docstring.

  `plan`'s own `scores` field is ignored: the differentiable scores come in `scores`.
  windows: the [slots, d] products (Y; dX~ in the backward) are made and summed per row one
  column window at a time (window_sum); a pair (forward, backward): Y's windows, dX~'s.
  dispatch: how the tokens reach the rows the plan indexes and the outputs come back
  (LocalRows: on this device; the expert-parallel layer passes its own). The forward and the
  backward below are the only ones: every layer of this package runs them.
  """
  return _expert_mlp_fwd(ops, x, scores, w1, w2, plan, windows, dispatch)[0]


# A column window's width is a multiple of this (the GPU kernels' column tile divides it).
WINDOW_COLUMN_ALIGN = 128


def max_column_windows(num_cols: int) -> int:
  """The most column windows num_cols columns split into (one where they are not a multiple
  of WINDOW_COLUMN_ALIGN)."""
  return num_cols // WINDOW_COLUMN_ALIGN if num_cols % WINDOW_COLUMN_ALIGN == 0 else 1


def column_windows(num_cols: int, windows: int) -> list[tuple[int, int]]:
  """`windows` consecutive column ranges [lo, hi) covering 0 .. num_cols - 1, their bounds
  multiples of WINDOW_COLUMN_ALIGN (widths within one multiple of each other).

  Raises TypeError when windows is not an int, ValueError when it is not in
  [1, num_cols // WINDOW_COLUMN_ALIGN] (only 1 where num_cols is not a multiple of it)."""
  if not isinstance(windows, int) or isinstance(windows, bool):
    raise TypeError(f"windows must be a Python int; got {type(windows).__name__}")
  if windows == 1:
    return [(0, num_cols)]
  tiles = max_column_windows(num_cols)
  if not 1 <= windows <= tiles:
    raise ValueError(f"windows must be between 1 and {tiles}: d={num_cols} splits into windows "
                     f"whose widths are multiples of {WINDOW_COLUMN_ALIGN} columns; got {windows}")
  cuts = [WINDOW_COLUMN_ALIGN * (tiles * i // windows) for i in range(windows)] + [num_cols]
  return list(zip(cuts[:-1], cuts[1:]))


def window_pair(windows) -> tuple[int, int]:
  """moe's `windows` as (forward, backward): an int is both, a pair (tuple or list) its two
  (checked here for being one of those; column_windows checks each count against d)."""
  if isinstance(windows, (tuple, list)) and len(windows) == 2:
    return tuple(windows)
  if isinstance(windows, int) and not isinstance(windows, bool):
    return windows, windows
  raise TypeError(f"windows must be a Python int or a pair (forward, backward) of them; got "
                  f"{windows!r}")


def resolve_windows(windows, ops: backends.Ops, d: int) -> tuple[int, int]:
  """moe's `windows` as (forward, backward) counts for a layer of width d, run at the width
  the kernels take it (Ops.kernel_widths): None takes the resolved backends' default
  (ops.windows) where that width has room for it, else 1; each count is checked against that
  width (column_windows' errors name the limit)."""
  d = ops.kernel_widths(d, 1)[0]
  if windows is None:
    windows = ops.windows if ops.windows <= max_column_windows(d) else 1
  forward, backward = window_pair(windows)
  for count in (forward, backward):
    column_windows(d, count)
  return forward, backward


def window_sum(matmul, aggregate, lhs, rhs, scores, plan: RoutingPlan, windows: int,
               num_cols: int, into: bool = False):
  """aggregate(matmul(lhs, rhs, plan), scores, plan), the [slots, num_cols] product made over
  column_windows one window at a time: each window's columns are summed per token before the
  next window's GEMM starts (an optimization barrier orders them), so the product is never
  whole in memory: its peak is one window's. The sums are the result's columns (no partial
  sums: each window is complete in its columns): concatenated, or with `into` (an aggregate
  that writes its window into the result, Ops.aggregate_into) written there in turn."""
  bounds = column_windows(num_cols, windows)
  if len(bounds) == 1:
    return aggregate(matmul(lhs, rhs, plan), scores, plan)
  outs = []
  for cols in bounds:
    if outs:
      outs[-1], lhs = jax.lax.optimization_barrier((outs[-1], lhs))
    product = matmul(lhs, rhs, plan, cols=cols)
    if into:
      outs = [aggregate(product, scores, plan, into=(outs[-1] if outs else num_cols, cols[0]))]
    else:
      outs.append(aggregate(product, scores, plan))
  return outs[0] if into else jnp.concatenate(outs, axis=1)


def run_experts(ops: backends.Ops, x, scores, w1, w2, plan: RoutingPlan,
                windows: tuple[int, int] = (1, 1), dispatch=LocalRows()):
  """expert_mlp at the widths the resolved kernels take (Ops.kernel_widths): x, w1 and w2
  zero-padded to them where d or n is not a multiple of the kernels' column tiles, the output
  cut back to x's d columns (core/padding.py: the numbers are those of the unpadded layer).
  Every layer of this package calls the expert computation through here."""
  d, n = x.shape[1], w2.shape[1]
  kernel_d, kernel_n = ops.kernel_widths(d, n)
  w1, w2 = padding.pad_expert_weights(w1, w2, kernel_d, kernel_n)
  out = expert_mlp(ops, padding.pad_columns(x, kernel_d), scores, w1, w2, plan, windows, dispatch)
  return out if kernel_d == d else out[:, :d]


def _expert_mlp_fwd(ops, x, scores, w1, w2, plan, windows, dispatch):
  slot_scores = dispatch.slot_scores(scores, plan)
  h, a = ops.up_proj(dispatch.rows(x), w1, plan)
  out_rows = window_sum(ops.down_proj, ops.aggregate, a, w2, slot_scores, plan,
                        window_pair(windows)[0], x.shape[1], ops.aggregate_into)
  return dispatch.combine(ops, out_rows), (x, h, slot_scores, w1, w2, plan, dispatch)


def _expert_mlp_bwd(ops, windows, residuals, dout):
  x, h, slot_scores, w1, w2, plan, dispatch = residuals
  dout_rows = dispatch.rows(dout.astype(x.dtype))
  dh, dscores, a_scaled = ops.dh(dout_rows, w2, h, slot_scores, plan)
  # dW2 first: A' (and dO's rows, where a backend gathers them in XLA) die before dX~ is made
  dw2 = ops.dw2(a_scaled, dout_rows, plan)
  dx = dispatch.combine(ops, window_sum(ops.dx_tilde, ops.aggregate, dh, w1, None, plan,
                                        window_pair(windows)[1], x.shape[1],
                                        ops.aggregate_into))
  # X's rows again for dW1 (gathered, or sent, anew: never kept from the forward). The barrier
  # keeps XLA from merging this gather of X's rows with the forward's (when a backend gathers
  # them in XLA): merged, the gathered X [pairs, d] would be kept from the forward to the
  # backward, which is what this layer exists to avoid.
  dw1 = ops.dw1(dispatch.rows(jax.lax.optimization_barrier(x)), dh, plan)
  dw1, dw2 = dispatch.weight_grads(dw1, dw2)
  # (the layer's scores: slot_scores' dtype; they vary over the same mesh axes as x)
  grads = (dx, dispatch.slot_scores_grad(dscores, plan).astype(slot_scores.dtype),
           dw1.astype(w1.dtype), dw2.astype(w2.dtype))
  grads = dispatch.finish(grads, (x, x, w1, w2))
  none = lambda tree: jax.tree_util.tree_map(lambda _: None, tree)
  return (*grads, none(plan), none(dispatch))


expert_mlp.defvjp(_expert_mlp_fwd, _expert_mlp_bwd)


@dataclasses.dataclass(frozen=True)
class MoEOutput:
  """out: [T, d]; plan: the RoutingPlan used; stats: RouterStats (counts, aux losses)."""
  out: jax.Array
  plan: RoutingPlan
  stats: RouterStats


jax.tree_util.register_dataclass(MoEOutput)


def as_arrays(**named):
  """The inputs as JAX arrays, as jnp.asarray takes them (NumPy arrays, Python lists and
  scalars too); TypeError naming the argument that is none of those."""
  out = []
  for name, value in named.items():
    try:
      out.append(jnp.asarray(value))
    except TypeError as e:
      raise TypeError(f"{name} must be an array (a JAX or NumPy array, or a nested list of "
                      f"numbers); got {type(value).__name__}: {e}") from None
  return out


def _check_inputs(x, router_w, w1, w2):
  validation.check_rank("x", x, 2, "[T, d]")
  validation.check_rank("router_w", router_w, 2, "[d, E]")
  for name, arr in (("x", x), ("router_w", router_w)):
    validation.check_float_dtype(name, arr)
  t, d = x.shape
  e = router_w.shape[1]
  if t < 1:
    raise ValueError(f"x must have at least one token; got shape {tuple(x.shape)}")
  validation.check_dim("router_w", router_w.shape[0], d, "dim 0 (d, from x)")
  check_expert_weights(w1, w2, x, "x", e, "router_w")


def check_expert_weights(w1, w2, rows, rows_name: str, num_experts: Optional[int] = None,
                         experts_from: str = "w1") -> int:
  """w1 [E, d, 2n] and w2 [E, n, d]: their ranks, float dtypes, and shapes against the rows they
  multiply (`rows`, named rows_name: d wide, their dtype) and E (from the argument
  experts_from; None: w1's own); errors name the argument and where the expected size comes
  from. Returns n."""
  validation.check_rank("w1", w1, 3, "[E, d, 2n]")
  validation.check_rank("w2", w2, 3, "[E, n, d]")
  for name, arr in (("w1", w1), ("w2", w2)):
    validation.check_float_dtype(name, arr)
  if num_experts is None:
    num_experts = w1.shape[0]
  d = rows.shape[1]
  validation.check_dim("w1", w1.shape[0], num_experts, f"dim 0 (E, from {experts_from})")
  validation.check_dim("w1", w1.shape[1], d, f"dim 1 (d, from {rows_name})")
  if w1.shape[2] % 2:
    raise ValueError(f"w1: dim 2 (2n: gate and up halves) must be even; got {w1.shape[2]}")
  n = w1.shape[2] // 2
  validation.check_dim("w2", w2.shape[0], num_experts, f"dim 0 (E, from {experts_from})")
  validation.check_dim("w2", w2.shape[1], n, "dim 1 (n, half of w1's dim 2)")
  validation.check_dim("w2", w2.shape[2], d, f"dim 2 (d, from {rows_name})")
  for name, arr in (("w1", w1), ("w2", w2)):
    if arr.dtype != rows.dtype:
      raise TypeError(f"{name} must have {rows_name}'s dtype {rows.dtype}; got {arr.dtype}")
  return n


def moe(x, router_w, w1, w2, *, k: int, score_fn: str = "softmax_topk",
        renormalize: bool = False, rounding: Optional[str] = None, tile: int = 128,
        rng=None, backend: backends.BackendSpec = "auto",
        windows: Optional[int | tuple[int, int]] = None,
        kernel_config: Optional[Mapping[str, Hashable]] = None) -> MoEOutput:
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
      column windows (of d), each summed per token into its columns of the output before the
      next is made: the layer's peak memory then holds one window of the [T*K, d] product
      instead of all of it, for one more GEMM launch per window and one more read of the
      GEMM's left operand (A [slots, n]; dH [slots, 2n]). The step's peak shrinks only where
      that product is the peak, as with the cute backend's stores: on the pallas backend,
      whose backward also gathers rows of dO and X into [T*K, d] copies, windows leave it as it
      is. 1: no windows. At most d / WINDOW_COLUMN_ALIGN (128). A
      pair (forward, backward): Y's windows and dX~'s (the step's peak is the larger of the
      two passes'). None (default): the measured choice
      (backends.default_windows: two where the store GEMMs run on cute and d >= 2n, else one;
      one where the width the kernels run d at, padded as below, is not a multiple of 128 or
      is too narrow for them).
      Widths the chosen kernels do not tile (d or n not a multiple of 128 on cute, of 64 on
      pallas) run zero-padded up to their multiple, the output cut back to d columns: the
      numbers are the unpadded layer's (core/padding.py).

    kernel_config: {backend name: its kernel configuration} for the ops that run on that
      backend, e.g. {"cute": ffi.config.CuteConfig(store_cluster_n=2)} or {"pallas":
      pallas_kernels.config.PallasConfig(...)}: immutable data, part of what a jitted call is
      cached on. None (default): each backend's measured defaults.
  Returns:
    MoEOutput(out [T, d] in x's dtype, plan, stats). Differentiable in x, router_w, w1, w2.
  """
  x, router_w, w1, w2 = as_arrays(x=x, router_w=router_w, w1=w1, w2=w2)
  _check_inputs(x, router_w, w1, w2)
  ops = backends.resolve(backend, dtype=x.dtype, d=x.shape[1], n=w2.shape[1],
                         num_experts=router_w.shape[1], k=k,
                         token_rounding=rounding not in (None, "none"), kernel_config=kernel_config)
  logits = routing.router_logits(x, router_w)
  plan, stats = routing.route(logits, k=k, score_fn=score_fn, renormalize=renormalize,
                              rounding=rounding, tile=tile, rng=rng, align=ops.align,
                              top_k=ops.top_k, rounded_slots=ops.rounded_slots)
  plan_arrays = dataclasses.replace(plan, scores=jax.lax.stop_gradient(plan.scores))
  out = run_experts(ops, x, plan.scores, w1, w2, plan_arrays,
                    resolve_windows(windows, ops, x.shape[1]))
  return MoEOutput(out=out, plan=plan, stats=stats)
