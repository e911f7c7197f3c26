"""Expert parallelism on JAX's SPMD engine: the SonicMoE layer under `jax.shard_map`.

Layout over a `jax.sharding.Mesh`: tokens are split over every mesh axis in `token_axes`
(data axes plus the expert axis), experts over `expert_axis` (E / ep experts per shard, the
expert weights replicated over the other axes), the router weight replicated.

Per device: route the local tokens over all E experts (token rounding, when on, rounds the
local counts, so every global count is a tile multiple too; each expert's global count then
moves by less than tile x number of token shards); send each (token, expert) row to the shard
owning the expert with a padded `all_to_all` (capacity per destination: every local pair by
default, so nothing is ever dropped); run the local experts as a K=1 layer over the received
rows (the same backend ops as the single-device layer); send the weighted rows back; sum each
token's rows (gather-and-sum).

The expert part is the single-device layer's own custom_vjp (layer.expert_mlp) run over the
received rows with ExpertParallelRows as its dispatch: it keeps X (local tokens), H (received
rows) and the integer plans; the backward mirrors the forward (dO out, dX~ and dS back) and
sends the X rows again for dW1 instead of keeping them, so no [T*K, d] array is kept here
either. Its column windows and the order of its backward are the single-device layer's.
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Hashable, Mapping, Optional, Sequence

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from sonicmoe_jax import backends, layer
from sonicmoe_jax.core import routing, validation, xla_ops
from sonicmoe_jax.core.varying import varying, vary_like
from sonicmoe_jax.core.routing import RoutingPlan


def _exchange(v, axis):
  return jax.lax.all_to_all(v, axis, 0, 0, tiled=True)


def _sort_by_destination(plan: RoutingPlan, ep: int, experts_per_shard: int):
  """(order: slots sorted by destination shard, invalid last; the sorted destinations; rows
  per destination [ep])."""
  dest = jnp.where(plan.valid, plan.expert_index // experts_per_shard, ep)
  order = jnp.argsort(dest, stable=True).astype(jnp.int32)
  counts = jnp.zeros((ep + 1,), jnp.int32).at[dest].add(1)[:ep]
  return order, dest[order], counts


def _exclusive_cumsum(v, axis=-1):
  return jnp.cumsum(v, axis=axis) - v


@dataclasses.dataclass(frozen=True)
class PaddedTransport:
  """Rows travel in a [ep, capacity] buffer per device through jax.lax.all_to_all.
  send_slot[j, r]: the local slot sent to shard j as row r (num_slots = none);
  slot_dest, slot_row: each slot's (shard, row), shard = ep when not sent."""
  send_slot: jax.Array
  slot_dest: jax.Array
  slot_row: jax.Array
  axis: str = dataclasses.field(metadata=dict(static=True))

  @classmethod
  def build(cls, plan, ep, experts_per_shard, capacity, axis):
    order, sorted_dest, counts = _sort_by_destination(plan, ep, experts_per_shard)
    starts = jnp.concatenate([_exclusive_cumsum(counts), jnp.zeros((1,), jnp.int32)])
    row = jnp.arange(order.shape[0], dtype=jnp.int32) - starts[sorted_dest]
    keep = (sorted_dest < ep) & (row < capacity)
    send = jnp.full((ep, capacity), plan.num_slots, jnp.int32).at[
        jnp.where(keep, sorted_dest, ep), jnp.where(keep, row, 0)].set(order, mode="drop")
    slot_dest = jnp.full((plan.num_slots,), ep, jnp.int32).at[order].set(jnp.where(keep, sorted_dest, ep))
    slot_row = jnp.zeros((plan.num_slots,), jnp.int32).at[order].set(jnp.where(keep, row, 0))
    return cls(send, slot_dest, slot_row, axis)

  @property
  def num_rows(self):
    return self.send_slot.size

  def to_experts(self, values):
    """values [num_slots, ...] at the token side -> [num_rows, ...] at the expert side."""
    rows = values.at[self.send_slot].get(mode="fill", fill_value=0)
    rows = _exchange(rows, self.axis)
    return rows.reshape(-1, *rows.shape[2:])

  def to_tokens(self, rows):
    """[num_rows, ...] at the expert side -> [num_slots, ...] back at the token side."""
    rows = _exchange(rows.reshape(*self.send_slot.shape, *rows.shape[1:]), self.axis)
    return rows.at[self.slot_dest, self.slot_row].get(mode="fill", fill_value=0)

  def dropped(self, plan):
    return jnp.sum(plan.valid & (self.slot_dest >= self.send_slot.shape[0]))


