"""The cute aggregate (ffi/gather_sum.py: each token's expert rows gathered and summed) and the
router's top-K (ffi/topk.py): they lower for CUDA, refuse what they cannot take, and match
numpy, jax.lax.top_k and the xla backend on the GPU."""
import importlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import sonicmoe_jax as sm
from conftest import make_inputs, rel_err
from cute_helpers import BIG_D, BIG_ROWS, FFI_TARGET, cuda_module, needs_cute


@needs_cute
def test_cute_aggregate_compiles_and_lowers_for_cuda():
  T, d, n, E, K = 128, 256, 64, 8, 2
  args = make_inputs(0, T, d, n, E, jnp.bfloat16)

  def layer(*a):
    return sm.moe(*a, k=K, backend={"aggregate": "cute"}).out

  assert FFI_TARGET in cuda_module(layer, *args)


@pytest.mark.gpu
@needs_cute
@pytest.mark.parametrize("rounding", [None, "nearest"])
def test_cute_aggregate_matches_xla_on_gpu(rounding):
  T, d, n, E, K = 1000, 512, 128, 16, 4
  args = make_inputs(1, T, d, n, E, jnp.bfloat16)
  cot = jax.random.normal(jax.random.key(2), (T, d))
  kw = dict(k=K, rounding=rounding, tile=128)

  def grads(backend):
    f = lambda *a: jnp.sum(sm.moe(*a, backend=backend, **kw).out.astype(jnp.float32) * cot)
    return sm.moe(*args, backend=backend, **kw).out, jax.grad(f, argnums=(0, 2, 3))(*args)
  out_c, g_c = grads({"aggregate": "cute"})
  out_x, g_x = grads("xla")
  assert rel_err(out_c, out_x) < 1e-2
  for a, b in zip(g_c, g_x):
    assert rel_err(a, b) < 1e-2


@pytest.mark.gpu
@needs_cute
@pytest.mark.parametrize("d,dtype", [(1536, jnp.bfloat16), (100, jnp.bfloat16), (200, jnp.float32)])
def test_cute_gather_sum_matches_numpy_on_gpu(d, dtype):
  """gather_sum called directly (README): 16-byte vector accesses where d allows (8 bf16 or 4
  fp32 values), one value at a time where it does not (d = 100 bf16); tokens with no slots get
  zeros; weighted and unweighted."""
  from ffi import gather_sum
  rng = np.random.default_rng(d)
  T, P = 300, 1000
  y = jnp.asarray(rng.normal(size=(P, d)), dtype)
  scores = jnp.asarray(rng.random(P), jnp.float32)
  counts = rng.integers(0, 7, T)
  counts[::17] = 0
  offsets = np.concatenate([[0], np.cumsum(counts)]).astype(np.int32)
  slots = rng.integers(0, P, offsets[-1]).astype(np.int32)
  yf = np.asarray(y.astype(jnp.float32))
  for weighted in (True, False):
    s = scores if weighted else None
    got = jax.jit(lambda *a: gather_sum.gather_sum(*a, num_tokens=T))(
        y, s, jnp.asarray(slots), jnp.asarray(offsets))
    w = np.asarray(scores) if weighted else np.ones(P, np.float32)
    want = np.stack([(yf[slots[offsets[t]:offsets[t + 1]]] * w[slots[offsets[t]:offsets[t + 1]], None]
                      ).sum(0) for t in range(T)])
    np.testing.assert_allclose(np.asarray(got.astype(jnp.float32)), want, rtol=2e-2, atol=2e-2)
    assert np.all(np.asarray(got.astype(jnp.float32))[counts == 0] == 0)


@needs_cute
def test_cute_gather_sum_into_under_vmap_lowers_without_writing_over_its_input():
  """Batched windows are summed on their own and set into the result by XLA: the unbatched
  window aliases the earlier result, the batched one does not (a sequential vmap of the
  aliasing call loses the earlier windows' columns)."""
  from ffi import gather_sum
  T, P, d = 64, 96, 256
  slots = jnp.arange(P, dtype=jnp.int32) % T
  offsets = jnp.asarray(np.minimum(np.arange(T + 1) * 2, P), jnp.int32)

  def windows(y, scores):
    out = gather_sum.gather_sum(y[:, :128], scores, slots, offsets, T, into=(d, 0))
    return gather_sum.gather_sum(y[:, 128:], scores, slots, offsets, T, into=(out, 128))

  y, s = jnp.ones((P, d), jnp.bfloat16), jnp.ones((P,), jnp.float32)
  assert "output_operand_aliases" in cuda_module(windows, y, s)
  batched = cuda_module(jax.vmap(windows), jnp.stack([y, y]), jnp.stack([s, s]))
  assert "output_operand_aliases" not in batched and "dynamic_update_slice" in batched


