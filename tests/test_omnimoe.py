"""OmniMoE: Cartesian top-K == brute force; expert-centric == token-centric == dense float32
reference (forward and gradients, relative 1e-4); errors."""
import json
import re
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from conftest import rel_err
from cute_helpers import FFI_TARGET, cuda_module, needs_cute
from models import omnimoe


@pytest.mark.parametrize("method", [None, "candidates", "bisection"])
@pytest.mark.parametrize("rows,cols,k", [(8, 8, 1), (8, 8, 7), (16, 16, 40), (4, 4, 16),
                                         (32, 8, 50), (8, 32, 200)])
def test_cartesian_topk_equals_brute_force(rows, cols, k, method):
  ks = jax.random.split(jax.random.key(rows + k), 2)
  pr = jax.nn.log_softmax(jax.random.normal(ks[0], (12, rows)) * 2)
  pc = jax.nn.log_softmax(jax.random.normal(ks[1], (12, cols)) * 2)
  vals, ids = jax.jit(omnimoe.cartesian_topk, static_argnums=(2, 3))(pr, pc, k, method)
  full = (pr[:, :, None] + pc[:, None, :]).reshape(12, -1)
  ref_vals, ref_ids = jax.lax.top_k(full, k)
  np.testing.assert_array_equal(-np.sort(-np.asarray(vals), 1), ref_vals)
  np.testing.assert_array_equal(np.sort(ids, 1), np.sort(ref_ids, 1))
  np.testing.assert_array_equal(vals, np.take_along_axis(np.asarray(full), np.asarray(ids), 1))


@pytest.mark.parametrize("rows,cols,k", [(8, 8, 5), (16, 16, 40), (4, 16, 30)])
def test_cartesian_topk_with_ties_takes_k_distinct_experts_of_the_top_scores(rows, cols, k):
  """Scores on a coarse grid tie often: the k scores are still the k largest, the experts
  distinct, and both methods break ties alike (lower row, then column ranks first)."""
  ks = jax.random.split(jax.random.key(k), 2)
  pr = jnp.round(jax.random.normal(ks[0], (16, rows)) * 2) / 4
  pc = jnp.round(jax.random.normal(ks[1], (16, cols)) * 2) / 4
  vals, ids = omnimoe.cartesian_topk(pr, pc, k, "bisection")
  full = np.asarray((pr[:, :, None] + pc[:, None, :]).reshape(16, -1))
  np.testing.assert_array_equal(-np.sort(-np.asarray(vals), 1), -np.sort(-full, 1)[:, :k])
  np.testing.assert_array_equal(vals, np.take_along_axis(full, np.asarray(ids), 1))
  assert all(len(set(row)) == k for row in np.asarray(ids).tolist())
  _, listed = omnimoe.cartesian_topk(pr, pc, k, "candidates")
  np.testing.assert_array_equal(np.sort(ids, 1), np.sort(listed, 1))
  with pytest.raises(ValueError, match="method must be"):
    omnimoe.cartesian_topk(pr, pc, k, "sort")


def _dense_reference(x, w, v, g, ids):
  n = w.shape[0]
  gates = jnp.zeros((x.shape[0], n)).at[jnp.arange(x.shape[0])[:, None], ids].add(g)
  return (gates * jax.nn.silu(x @ w.T)) @ v


@pytest.mark.parametrize("T,N,k,group", [(10, 64, 8, 4), (33, 256, 40, 16), (5, 16, 16, 3)])
def test_schedules_match_dense_reference(T, N, k, group):
  d = 16
  ks = jax.random.split(jax.random.key(T), 5)
  x = jax.random.normal(ks[0], (T, d))
  w = jax.random.normal(ks[1], (N, d)) / 4
  v = jax.random.normal(ks[2], (N, d)) / 4
  rows, cols = omnimoe.grid_shape(N)
  wr, wc = jax.random.normal(ks[3], (d, rows)), jax.random.normal(ks[4], (d, cols))
  cot = jax.random.normal(jax.random.key(0), (T, d))

  def run(kind):
    def f(x, w, v, wr, wc):
      g, ids = omnimoe.route(x, wr, wc, k)
      if kind == "dense":
        return _dense_reference(x, w, v, g, ids)
      if kind == "token":
        return omnimoe.token_centric(x, w, v, g, ids)
      return omnimoe.expert_centric(omnimoe.XlaGroupedOps, x, w, v, g, omnimoe.schedule(ids, N, group))
    out = jax.jit(f)(x, w, v, wr, wc)   # (jitted: one compile, not one per op)
    grads = jax.jit(jax.grad(lambda *a: jnp.sum(f(*a) * cot), argnums=(0, 1, 2, 3, 4)))(
        x, w, v, wr, wc)
    return out, grads

  ref_out, ref_g = run("dense")
  for kind in ("token", "expert"):
    out, grads = run(kind)
    assert rel_err(out, ref_out) < 1e-4, kind
    for name, a, b in zip(("x", "w", "v", "w_row", "w_col"), grads, ref_g):
      assert rel_err(a, b) < 1e-4, (kind, name)