@dataclasses.dataclass(frozen=True)
class RaggedTransport:
  """Only real rows travel, through jax.lax.ragged_all_to_all (GPU/TPU; XLA:CPU lacks it).
  Rows leave sorted by destination (order) and arrive grouped by source; the receive buffer
  has room for every device's slots (ep x num_slots rows), so nothing is dropped."""
  order: jax.Array
  slot_pos: jax.Array
  send_sizes: jax.Array
  send_offsets: jax.Array
  remote_offsets: jax.Array    # where my rows land in each receiver's buffer
  recv_sizes: jax.Array
  recv_offsets: jax.Array
  return_offsets: jax.Array    # where each source's rows land back in its sorted buffer
  axis: str = dataclasses.field(metadata=dict(static=True))

  @classmethod
  def build(cls, plan, ep, experts_per_shard, capacity, axis):
    del capacity
    order, _, counts = _sort_by_destination(plan, ep, experts_per_shard)
    me = jax.lax.axis_index(axis)
    sizes = jax.lax.all_gather(counts, axis)                     # [source, destination]
    slot_pos = jnp.zeros((plan.num_slots,), jnp.int32).at[order].set(
        jnp.arange(plan.num_slots, dtype=jnp.int32))
    return cls(order=order, slot_pos=jnp.where(plan.valid, slot_pos, plan.num_slots),
               send_sizes=counts, send_offsets=_exclusive_cumsum(counts),
               remote_offsets=_exclusive_cumsum(sizes, axis=0)[me],
               recv_sizes=sizes[:, me], recv_offsets=_exclusive_cumsum(sizes[:, me]),
               return_offsets=_exclusive_cumsum(sizes, axis=1)[:, me], axis=axis)

  @property
  def num_rows(self):
    return self.send_sizes.shape[0] * self.order.shape[0]

  def to_experts(self, values):
    out = jnp.zeros((self.num_rows, *values.shape[1:]), values.dtype)
    return jax.lax.ragged_all_to_all(values[self.order], out, self.send_offsets, self.send_sizes,
                                     self.remote_offsets, self.recv_sizes, axis_name=self.axis)

  def to_tokens(self, rows):
    out = jnp.zeros((self.order.shape[0], *rows.shape[1:]), rows.dtype)
    back = jax.lax.ragged_all_to_all(rows, out, self.recv_offsets, self.recv_sizes,
                                     self.return_offsets, self.send_sizes, axis_name=self.axis)
    return back.at[self.slot_pos].get(mode="fill", fill_value=0)

  def dropped(self, plan):
    return jnp.zeros((), jnp.int32)


jax.tree_util.register_dataclass(PaddedTransport)
jax.tree_util.register_dataclass(RaggedTransport)
TRANSPORTS = {"padded": PaddedTransport, "ragged": RaggedTransport}


