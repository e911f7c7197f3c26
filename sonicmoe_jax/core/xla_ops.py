"""Backend "xla": the expert ops in plain JAX (gathers + grouped GEMMs + gather-and-sum).

Runs on any platform and is the reference every other backend is tested against. Op
signatures are the dispatch table's (see backends.py). Padding slots of the plan gather zero
rows, so every output row of a padding slot is exactly zero.

The grouped GEMMs are jax.lax.ragged_dot on TPUs. On GPUs XLA computes ragged_dot as every
group's dense product (E times the FLOPs and memory; at production sizes its autotuner fails),
so there they run as batched GEMMs over 128-row tiles, a chunk of tiles at a time
(tiled_grouped.py). On a CPU XLA also computes ragged_dot densely, so where the CPU platform
has one device each expert's rows are multiplied by its weights alone, in float32, by NumPy
through jax.pure_callback (grouped_matmul_host, grouped_weight_grad_host): FLOPs as the math
counts them, and jax.vmap runs it once per batch element. With several CPU devices (a mesh of
them) the collectives between them would wait on the callbacks: ragged_dot runs there.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from sonicmoe_jax.core import swiglu, tiled_grouped
from sonicmoe_jax.core.varying import vary_like
from sonicmoe_jax.core import routing
from sonicmoe_jax.core.routing import RoutingPlan

_F32 = jnp.float32


def gather_rows(x, index):
  """x[index] with rows for out-of-range indices (padding slots) filled with zeros.

  Rows of 16-bit elements are gathered as 32-bit words (pairs of elements): XLA's gather then
  moves half as many, twice as wide elements, which runs faster on the GPU. Zero words are
  zero elements.
  """
  if x.ndim != 2 or x.dtype.itemsize != 2 or x.shape[1] % 2:
    return x.at[index].get(mode="fill", fill_value=0)
  rows, width = x.shape
  words = jax.lax.bitcast_convert_type(x.reshape(rows, width // 2, 2), jnp.uint32)
  out = words.at[index].get(mode="fill", fill_value=0)
  return jax.lax.bitcast_convert_type(out, x.dtype).reshape(index.shape[0], width)


def output_window(w, cols, axis: int):
  """Weights w cut to the output columns cols=(lo, hi) of the product they make (their
  `axis`), or w itself (cols None): down_proj and dx_tilde's column windows."""
  if cols is None:
    return w
  return jax.lax.slice_in_dim(w, cols[0], cols[1], axis=axis)


def _group_bounds(group_sizes):
  """(expert, first row, end row) of each expert with rows, groups laid out from row 0."""
  ends = np.cumsum(np.asarray(group_sizes, np.int64))
  return [(e, end - size, end) for e, (size, end) in enumerate(zip(np.asarray(group_sizes), ends))
          if size > 0]


def _numpy_grouped_matmul(lhs, rhs, group_sizes):
  out = np.zeros((lhs.shape[0], rhs.shape[2]), np.float32)
  for e, lo, hi in _group_bounds(group_sizes):
    out[lo:hi] = np.asarray(lhs[lo:hi], np.float32) @ np.asarray(rhs[e], np.float32)
  return out


def _numpy_grouped_weight_grad(lhs, rhs, group_sizes):
  out = np.zeros((group_sizes.shape[0], lhs.shape[1], rhs.shape[1]), np.float32)
  for e, lo, hi in _group_bounds(group_sizes):
    out[e] = np.asarray(lhs[lo:hi], np.float32).T @ np.asarray(rhs[lo:hi], np.float32)
  return out


@jax.custom_vjp
def grouped_matmul_host(lhs, rhs, group_sizes):
  """The varlen-M grouped GEMM computed on the host, group by group (float32); differentiable
  (its gradients are grouped GEMMs on the host too)."""
  shape = jax.ShapeDtypeStruct((lhs.shape[0], rhs.shape[2]), _F32)
  out = jax.pure_callback(_numpy_grouped_matmul, shape, lhs, rhs, group_sizes,
                          vmap_method="sequential")
  return vary_like(out, lhs, rhs, group_sizes)   # (as ragged_dot's under shard_map)


@jax.custom_vjp
def grouped_weight_grad_host(lhs, rhs, group_sizes):
  """The varlen-K grouped GEMM computed on the host, group by group (float32); differentiable."""
  shape = jax.ShapeDtypeStruct((group_sizes.shape[0], lhs.shape[1], rhs.shape[1]), _F32)
  out = jax.pure_callback(_numpy_grouped_weight_grad, shape, lhs, rhs, group_sizes,
                          vmap_method="sequential")
  return vary_like(out, lhs, rhs, group_sizes)


def _matmul_host_fwd(lhs, rhs, group_sizes):
  return grouped_matmul_host(lhs, rhs, group_sizes), (lhs, rhs, group_sizes)


