"""Routing plan invariants and token-rounding properties for every mode."""
import jax
import jax.extend.core
import jax.numpy as jnp
import numpy as np
import pytest

import sonicmoe_jax as sm
from conftest import rel_err

MODES = ["nearest", "stochastic", "up", "down", "balanced"]


def _logits(seed, T, E):
  return jax.random.normal(jax.random.key(seed), (T, E)) * 2.0


def _route(logits, rng=None, **options):
  """sm.route jitted: one compile, not one per op (route runs eagerly in the other tests)."""
  return jax.jit(lambda l, key: sm.route(l, rng=key, **options))(logits, rng)


def _check_plan_structure(plan, T, E):
  tok = np.asarray(plan.token_index)
  exp = np.asarray(plan.expert_index)
  valid = np.asarray(plan.valid)
  sizes = np.asarray(plan.group_sizes)
  offsets = np.asarray(plan.group_offsets)
  align = plan.align
  assert offsets[0] == 0 and np.all(np.diff(offsets) == -(-sizes // align) * align)
  assert valid.sum() == sizes.sum()
  for e in range(E):
    assert np.all(exp[offsets[e]:offsets[e] + sizes[e]] == e)
    assert np.all(valid[offsets[e]:offsets[e] + sizes[e]])
  assert np.all(tok[~valid] == T) and np.all(exp[~valid] == E)
  assert np.all(np.asarray(plan.scores)[~valid] == 0)
  # (token, expert) pairs are unique
  pairs = set(zip(tok[valid].tolist(), exp[valid].tolist()))
  assert len(pairs) == valid.sum()
  # the token CSR lists exactly each token's slots
  slots = np.asarray(plan.token_slots)
  toff = np.asarray(plan.token_offsets)
  assert toff[0] == 0 and toff[-1] == valid.sum()
  for t in range(T):
    assert np.all(tok[slots[toff[t]:toff[t + 1]]] == t)


@pytest.mark.parametrize("T,E,K", [(64, 8, 2), (37, 4, 1), (20, 1, 1), (50, 64, 6)])
def test_topk_plan(T, E, K):
  logits = _logits(T + E, T, E)
  plan, stats = _route(logits, k=K)
  _check_plan_structure(plan, T, E)
  assert plan.fixed_k and plan.num_slots == T * K
  expected = set()
  top = np.argsort(-np.asarray(logits), axis=1)[:, :K]
  for t in range(T):
    for e in top[t]:
      expected.add((t, int(e)))
  got = set(zip(np.asarray(plan.token_index).tolist(), np.asarray(plan.expert_index).tolist()))
  assert got == expected
  # softmax over the K selected logits: each token's scores sum to 1
  per_token = np.zeros(T)
  np.add.at(per_token, np.asarray(plan.token_index), np.asarray(plan.scores))
  np.testing.assert_allclose(per_token, 1.0, rtol=1e-5)
  np.testing.assert_array_equal(stats.topk_counts, stats.expert_counts)


def test_softmax_all_scores():
  logits = _logits(1, 32, 8)
  probs = np.asarray(jax.nn.softmax(logits, axis=-1))
  plan, _ = sm.route(logits, k=3, score_fn="softmax_all")
  tok, exp = np.asarray(plan.token_index), np.asarray(plan.expert_index)
  np.testing.assert_allclose(np.asarray(plan.scores), probs[tok, exp], rtol=1e-5)
  plan, _ = sm.route(logits, k=3, score_fn="softmax_all", renormalize=True)
  per_token = np.zeros(32)
  np.add.at(per_token, np.asarray(plan.token_index), np.asarray(plan.scores))
  np.testing.assert_allclose(per_token, 1.0, rtol=1e-5)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("T,E,K,tile", [(256, 8, 2, 16), (300, 16, 4, 32), (128, 4, 1, 8)])
def test_rounding_properties(mode, T, E, K, tile):
  logits = _logits(T * E + tile, T, E)
  plan, stats = _route(logits, k=K, rounding=mode, tile=tile, rng=jax.random.key(3))
  _check_plan_structure(plan, T, E)
  f = np.asarray(stats.topk_counts)
  c = np.asarray(stats.expert_counts)
  assert np.all(c % tile == 0), "every count is a multiple of the tile"
  assert np.all(np.abs(c - f) < tile), "every count moves by less than one tile"
  if mode == "up":
    assert np.all(c >= f)
  if mode == "down":
    assert np.all(c <= f)
  if mode == "nearest":
    down = f // tile * tile
    up = np.where(f > down, down + tile, down)
    nearest = np.where((up - f) < (f - down), up, down)
    np.testing.assert_array_equal(c, nearest)
  if mode == "balanced":
    assert abs(int(c.sum()) - int(f.sum())) <= tile // 2
  assert int(stats.changed_pairs) == int(np.abs(c - f).sum())

  # chosen tokens rank before unchosen: an expert keeps all its chosen tokens before any
  # unchosen one, and drops only its lowest-scoring chosen tokens
  raw = np.asarray(logits, np.float64)
  top = np.argsort(-raw, axis=1)[:, :K]
  top_vals = np.take_along_axis(raw, top, axis=1)
  c_t = np.log(np.exp(top_vals - top_vals.max(1, keepdims=True)).sum(1)) + top_vals.max(1)
  lg = np.exp(raw - c_t[:, None])  # the pair scores that rank tokens within an expert
  chosen = np.zeros((T, E), bool)
  np.put_along_axis(chosen, top, True, axis=1)
  tok, exp, valid = (np.asarray(a) for a in (plan.token_index, plan.expert_index, plan.valid))
  scores = np.asarray(plan.scores)
  for e in range(E):
    mine = tok[valid & (exp == e)]
    kept = np.zeros(T, bool)
    kept[mine] = True
    chosen_e = chosen[:, e]
    if c[e] >= f[e]:
      assert np.all(kept[chosen_e]), "rounding up keeps every chosen token"
      added = kept & ~chosen_e
      if added.any() and (~kept & ~chosen_e).any():
        assert lg[added, e].min() >= lg[~kept & ~chosen_e, e].max(), "adds the best unchosen tokens"
    else:
      assert not np.any(kept & ~chosen_e), "rounding down adds no unchosen token"
      dropped = chosen_e & ~kept
      if dropped.any() and kept.any():
        assert lg[dropped, e].max() <= lg[kept & chosen_e, e].min(), "drops the lowest scores"
  assert np.all(scores[valid] > 0) and np.all(scores[valid] <= 1.0 + 1e-6)


# (T, E, seed) of the selection checks (a stable sort's choice)
SELECTION_SHAPES = [(97, 12, 0), (1000, 5, 1), (1, 3, 2), (4099, 4, 3)]


def check_top_per_column(select, T, E, seed):
  """select(values, counts) takes what a stable descending sort of each column would: ties
  (values from a small set, both signs) go to the lower row; counts 0, 1 and T among them."""
  rng = np.random.default_rng(seed)
  values = rng.choice(np.array([-0.75, -0.5, -0.0, 0.0, 0.25, 0.5, 1.0], np.float32), (T, E))
  values[:, 0] = rng.normal(size=T)
  counts = rng.integers(0, T + 1, E)
  counts[1], counts[2] = 0, T
  if T > 1:
    counts[-1] = 1
  got = np.asarray(select(jnp.asarray(values), jnp.asarray(counts, jnp.int32)))
  order = np.argsort(-values, axis=0, kind="stable")
  for e in range(E):
    want = np.zeros(T, bool)
    want[order[:counts[e], e]] = True
    np.testing.assert_array_equal(got[:, e], want, err_msg=f"column {e}, count {counts[e]}")


@pytest.mark.parametrize("T,E,seed", SELECTION_SHAPES)
def test_top_per_column_equals_stable_sort(T, E, seed):
  """The sort-free selection behind token rounding (32 bisection passes over [T, E])."""
  from sonicmoe_jax.core.routing import top_per_column
  check_top_per_column(jax.jit(top_per_column), T, E, seed)


def test_rounded_slot_scores_keep_no_pair_scores_for_the_backward(capsys):
  """Under rounding the slots' scores come from their own logits: the backward of the plan's
  scores saves no [T, E] float array (the pairs' scores only rank the tokens)."""
  T, E = 256, 8
  loss = lambda l: jnp.sum(sm.route(l, k=2, rounding="nearest", tile=16)[0].scores ** 2)
  from jax.ad_checkpoint import print_saved_residuals
  print_saved_residuals(loss, _logits(1, T, E))
  saved = capsys.readouterr().out
  assert f"f32[{T},{E}]" not in saved, saved


@pytest.mark.parametrize("mode", ["up", "down"])
def test_rounding_with_all_scores_tied(mode):
  T, E, K, tile = 64, 4, 2, 16
  logits = jnp.zeros((T, E)).at[:, 0].set(1.0)   # ties everywhere past expert 0
  plan, stats = sm.route(logits, k=K, rounding=mode, tile=tile)
  _check_plan_structure(plan, T, E)
  assert np.all(np.asarray(stats.expert_counts) % tile == 0)


def test_stochastic_rounding_needs_key_and_is_reproducible():
  logits = _logits(0, 256, 8)
  with pytest.raises(ValueError, match="rng"):
    sm.route(logits, k=2, rounding="stochastic", tile=16)
  a = sm.route(logits, k=2, rounding="stochastic", tile=16, rng=jax.random.key(1))[1].expert_counts
  b = sm.route(logits, k=2, rounding="stochastic", tile=16, rng=jax.random.key(1))[1].expert_counts
  np.testing.assert_array_equal(a, b)
  draws = [np.asarray(sm.route(logits, k=2, rounding="stochastic", tile=16,
                               rng=jax.random.key(s))[1].expert_counts) for s in range(20)]
  assert len({tuple(d) for d in draws}) > 1, "different keys give different roundings"


def test_stochastic_rounding_is_unbiased():
  counts = jnp.array([5, 21, 40, 63, 64], jnp.int32)
  keys = jax.random.split(jax.random.key(0), 4000)
  rounded = jax.vmap(lambda k: sm.round_counts(counts, tile=16, num_tokens=1000,
                                               mode="stochastic", rng=k))(keys)
  np.testing.assert_allclose(np.asarray(rounded).mean(0), np.asarray(counts), atol=1.0)


def test_round_up_is_capped_by_token_count():
  # f = 70 with tile 64 and T = 100: rounding up to 128 would need more tokens than exist.
  counts = jnp.array([70, 30], jnp.int32)
  out = sm.round_counts(counts, tile=64, num_tokens=100, mode="up")
  np.testing.assert_array_equal(out, [64, 64])


def test_rounding_under_jit():
  logits = _logits(5, 128, 8)
  f = jax.jit(lambda l: sm.route(l, k=2, rounding="nearest", tile=16)[0].group_sizes)
  np.testing.assert_array_equal(f(logits), sm.route(logits, k=2, rounding="nearest", tile=16)[0].group_sizes)


def test_aux_losses():
  T, E = 64, 8
  uniform = jnp.zeros((T, E))
  # uniform router with perfectly balanced counts gives load-balancing loss 1
  counts = jnp.full((E,), T * 2 // E, jnp.int32)
  np.testing.assert_allclose(sm.load_balancing_loss(uniform, counts, 2), 1.0, rtol=1e-6)
  np.testing.assert_allclose(sm.z_loss(uniform), np.log(E) ** 2, rtol=1e-6)
  skewed = uniform.at[:, 0].set(10.0)
  _, stats = sm.route(skewed, k=1)
  assert float(stats.load_balancing_loss) > 5.0


@pytest.mark.parametrize("rounding,tile", [(None, 1), ("nearest", 16), ("up", 8)])
@pytest.mark.parametrize("align", [8, 32])
def test_aligned_plan(rounding, tile, align):
  T, E, K = 150, 8, 2
  logits = _logits(align + tile, T, E)
  plan, stats = _route(logits, k=K, rounding=rounding, tile=max(tile, 1), align=align)
  dense, _ = _route(logits, k=K, rounding=rounding, tile=max(tile, 1))
  _check_plan_structure(plan, T, E)
  offsets = np.asarray(plan.group_offsets)
  assert np.all(offsets % align == 0) and plan.num_slots % align == 0
  assert offsets[-1] <= plan.num_slots
  np.testing.assert_array_equal(plan.group_sizes, dense.group_sizes)
  # the same (token, expert, score) pairs, only moved
  def pairs(p):
    v = np.asarray(p.valid)
    return sorted(zip(np.asarray(p.token_index)[v].tolist(), np.asarray(p.expert_index)[v].tolist(),
                      np.round(np.asarray(p.scores)[v], 6).tolist()))
  assert pairs(plan) == pairs(dense)


def test_aligned_layer_matches_dense_layout():
  from conftest import make_inputs, rel_err
  from sonicmoe_jax import layer, backends
  args = make_inputs(0, 96, 32, 16, 8)
  ops = backends.resolve("xla")._replace(align=32)
  x, r, w1, w2 = args

  def run(ops):
    plan, _ = sm.route(sm.router_logits(x, r), k=2, align=ops.align)
    return layer.expert_mlp(ops, x, plan.scores, w1, w2, plan)
  assert rel_err(run(ops), run(backends.resolve("xla"))) < 1e-5


def test_aggregate_with_many_slots_per_token():
  """Rounding up with K=1 and a wide tile gives tokens several slots (more than k): the
  gather-and-sum reads every one of them, in as many column blocks as needed."""
  from sonicmoe_jax.core import xla_ops
  T, E, K, d = 96, 8, 1, 16
  plan, _ = sm.route(_logits(5, T, E), k=K, rounding="up", tile=32)
  per_token = np.bincount(np.asarray(plan.token_index)[np.asarray(plan.valid)], minlength=T)
  assert per_token.max() > 2 * K, "the case needs tokens with more than two blocks of slots"
  y = jax.random.normal(jax.random.key(1), (plan.num_slots, d))
  got = xla_ops.aggregate(y, plan.scores, plan)
  tok, valid, s = (np.asarray(a) for a in (plan.token_index, plan.valid, plan.scores))
  want = np.zeros((T, d))
  np.add.at(want, tok[valid], np.asarray(y, np.float64)[valid] * s[valid, None])
  np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("n", [1, 2, 7, 8, 9, 129, 1000])
def test_count_below_matches_searchsorted(n):
  from sonicmoe_jax.core.routing import count_below
  rng = np.random.default_rng(n)
  values = np.sort(rng.integers(0, 40, n)).astype(np.int32)
  queries = rng.integers(-3, 44, 200).astype(np.int32)
  for inclusive, side in ((False, "left"), (True, "right")):
    got = count_below(jnp.asarray(values), jnp.asarray(queries), inclusive=inclusive)
    np.testing.assert_array_equal(got, np.searchsorted(values, queries, side=side))


@pytest.mark.parametrize("rounding", [None, "nearest", "balanced"])
def test_routing_plan_has_no_device_loops(rounding):
  # a loop in the plan is a GPU while loop: one host round trip per step (jnp.searchsorted's)
  logits = _logits(3, 256, 16)
  text = jax.jit(lambda l: sm.route(l, k=2, rounding=rounding, tile=64, align=64)).lower(logits).as_text()
  assert "stablehlo.while" not in text


PLAN_FIELDS = ("token_index", "expert_index", "scores", "valid", "group_sizes", "group_offsets",
               "token_slots", "token_offsets")


@pytest.mark.parametrize("T,E,K,align", [(300, 8, 2, 1), (300, 8, 2, 128), (37, 4, 1, 16),
                                         (20, 1, 1, 1), (1000, 64, 6, 128), (129, 130, 3, 8),
                                         (256, 16, 16, 1)])
def test_topk_plan_by_counting_equals_the_sorted_plan(T, E, K, align):
  """The counting plan (a blocked prefix count down the [T, E] chosen mask: T not a multiple
  of its 128-row blocks, experts without tokens, K = 1, K = E, E = 1) equals the sorted plan
  field for field, and gradients reach the scores alike."""
  from sonicmoe_jax.core import routing
  logits = _logits(T + E, T, E)
  if E > 4:
    logits = logits.at[:, 0].add(-100.0)   # expert 0 gets no tokens
  values, experts = jax.lax.top_k(logits, K)
  scores = jax.nn.softmax(values, axis=-1)
  # (jitted: one compile a method, not one per op)
  plan_of = lambda m: lambda s: routing._topk_plan(s, experts, E, align, m)
  plans = {m: jax.jit(plan_of(m))(scores) for m in ("count", "sort")}
  for field in PLAN_FIELDS:
    np.testing.assert_array_equal(getattr(plans["count"], field), getattr(plans["sort"], field),
                                  err_msg=field)
  weights = jax.random.normal(jax.random.key(1), (plans["sort"].num_slots,))
  grads = {m: jax.jit(jax.grad(lambda s: jnp.sum(plan_of(m)(s).scores * weights)))(scores)
           for m in ("count", "sort")}
  np.testing.assert_array_equal(grads["count"], grads["sort"])
  assert np.any(np.asarray(grads["count"]) != 0)


@pytest.mark.parametrize("rows,cols", [(517, 40), (2**24, 1)])
def test_column_prefix_counts_match_numpy(rows, cols):
  """The blocked count (odd rows), and from 2^24 rows on (fp32 no longer exact) the plain
  cumulative sum."""
  from sonicmoe_jax.core.routing import _column_prefix_counts
  mask = np.random.default_rng(0).random((rows, cols)) < 0.3
  counts, totals = _column_prefix_counts(jnp.asarray(mask))
  np.testing.assert_array_equal(counts, np.cumsum(mask, axis=0))
  np.testing.assert_array_equal(totals, mask.sum(axis=0))


def test_topk_plan_method_is_checked_and_many_experts_sort(monkeypatch):
  from sonicmoe_jax.core import routing
  values, experts = jax.lax.top_k(_logits(0, 64, 8), 2)
  with pytest.raises(ValueError, match="method must be 'count', 'sort' or None; got 'radix'"):
    routing._topk_plan(values, experts, 8, 1, "radix")
  calls = []
  monkeypatch.setattr(routing, "_pairs_to_plan", lambda *a, **kw: calls.append(a[2]))
  routing._topk_plan(values, experts, 8, 1)
  assert calls == []                       # 8 experts: counted
  monkeypatch.setattr(routing, "COUNT_MAX_EXPERTS", 4)
  routing._topk_plan(values, experts, 8, 1)
  assert calls == [8]                      # more than COUNT_MAX_EXPERTS: sorted


@pytest.mark.parametrize("num_experts", [1, 7, 300])
def testsort_pairs_by_expert_is_a_stable_argsort(num_experts):
  from sonicmoe_jax.core.routing import sort_pairs_by_expert
  flat = np.random.default_rng(num_experts).integers(0, num_experts + 1, 5000).astype(np.int32)
  order, sorted_expert = sort_pairs_by_expert(jnp.asarray(flat), num_experts)
  want = np.argsort(flat, kind="stable")
  np.testing.assert_array_equal(order, want)
  np.testing.assert_array_equal(sorted_expert, flat[want])


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
def test_router_logits_of_16_bit_inputs_equal_the_float32_product(dtype):
  """Same-dtype 16-bit X and Wr skip the fp32 copy of X; the logits are still the fp32 product
  of the same values (exact products, fp32 sums), and gradients flow as before."""
  x = jax.random.normal(jax.random.key(0), (300, 192)).astype(dtype)
  w = (jax.random.normal(jax.random.key(1), (192, 24)) / 8).astype(dtype)
  got = sm.router_logits(x, w)
  want = jnp.dot(x.astype(jnp.float32), w.astype(jnp.float32), precision="highest")
  assert got.dtype == jnp.float32
  np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
  gx, gw = jax.grad(lambda a, b: jnp.sum(jnp.tanh(sm.router_logits(a, b))), argnums=(0, 1))(x, w)
  rx, rw = jax.grad(lambda a, b: jnp.sum(jnp.tanh(jnp.dot(a.astype(jnp.float32), b.astype(jnp.float32),
                                                          precision="highest"))), argnums=(0, 1))(x, w)
  assert gx.dtype == dtype and gw.dtype == dtype
  # bfloat16: dlogits rounded for the backward's GEMMs; errors relative to the whole gradient
  assert rel_err(gx, rx) < 1e-2 and rel_err(gw, rw) < 1e-2
  # with bfloat16 the backward's GEMMs read bfloat16 operands too (fp32 ones ran ~3x slower on
  # the H200); float16 keeps fp32 operands there (dlogits could flush to zero in float16)
  grad_jaxpr = jax.make_jaxpr(jax.grad(lambda a, b: jnp.sum(sm.router_logits(a, b) ** 2),
                                       argnums=(0, 1)))(x, w)
  backward = [e for e in grad_jaxpr.jaxpr.eqns if e.primitive.name == "dot_general"]
  forward = [e for eqn in grad_jaxpr.jaxpr.eqns for sub in jax.extend.core.jaxprs_in_params(eqn.params)
             for e in sub.eqns if e.primitive.name == "dot_general"]
  assert len(forward) == 1 and {v.aval.dtype for v in forward[0].invars} == {jnp.dtype(dtype)}
  want = jnp.dtype(dtype if dtype == jnp.bfloat16 else jnp.float32)
  assert len(backward) == 2 and {v.aval.dtype for e in backward for v in e.invars} == {want}


def test_aggregate_of_a_plan_from_assignments_has_no_device_loop():
  """A plan from given assignments bounds each token's slots (max_token_slots = J), so the
  aggregation unrolls its blocks (no while loop: a host round trip per step on a GPU) and
  equals the sum; under token rounding the bound is unknown and the loop stays."""
  from sonicmoe_jax.core import routing, xla_ops
  T, E, J, d = 50, 6, 3, 16
  rng = np.random.default_rng(0)
  experts = rng.integers(0, E + 1, (T, J)).astype(np.int32)    # E: no expert
  scores = rng.random((T, J)).astype(np.float32)
  plan = routing.plan_from_experts(jnp.asarray(experts), jnp.asarray(scores), E, align=4)
  assert plan.max_token_slots == J and not plan.fixed_k
  y = jnp.asarray(rng.normal(size=(plan.num_slots, d)), jnp.float32)
  text = jax.jit(lambda v: xla_ops.aggregate(v, plan.scores, plan)).lower(y).as_text()
  assert "stablehlo.while" not in text
  got = xla_ops.aggregate(y, plan.scores, plan)
  tok, sc, valid = (np.asarray(a) for a in (plan.token_index, plan.scores, plan.valid))
  want = np.zeros((T, d), np.float32)
  np.add.at(want, tok[valid], np.asarray(y)[valid] * sc[valid, None])
  np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
  rounded, _ = sm.route(_logits(1, 256, 8), k=2, rounding="nearest", tile=64)
  assert rounded.max_token_slots is None


def test_group_row_ranges_clamp_sizes_to_groups():
  """The weight gradients' k ranges: each expert's (first slot, end), the end its size past
  the first slot clamped to the group, or the group's end without sizes."""
  from sonicmoe_jax.core import routing
  offsets = jnp.array([0, 256, 256, 896, 1024], jnp.int32)
  np.testing.assert_array_equal(routing.group_row_ranges(offsets),
                                [0, 256, 256, 256, 256, 896, 896, 1024])
  np.testing.assert_array_equal(routing.group_row_ranges(offsets, jnp.array([200, 0, 700, 1])),
                                [0, 200, 256, 256, 256, 896, 896, 897])