@dataclasses.dataclass(frozen=True)
class ExpertParallelRows:
  """layer.expert_mlp's dispatch across devices (see layer.LocalRows for the protocol): each
  (token, expert) row travels to the device that owns the expert (`transport`) and its
  output comes back, summed per token over the token-side `plan`. The expert-side plan that
  expert_mlp runs is a K=1 plan over the received rows. The expert weights are replicated over
  `data_axes`, so their gradients are summed over them."""
  plan: RoutingPlan          # the token side's (token, expert) slots
  transport: object          # PaddedTransport or RaggedTransport
  data_axes: tuple = dataclasses.field(metadata=dict(static=True))

  def rows(self, values):
    return self.transport.to_experts(xla_ops.gather_rows(values, self.plan.token_index))

  def slot_scores(self, scores, plan):
    return xla_ops.gather_rows(self.transport.to_experts(scores), plan.token_index)

  def slot_scores_grad(self, dscores, plan):
    num_rows = self.transport.num_rows
    rows = jnp.zeros((num_rows + 1,), jnp.float32).at[plan.token_index].add(dscores)[:num_rows]
    return self.transport.to_tokens(rows)

  def combine(self, ops, rows):
    return ops.aggregate(self.transport.to_tokens(rows), None, self.plan)

  def weight_grads(self, dw1, dw2):
    if not self.data_axes:
      return dw1, dw2
    return tuple(jax.lax.psum(g.astype(jnp.float32), self.data_axes) for g in (dw1, dw2))

  def finish(self, grads, primals):
    # a Pallas kernel's outputs carry no varying-axes type under shard_map: restore the primals'
    return tuple(vary_like(g, p) for g, p in zip(grads, primals))


jax.tree_util.register_dataclass(ExpertParallelRows)


def _ep_layer(x, router_w, w1, w2, rng, *, ops, k, expert_axis, token_axes, capacity_factor,
              transport, route_kw, windows):
  ep = jax.lax.psum(1, expert_axis)
  experts_per_shard = w1.shape[0]
  logits = routing.router_logits(x, varying(router_w, token_axes))
  if rng is not None:  # a different stochastic-rounding draw on every token shard
    for a in token_axes:
      rng = jax.random.fold_in(rng, jax.lax.axis_index(a))
  # XLA's top_k here, not ops.top_k: Pallas outputs carry no varying-axis type under shard_map
  plan, stats = routing.route(logits, k=k, rng=rng, **route_kw)
  capacity = plan.num_slots if capacity_factor is None else max(
      1, int(capacity_factor * plan.num_slots / ep + 0.999))
  route_rows = TRANSPORTS[transport].build(plan, ep, experts_per_shard, capacity, expert_axis)
  # each row's local expert + 1 (0 marks an empty row of the receive buffer)
  tagged = jnp.where(plan.valid, plan.expert_index % experts_per_shard + 1, 0).astype(jnp.int32)
  recv_tag = route_rows.to_experts(tagged)
  recv_expert = jnp.where(recv_tag > 0, recv_tag - 1, experts_per_shard)
  recv_plan = routing.plan_from_experts(recv_expert[:, None], jnp.zeros((route_rows.num_rows, 1)),
                                        experts_per_shard, align=ops.align)
  arrays = dataclasses.replace(plan, scores=jax.lax.stop_gradient(plan.scores))
  dispatch = ExpertParallelRows(arrays, route_rows,
                                tuple(a for a in token_axes if a != expert_axis))
  out = layer.run_experts(ops, x, plan.scores, w1, w2, recv_plan, windows, dispatch)
  dropped = route_rows.dropped(plan)
  topk_counts = jax.lax.psum(stats.topk_counts, token_axes)
  mean_prob = jax.lax.pmean(jnp.mean(jax.nn.softmax(logits, axis=-1), axis=0), token_axes)
  global_stats = dataclasses.replace(
      stats,
      topk_counts=topk_counts,
      expert_counts=jax.lax.psum(stats.expert_counts, token_axes),
      changed_pairs=jax.lax.psum(stats.changed_pairs, token_axes),
      # of the global batch: its T k pairs are what the global counts sum to
      load_balancing_loss=routing.switch_loss(
          topk_counts.astype(jnp.float32) / jnp.sum(topk_counts), mean_prob),
      z_loss=jax.lax.pmean(stats.z_loss, token_axes))
  return out, global_stats, jax.lax.psum(dropped, token_axes)


