"""examples/grouped_dispatch.py (an expert-parallel block with its own dispatch around
grouped_expert_mlp) on 8 virtual CPU devices against the single-device layer. XLA:CPU has no
ragged_all_to_all, so the test runs the example over an exact emulation of it built from
all_gather (each device copies its chunk out of every source's rows)."""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh

import sonicmoe_jax as sm
from conftest import make_inputs, rel_err
from examples import grouped_dispatch

assert jax.device_count() == 8, "run with --xla_force_host_platform_device_count=8"


def emulated_ragged_all_to_all(operand, output, input_offsets, send_sizes, output_offsets,
                               recv_sizes, *, axis_name):
  """jax.lax.ragged_all_to_all's result: source s's chunk for me (its rows input_offsets_s[me]
  .. + send_sizes_s[me]) lands at output rows output_offsets_s[me] .. of mine."""
  del recv_sizes
  me = jax.lax.axis_index(axis_name)
  gathered = [jax.lax.all_gather(v, axis_name) for v in
              (operand, input_offsets, send_sizes, output_offsets)]
  rows = jnp.arange(operand.shape[0])
  for source in range(gathered[0].shape[0]):
    src_rows, src_in, src_sizes, src_out = (g[source] for g in gathered)
    take = rows < src_sizes[me]
    dest = jnp.where(take, src_out[me] + rows, output.shape[0])
    values = src_rows.at[src_in[me] + rows].get(mode="fill", fill_value=0)
    output = output.at[dest].set(values, mode="drop")
  return output


@pytest.mark.parametrize("devices", [1, 4, 8])
def test_grouped_dispatch_example_equals_the_layer(devices, monkeypatch):
  monkeypatch.setattr(jax.lax, "ragged_all_to_all", emulated_ragged_all_to_all)
  tokens, d, n, num_experts, k = 16 * devices, 32, 16, 2 * devices, 2
  args = make_inputs(devices, tokens, d, n, num_experts)
  mesh = Mesh(np.array(jax.devices()[:devices]), ("ep",))
  block = jax.jit(functools.partial(grouped_dispatch.moe_block, mesh=mesh, k=k))
  single = jax.jit(lambda *a: sm.moe(*a, k=k).out)
  assert rel_err(block(*args), single(*args)) < 1e-4
  cot = jax.random.normal(jax.random.key(2), (tokens, d))
  grads = lambda f: jax.jit(jax.grad(lambda *a: jnp.sum(f(*a) * cot), argnums=(0, 1, 2, 3)))(*args)
  for name, a, b in zip(("dx", "drouter_w", "dw1", "dw2"), grads(block), grads(single)):
    assert rel_err(a, b) < 1e-4, name