def test_layer_and_errors():
  m = omnimoe.OmniMoE(32, 64, 8, 64, group=8, rngs=nnx.Rngs(0))
  y, stats = m(jax.random.normal(jax.random.key(1), (2, 10, 32)))
  assert y.shape == (2, 10, 32) and int(stats.expert_counts.sum()) == 2 * 10 * 8
  t = omnimoe.OmniMoE(32, 64, 8, 64, execution="token_centric", rngs=nnx.Rngs(0))
  x = jax.random.normal(jax.random.key(2), (7, 32))
  assert rel_err(t(x)[0], m(x)[0]) < 1e-5  # same init, same math
  small = omnimoe.OmniMoE(32, 64, 8, 64, group=8, chunk_bytes=1, rngs=nnx.Rngs(0))
  assert rel_err(small(x)[0], m(x)[0]) < 1e-5  # one token a chunk: the same numbers
  with pytest.raises(ValueError, match="chunk_bytes must be >= 1; got 0"):
    omnimoe.OmniMoE(32, 64, 8, 64, chunk_bytes=0, rngs=nnx.Rngs(0))
  with pytest.raises(ValueError, match="perfect square"):
    omnimoe.OmniMoE(32, 60, 8, 64, rngs=nnx.Rngs(0))
  with pytest.raises(ValueError, match="k must satisfy"):
    omnimoe.OmniMoE(32, 64, 65, 64, rngs=nnx.Rngs(0))
  with pytest.raises(ValueError, match="execution must be"):
    omnimoe.OmniMoE(32, 64, 8, 64, execution="scatter", rngs=nnx.Rngs(0))


def test_omnimoe_benchmark_sweeps_the_papers_points():
  from benchmarks import omnimoe_bench
  points = omnimoe_bench.sweep_points([3_000_000, 7_000_000, 28_000_000], [1024, 4096, 16384])
  assert points == [(3_000_000, 1024), (7_000_000, 1024), (28_000_000, 1024),
                    (3_000_000, 4096), (3_000_000, 16384), (28_000_000, 4096)]
  k, d_mlp, params = omnimoe_bench.table_a_point(1024, 28_000_000, 1024 * 1024)
  assert (k, d_mlp) == (4096, 6144) and abs(params - 28e6) < 0.1 * 28e6
  assert omnimoe_bench.table_a_point(1024, 4_000_000, 1024 * 1024)[0] == 576   # about 512


def test_omnimoe_benchmark_tiny(tmp_path):
  from benchmarks import omnimoe_bench
  recs = omnimoe_bench.main(["--tiny", "--out", str(tmp_path)])
  assert json.loads((tmp_path / "omnimoe_bench.json").read_text()) == json.loads(json.dumps(recs))
  assert {r["impl"] for r in recs} == {"omnimoe", "peer_token_centric", "deepseekmoe", "dense"}
  assert all(r["status"] == "ok" and r["fwd_ms"] > 0 and r["step_ms"] > 0 for r in recs), recs
  assert recs[0]["command"] == f"python -m benchmarks.omnimoe_bench --tiny --out {tmp_path}"
  for r in recs:  # |E_active| and the scheduling alone for the OmniMoE layers (256 atomic experts)
    omni = r["impl"] in ("omnimoe", "peer_token_centric")
    assert (1 <= r["active_experts"] <= 256) if omni else r["active_experts"] is None
    assert (r["schedule_ms"] > 0) if omni else "schedule_ms" not in r


