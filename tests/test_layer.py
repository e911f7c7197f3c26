"""Forward and all gradients of the layer against the float32 plain-autodiff oracle."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import sonicmoe_jax as sm
from conftest import make_inputs, oracle_moe, rel_err

# (T, d, n, E, K, dead_experts)
SHAPES = [
    (64, 32, 16, 8, 2, 0),
    (37, 32, 16, 4, 1, 0),     # K = 1, T not a multiple of any tile
    (50, 16, 8, 1, 1, 0),      # E = 1
    (64, 32, 16, 16, 2, 5),    # five experts receive no tokens
    (33, 16, 8, 64, 4, 0),     # many experts, most with 0-3 tokens
]
TOL = {jnp.float32: 1e-4, jnp.bfloat16: 2e-2}


def _loss_and_grads(fn, args, cotangent):
  def loss(*a):
    return jnp.sum(fn(*a).astype(jnp.float32) * cotangent)
  return jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2, 3)))(*args)


def _compare(ours, ref, dtype, args, cot):
  """ours and ref jitted (one compile each, not one per op; the layer runs eagerly in the
  tests of its plan and statistics)."""
  tol = TOL[dtype]
  assert rel_err(jax.jit(ours)(*args), jax.jit(ref)(*args)) < tol
  _, g_ours = _loss_and_grads(ours, args, cot)
  _, g_ref = _loss_and_grads(ref, args, cot)
  for name, a, b in zip(("dx", "drouter_w", "dw1", "dw2"), g_ours, g_ref):
    assert np.all(np.isfinite(np.asarray(a, np.float32))), name
    err = rel_err(a, b)
    assert err < tol, f"{name}: relative error {err:.2e} >= {tol}"


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "T{}-d{}-n{}-E{}-K{}-dead{}".format(*s))
def test_topk_matches_oracle(shape, dtype):
  T, d, n, E, K, dead = shape
  args = make_inputs(T * 7 + E, T, d, n, E, dtype, dead_experts=dead)
  cot = jax.random.normal(jax.random.key(99 + T), (T, d))
  ours = lambda *a: sm.moe(*a, k=K).out
  ref = lambda *a: oracle_moe(*a, k=K)
  if dead:
    counts = sm.moe(*args, k=K).stats.expert_counts
    assert np.all(np.asarray(counts[:dead]) == 0)
  _compare(ours, ref, dtype, args, cot)


@pytest.mark.parametrize("score_fn,renormalize", [("softmax_all", False), ("softmax_all", True)])
def test_score_functions_match_oracle(score_fn, renormalize):
  args = make_inputs(3, 48, 32, 16, 8, jnp.float32)
  cot = jax.random.normal(jax.random.key(5), (48, 32))
  kw = dict(k=3, score_fn=score_fn, renormalize=renormalize)
  _compare(lambda *a: sm.moe(*a, **kw).out, lambda *a: oracle_moe(*a, **kw), jnp.float32, args, cot)


@pytest.mark.parametrize("mode", ["nearest", "stochastic", "up", "down", "balanced"])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
def test_token_rounding_matches_oracle_on_its_pairs(mode, dtype):
  T, d, n, E, K, tile = 96, 32, 16, 8, 2, 16
  args = make_inputs(11, T, d, n, E, dtype)
  rng = jax.random.key(4)
  kw = dict(k=K, rounding=mode, tile=tile, rng=rng)
  plan = sm.moe(*args, **kw).plan
  valid = np.asarray(plan.valid)
  member = np.zeros((T, E), bool)
  member[np.asarray(plan.token_index)[valid], np.asarray(plan.expert_index)[valid]] = True
  cot = jax.random.normal(jax.random.key(7), (T, d))
  _compare(lambda *a: sm.moe(*a, **kw).out,
           lambda *a: oracle_moe(*a, k=K, member=member), dtype, args, cot)


def test_jit_and_grad_of_training_step():
  T, d, n, E, K = 64, 32, 16, 8, 2
  x, router_w, w1, w2 = make_inputs(0, T, d, n, E)
  target = jax.random.normal(jax.random.key(1), (T, d))
  params = dict(router_w=router_w, w1=w1, w2=w2)

  def loss(p):
    o = sm.moe(x, p["router_w"], p["w1"], p["w2"], k=K, rounding="nearest", tile=16)
    return jnp.mean((o.out - target) ** 2) + 1e-2 * o.stats.load_balancing_loss

  @jax.jit
  def step(p):
    l, g = jax.value_and_grad(loss)(p)
    return l, jax.tree_util.tree_map(lambda a, b: a - 0.1 * b, p, g)

  first, params = step(params)
  for _ in range(20):
    last, params = step(params)
  assert float(last) < 0.9 * float(first)


def test_padding_slots_are_zero_in_every_output():
  T, d, n, E, K = 40, 16, 8, 4, 1
  x, router_w, w1, w2 = make_inputs(2, T, d, n, E, jnp.float32)
  plan, _ = sm.route(sm.router_logits(x, router_w), k=K, rounding="down", tile=16)
  pad = ~np.asarray(plan.valid)
  assert pad.any()
  ops = sm.resolve_backend("xla")
  h, a = ops.up_proj(x, w1, plan)
  y = ops.down_proj(a, w2, plan)
  dh, ds, a_scaled = ops.dh(jnp.ones((T, d)), w2, h, plan.scores, plan)
  for name, arr in dict(h=h, a=a, y=y, dh=dh, a_scaled=a_scaled).items():
    assert np.all(np.asarray(arr)[pad] == 0), name
  assert np.all(np.asarray(ds)[pad] == 0)


def test_vmap_over_the_layer_is_each_batch_element_on_its_own():
  """jax.vmap over the layer (the xla backend) gives each element's own output and gradients,
  token rounding included."""
  x, r, w1, w2 = make_inputs(0, 64, 32, 16, 8, jnp.float32)
  xb = jnp.stack([x, x * 0.5 + 1.0, -x])
  for rounding in (None, "nearest"):
    f = lambda xx: sm.moe(xx, r, w1, w2, k=2, rounding=rounding, tile=16, backend="xla").out
    out = jax.vmap(f)(xb)
    for i in range(3):
      assert rel_err(out[i], f(xb[i])) < 1e-6
  loss = lambda xx, w: jnp.sum(sm.moe(xx, r, w, w2, k=2, backend="xla").out ** 2)
  grads = jax.vmap(jax.grad(loss, argnums=(0, 1)), in_axes=(0, None))(xb, w1)
  for i in range(3):
    want = jax.grad(loss, argnums=(0, 1))(xb[i], w1)
    assert rel_err(grads[0][i], want[0]) < 1e-5 and rel_err(grads[1][i], want[1]) < 1e-5


def _check_vmap(backend, dtype, tol):
  """jax.vmap over the layer on `backend`: each batch element's output and gradients as when
  it runs alone (plain top-K and token rounding)."""
  # (on the GPU backends d >= 2n: cute's stores make two column windows there)
  T, d, n, E = (256, 256, 128, 8) if backend != "xla" else (64, 32, 16, 8)
  x, r, w1, w2 = make_inputs(1, T, d, n, E, dtype)
  xb = jnp.stack([x, (-x.astype(jnp.float32)).astype(dtype)])
  for rounding in (None, "nearest"):
    f = lambda xx: sm.moe(xx, r, w1, w2, k=2, rounding=rounding, tile=64, backend=backend).out
    out, one = jax.jit(jax.vmap(f))(xb), jax.jit(f)
    for i in range(2):
      assert rel_err(out[i], one(xb[i])) < tol, (rounding, i)
  loss = lambda xx, w: jnp.sum(sm.moe(xx, r, w, w2, k=2, backend=backend).out.astype(jnp.float32) ** 2)
  grads = jax.jit(jax.vmap(jax.grad(loss, argnums=(0, 1)), in_axes=(0, None)))(xb, w1)
  one = jax.jit(jax.grad(loss, argnums=(0, 1)))
  for i in range(2):
    want = one(xb[i], w1)
    assert rel_err(grads[0][i], want[0]) < tol and rel_err(grads[1][i], want[1]) < tol


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["pallas", "cute", "auto"])
def test_vmap_over_the_layer_on_gpu_backends(backend):
  if backend == "cute":
    pytest.importorskip("cutlass")
  _check_vmap(backend, jnp.bfloat16, 1e-2)


def test_cpu_grouped_gemms_compute_each_expert_alone_as_ragged_dot_would():
  """On a one-device CPU the xla backend's grouped GEMMs run each expert's rows on the host
  (no E-fold dense ragged_dot) and give ragged_dot's numbers, empty experts and rows past the
  groups included."""
  from sonicmoe_jax.core import xla_ops
  key = jax.random.split(jax.random.key(3), 3)
  sizes = jnp.array([5, 0, 17, 3, 0], jnp.int32)   # 25 rows of 30: the last 5 past the groups
  lhs = jax.random.normal(key[0], (30, 12))
  rhs = jax.random.normal(key[1], (5, 12, 7))
  other = jax.random.normal(key[2], (30, 9))
  got = jax.jit(xla_ops.grouped_matmul_host)(lhs, rhs, sizes)
  want = jax.lax.ragged_dot(lhs, rhs, sizes, preferred_element_type=jnp.float32)
  np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
  assert np.all(np.asarray(got[25:]) == 0)
  got = jax.jit(xla_ops.grouped_weight_grad_host)(lhs, other, sizes)
  want = jax.lax.ragged_dot_general(lhs, other, sizes, jax.lax.RaggedDotDimensionNumbers(
      dot_dimension_numbers=(((0,), (0,)), ((), ())), lhs_ragged_dimensions=[0],
      rhs_group_dimensions=[]), preferred_element_type=jnp.float32)
  np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
  if jax.default_backend() == "cpu" and jax.device_count() == 1:
    args = make_inputs(1, 64, 32, 16, 8, jnp.float32)
    jaxpr = str(jax.make_jaxpr(lambda *a: sm.moe(*a, k=2, backend="xla").out)(*args))
    assert "pure_callback" in jaxpr


def test_cpu_grouped_gemms_are_differentiable_as_ragged_dot():
  """The host grouped GEMMs' gradients (plain autodiff through the xla backend's ops uses them)
  equal ragged_dot's."""
  from sonicmoe_jax.core import xla_ops
  key = jax.random.split(jax.random.key(4), 4)
  sizes = jnp.array([5, 0, 17, 3], jnp.int32)
  lhs, rhs = jax.random.normal(key[0], (28, 12)), jax.random.normal(key[1], (4, 12, 7))
  other, cot = jax.random.normal(key[2], (28, 9)), jax.random.normal(key[3], (4, 12, 9))
  # each row's expert as a one-hot (rows past the groups: none), the dense weight gradient's
  onehot = jax.nn.one_hot(jnp.repeat(jnp.arange(4), sizes, total_repeat_length=28), 4) * (
      jnp.arange(28) < jnp.sum(sizes))[:, None]
  pairs = [
      (lambda a, b: jnp.sum(jnp.sin(xla_ops.grouped_matmul_host(a, b, sizes))),
       lambda a, b: jnp.sum(jnp.sin(jax.lax.ragged_dot(a, b, sizes))), (lhs, rhs)),
      (lambda a, b: jnp.sum(xla_ops.grouped_weight_grad_host(a, b, sizes) * cot),
       lambda a, b: jnp.sum(jnp.einsum("pa,pe,pb->eab", a, onehot, b) * cot), (lhs, other))]
  for host, ragged, args in pairs:
    for got, want in zip(jax.grad(host, argnums=(0, 1))(*args),
                         jax.grad(ragged, argnums=(0, 1))(*args)):
      np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)
