"""The OmniMoE router's top-k as a CuTe kernel (ffi/cartesian_topk.py): it compiles for sm_90a,
refuses what it cannot take, and on the GPU gives models/omnimoe.py's bisection bit for bit."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from cute_helpers import FFI_TARGET, cuda_module, needs_cute
from models import omnimoe


def _log_probs(num_tokens: int, rows: int, cols: int, seed: int, coarse: bool = False):
  """Each token's row and column log-probabilities; coarse: rounded to quarters, so that pair
  scores tie often."""
  ks = jax.random.split(jax.random.key(seed), 2)
  pr = jax.nn.log_softmax(jax.random.normal(ks[0], (num_tokens, rows)) * 2)
  pc = jax.nn.log_softmax(jax.random.normal(ks[1], (num_tokens, cols)) * 2)
  if coarse:
    pr, pc = jnp.round(pr * 4) / 4, jnp.round(pc * 4) / 4
  return pr, pc


@needs_cute
@pytest.mark.parametrize("rows,cols,k", [(1024, 1024, 4096), (2048, 2048, 4096), (16, 8, 5)])
def test_cute_cartesian_topk_compiles_for_cuda(rows, cols, k):
  """The kernel compiles for sm_90a at the paper's grid (1024 x 1024, k = 4096), with two row
  ranks a thread (2048 of them) and at a small grid (k below both sides)."""
  from ffi import cartesian_topk
  kr, kc = min(k, rows), min(k, cols)
  fn = lambda rv, ri, cv, ci: cartesian_topk.cartesian_topk(rv, ri, cv, ci, k, rows, cols)
  shapes = [jax.ShapeDtypeStruct((4, kr), jnp.float32), jax.ShapeDtypeStruct((4, kr), jnp.int32),
            jax.ShapeDtypeStruct((4, kc), jnp.float32), jax.ShapeDtypeStruct((4, kc), jnp.int32)]
  assert FFI_TARGET in cuda_module(fn, *shapes)


@needs_cute
def test_cute_cartesian_topk_refuses_what_it_cannot_take():
  from ffi import cartesian_topk
  vals, ids = jnp.zeros((2, 4)), jnp.zeros((2, 4), jnp.int32)
  with pytest.raises(ValueError, match=r"cute cartesian_topk: k=17 must be between 1 and rows \* cols = 16"):
    cartesian_topk.cartesian_topk(vals, ids, vals, ids, 17, 4, 4)
  with pytest.raises(ValueError, match="must be at most 2048; got 4096 x 4, k=5000"):
    cartesian_topk.cartesian_topk(vals, ids, vals, ids, 5000, 4096, 4)
  with pytest.raises(ValueError, match=r"row_vals and row_ids must be \[T, min\(k, rows\) = 3\]"):
    cartesian_topk.cartesian_topk(vals, ids, vals, ids, 3, 4, 4)
  with pytest.raises(ValueError, match=r"col_vals and col_ids must be \[T = 2, min\(k, cols\) = 2\]"):
    cartesian_topk.cartesian_topk(vals, ids, vals, ids, 8, 4, 2)


def test_cartesian_topk_runs_xla_off_the_gpu():
  """Off the GPU (or without the cute extra) method None picks one of the XLA methods."""
  if jax.default_backend() == "gpu":
    pytest.skip("on a GPU the kernel runs")
  assert not omnimoe._kernel_runs(1024, 1024, 4096)
  with pytest.raises(ValueError, match="'kernel' or None; got 'sort'"):
    omnimoe.cartesian_topk(jnp.zeros((2, 4)), jnp.zeros((2, 4)), 3, "sort")


@pytest.mark.gpu
@needs_cute
@pytest.mark.parametrize("num_tokens,rows,cols,k,coarse", [
    (64, 1024, 1024, 4096, False), (64, 1024, 1024, 4096, True), (48, 2048, 2048, 3000, False),
    (33, 64, 16, 100, True), (40, 16, 64, 1, False), (40, 8, 8, 64, True),
    (8, 256, 256, 576, False)])
def test_cute_cartesian_topk_matches_the_bisection_on_gpu(num_tokens, rows, cols, k, coarse):
  """Scores and expert ids equal the XLA bisection's element for element (the same pairs in
  the same order): at the paper's grid and k, with ties (scores rounded to quarters), two
  row ranks a thread (2048), k above one side, k = 1, k = N; and method None runs the kernel."""
  pr, pc = _log_probs(num_tokens, rows, cols, seed=k + rows, coarse=coarse)
  run = jax.jit(omnimoe.cartesian_topk, static_argnums=(2, 3))
  want_vals, want_ids = run(pr, pc, k, "bisection")
  got_vals, got_ids = run(pr, pc, k, "kernel")
  np.testing.assert_array_equal(got_ids, want_ids)
  np.testing.assert_array_equal(got_vals, want_vals)
  assert omnimoe._kernel_runs(rows, cols, k)
  np.testing.assert_array_equal(run(pr, pc, k, None)[1], want_ids)


@pytest.mark.gpu
@needs_cute
def test_cute_cartesian_topk_gradients_match_the_bisection_on_gpu():
  """The kernel's scores carry gradients to both sides' log-probabilities, equal to the
  bisection's (the same pairs, the same sums; summed in any order)."""
  pr, pc = _log_probs(16, 256, 256, seed=3)
  weights = jax.random.normal(jax.random.key(4), (16, 576))
  def grads(method):
    loss = lambda a, b: (omnimoe.cartesian_topk(a, b, 576, method)[0] * weights).sum()
    return jax.jit(jax.grad(loss, argnums=(0, 1)))(pr, pc)
  for got, want in zip(grads("kernel"), grads("bisection")):
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