@pytest.mark.parametrize("align", [1, 8])
def test_aligned_schedule_same_result(align):
  T, N, k, d, group = 6, 64, 8, 16, 4
  ks = jax.random.split(jax.random.key(7), 4)
  x, w, v = (jax.random.normal(kk, (n_, d)) for kk, n_ in zip(ks[:3], (T, N, N)))
  ids = jax.random.permutation(ks[3], N)[: T * k].reshape(T, k)  # distinct experts
  g = jax.nn.softmax(jax.random.normal(ks[3], (T, k)), -1)
  sched = omnimoe.schedule(ids, N, group, align)
  assert np.all(np.asarray(sched.row_offsets) % align == 0)
  out = omnimoe.expert_centric(omnimoe.XlaGroupedOps, x, w, v, g, sched)
  assert rel_err(out, omnimoe.token_centric(x, w, v, g, ids)) < 1e-5


def test_pallas_grouped_matches_xla_interpret():
  """Expert-centric GEMMs on the Pallas kernels (interpret mode): forward and gradients."""
  T, N, k, d, group = 32, 256, 8, 128, 128
  ks = jax.random.split(jax.random.key(11), 5)
  x = jax.random.normal(ks[0], (T, d)).astype(jnp.bfloat16)
  w = (jax.random.normal(ks[1], (N, d)) / 8).astype(jnp.bfloat16)
  v = (jax.random.normal(ks[2], (N, d)) / 4).astype(jnp.bfloat16)
  rows, cols = omnimoe.grid_shape(N)
  g, ids = omnimoe.route(x, jax.random.normal(ks[3], (d, rows)), jax.random.normal(ks[4], (d, cols)), k)
  cot = jax.random.normal(jax.random.key(1), (T, d))

  def run(ops):
    f = lambda x, w, v, g: omnimoe.expert_centric(ops, x, w, v, g, omnimoe.schedule(ids, N, group, ops.align))
    return jax.jit(lambda *a: (f(*a), jax.grad(lambda *b: jnp.sum(   # one program: 1.4x faster
        f(*b).astype(jnp.float32) * cot), argnums=(0, 1, 2, 3))(*a)))(x, w, v, g)

  out_p, g_p = run(omnimoe.PallasGroupedOps)
  out_x, g_x = run(omnimoe.XlaGroupedOps)
  assert rel_err(out_p, out_x) < 2e-2
  for name, a, b in zip(("x", "w", "v", "g"), g_p, g_x):
    assert rel_err(a, b) < 2e-2, name