def _matmul_host_bwd(res, dout):
  lhs, rhs, group_sizes = res   # out = lhs_e rhs_e: dlhs_e = dout_e rhs_e^T, drhs_e = lhs_e^T dout_e
  dlhs = grouped_matmul_host(dout, jnp.swapaxes(rhs, 1, 2), group_sizes)
  drhs = grouped_weight_grad_host(lhs, dout, group_sizes)
  return dlhs.astype(lhs.dtype), drhs.astype(rhs.dtype), None


def _weight_grad_host_fwd(lhs, rhs, group_sizes):
  return grouped_weight_grad_host(lhs, rhs, group_sizes), (lhs, rhs, group_sizes)


def _weight_grad_host_bwd(res, dout):
  lhs, rhs, group_sizes = res   # out_e = lhs_e^T rhs_e: dlhs_e = rhs_e dout_e^T, drhs_e = lhs_e dout_e
  dlhs = grouped_matmul_host(rhs, jnp.swapaxes(dout, 1, 2), group_sizes)
  drhs = grouped_matmul_host(lhs, dout, group_sizes)
  return dlhs.astype(lhs.dtype), drhs.astype(rhs.dtype), None


grouped_matmul_host.defvjp(_matmul_host_fwd, _matmul_host_bwd)
grouped_weight_grad_host.defvjp(_weight_grad_host_fwd, _weight_grad_host_bwd)


def _ragged_matmul(lhs, rhs, group_sizes):
  return jax.lax.ragged_dot(lhs, rhs, group_sizes, preferred_element_type=_F32)


def _ragged_weight_grad(lhs, rhs, group_sizes):
  dims = jax.lax.RaggedDotDimensionNumbers(
      dot_dimension_numbers=(((0,), (0,)), ((), ())),
      lhs_ragged_dimensions=[0], rhs_group_dimensions=[])
  return jax.lax.ragged_dot_general(lhs, rhs, group_sizes, dims, preferred_element_type=_F32)


def _one_cpu_device() -> bool:
  """Whether the CPU platform has one device (where the host path runs)."""
  try:
    return len(jax.devices("cpu")) == 1
  except RuntimeError:
    return False


def grouped_matmul(lhs, rhs, group_sizes):
  """Varlen-M grouped GEMM, fp32: out[r] = lhs[r] @ rhs[g] for group g's rows (groups laid out
  from row 0, as jax.lax.ragged_dot), by the platform's formulation (module docstring)."""
  return jax.lax.platform_dependent(
      lhs, rhs, group_sizes,
      cpu=grouped_matmul_host if _one_cpu_device() else _ragged_matmul,
      cuda=tiled_grouped.grouped_matmul, rocm=tiled_grouped.grouped_matmul,
      default=_ragged_matmul)


def grouped_weight_grad(lhs, rhs, group_sizes):
  """Varlen-K grouped GEMM, fp32 [G, a, b]: out[g] = lhs_g^T rhs_g over group g's rows."""
  return jax.lax.platform_dependent(
      lhs, rhs, group_sizes,
      cpu=grouped_weight_grad_host if _one_cpu_device() else _ragged_weight_grad,
      cuda=tiled_grouped.grouped_weight_grad, rocm=tiled_grouped.grouped_weight_grad,
      default=_ragged_weight_grad)


def _grouped_matmul(lhs, rhs, plan: RoutingPlan):
  """Slot rows of expert e times rhs[e], fp32."""
  return grouped_matmul(lhs, rhs, plan.padded_group_sizes)


def _grouped_weight_grad(lhs, rhs, plan: RoutingPlan):
  """out[e] = lhs_e^T rhs_e over expert e's slots, fp32 [E, a, b]."""
  return grouped_weight_grad(lhs, rhs, plan.padded_group_sizes)


def top_k(logits, k: int):
  """The router's top-K: (values [T, k], experts [T, k] int32), ties to the lower expert."""
  return jax.lax.top_k(logits, k)


def rounded_slots(values, counts, offsets, num_slots: int):
  """Token rounding's selection placed in the plan's slots (routing.rounded_slots)."""
  return routing.rounded_slots(values, counts, offsets, num_slots)


def up_proj(x, w1, plan: RoutingPlan):
  """H = X_e W1_e and A = SwiGLU(H) per expert, rows gathered by plan.token_index."""
  h = _grouped_matmul(gather_rows(x, plan.token_index), w1, plan)
  return h.astype(x.dtype), swiglu.forward(h).astype(x.dtype)


def down_proj(a, w2, plan: RoutingPlan, cols=None):
  """Y = A_e W2_e per expert, contiguous in slot order; with cols=(lo, hi) Y's columns
  lo .. hi - 1 only (W2's columns sliced)."""
  return _grouped_matmul(a, output_window(w2, cols, 2), plan).astype(a.dtype)


