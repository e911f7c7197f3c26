"""Expert parallelism on 8 virtual CPU devices (run by tests/test_sharding.py in its own process,
with XLA_FLAGS=--xla_force_host_platform_device_count=8). Tolerances: float32, relative 1e-4."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh

import sonicmoe_jax as sm
from sonicmoe_jax import sharding
from conftest import make_inputs, rel_err

assert jax.device_count() == 8, "run with --xla_force_host_platform_device_count=8"


def mesh(data, expert):
  devs = np.array(jax.devices()[: data * expert]).reshape(data, expert)
  return Mesh(devs, ("data", "expert"))


def _grads(fn, args, cot):
  """fn's gradients, jitted (eagerly each op of the backward compiles on its own)."""
  return jax.jit(jax.grad(lambda *a: jnp.sum(fn(*a) * cot), argnums=(0, 1, 2, 3)))(*args)


def expert_parallel(*args, **kwargs):
  """sharding.moe_expert_parallel under one jit (eagerly each op would compile on its own:
  ~30 s per test on the 2-core CI machine)."""
  return jax.jit(lambda *a: sharding.moe_expert_parallel(*a, **kwargs))(*args)


@pytest.mark.parametrize("data,expert", [(2, 4), (1, 8), (4, 2), (8, 1)])
def test_sharded_equals_single_device(data, expert):
  T, d, n, E, K = 64, 32, 16, 8, 2
  args = make_inputs(data * 10 + expert, T, d, n, E)
  cot = jax.random.normal(jax.random.key(1), (T, d))
  m = mesh(data, expert)
  ep = lambda *a: sharding.moe_expert_parallel(*a, mesh=m, k=K)[0]
  single = lambda *a: sm.moe(*a, k=K).out
  assert rel_err(jax.jit(ep)(*args), jax.jit(single)(*args)) < 1e-4
  for name, a, b in zip(("dx", "drouter", "dw1", "dw2"), _grads(jax.jit(ep), args, cot), _grads(single, args, cot)):
    assert rel_err(a, b) < 1e-4, name


@pytest.mark.parametrize("windows", [2, (1, 3)])
def test_sharded_with_column_windows_equals_single_device(windows):
  """The expert-parallel layer runs the single-device expert computation (layer.expert_mlp), so
  its column windows (forward and backward apart) give the single device's numbers: output and
  all four gradients, with one barrier per window boundary in each pass."""
  T, d, n, E, K = 64, 384, 16, 8, 2
  args = make_inputs(21, T, d, n, E)
  cot = jax.random.normal(jax.random.key(2), (T, d))
  m = mesh(2, 4)
  ep = lambda *a: sharding.moe_expert_parallel(*a, mesh=m, k=K, windows=windows)[0]
  single = lambda *a: sm.moe(*a, k=K).out
  assert rel_err(jax.jit(ep)(*args), jax.jit(single)(*args)) < 1e-4
  for name, a, b in zip(("dx", "drouter", "dw1", "dw2"), _grads(jax.jit(ep), args, cot),
                        _grads(single, args, cot)):
    assert rel_err(a, b) < 1e-4, name
  forward, backward = (windows, windows) if isinstance(windows, int) else windows
  step = jax.make_jaxpr(jax.grad(lambda *a: jnp.sum(ep(*a) * cot), argnums=(0, 2, 3)))(*args)
  assert str(step).count("optimization_barrier") >= (forward - 1) + (backward - 1) + 1


def test_one_expert_receives_everything():
  T, d, n, E, K = 64, 32, 16, 8, 1
  args = make_inputs(3, T, d, n, E, dead_experts=7)   # every token picks expert 7
  m = mesh(2, 4)
  out, stats, dropped = expert_parallel(*args, mesh=m, k=K)
  assert int(stats.topk_counts[7]) == T and int(dropped) == 0
  assert rel_err(out, jax.jit(lambda *a: sm.moe(*a, k=K).out)(*args)) < 1e-4


