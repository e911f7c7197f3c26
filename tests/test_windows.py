"""The layer's column windows (moe(..., windows=W)): the same result as without, a smaller peak."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import sonicmoe_jax as sm
from cute_helpers import needs_cute
from conftest import make_inputs, rel_err
from sonicmoe_jax.core import xla_ops


@pytest.mark.parametrize("num_cols,windows", [(256, 2), (384, 3), (1536, 2), (640, 3),
                                              (4096, 4), (100, 1)])
def test_column_windows_cover_the_columns_in_aligned_consecutive_ranges(num_cols, windows):
  bounds = sm.layer.column_windows(num_cols, windows)
  assert len(bounds) == windows and bounds[0][0] == 0 and bounds[-1][1] == num_cols
  for (lo, hi), (next_lo, _) in zip(bounds, bounds[1:]):
    assert hi == next_lo
  align = sm.layer.WINDOW_COLUMN_ALIGN
  for lo, hi in bounds:
    assert hi > lo and (windows == 1 or (lo % align == 0 and hi % align == 0))


@pytest.mark.parametrize("num_cols,windows", [(512, 0), (512, 5), (512, 2.0), (512, True),
                                              (320, 2)])
def test_column_windows_refuse_what_cannot_be_split(num_cols, windows):
  with pytest.raises((ValueError, TypeError), match="windows"):
    sm.layer.column_windows(num_cols, windows)   # 512: four column tiles of 128


@pytest.mark.parametrize("windows", [2, 3])
@pytest.mark.parametrize("rounding", [None, "nearest"])
def test_windows_give_the_layer_and_its_gradients_unchanged(windows, rounding):
  T, d, n, E, K = 128, 384, 16, 8, 4
  x, router_w, w1, w2 = make_inputs(5, T, d, n, E, jnp.float32)
  dout = jax.random.normal(jax.random.key(6), (T, d))

  def loss(w, *args):
    out = sm.moe(*args, k=K, rounding=rounding, tile=16, backend="xla", windows=w).out
    return jnp.sum(out * dout)

  grads = [jax.jit(jax.grad(loss, argnums=(1, 2, 3, 4)), static_argnums=0)(w, x, router_w, w1, w2)
           for w in (1, windows)]
  for name, whole, windowed in zip(("dx", "drouter_w", "dw1", "dw2"), *grads):
    assert rel_err(windowed, whole) < 1e-5, name
  out_1 = sm.moe(x, router_w, w1, w2, k=K, rounding=rounding, tile=16, backend="xla").out
  out_w = sm.moe(x, router_w, w1, w2, k=K, rounding=rounding, tile=16, backend="xla",
                 windows=windows).out
  assert rel_err(out_w, out_1) < 1e-5


def test_window_sum_orders_each_window_after_the_last_ones_sum():
  """Without the optimization barrier XLA may make every window's GEMM first (all of the
  product alive at once, as without windows): one barrier between consecutive windows."""
  T, d, n, E, K = 256, 384, 16, 8, 4
  x, router_w, _, _ = make_inputs(7, T, 32, n, E, jnp.bfloat16)
  plan, _ = sm.route(sm.router_logits(x, router_w), k=K, align=128)
  a = jax.random.normal(jax.random.key(8), (plan.num_slots, n), jnp.bfloat16)
  w = jax.random.normal(jax.random.key(9), (n, d), jnp.bfloat16)

  def matmul(lhs, rhs, plan, cols=None):
    lo, hi = (0, d) if cols is None else cols
    return jnp.dot(lhs, rhs[:, lo:hi], preferred_element_type=jnp.float32).astype(lhs.dtype)

  whole = xla_ops.aggregate(matmul(a, w, plan), plan.scores, plan)
  for windows in (1, 2, 3):
    for into in (False, True):   # concatenated, or each window written into the result
      fn = jax.jit(lambda a, w, plan: sm.layer.window_sum(
          matmul, xla_ops.aggregate, a, w, plan.scores, plan, windows, d, into))
      text = fn.lower(a, w, plan).as_text()
      assert text.count("optimization_barrier") == windows - 1
      assert ("concatenate" in text) == (windows > 1 and not into)
      np.testing.assert_array_equal(fn(a, w, plan), whole)   # each column's sum as without


def test_aggregate_into_writes_its_columns_of_the_result():
  x, router_w, _, _ = make_inputs(3, 64, 32, 16, 4, jnp.float32)
  plan, _ = sm.route(sm.router_logits(x, router_w), k=2)
  y = jax.random.normal(jax.random.key(4), (plan.num_slots, 128))
  sums = xla_ops.aggregate(y, plan.scores, plan)
  first = xla_ops.aggregate(y, plan.scores, plan, into=(384, 128))
  np.testing.assert_array_equal(first[:, 128:256], sums)
  assert not np.any(first[:, :128]) and not np.any(first[:, 256:])
  again = xla_ops.aggregate(2 * y, plan.scores, plan, into=(first, 256))
  np.testing.assert_array_equal(again[:, 128:256], sums)
  np.testing.assert_allclose(again[:, 256:], 2 * sums, rtol=1e-6)


@needs_cute
def test_cute_windows_write_into_the_result_and_lower_for_cuda():
  """With the cute aggregate the layer's windows chain through its in-place writes: no
  concatenation in the lowered step."""
  from cute_helpers import cuda_module
  x, r, w1, w2 = make_inputs(0, 256, 256, 128, 8, jnp.bfloat16)
  loss = lambda x, w1: jnp.sum(sm.moe(x, r, w1, w2, k=2, backend="cute", windows=2)
                               .out.astype(jnp.float32))
  text = cuda_module(jax.grad(loss, argnums=(0, 1)), x, w1)
  joins = [line for line in text.splitlines() if "stablehlo.concatenate" in line]
  assert joins and not any("tensor<256x256xbf16>" in line for line in joins)   # (the plan's
  # offsets are joined; the outputs' windows are not)

@pytest.mark.parametrize("stores,d,n,expected", [
    (("cute", "cute"), 1536, 256, 2), (("cute", "cute"), 2048, 1024, 2),
    (("cute", "cute"), 1536, 1024, 1), (("pallas", "pallas"), 4096, 256, 1),
    (("cute", "pallas"), 4096, 256, 1), (("cute", "cute"), None, 256, 1)])
def test_default_windows_are_two_where_cute_stores_a_product_as_wide_as_h(stores, d, n, expected):
  """The measured rule (backends.default_windows): two windows where down_proj and dx_tilde
  run on cute and d >= 2n, else one."""
  assert sm.backends.default_windows(stores, d, n) == expected
  assert sm.backends.resolve("xla", d=d, n=n).windows == 1


@pytest.mark.parametrize("d,default,barriers", [(384, 3, 2), (384, 1, 0), (256, 3, 0),
                                                 (320, 2, 0)])
def test_moe_without_windows_takes_the_backends_default_where_d_fits_it(
    monkeypatch, d, default, barriers):
  """windows=None: the resolved backend's default (Ops.windows), one where d is not a
  multiple of 128 columns or narrower than the windows (one barrier per window boundary in
  the forward)."""
  real_resolve = sm.backends.resolve
  monkeypatch.setattr(sm.backends, "resolve",
                      lambda *a, **kw: real_resolve(*a, **kw)._replace(windows=default))
  x, router_w, w1, w2 = make_inputs(11, 64, d, 16, 4, jnp.float32)
  forward = lambda *a: sm.moe(*a, k=2, backend="xla").out
  jaxpr = str(jax.make_jaxpr(forward)(x, router_w, w1, w2))
  assert jaxpr.count("optimization_barrier") == barriers


@pytest.mark.parametrize("windows,barriers", [((1, 2), (0, 1)), ((3, 1), (2, 0)),
                                              ([2, 2], (1, 1)), (2, (1, 1))])
def test_a_windows_pair_splits_the_forward_and_the_backward_apart(windows, barriers):
  """windows=(forward, backward): Y's windows in the forward, dX~'s in the backward (one
  barrier per window boundary in each), the layer's value and gradients as with one window."""
  T, d, n, E, K = 128, 384, 16, 8, 4
  x, router_w, w1, w2 = make_inputs(12, T, d, n, E, jnp.float32)
  dout = jax.random.normal(jax.random.key(13), (T, d))
  forward = lambda *a: sm.moe(*a, k=K, backend="xla", windows=windows).out
  out, pullback = jax.vjp(forward, x, router_w, w1, w2)
  assert str(jax.make_jaxpr(forward)(x, router_w, w1, w2)).count("optimization_barrier") == \
      barriers[0]
  # (the backward's barriers: dW1's one on X, then dX~'s windows)
  backward_jaxpr = str(jax.make_jaxpr(pullback)(dout))
  assert backward_jaxpr.count("optimization_barrier") == 1 + barriers[1]
  whole, whole_pullback = jax.vjp(lambda *a: sm.moe(*a, k=K, backend="xla", windows=1).out,
                                  x, router_w, w1, w2)
  assert rel_err(out, whole) < 1e-5
  for name, got, want in zip(("dx", "drouter_w", "dw1", "dw2"), pullback(dout),
                             whole_pullback(dout)):
    assert rel_err(got, want) < 1e-5, name


