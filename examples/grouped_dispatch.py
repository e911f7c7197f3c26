"""An expert-parallel MoE block with its own dispatch, running sonicmoe-jax's expert computation.

The block routes its local tokens, sends each (token, expert) row to the device that owns the
expert with `jax.lax.ragged_all_to_all`, runs `sonicmoe_jax.grouped_expert_mlp` on the rows it
receives (grouped by local expert), sends the weighted outputs back and sums them per token.
Only the expert computation is ours: the routing and the transport are the block's, as in a
framework that does its own dispatch. ragged_all_to_all runs on GPUs and TPUs (XLA:CPU lacks
it).

  python -m examples.grouped_dispatch      # on the GPUs present: checks it against sonicmoe_jax.moe
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, PartitionSpec as P

import sonicmoe_jax as sm


def _exclusive_cumsum(v, axis=0):
  return jnp.cumsum(v, axis=axis) - v


def _local_block(x, router_w, w1, w2, *, k: int, axis: str):
  """Per device: x [T, d] its tokens, w1 [E_local, d, 2n] and w2 [E_local, n, d] its experts."""
  num_tokens, num_experts = x.shape[0], router_w.shape[1]
  local_experts, devices = w1.shape[0], num_experts // w1.shape[0]
  logits = x.astype(jnp.float32) @ router_w.astype(jnp.float32)
  top_logits, top_experts = jax.lax.top_k(logits, k)
  pair_scores = jax.nn.softmax(top_logits, axis=-1).reshape(-1)
  pair_experts = top_experts.reshape(-1)
  pair_tokens = jnp.arange(num_tokens * k) // k

  # send: pairs sorted by expert (so by destination device), then the row exchange
  order = jnp.argsort(pair_experts, stable=True)
  dest = pair_experts[order] // local_experts
  send_sizes = jnp.zeros((devices,), jnp.int32).at[dest].add(1)
  sizes = jax.lax.all_gather(send_sizes, axis)                 # [source, destination]
  me = jax.lax.axis_index(axis)
  recv_sizes = sizes[:, me]
  capacity = devices * num_tokens * k                            # every row could come here

  def to_experts(values):
    out = jnp.zeros((capacity, *values.shape[1:]), values.dtype)
    return jax.lax.ragged_all_to_all(values[order], out, _exclusive_cumsum(send_sizes),
                                     send_sizes, _exclusive_cumsum(sizes, 0)[me], recv_sizes,
                                     axis_name=axis)

  rows = to_experts(x[pair_tokens])
  row_scores = to_experts(pair_scores)
  row_experts = to_experts(pair_experts % local_experts)         # the receiver's local ids
  # rows arrive grouped by source; group them by local expert (the unused rows last)
  live = jnp.arange(capacity) < jnp.sum(recv_sizes)
  regroup = jnp.argsort(jnp.where(live, row_experts, local_experts), stable=True)
  group_sizes = jnp.zeros((local_experts + 1,), jnp.int32).at[
      jnp.where(live, row_experts, local_experts)].add(1)[:local_experts]
  out_rows = sm.grouped_expert_mlp(rows[regroup], row_scores[regroup], w1, w2, group_sizes)
  out_rows = jnp.zeros_like(out_rows).at[regroup].set(out_rows)

  # return: the reverse exchange, then each token's rows summed
  back = jax.lax.ragged_all_to_all(out_rows, jnp.zeros((num_tokens * k, x.shape[1]), x.dtype),
                                   _exclusive_cumsum(recv_sizes), recv_sizes,
                                   _exclusive_cumsum(sizes, 1)[:, me], send_sizes,
                                   axis_name=axis)
  pairs = jnp.zeros_like(back).at[order].set(back)
  return pairs.reshape(num_tokens, k, -1).sum(axis=1, dtype=jnp.float32).astype(x.dtype)


def moe_block(x, router_w, w1, w2, *, mesh: Mesh, k: int, axis: str = "ep"):
  """Tokens and experts split over mesh axis `axis`; the router weight replicated."""
  block = functools.partial(_local_block, k=k, axis=axis)
  return jax.shard_map(block, mesh=mesh, in_specs=(P(axis), P(), P(axis), P(axis)),
                       out_specs=P(axis))(x, router_w, w1, w2)


def main():
  devices = np.array(jax.devices())
  mesh = Mesh(devices, ("ep",))
  tokens, d, n, num_experts, k = 1024 * len(devices), 512, 256, 8 * len(devices), 4
  keys = jax.random.split(jax.random.key(0), 4)
  x = jax.random.normal(keys[0], (tokens, d), jnp.bfloat16)
  router_w = jax.random.normal(keys[1], (d, num_experts), jnp.float32) / np.sqrt(d)
  w1 = (jax.random.normal(keys[2], (num_experts, d, 2 * n)) / np.sqrt(d)).astype(jnp.bfloat16)
  w2 = (jax.random.normal(keys[3], (num_experts, n, d)) / np.sqrt(n)).astype(jnp.bfloat16)
  ours = jax.jit(functools.partial(moe_block, mesh=mesh, k=k))(x, router_w, w1, w2)
  single = jax.jit(lambda *a: sm.moe(*a, k=k).out)(x, router_w, w1, w2)
  err = float(jnp.linalg.norm((ours - single).astype(jnp.float32))
              / jnp.linalg.norm(single.astype(jnp.float32)))
  print(f"{len(devices)} device(s): relative difference to sonicmoe_jax.moe {err:.2e}")
  return err


if __name__ == "__main__":
  main()
