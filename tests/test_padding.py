"""Widths the kernels' tiles do not divide: the layer zero-pads d and n up to the resolved
backends' multiples (sonicmoe_jax/core/padding.py) and its numbers are the unpadded layer's."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import sonicmoe_jax as sm
from conftest import make_inputs
from sonicmoe_jax import backends, layer
from sonicmoe_jax.core import padding, routing


def test_padded_width_rounds_up_to_the_multiple():
  assert [padding.padded_width(w, 64) for w in (1, 64, 65, 200, 2944)] == [64, 64, 128, 256, 2944]
  assert padding.padded_width(72, 1) == 72


def test_padded_weights_keep_the_gate_and_up_halves_n_apart():
  E, d, n = 3, 5, 7
  w1 = jax.random.normal(jax.random.key(0), (E, d, 2 * n))
  w2 = jax.random.normal(jax.random.key(1), (E, n, d))
  p1, p2 = padding.pad_expert_weights(w1, w2, 8, 16)
  assert p1.shape == (E, 8, 32) and p2.shape == (E, 16, 8)
  np.testing.assert_array_equal(p1[:, :d, :n], w1[:, :, :n])           # gate half
  np.testing.assert_array_equal(p1[:, :d, 16:16 + n], w1[:, :, n:])    # up half
  np.testing.assert_array_equal(p2[:, :n, :d], w2)
  for pad in (p1[:, d:], p1[:, :, n:16], p1[:, :, 16 + n:], p2[:, n:], p2[:, :, d:]):
    assert pad.size and not np.any(pad)
  assert padding.pad_expert_weights(w1, w2, d, n)[0] is w1   # nothing to pad: the same arrays


@pytest.mark.parametrize("multiples", [(8, 16), (64, 64), (128, 128)])
def test_padded_expert_computation_equals_the_unpadded_one(multiples):
  """run_experts at padded widths (the xla backend told to pad, in float32) against the same
  layer unpadded: output and all four gradients, to float32 rounding."""
  T, d, n, E, K = 64, 40, 24, 4, 2
  x, router_w, w1, w2 = make_inputs(11, T, d, n, E, jnp.float32)
  cot = jax.random.normal(jax.random.key(12), (T, d))
  plain = backends.resolve("xla")
  padded = plain._replace(width_multiples=multiples)
  assert padded.kernel_widths(d, n) != (d, n)

  def grads(ops):
    def loss(x, router_w, w1, w2):
      plan = routing.route(routing.router_logits(x, router_w), k=K, align=ops.align)[0]
      arrays = jax.tree_util.tree_map(jax.lax.stop_gradient, plan)
      out = layer.run_experts(ops, x, plan.scores, w1, w2, arrays, (1, 1))
      return jnp.sum(out * cot), out
    return jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3), has_aux=True))(x, router_w, w1, w2)
  (g_plain, out_plain), (g_padded, out_padded) = grads(plain), grads(padded)
  assert out_padded.shape == (T, d)
  np.testing.assert_allclose(out_padded, out_plain, rtol=1e-5, atol=1e-5)
  for name, a, b in zip(("dx", "drouter_w", "dw1", "dw2"), g_padded, g_plain):
    assert a.shape == b.shape, name
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5, err_msg=name)


def test_windows_are_counted_against_the_padded_width():
  """d = 200 runs at 256 on backends that pad to 128: two column windows of 128 fit there."""
  ops = backends.resolve("xla")._replace(width_multiples=(128, 128), windows=2)
  assert layer.resolve_windows(None, ops, 200) == (2, 2)
  assert layer.resolve_windows(None, backends.resolve("xla")._replace(windows=2), 200) == (1, 1)
  with pytest.raises(ValueError, match="windows must be between 1 and 2"):
    layer.resolve_windows(3, ops, 200)