@pytest.mark.parametrize("windows,error", [((1, 10_000), "windows must be between 1 and"),
                                           ((1, 2, 3), "windows must be a Python int or a pair"),
                                           ("2", "windows must be a Python int or a pair"),
                                           ((2, 1.0), "windows must be a Python int;")])
def test_moe_refuses_a_bad_windows_pair(windows, error):
  x, router_w, w1, w2 = make_inputs(8, 64, 384, 8, 4, jnp.float32)
  with pytest.raises((ValueError, TypeError), match=error):
    sm.moe(x, router_w, w1, w2, k=2, backend="xla", windows=windows)


def test_moe_names_the_windows_limit():
  x, router_w, w1, w2 = make_inputs(8, 64, 16, 8, 4, jnp.float32)
  with pytest.raises(ValueError, match="windows must be between 1 and"):
    sm.moe(x, router_w, w1, w2, k=2, backend="xla", windows=10_000)


def test_pallas_layer_with_windows_matches_xla_interpret():
  """The pallas backend's store GEMMs on windows (the weights' columns sliced), interpreted on
  the CPU: the layer and its gradients as the xla backend's without windows."""
  T, d, n, E, K = 256, 384, 64, 4, 2
  args = make_inputs(9, T, d, n, E, jnp.bfloat16)
  cot = jax.random.normal(jax.random.key(10), (T, d))

  def grads(backend, windows):
    loss = lambda *a: jnp.sum(sm.moe(*a, k=K, backend=backend, windows=windows).out
                              .astype(jnp.float32) * cot)
    return jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3)))(*args)   # (one compiled program)

  for name, a, b in zip(("dx", "drouter_w", "dw1", "dw2"), grads("pallas", 3), grads("xla", 1)):
    assert rel_err(a, b) < 1e-2, name