def aggregate(y, scores, plan: RoutingPlan, into=None):
  """O_t = sum over token t's slots of score * Y_slot (fp32 sum); scores=None sums plainly.
  into=(out, lo): the sums as columns lo .. of a wider result, returned whole (out: its width,
  a new result with zeros elsewhere, or an earlier window's result); the layer's windows
  concatenate this backend's sums instead, which XLA fuses.

  A gather-and-sum, never a scatter: with a variable slot count per token (token rounding),
  tokens' slots are read in column blocks of k (slot j of token t in block j // k), as many
  blocks as the busiest token needs (usually two: rounding adds fewer than a tile of tokens
  per expert), or where the plan bounds a token's slots (plan.max_token_slots: plans from
  given assignments) that many, unrolled.
  """
  sums = _aggregate(y, scores, plan)
  return sums if into is None else write_window(*into, sums)


def write_window(out, lo: int, sums):
  """sums [..., T, d] as columns lo .. lo + d of out [..., T, D], returned whole; out as an int
  D: a new result, zeros outside the window."""
  if isinstance(out, int):
    out = jnp.zeros((*sums.shape[:-1], out), sums.dtype)
  return jax.lax.dynamic_update_slice_in_dim(out, sums, lo, axis=-1)


def _aggregate(y, scores, plan: RoutingPlan):
  if plan.fixed_k:  # every token has exactly k slots
    rows = y.astype(_F32)
    if scores is not None:
      rows = rows * scores[:, None]
    out = jnp.sum(rows[plan.token_slots].reshape(plan.num_tokens, plan.k, -1), axis=1)
    return out.astype(y.dtype)
  starts = plan.token_offsets[:-1]
  counts = plan.token_offsets[1:] - starts
  column = jnp.arange(plan.k, dtype=jnp.int32)
  num_rows = y.shape[0]

  def block_sum(b):  # token t's slots b*k .. b*k+k-1 (zero rows past its count), summed
    j = b * plan.k + column[None, :]                                      # [T, k]
    slot = plan.token_slots[jnp.minimum(starts[:, None] + j, num_rows - 1)]
    slot = jnp.where(j < counts[:, None], slot, num_rows)
    # a plain gather, not gather_rows: XLA fuses it into the sum (the word view it would not)
    block = y.at[slot].get(mode="fill", fill_value=0).astype(_F32)        # [T, k, d]
    if scores is not None:
      block = block * scores.at[slot].get(mode="fill", fill_value=0)[..., None]
    return jnp.sum(block, axis=1)

  if plan.max_token_slots is not None:   # as many blocks as a token can fill: no device loop
    out = block_sum(0)
    for b in range(1, -(-plan.max_token_slots // plan.k)):
      out = out + block_sum(b)
    return out.astype(y.dtype)
  # the first block covers every slot of most tokens; the loop (a device while loop: a host
  # round trip per step on a GPU) only the busiest tokens' rest
  num_blocks = (jnp.max(counts) + plan.k - 1) // plan.k
  out = jax.lax.fori_loop(1, num_blocks, lambda b, acc: acc + block_sum(b), block_sum(0))
  return out.astype(y.dtype)


def dh(dout, w2, h, scores, plan: RoutingPlan):
  """The dH kernel: dA' = dO_e W2_e^T; dS = <dA', A>; dH = dSwiGLU(s dA', H); A' = s A."""
  da_prime = _grouped_matmul(gather_rows(dout, plan.token_index), jnp.swapaxes(w2, 1, 2), plan)
  s = scores[:, None]
  dh_, a = swiglu.backward(s * da_prime, h)
  dscores = jnp.where(plan.valid, jnp.sum(da_prime * a, axis=-1), 0.0)
  return dh_.astype(h.dtype), dscores, (s * a).astype(h.dtype)


def dx_tilde(dh_, w1, plan: RoutingPlan, cols=None):
  """dX~ = dH_e W1_e^T per expert, contiguous in slot order; cols as down_proj's (W1's rows
  sliced)."""
  return _grouped_matmul(dh_, jnp.swapaxes(output_window(w1, cols, 1), 1, 2),
                         plan).astype(dh_.dtype)


def dw1(x, dh_, plan: RoutingPlan):
  """dW1_e = X_e^T dH_e, X rows gathered by plan.token_index."""
  return _grouped_weight_grad(gather_rows(x, plan.token_index), dh_, plan)


def dw2(a_scaled, dout, plan: RoutingPlan):
  """dW2_e = A'_e^T dO_e, dO rows gathered by plan.token_index."""
  return _grouped_weight_grad(a_scaled, gather_rows(dout, plan.token_index), plan)


OPS = dict(top_k=top_k, rounded_slots=rounded_slots, up_proj=up_proj, down_proj=down_proj,
           aggregate=aggregate, dh=dh, dx_tilde=dx_tilde, dw1=dw1, dw2=dw2)
