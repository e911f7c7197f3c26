"""Router top-K as a CuTe DSL kernel: one warp per token, k rounds of a warp-wide argmax.

Tiling: CTA b takes tokens b * WARPS .. b * WARPS + WARPS - 1, warp w token b * WARPS + w. Lane l
holds the token's experts l, l + 32, l + 64, ... (E / 32 keys in registers; each load
instruction of the warp reads 32 neighbouring logits). A round: each lane's largest key, the
warp's largest (redux.sync max), the lowest expert holding it (redux.sync min over the lanes'
lowest such expert), and that expert's key is masked with INT32_MIN, below every key. Lane j
keeps round j's result; lanes below k store them, [k] values and experts per token.

Keys: each logit's float32 bits read as an int32 key in the order of the float values
(negative floats with their magnitude bits flipped: ordered_key, its own inverse, which turns
the chosen keys back into values), so -inf logits stay selectable and ties go to the lower
expert, as jax.lax.top_k.
"""
from __future__ import annotations

import cutlass
import cutlass.cute as cute
import jax
import jax.numpy as jnp

from ffi import xla_call

WARPS = 4                 # tokens per CTA
THREADS = 32 * WARPS
MAX_EXPERTS = 1024        # E / 32 keys per lane: 32 registers at most
MAX_K = 32                # round j's result is kept by lane j
_TAKEN = -2**31           # a taken expert's key, below every ordered key
_MAGNITUDE_BITS = 0x7FFFFFFF


def unsupported(num_experts: int, k: int):
  """Why this kernel cannot take logits with this many experts and this k, or None."""
  if num_experts % 32:
    return f"E={num_experts} is not a multiple of 32 (a warp's lanes)"
  if num_experts > MAX_EXPERTS:
    return f"E={num_experts} is above {MAX_EXPERTS}"
  if not 1 <= k <= min(num_experts, MAX_K):
    return f"k={k} must be between 1 and min(E, {MAX_K})"
  return None


@cute.jit
def ordered_key(bits):
  """An int32 key in the order of the float32 whose bits these are (its own inverse)."""
  key = bits
  if bits < 0:
    key = bits ^ cutlass.Int32(_MAGNITUDE_BITS)
  return key


@cute.kernel
def _top_k_kernel(logits: cute.Tensor, top_values: cute.Tensor, top_experts: cute.Tensor,
                  k: cutlass.Constexpr, per_lane: cutlass.Constexpr):
  keys = cute.recast_tensor(logits, cutlass.Int32)           # the float32 bits
  top_keys = cute.recast_tensor(top_values, cutlass.Int32)
  block, _, _ = cute.arch.block_idx()
  lane = cute.arch.lane_idx()
  token = block * WARPS + cute.arch.make_warp_uniform(cute.arch.warp_idx())
  if token < keys.shape[0]:
    mine = cute.make_rmem_tensor((per_lane,), cutlass.Int32)
    for i in cutlass.range_constexpr(per_lane):
      mine[i] = ordered_key(keys[token, lane + 32 * i])
    kept_key = cutlass.Int32(0)
    kept_expert = cutlass.Int32(0)
    for j in cutlass.range_constexpr(k):
      best = mine[0]
      for i in cutlass.range_constexpr(1, per_lane):
        best = cutlass.max(best, mine[i])
      best = cute.arch.warp_redux_sync(best, "max")
      # the lowest expert of this lane at the warp's best key (E if none), then the warp's
      expert = cutlass.Int32(32 * per_lane)
      for i in cutlass.range_constexpr(per_lane - 1, -1, -1):
        if mine[i] == best:
          expert = lane + 32 * i
      expert = cute.arch.warp_redux_sync(expert, "min")
      for i in cutlass.range_constexpr(per_lane):
        if lane + 32 * i == expert:
          mine[i] = cutlass.Int32(_TAKEN)
      if lane == j:
        kept_key = best
        kept_expert = expert
    if lane < k:
      top_keys[token, lane] = ordered_key(kept_key)         # the value's bits again
      top_experts[token, lane] = kept_expert


@cute.jit
def _top_k(stream, logits: cute.Tensor, top_values: cute.Tensor, top_experts: cute.Tensor,
           k: cutlass.Constexpr, per_lane: cutlass.Constexpr):
  _top_k_kernel(logits, top_values, top_experts, k, per_lane).launch(
      grid=((logits.shape[0] + WARPS - 1) // WARPS, 1, 1), block=(THREADS, 1, 1), stream=stream)


def top_k(logits, k: int):
  """(values [T, k] f32, experts [T, k] int32) of the k largest logits per row, as
  jax.lax.top_k (ties: the lower expert first). logits: [T, E] float32, E a multiple of 32 and
  at most MAX_EXPERTS, 1 <= k <= min(E, MAX_K) (see `unsupported`)."""
  if logits.ndim != 2:
    raise ValueError(f"cute top_k: logits must be [T, E]; got shape {logits.shape}")
  if logits.dtype != jnp.float32:
    raise TypeError(f"cute top_k: logits must be float32; got {logits.dtype}")
  num_tokens, num_experts = logits.shape
  reason = unsupported(num_experts, k)
  if reason:
    raise ValueError(f"cute top_k: {reason}")
  values, experts = xla_call.call(
      _top_k, [logits],
      [jax.ShapeDtypeStruct((num_tokens, k), jnp.float32),
       jax.ShapeDtypeStruct((num_tokens, k), jnp.int32)],
      k=k, per_lane=num_experts // 32)
  return values, experts