def moe_expert_parallel(x, router_w, w1, w2, *, mesh: jax.sharding.Mesh, k: int,
                        expert_axis: str = "expert", data_axes: Sequence[str] = ("data",),
                        score_fn: str = "softmax_topk", renormalize: bool = False,
                        rounding: Optional[str] = None, tile: int = 128, rng=None,
                        capacity_factor: Optional[float] = None, transport: str = "padded",
                        backend: backends.BackendSpec = "auto",
                        windows: Optional[int | tuple[int, int]] = None,
                        kernel_config: Optional[Mapping[str, Hashable]] = None):
  """The SonicMoE layer with experts sharded over `expert_axis` of `mesh`.

  Args are those of `sonicmoe_jax.moe` (windows and kernel_config too: the expert computation
    is moe's, layer.expert_mlp, on the received rows; global shapes: x [T, d], w1 [E, d, 2n], ...) plus
    mesh: the device mesh; expert_axis: the axis experts are split over (E must be a multiple
      of its size); data_axes: further axes tokens are split over (T must be a multiple of the
      product of all token-axis sizes).
    capacity_factor: rows each device may send to one expert shard, as a multiple of its
      slots / ep. None (default) sends up to all of them: never drops, costs ep x the buffer.
      With a factor, pairs beyond capacity are dropped and counted in `dropped_pairs`.
    transport: "padded" (jax.lax.all_to_all of [ep, capacity] buffers; runs everywhere) or
      "ragged" (jax.lax.ragged_all_to_all: only real rows travel; GPU/TPU only).
  Returns:
    (out [T, d], RouterStats with global counts, dropped_pairs).
  """
  x, router_w, w1, w2 = layer.as_arrays(x=x, router_w=router_w, w1=w1, w2=w2)
  layer._check_inputs(x, router_w, w1, w2)
  names = mesh.axis_names
  data_axes = tuple(a for a in data_axes if a != expert_axis)
  for a in (expert_axis, *data_axes):
    if a not in names:
      raise ValueError(f"mesh has no axis {a!r}; its axes are {names}")
  ep = mesh.shape[expert_axis]
  num_experts = w1.shape[0]
  if num_experts % ep:
    raise ValueError(f"w1: E={num_experts} experts must be a multiple of the '{expert_axis}' "
                     f"axis size {ep}")
  token_axes = (*data_axes, expert_axis)
  shards = 1
  for a in token_axes:
    shards *= mesh.shape[a]
  if x.shape[0] % shards:
    raise ValueError(f"x: T={x.shape[0]} tokens must be a multiple of the {shards} token shards "
                     f"(mesh axes {token_axes})")
  validation.check_choice("transport", transport, tuple(TRANSPORTS))
  ops = backends.resolve(backend, dtype=x.dtype, d=x.shape[1], n=w2.shape[1],
                         num_experts=router_w.shape[1], k=k, kernel_config=kernel_config)
  route_kw = dict(score_fn=score_fn, renormalize=renormalize, rounding=rounding, tile=tile)
  windows = layer.resolve_windows(windows, ops, x.shape[1])
  body = functools.partial(_ep_layer, ops=ops, k=k, expert_axis=expert_axis, token_axes=token_axes,
                           windows=windows,
                           capacity_factor=capacity_factor, transport=transport, route_kw=route_kw)
  tok = P(token_axes)
  rng_spec = None if rng is None else P()
  fn = jax.shard_map(
      body, mesh=mesh,
      in_specs=(tok, P(), P(expert_axis), P(expert_axis), rng_spec),
      out_specs=(tok, P(), P()))
  return fn(x, router_w, w1, w2, rng)


def expert_parallel_bytes_per_token(d: int, k: int, itemsize: int = 2) -> dict:
  """Communication per token per layer (each direction of one all_to_all moves k rows of d):
  forward sends X rows out and Y rows back; backward sends dO out, dX~ back and X out again."""
  row = k * d * itemsize
  return dict(forward=2 * row, backward=3 * row, total=5 * row)