@pytest.mark.gpu
def test_pallas_grouped_matches_float32_reference_on_gpu():
  """On the GPU (the Pallas GEMMs, x's rows gathered in the scores GEMM, the CuTe per-token
  sums where installed): output and gradients against the dense float32 reference, at a token
  count that is no multiple of a tile and a group with no tasks."""
  T, N, k, d, group = 300, 1024, 24, 256, 128
  ks = jax.random.split(jax.random.key(21), 5)
  x = jax.random.normal(ks[0], (T, d))
  w, v = jax.random.normal(ks[1], (N, d)) / 16, jax.random.normal(ks[2], (N, d)) / 4
  rows, cols = omnimoe.grid_shape(N)
  g, ids = omnimoe.route(x, jax.random.normal(ks[3], (d, rows)), jax.random.normal(ks[4], (d, cols)), k)
  ids = jnp.where(ids // group == 3, ids + group, ids)      # group 3 gets no tasks
  cot = jax.random.normal(jax.random.key(3), (T, d))
  bf = lambda a: a.astype(jnp.bfloat16)
  sched = omnimoe.schedule(ids, N, group, omnimoe.PallasGroupedOps.align)
  assert int(sched.padded_group_sizes[3]) == 0
  f = lambda *a: omnimoe.expert_centric(omnimoe.PallasGroupedOps, *map(bf, a), sched)
  ref = lambda *a: _dense_reference(*a, ids)
  run = lambda f: jax.jit(lambda *a: (f(*a), jax.grad(lambda *b: jnp.sum(
      f(*b).astype(jnp.float32) * cot), argnums=(0, 1, 2, 3))(*a)))(x, w, v, g)
  (out, grads), (want, want_grads) = run(f), run(ref)
  assert rel_err(out, want) < 2e-2
  for name, a, b in zip(("x", "w", "v", "g"), grads, want_grads):
    assert rel_err(a, b) < 2e-2, name


def test_token_chunks_are_as_few_and_as_even_as_the_limit_allows():
  """split_tokens: ceil(T / chunk) chunks of equal size, padded by fewer tokens than chunks
  (4096 tokens at 1638 a chunk: 3 of 1366, not 3 of 1638); a limit past T is one chunk of T
  (not one of `chunk` tokens, mostly padding); unsplit gives back [T, ...]."""
  x = jnp.arange(4096 * 2, dtype=jnp.float32).reshape(4096, 2)
  (chunks,), unsplit = omnimoe.split_tokens(1638, x)
  assert chunks.shape == (3, 1366, 2)
  np.testing.assert_array_equal(unsplit(chunks), x)
  (chunks,), _ = omnimoe.split_tokens(58254, x[:256])
  assert chunks.shape == (1, 256, 2)
  (chunks,), unsplit = omnimoe.split_tokens(5, x[:37])
  assert chunks.shape == (8, 5, 2) and np.all(np.asarray(chunks[-1, 2:]) == 0)
  np.testing.assert_array_equal(unsplit(chunks), x[:37])


@pytest.mark.parametrize("execution", ["token_centric", "expert_centric"])
def test_chunks_of_tokens_give_the_same_output_and_gradients(execution):
  """Both executions in chunks of tokens (the last one padded; expert-centric, larger ones in
  the forward than in the backward): the same output and gradients as in one piece, and the
  lowered program loops over chunks without a whole-batch array."""
  T, N, k, d, group = 37, 64, 8, 16, 4
  ks = jax.random.split(jax.random.key(3), 5)
  x = jax.random.normal(ks[0], (T, d))
  w, v = jax.random.normal(ks[1], (N, d)) / 4, jax.random.normal(ks[2], (N, d)) / 4
  g = jax.nn.softmax(jax.random.normal(ks[3], (T, k)), -1)
  ids = jax.random.randint(ks[4], (T, k), 0, N)
  cot = jax.random.normal(jax.random.key(9), (T, d))
  if execution == "token_centric":
    per_token = 2 * k * d * 4                       # bytes of one token's gathers
    f = lambda chunk: lambda *a: omnimoe.token_centric(*a, ids, chunk_bytes=chunk * per_token)
  else:
    per_token = k * (6 * d + 12 * group)            # bytes of one token's task rows (backward)
    # the forward in chunks of at most 15 tokens (3 of 13), the backward of 5 (8, one padded)
    assert omnimoe.expert_centric_chunk(d, k, group, 5 * per_token, backward=False) == 15
    f = lambda chunk: lambda *a: omnimoe.expert_centric_in_chunks(
        omnimoe.XlaGroupedOps, *a, ids, N, group, chunk_bytes=chunk * per_token)

  def run(chunk):
    fn = f(chunk)
    return fn(x, w, v, g), jax.grad(lambda *a: jnp.sum(fn(*a) * cot), argnums=(0, 1, 2, 3))(x, w, v, g)

  whole, whole_grads = run(T)
  chunked, chunked_grads = run(5)
  assert rel_err(whole, omnimoe.token_centric(x, w, v, g, ids)) < 1e-5
  assert rel_err(chunked, whole) < 1e-5
  for a, b in zip(chunked_grads, whole_grads):
    assert rel_err(a, b) < 1e-5
  text = jax.jit(f(5)).lower(x, w, v, g).as_text()
  assert "while" in text and f"{T}x{k}x{d}" not in text and f"{T * k}x{d}" not in text


@pytest.mark.parametrize("align", [1, 8])
def test_schedule_rows_are_each_groups_tokens_once_in_order(align):
  """Each group's rows hold its tokens in ascending order, each token once (its tasks in the
  group merged into one row), every task sits in a row of its token, and token_rows lists each
  token's rows once, tokens in order."""
  T, N, k, group = 40, 64, 6, 8
  ids = jax.vmap(lambda key: jax.random.permutation(key, N)[:k])(
      jax.random.split(jax.random.key(5), T)).astype(jnp.int32)
  sched = omnimoe.schedule(ids, N, group, align)
  offsets, row_token = np.asarray(sched.row_offsets), np.asarray(sched.row_token)
  assert len(offsets) - 1 == N // group
  for q in range(len(offsets) - 1):
    tokens = row_token[offsets[q]:offsets[q + 1]]
    tokens = tokens[tokens < T]
    want = [t for t in range(T) if (np.asarray(ids[t]) // group == q).any()]
    np.testing.assert_array_equal(tokens, want)
  task_row = np.asarray(sched.task_row).reshape(T, k)
  assert np.all(row_token[task_row] == np.arange(T)[:, None])
  token_rows, token_offsets = np.asarray(sched.token_rows), np.asarray(sched.token_offsets)
  for t in range(T):
    rows = token_rows[token_offsets[t]:token_offsets[t + 1]]
    np.testing.assert_array_equal(np.sort(rows), np.flatnonzero(row_token == t))


def test_expert_centric_with_empty_groups_and_a_token_in_one_group():
  """Groups left with no tasks (fewer active experts than the groups hold) and a token whose
  experts all fall in one group (one row, all its weights in it): the dense reference's output
  and gradients."""
  T, N, k, d, group = 9, 64, 4, 16, 4
  ks = jax.random.split(jax.random.key(12), 4)
  x = jax.random.normal(ks[0], (T, d))
  w, v = jax.random.normal(ks[1], (N, d)) / 4, jax.random.normal(ks[2], (N, d)) / 4
  g = jax.nn.softmax(jax.random.normal(ks[3], (T, k)), -1)
  ids = jnp.asarray([[0, 1, 2, 3]] + [[8, 9, 40, 41]] * (T - 1), jnp.int32)  # 8 active experts
  sched = omnimoe.schedule(ids, N, group)
  sizes = np.asarray(sched.padded_group_sizes)
  assert sizes[0] == 1 and np.sum(sizes == 0) >= 1    # token 0 alone in group 0; empty groups
  cot = jax.random.normal(jax.random.key(2), (T, d))
  run = lambda f: (f(x, w, v, g), jax.grad(lambda *a: jnp.sum(f(*a) * cot), argnums=(0, 1, 2, 3))(x, w, v, g))
  out, grads = run(lambda *a: omnimoe.expert_centric(omnimoe.XlaGroupedOps, *a, sched))
  ref, ref_grads = run(lambda *a: _dense_reference(*a, ids))
  assert rel_err(out, ref) < 1e-5
  for a, b in zip(grads, ref_grads):
    assert rel_err(a, b) < 1e-5


def _lowering_inputs(T: int, N: int, k: int, d: int):
  """(x, w, v, g, ids) of the expert-centric layer in bf16, for lowering only (zeros)."""
  w = jnp.zeros((N, d), jnp.bfloat16)
  return (jnp.zeros((T, d), jnp.bfloat16), w, w, jnp.zeros((T, k), jnp.bfloat16),
          jnp.zeros((T, k), jnp.int32))


@needs_cute
def test_pallas_grouped_sums_tokens_with_the_gather_sum_kernel_on_gpu():
  """Lowered for a GPU, the Pallas-GEMM expert-centric layer sums each token's rows with the
  CuTe gather-and-sum kernel (no scatter-add), forward and backward, and its forward gathers
  x's rows inside the scores GEMM (no [rows, d] gather by XLA)."""
  from pallas_kernels import config
  T, N, k, d, group = 64, 512, 8, 128, 128
  x, w, v, g, ids = _lowering_inputs(T, N, k, d)
  ops = omnimoe.PallasGroupedOps
  def step(x, w, v, g, ids):
    f = lambda *a: omnimoe.expert_centric(ops, *a, omnimoe.schedule(ids, N, group, ops.align))
    return jax.value_and_grad(lambda *a: jnp.sum(f(*a)),
                              argnums=(0, 1, 2, 3))(x, w, v, g)
  with config.lowering_for_gpu():
    text = cuda_module(step, x, w, v, g, ids)
  assert text.count(f"custom_call {FFI_TARGET}") == 2        # the output's sums and dX's
  scatter_types = re.findall(r'"stablehlo.scatter".*?\}\) : \([^\n]*-> (tensor<[^>]*>)', text,
                             re.DOTALL)
  assert scatter_types and f"tensor<{T}x{d}xf32>" not in scatter_types   # no per-token scatter-add
  def forward(x, w, v, g, ids):
    return omnimoe.expert_centric(ops, x, w, v, g, omnimoe.schedule(ids, N, group, ops.align))
  with config.lowering_for_gpu():
    text = cuda_module(forward, x, w, v, g, ids)
  gather_types = re.findall(r'"stablehlo.gather"[^\n]*-> (tensor<[^>]*>)', text)
  assert not [t for t in gather_types if t.endswith(f"x{d}xbf16>")]


@needs_cute
def test_cute_grouped_runs_every_gemm_and_sum_on_kernels():
  """Lowered for a GPU, the CuTe-GEMM expert-centric layer's forward and backward run their
  five grouped GEMMs and both per-token sums as kernel calls, and no [rows, d] gather of x's
  rows happens in the forward (the scores GEMM gathers them)."""
  T, N, k, d, group = 64, 512, 8, 128, 128
  x, w, v, g, ids = _lowering_inputs(T, N, k, d)
  ops = omnimoe.CuteGroupedOps
  sched = lambda ids: omnimoe.schedule(ids, N, group, ops.align)
  def step(x, w, v, g, ids):
    f = lambda *a: omnimoe.expert_centric(ops, *a, sched(ids))
    return jax.value_and_grad(lambda *a: jnp.sum(f(*a)), argnums=(0, 1, 2, 3))(x, w, v, g)
  # forward: scores, output rows, sums; backward: scores again, dA, dZ W, dW, dV, dX's sums
  assert cuda_module(step, x, w, v, g, ids).count(f"custom_call {FFI_TARGET}") == 9
  text = cuda_module(lambda *a: omnimoe.expert_centric(ops, *a[:4], sched(a[4])), x, w, v, g, ids)
  gather_types = re.findall(r'"stablehlo.gather"[^\n]*-> (tensor<[^>]*>)', text)
  assert not [t for t in gather_types if t.endswith(f"x{d}xbf16>")]


@pytest.mark.gpu
@needs_cute
def test_cute_grouped_layer_matches_xla_on_gpu():
  """The OmniMoE layer on the CuTe grouped GEMMs: forward and gradients of x, W, V and the
  routing weights against the xla backend's, within bf16 tolerances (relative 2e-2)."""
  T, N, k, d, group = 200, 4096, 64, 256, 128
  ks = jax.random.split(jax.random.key(5), 4)
  x = jax.random.normal(ks[0], (T, d), jnp.bfloat16)
  w = (jax.random.normal(ks[1], (N, d)) / 16).astype(jnp.bfloat16)
  v = (jax.random.normal(ks[2], (N, d)) / 8).astype(jnp.bfloat16)
  g = jax.nn.softmax(jax.random.normal(ks[3], (T, k)), -1).astype(jnp.bfloat16)
  ids = jax.vmap(lambda key: jax.random.choice(key, N, (k,), replace=False))(
      jax.random.split(jax.random.key(6), T)).astype(jnp.int32)
  dout = jax.random.normal(jax.random.key(7), (T, d), jnp.bfloat16)
  def grads(ops):
    f = lambda *a: omnimoe.expert_centric(ops, *a, omnimoe.schedule(ids, N, group, ops.align))
    y, vjp = jax.vjp(f, x, w, v, g)
    return (y, *vjp(dout))
  for got, want in zip(jax.jit(lambda: grads(omnimoe.CuteGroupedOps))(),
                       jax.jit(lambda: grads(omnimoe.XlaGroupedOps))()):
    assert rel_err(got, want) < 2e-2


def test_router_benchmark_tiny(tmp_path):
  """The router benchmark's smoke run: both methods timed, the same experts picked."""
  from benchmarks import omnimoe_router_bench
  recs = omnimoe_router_bench.main(["--points", "16:40,8:100", "--side", "16", "--out", str(tmp_path)])
  assert [(r["tokens"], r["k"]) for r in recs] == [(16, 40), (8, 100)]
  assert all(r["same_experts"] and r["candidates_ms"] > 0 and r["bisection_ms"] > 0 for r in recs)
  assert json.loads((tmp_path / "omnimoe_router_bench.json").read_text())["records"] == recs


def test_schedule_stats_tiny(tmp_path):
  """The schedule-density benchmark's smoke run: its JSON, and rows that hold between one and
  min(B, K) tasks each."""
  from benchmarks import omnimoe_schedule_stats
  recs = omnimoe_schedule_stats.main(["--tiny", "--out", str(tmp_path)])
  saved = json.loads((tmp_path / "omnimoe_schedule_stats.json").read_text())
  assert saved["records"] == json.loads(json.dumps(recs)) and saved["meta"]["commit"]
  for r in recs:
    assert 1 <= r["tasks_per_row"] <= min(r["group"], r["k"])
    assert r["dense_over_useful"] == pytest.approx(r["group"] / r["tasks_per_row"])
    assert 1 <= r["active_experts"] <= r["atomic_experts"]
