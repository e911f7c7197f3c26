"""The expert computation on rows already grouped by expert, against a float32 reference."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import sonicmoe_jax as sm
from sonicmoe_jax.core import routing
from conftest import rel_err

TOL = {jnp.float32: 1e-4, jnp.bfloat16: 2e-2}


def _inputs(seed, rows, d, n, num_experts, dtype):
  ks = jax.random.split(jax.random.key(seed), 4)
  x = jax.random.normal(ks[0], (rows, d))
  scores = jax.random.uniform(ks[1], (rows,), minval=0.1, maxval=1.0)
  w1 = jax.random.normal(ks[2], (num_experts, d, 2 * n)) / np.sqrt(d)
  w2 = jax.random.normal(ks[3], (num_experts, n, d)) / np.sqrt(n)
  return x.astype(dtype), scores, w1.astype(dtype), w2.astype(dtype)


def _reference(group_sizes, rows, scores, w1, w2):
  """Each row through its expert's SwiGLU MLP in float32 (rows past the groups: zeros)."""
  num_rows, n = rows.shape[0], w2.shape[1]
  expert = np.repeat(np.arange(len(group_sizes)), group_sizes)[:num_rows]
  live = np.arange(num_rows) < len(expert)
  expert = np.pad(expert, (0, num_rows - len(expert)))
  rows, w1, w2 = (a.astype(jnp.float32) for a in (rows, w1, w2))
  h = jnp.einsum("rd,rdf->rf", rows, w1[expert])
  a = jax.nn.silu(h[:, :n]) * h[:, n:]
  y = jnp.einsum("rn,rnd->rd", a, w2[expert])
  return jnp.where(live[:, None], scores[:, None] * y, 0.0)


def _check(backend, group_sizes, num_rows, d, n, dtype, seed=0):
  args = _inputs(seed, num_rows, d, n, len(group_sizes), dtype)
  sizes = jnp.asarray(group_sizes, jnp.int32)
  ours = jax.jit(lambda *a: sm.grouped_expert_mlp(*a, sizes, backend=backend))
  ref = jax.jit(lambda *a: _reference(np.asarray(group_sizes), *a))
  out = ours(*args)
  assert out.shape == (num_rows, d) and out.dtype == dtype
  assert rel_err(out, ref(*args)) < TOL[dtype]
  cot = jax.random.normal(jax.random.key(seed + 1), (num_rows, d))
  grad = lambda f: jax.jit(jax.grad(lambda *a: jnp.sum(f(*a).astype(jnp.float32) * cot),
                                    argnums=(0, 1, 2, 3)))(*args)
  for name, a, b in zip(("drows", "dscores", "dw1", "dw2"), grad(ours), grad(ref)):
    assert np.all(np.isfinite(np.asarray(a, np.float32))), name
    assert rel_err(a, b) < TOL[dtype], name


# (group sizes, rows): empty experts, rows past the groups, one expert, a group cut at R
LAYOUTS = [([10, 0, 7, 20, 6], 50), ([33], 33), ([0, 0, 5], 9), ([12, 40, 3], 30)]


@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda l: "sizes{}-R{}".format(*l))
def test_grouped_expert_mlp_matches_reference(layout):
  _check("xla", layout[0], layout[1], d=16, n=8, dtype=jnp.float32)


def test_grouped_expert_mlp_group_sizes_can_be_traced():
  args = _inputs(3, 40, 16, 8, 4, jnp.float32)
  fn = jax.jit(lambda sizes: sm.grouped_expert_mlp(*args, sizes, backend="xla"))
  for sizes in ([10, 10, 10, 10], [0, 40, 0, 0], [1, 2, 3, 4]):
    np.testing.assert_allclose(fn(jnp.array(sizes)), _reference(np.array(sizes), *args),
                               rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("align", [1, 8, 128])
def test_plan_from_group_sizes_places_each_row_once_in_its_expert_group(align):
  sizes, num_rows = np.array([5, 0, 9, 130, 2]), 140       # the last groups pass R
  plan = routing.plan_from_group_sizes(jnp.asarray(sizes), num_rows, align)
  assert plan.num_slots % align == 0
  offsets = np.asarray(plan.group_offsets)
  assert np.all(offsets % align == 0)
  token, expert, valid = (np.asarray(a) for a in (plan.token_index, plan.expert_index, plan.valid))
  total = min(sizes.sum(), num_rows)
  assert sorted(token[valid]) == list(range(total))
  expected_expert = np.repeat(np.arange(len(sizes)), sizes)[:total]
  assert np.array_equal(expert[valid][np.argsort(token[valid])], expected_expert)
  assert np.all(token[~valid] == num_rows) and np.all(expert[~valid] == len(sizes))
  slots = np.asarray(plan.token_slots)
  assert sorted(slots) == list(range(plan.num_slots))           # a permutation
  assert np.array_equal(token[slots[:total]], np.arange(total))  # row r's slot, in row order
  assert np.array_equal(np.asarray(plan.token_offsets), np.minimum(np.arange(num_rows + 1), total))


def test_grouped_expert_mlp_errors_name_the_argument():
  rows, scores, w1, w2 = _inputs(0, 8, 16, 8, 2, jnp.float32)
  with pytest.raises(ValueError, match="scores"):
    sm.grouped_expert_mlp(rows, scores[:7], w1, w2, jnp.array([4, 4]))
  with pytest.raises(ValueError, match="group_sizes"):
    sm.grouped_expert_mlp(rows, scores, w1, w2, jnp.array([4, 4, 0]))
  with pytest.raises(TypeError, match="group_sizes"):
    sm.grouped_expert_mlp(rows, scores, w1, w2, jnp.array([4.0, 4.0]))
  with pytest.raises(TypeError, match="w1"):
    sm.grouped_expert_mlp(rows, scores, w1.astype(jnp.bfloat16), w2, jnp.array([4, 4]))


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["pallas", "cute"])
def test_grouped_expert_mlp_kernels_match_reference(backend):
  if backend == "cute":
    pytest.importorskip("cutlass")
  _check(backend, [300, 0, 77, 1000, 129], 1600, d=256, n=128, dtype=jnp.bfloat16)


@pytest.mark.gpu
def test_grouped_dispatch_example_runs_with_ragged_all_to_all():
  from examples import grouped_dispatch
  assert grouped_dispatch.main() < 2e-2
