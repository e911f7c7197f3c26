"""Flax nnx and Linen layers: init, apply, grad, train/eval switch."""
import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

import sonicmoe_jax as sm
from conftest import oracle_moe, rel_err


def test_nnx_init_shapes_and_apply_matches_functional():
  m = sm.SonicMoE(32, 16, 8, 2, tile=16, dtype=jnp.float32, rngs=nnx.Rngs(0))
  assert m.router_w[...].shape == (32, 8) and m.w1[...].shape == (8, 32, 32)
  assert m.w2[...].shape == (8, 16, 32)
  x = jax.random.normal(jax.random.key(1), (4, 24, 32))
  m.eval()
  y, stats = m(x)
  assert y.shape == x.shape
  ref = oracle_moe(x.reshape(-1, 32), m.router_w[...], m.w1[...], m.w2[...], k=2)
  assert rel_err(y.reshape(-1, 32), ref) < 1e-4
  assert int(stats.expert_counts.sum()) == 4 * 24 * 2


def test_nnx_train_rounds_and_eval_does_not():
  m = sm.SonicMoE(32, 16, 8, 2, tile=16, rounding="nearest", rngs=nnx.Rngs(0))
  x = jax.random.normal(jax.random.key(2), (128, 32))
  _, train_stats = m(x)
  assert np.all(np.asarray(train_stats.expert_counts) % 16 == 0)
  m.eval()
  _, eval_stats = m(x)
  np.testing.assert_array_equal(eval_stats.expert_counts, eval_stats.topk_counts)
  m.train()
  assert not m.deterministic


def test_nnx_stochastic_rounding_uses_rng_stream():
  m = sm.SonicMoE(32, 16, 8, 2, tile=16, rounding="stochastic", rngs=nnx.Rngs(0, rounding=1))
  x = jax.random.normal(jax.random.key(3), (256, 32))
  counts = {tuple(np.asarray(m(x)[1].expert_counts)) for _ in range(6)}
  assert len(counts) > 1


def test_nnx_grad_and_optimizer_step():
  m = sm.SonicMoE(32, 16, 8, 2, tile=16, rngs=nnx.Rngs(0))
  opt = nnx.Optimizer(m, optax.adamw(1e-2), wrt=nnx.Param)
  x = jax.random.normal(jax.random.key(4), (64, 32))
  target = jax.random.normal(jax.random.key(5), (64, 32))

  @nnx.jit
  def step(m, opt):
    def loss_fn(m):
      y, st = m(x)
      return jnp.mean((y.astype(jnp.float32) - target) ** 2) + 1e-2 * st.load_balancing_loss
    loss, grads = nnx.value_and_grad(loss_fn)(m)
    opt.update(m, grads)
    return loss

  losses = [float(step(m, opt)) for _ in range(15)]
  assert losses[-1] < losses[0]


def test_linen_wrapper():
  mod = sm.SonicMoELinen(d_model=32, d_expert=16, num_experts=8, k=2, tile=16, dtype=jnp.float32)
  x = jax.random.normal(jax.random.key(6), (64, 32))
  params = jax.jit(mod.init)(jax.random.key(0), x)   # (init and grad jitted; apply eager)
  y, stats = mod.apply(params, x, deterministic=True)
  p = params["params"]
  assert rel_err(y, oracle_moe(x, p["router_w"], p["w1"], p["w2"], k=2)) < 1e-4
  g = jax.jit(jax.grad(lambda p: jnp.sum(mod.apply(p, x)[0] ** 2)))(params)
  assert g["params"]["w1"].shape == (8, 32, 32)


def test_nnx_and_linen_pass_windows_to_the_layer():
  """windows reaches the functional layer (the same output; out of its range: the layer's
  error); with a mesh too (the expert-parallel layer runs the same expert computation)."""
  import pytest
  x = jax.random.normal(jax.random.key(7), (96, 384))
  m = sm.SonicMoE(384, 16, 8, 2, dtype=jnp.float32, windows=3, rngs=nnx.Rngs(0))
  m.eval()
  ref = oracle_moe(x, m.router_w[...], m.w1[...], m.w2[...], k=2)
  assert rel_err(m(x)[0], ref) < 1e-4
  mod = sm.SonicMoELinen(d_model=384, d_expert=16, num_experts=8, k=2, tile=16,
                         dtype=jnp.float32, windows=2)
  params = jax.jit(mod.init)(jax.random.key(0), x)
  p = params["params"]
  y, _ = mod.apply(params, x, deterministic=True)
  assert rel_err(y, oracle_moe(x, p["router_w"], p["w1"], p["w2"], k=2)) < 1e-4
  too_many = sm.SonicMoE(384, 16, 8, 2, dtype=jnp.float32, windows=10_000, rngs=nnx.Rngs(0))
  too_many.eval()
  with pytest.raises(ValueError, match="windows must be between 1 and"):
    too_many(x)
  mesh = jax.sharding.Mesh(jax.devices()[:1], ("expert",))
  sharded = sm.SonicMoE(384, 16, 8, 2, dtype=jnp.float32, windows=2, mesh=mesh, data_axes=(),
                        rngs=nnx.Rngs(0))
  sharded.eval()
  assert rel_err(sharded(x)[0], oracle_moe(x, sharded.router_w[...], sharded.w1[...],
                                           sharded.w2[...], k=2)) < 1e-4


def test_flax_defaults_follow_the_input_and_take_a_small_batch():
  """Flax conventions: dtype None computes in the input's dtype (float32 in, float32 out);
  rounding is off by default, so a batch smaller than one tile runs (and rounding asked for
  on it names the limit); an input of the wrong width is blamed on x, by name."""
  import pytest
  x = jax.random.normal(jax.random.key(9), (3, 5, 32))   # 15 tokens < tile 128
  m = sm.SonicMoE(32, 16, 8, 2, rngs=nnx.Rngs(0))
  y, stats = m(x)
  assert y.dtype == jnp.float32 and y.shape == x.shape
  np.testing.assert_array_equal(stats.expert_counts, stats.topk_counts)
  assert m(x.astype(jnp.bfloat16))[0].dtype == jnp.bfloat16
  mod = sm.SonicMoELinen(d_model=32, d_expert=16, num_experts=8, k=2)
  params = mod.init(jax.random.key(0), x)
  assert mod.apply(params, x)[0].dtype == jnp.float32
  with pytest.raises(ValueError, match=r"x: its last dimension must be the layer's d_model=32; "
                                       r"got shape \(3, 5, 48\)"):
    m(jnp.ones((3, 5, 48)))
  rounded = sm.SonicMoE(32, 16, 8, 2, rounding="nearest", rngs=nnx.Rngs(0))
  with pytest.raises(ValueError, match="token rounding needs at least one tile of tokens"):
    rounded(x)


def test_nnx_parameters_carry_their_partitioning():
  """nnx.get_partition_spec gives w1 and w2 split over the "expert" mesh axis and the router
  replicated: what a jit/pjit training loop builds its NamedShardings from."""
  from jax.sharding import PartitionSpec as P
  m = sm.SonicMoE(32, 16, 8, 2, rngs=nnx.Rngs(0))
  specs = nnx.get_partition_spec(nnx.state(m, nnx.Param))
  assert specs["w1"] == P("expert", None, None)
  assert specs["w2"] == P("expert", None, None)
  assert specs["router_w"] == P(None, None)