def test_capacity_factor_drops_and_counts():
  args = make_inputs(3, 64, 32, 16, 8, dead_experts=7)
  _, _, dropped = expert_parallel(*args, mesh=mesh(2, 4), k=1, capacity_factor=1.0)
  assert int(dropped) > 0


def test_rounding_keeps_global_counts_tile_aligned():
  T, d, n, E, K, tile = 512, 32, 16, 8, 2, 16
  args = make_inputs(4, T, d, n, E)
  out, stats, _ = expert_parallel(*args, mesh=mesh(2, 4), k=K, rounding="nearest", tile=tile)
  counts = np.asarray(stats.expert_counts)
  assert np.all(counts % tile == 0)
  assert np.all(np.abs(counts - np.asarray(stats.topk_counts)) < tile * 8)
  assert np.all(np.isfinite(np.asarray(out)))


def test_residuals_stay_minimal_under_sharding():
  T, d, n, E, K = 64, 128, 16, 8, 4
  args = make_inputs(5, T, d, n, E)
  m = mesh(2, 4)
  res = sm.saved_residuals(lambda *a: sharding.moe_expert_parallel(*a, mesh=m, k=K)[0], *args)
  for r in res:
    if r.source.startswith("argument"):
      continue
    assert not (len(r.shape) >= 2 and r.shape[-1] == d and int(np.prod(r.shape)) > T * d), r


def test_errors():
  args = make_inputs(0, 64, 32, 16, 6)
  with pytest.raises(ValueError, match="E=6 experts must be a multiple of the 'expert' axis size 4"):
    sharding.moe_expert_parallel(*args, mesh=mesh(2, 4), k=1)
  args = make_inputs(0, 60, 32, 16, 8)
  with pytest.raises(ValueError, match="T=60 tokens must be a multiple of the 8 token shards"):
    sharding.moe_expert_parallel(*args, mesh=mesh(2, 4), k=1)
  with pytest.raises(ValueError, match="mesh has no axis 'model'"):
    sharding.moe_expert_parallel(*make_inputs(0, 64, 32, 16, 8), mesh=mesh(2, 4), k=1, data_axes=("model",))


def test_aux_losses_are_those_of_the_global_batch():
  args = make_inputs(9, 64, 32, 16, 8)
  _, stats, _ = expert_parallel(*args, mesh=mesh(2, 4), k=2)
  ref = jax.jit(lambda *a: sm.moe(*a, k=2).stats)(*args)
  np.testing.assert_allclose(stats.load_balancing_loss, ref.load_balancing_loss, rtol=1e-5)
  np.testing.assert_allclose(stats.z_loss, ref.z_loss, rtol=1e-5)
  np.testing.assert_array_equal(stats.topk_counts, ref.topk_counts)


def test_ragged_transport_lowers_for_cuda():
  """transport="ragged" (jax.lax.ragged_all_to_all; XLA:CPU cannot run it) lowers for CUDA
  with forward and backward; its numbers are checked on GPUs."""
  T, d, n, E, K = 64, 32, 16, 8, 2
  args = make_inputs(0, T, d, n, E)
  m = mesh(2, 4)

  def step(*a):
    f = lambda *b: jnp.sum(sharding.moe_expert_parallel(*b, mesh=m, k=K, transport="ragged")[0])
    return jax.grad(f, argnums=(0, 1, 2, 3))(*a)

  exported = jax.export.export(
      jax.jit(step), platforms=("cuda",),
      disabled_checks=[jax.export.DisabledSafetyCheck.custom_call("ragged_all_to_all")])(
      *[jax.ShapeDtypeStruct(a.shape, a.dtype) for a in args])
  text = exported.mlir_module()
  assert text.count("ragged_all_to_all") >= 5  # rows, scores and tags out; rows back; + backward
  with pytest.raises(ValueError, match="transport must be one of"):
    sharding.moe_expert_parallel(*args, mesh=m, k=K, transport="mail")