@pytest.mark.gpu
@needs_cute
def test_cute_gather_sum_into_a_wider_result_on_gpu():
  """Windows written into the result: a new [T, 384] result takes its first window's columns,
  the next call writes its own over it in place (the layer's windows under vmap too), and the
  whole equals the sums of the whole rows."""
  from ffi import gather_sum
  rng = np.random.default_rng(0)
  T, P, d = 300, 1000, 384
  y = jnp.asarray(rng.normal(size=(P, d)), jnp.bfloat16)
  scores = jnp.asarray(rng.random(P), jnp.float32)
  counts = rng.integers(0, 7, T)
  offsets = jnp.asarray(np.concatenate([[0], np.cumsum(counts)]), jnp.int32)
  slots = jnp.asarray(rng.integers(0, P, int(offsets[-1])), jnp.int32)

  def windows(y, scores):
    out = gather_sum.gather_sum(y[:, :128], scores, slots, offsets, T, into=(d, 0))
    return gather_sum.gather_sum(y[:, 128:], scores, slots, offsets, T, into=(out, 128))

  whole = jax.jit(lambda y, s: gather_sum.gather_sum(y, s, slots, offsets, T))(y, scores)
  np.testing.assert_array_equal(jax.jit(windows)(y, scores), whole)
  batched = jax.jit(jax.vmap(windows))(jnp.stack([y, -y]), jnp.stack([scores, scores]))
  np.testing.assert_array_equal(batched[0], whole)
  np.testing.assert_array_equal(batched[1], -whole)


@pytest.mark.gpu
@needs_cute
def test_cute_aggregate_past_2_31_elements_on_gpu():
  """Token rows gathered from Y's last rows, where slot * d passes 2^31, against float32."""
  from ffi import gather_sum
  T = 64
  y = jax.random.normal(jax.random.key(41), (BIG_ROWS, BIG_D), jnp.bfloat16)
  scores = jax.random.uniform(jax.random.key(42), (BIG_ROWS,), jnp.float32)
  slots = BIG_ROWS - 1 - jax.random.permutation(jax.random.key(43), 256)[:2 * T].astype(jnp.int32)
  offsets = jnp.arange(0, 2 * T + 1, 2, dtype=jnp.int32)
  got = jax.jit(gather_sum.gather_sum, static_argnums=4)(y, scores, slots, offsets, T)
  rows = y[slots].astype(jnp.float32) * scores[slots][:, None]
  want = rows.reshape(T, 2, BIG_D).sum(axis=1)
  assert rel_err(got, want) < 1e-2


def _top_k_logits(T, E, seed):
  """Random logits with ties (rounded to a coarse grid), -inf entries and a constant row."""
  logits = jnp.round(jax.random.normal(jax.random.key(seed), (T, E)) * 4) / 4
  logits = logits.at[::7, ::5].set(-jnp.inf)
  return logits.at[1].set(0.5)


@needs_cute
@pytest.mark.parametrize("T,E,k", [(1000, 128, 8), (37, 32, 1), (64, 256, 16), (5, 1024, 32)])
def test_cute_top_k_compiles_and_lowers_for_cuda(T, E, k):
  from ffi import topk
  assert FFI_TARGET in cuda_module(lambda l: topk.top_k(l, k),
                                    jax.ShapeDtypeStruct((T, E), jnp.float32))


@needs_cute
def test_cute_top_k_refuses_what_it_cannot_take():
  from ffi import topk
  cute_ops = importlib.import_module("ffi.ops")
  logits = jnp.zeros((16, 48), jnp.float32)
  with pytest.raises(ValueError, match="E=48 is not a multiple of 32"):
    topk.top_k(logits, 2)
  with pytest.raises(ValueError, match="E=2048 is above 1024"):
    topk.top_k(jnp.zeros((4, 2048), jnp.float32), 2)
  with pytest.raises(ValueError, match=r"k=33 must be between 1 and min\(E, 32\)"):
    topk.top_k(jnp.zeros((4, 64), jnp.float32), 33)
  with pytest.raises(TypeError, match="logits must be float32; got bfloat16"):
    topk.top_k(jnp.zeros((4, 64), jnp.bfloat16), 2)
  with pytest.warns(UserWarning, match="backend 'cute' top_k: E=48 .*using jax.lax.top_k"):
    values, experts = cute_ops.top_k(_top_k_logits(16, 48, 0), 3)
  want = jax.lax.top_k(_top_k_logits(16, 48, 0), 3)
  np.testing.assert_array_equal(values, want[0])
  np.testing.assert_array_equal(experts, want[1])


@pytest.mark.gpu
@needs_cute
@pytest.mark.parametrize("T,E,k", [(1000, 128, 8), (37, 32, 1), (333, 256, 16), (5, 1024, 32),
                                   (64, 64, 64 // 2)])
def test_cute_top_k_matches_lax_on_gpu(T, E, k):
  """Values and experts equal jax.lax.top_k's: ties to the lower expert, -inf logits, T not a
  multiple of the CTA's tokens, k = 1 and k = 32."""
  from ffi import topk
  logits = _top_k_logits(T, E, T + E)
  got = jax.jit(lambda l: topk.top_k(l, k))(logits)
  want = jax.lax.top_k(logits, k)
  np.testing.assert_array_equal(got[1], want[1])
  np.testing.assert_array_equal(got[0], want[0])
