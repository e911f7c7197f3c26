"""The xla backend's grouped GEMMs on GPUs (sonicmoe_jax/core/tiled_grouped.py): batched GEMMs
over row tiles, against NumPy per group, on CPU; and the layer lowered for CUDA runs them
instead of ragged_dot (which XLA's GPU compiler computes densely over every group)."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import sonicmoe_jax as sm
from conftest import make_inputs
from sonicmoe_jax.core import tiled_grouped, xla_ops

# (rows, K, N, group sizes): empty groups first, between and last; a group past one tile; rows
# past the last group; one group of all the rows; no rows in any group
CASES = [(300, 40, 24, [0, 130, 7, 0, 100]), (257, 16, 8, [257]),
         (500, 32, 16, [3, 0, 0, 200, 1, 50]), (64, 8, 8, [0, 0])]


def _operands(rows, k, n, sizes, seed=0):
  rng = np.random.default_rng(seed)
  lhs = jnp.asarray(rng.normal(size=(rows, k)), jnp.float32)
  rhs = jnp.asarray(rng.normal(size=(len(sizes), k, n)), jnp.float32)
  rows_rhs = jnp.asarray(rng.normal(size=(rows, n)), jnp.float32)
  return lhs, rhs, rows_rhs, jnp.asarray(sizes, jnp.int32)


@pytest.mark.parametrize("chunk_bytes", [tiled_grouped.CHUNK_BYTES, 1], ids=["chunks", "tile-each"])
@pytest.mark.parametrize("case", CASES, ids=lambda c: f"P{c[0]}-G{len(c[3])}")
def test_tiled_grouped_gemms_match_numpy_per_group(case, chunk_bytes):
  lhs, rhs, rows_rhs, sizes = _operands(*case)
  out = jax.jit(lambda *a: tiled_grouped.grouped_matmul(*a, chunk_bytes=chunk_bytes))(lhs, rhs, sizes)
  np.testing.assert_allclose(out, xla_ops._numpy_grouped_matmul(lhs, rhs, sizes), rtol=1e-5, atol=1e-4)
  grad = jax.jit(lambda *a: tiled_grouped.grouped_weight_grad(*a, chunk_bytes=chunk_bytes))(
      lhs, rows_rhs, sizes)
  np.testing.assert_allclose(grad, xla_ops._numpy_grouped_weight_grad(lhs, rows_rhs, sizes),
                             rtol=1e-5, atol=1e-4)


def test_tiled_grouped_gemms_differentiate_and_vmap_as_ragged_dot():
  lhs, rhs, rows_rhs, sizes = _operands(*CASES[0], seed=1)
  cot = jnp.asarray(np.random.default_rng(2).normal(size=(lhs.shape[0], rhs.shape[2])), jnp.float32)
  loss = lambda f: (lambda l, r: jnp.sum(f(l, r, sizes) * cot))
  got = jax.grad(loss(tiled_grouped.grouped_matmul), argnums=(0, 1))(lhs, rhs)
  want = jax.grad(loss(xla_ops._ragged_matmul), argnums=(0, 1))(lhs, rhs)
  for a, b in zip(got, want):
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-4)
  batched = jax.vmap(tiled_grouped.grouped_weight_grad, in_axes=(0, 0, None))(
      jnp.stack([lhs, 2 * lhs]), jnp.stack([rows_rhs, rows_rhs]), sizes)
  one = tiled_grouped.grouped_weight_grad(lhs, rows_rhs, sizes)
  np.testing.assert_allclose(batched[1], 2 * one, rtol=1e-5, atol=1e-4)


def test_xla_layer_lowered_for_cuda_has_no_ragged_dot():
  """On GPUs the xla backend's six GEMMs run as tiled batched GEMMs (for TPUs: ragged_dot)."""
  T, d, n, E, K = 256, 128, 64, 8, 2
  args = make_inputs(0, T, d, n, E, jnp.bfloat16)

  def step(*a):
    loss = lambda *b: jnp.sum(sm.moe(*b, k=K, backend="xla").out.astype(jnp.float32))
    return jax.value_and_grad(loss, argnums=(0, 1, 2, 3))(*a)
  specs = [jax.ShapeDtypeStruct(a.shape, a.dtype) for a in args]
  text = lambda platform: jax.export.export(jax.jit(step), platforms=(platform,))(*specs).mlir_module()
  assert "chlo.ragged_dot" not in text("cuda")
  assert "chlo.ragged_dot" in text("tpu")



@pytest.mark.gpu
def test_xla_backend_runs_a_production_size_layer_on_gpu():
  """The xla backend compiles and runs a forward+backward step at T = 16384, d = 2944,
  n = 1472, E = 64, K = 8 (where ragged_dot failed XLA's autotuner), and matches pallas."""
  from conftest import rel_err
  T, d, n, E, K = 16384, 2944, 1472, 64, 8
  args = make_inputs(9, T, d, n, E, jnp.bfloat16)

  def run(backend):
    loss = lambda *a: jnp.sum(sm.moe(*a, k=K, backend=backend).out.astype(jnp.float32) ** 2)
    return jax.jit(jax.value_and_grad(loss, argnums=(0, 2, 3)))(*args)
  (value_x, grads_x), (value_p, grads_p) = run("xla"), run("pallas")
  assert abs(float(value_x) - float(value_p)) <= 1e-2 * abs(float(value_p))
  for a, b in zip(grads_x, grads_p):
    assert rel_err(a, b) < 1e-2
