"""Shared test helpers: random inputs and the float32 plain-autodiff oracle."""

import os

# Off the GPU the suite is bound by XLA's compiles of small programs, not by running them:
# there XLA's CPU backend compiles at LLVM optimization level 0 (XLA's HLO passes still run).
# On a 2-core host it takes about a third off the suite's CPU time. Set before any backend starts; the 8-device processes of tests/test_sharding.py inherit it.
_FAST_COMPILE = "--xla_backend_optimization_level=0"
if not os.path.exists("/dev/nvidiactl") and _FAST_COMPILE not in os.environ.get("XLA_FLAGS", ""):
  os.environ["XLA_FLAGS"] = " ".join([os.environ.get("XLA_FLAGS", ""), _FAST_COMPILE]).strip()

import jax  # noqa: E402  (after XLA_FLAGS)
import jax.numpy as jnp
import numpy as np
import pytest

import interpret_cache  # noqa: E402

jax.config.update("jax_default_matmul_precision", "highest")
# Interpreted Pallas kernels compile their thread bodies once a process (interpret_cache.py).
INTERPRET_CACHE = interpret_cache.install()
# CuTe kernels compile afresh in the tests (no disk cache from earlier runs; the cache has its
# own test, tests/test_cute_ffi.py)
os.environ.setdefault("SONICMOE_CUTE_CACHE", "")


def has_gpu() -> bool:
  try:
    return jax.default_backend() == "gpu"
  except RuntimeError:
    return False


def pytest_configure(config):
  config.addinivalue_line("markers", "gpu: needs an NVIDIA GPU (skipped elsewhere)")
  config.addinivalue_line("markers", "multidevice: needs 8 (virtual) devices; run in its own process")


# The longest tests start first, in this order (longest first: the multidevice suite's
# 8-device processes, 35-46 s each on a 2-core machine, then the others of 19-22 s), so that under pytest-xdist they run beside the short ones instead of ending the
# run alone.
LONGEST_FIRST = ("test_sharding.py::test_multidevice_suite",
                 "test_train.py::test_token_rounding_study_runs",
                 "test_cute_ops.py::test_cute_store_wide_min_k_routes_each_store_gemm_by_its_contraction",
                 "test_windows.py::test_pallas_layer_with_windows_matches_xla_interpret",
                 "test_cute_ops.py::test_cute_store_tile_m_setting_lowers_the_store_gemms_to_192_row_kernels",
                 "test_bench.py::test_tile_sweep_custom_shape")


def _start_rank(nodeid: str) -> int:
  """A test's place in LONGEST_FIRST (a parametrized one's too), or after them all."""
  return next((i for i, name in enumerate(LONGEST_FIRST) if name in nodeid), len(LONGEST_FIRST))


def pytest_collection_modifyitems(config, items):
  items.sort(key=lambda item: _start_rank(item.nodeid))   # (a stable sort)
  if has_gpu():
    return
  skip = pytest.mark.skip(reason="needs a GPU")
  for item in items:
    if "gpu" in item.keywords:
      item.add_marker(skip)


def make_inputs(seed, T, d, n, E, dtype=jnp.float32, dead_experts=0):
  """Fresh random inputs; the first `dead_experts` experts get no tokens under top-K."""
  ks = jax.random.split(jax.random.key(seed), 4)
  x = jax.random.normal(ks[0], (T, d), jnp.float32)
  router_w = jax.random.normal(ks[1], (d, E), jnp.float32) / np.sqrt(d)
  if dead_experts:
    x = x.at[:, 0].set(4.0)
    router_w = router_w.at[0, :dead_experts].set(-10.0)
  w1 = jax.random.normal(ks[2], (E, d, 2 * n), jnp.float32) / np.sqrt(d)
  w2 = jax.random.normal(ks[3], (E, n, d), jnp.float32) / np.sqrt(n)
  return x.astype(dtype), router_w, w1.astype(dtype), w2.astype(dtype)


class PaddingSteps:
  """Weight-gradient rows for the padding-skip tests: groups of slots laid end to end, expert
  e's `sizes[e]` rows first in its group. kind per slot: 0 a row of the expert, 1 padding in a
  step of `step` rows that holds one of them, 2 padding in a step wholly past them (the one a
  kernel given the sizes must skip)."""

  def __init__(self, sizes, groups, step):
    self.kind = np.zeros(sum(groups), np.int32)
    first = 0
    for size, group in zip(sizes, groups):
      self.kind[first + size:first + group] = 1
      self.kind[first + -(-size // step) * step:first + group] = 2
      first += group

  def fill(self, values):
    """values [P, C] in bf16, with the kind-1 rows zeros and the kind-2 rows NaN."""
    kind = self.kind[:, None]
    return jnp.where(kind == 1, 0.0, jnp.where(kind == 2, jnp.nan, values)).astype(jnp.bfloat16)

  def gather_source(self, x_key, index_key, num_rows: int, cols: int):
    """(x [num_rows + 1, cols] bf16 whose last row is NaN, index [P]): the experts' slots read
    random rows of the others, kind-1 slots read past x's end (zeros), kind-2 ones the NaN row."""
    x = jax.random.normal(x_key, (num_rows + 1, cols)).at[num_rows].set(jnp.nan)
    real = jax.random.randint(index_key, self.kind.shape, 0, num_rows)
    index = jnp.where(self.kind == 0, real, jnp.where(self.kind == 1, num_rows + 1, num_rows))
    return x.astype(jnp.bfloat16), index


def oracle_moe(x, router_w, w1, w2, *, k, score_fn="softmax_topk", renormalize=False, member=None):
  """Dense float32 MoE by plain autodiff: every expert on every token, weighted by a [T, E]
  score matrix that is zero outside the routed pairs (`member`, default the top-K set)."""
  x, router_w, w1, w2 = (a.astype(jnp.float32) for a in (x, router_w, w1, w2))
  logits = x @ router_w
  top_vals, top_idx = jax.lax.top_k(logits, k)
  chosen = jax.nn.one_hot(top_idx, logits.shape[1]).sum(1) > 0
  if member is None:
    member = chosen
  if score_fn == "softmax_all" and not renormalize:
    c = jax.nn.logsumexp(logits, axis=-1, keepdims=True)
  else:
    c = jax.nn.logsumexp(top_vals, axis=-1, keepdims=True)
  s = jnp.where(member, jnp.exp(logits - c), 0.0)
  n = w2.shape[1]
  h = jnp.einsum("td,edf->tef", x, w1)
  a = jax.nn.silu(h[..., :n]) * h[..., n:]
  y = jnp.einsum("ten,end->ted", a, w2)
  return jnp.einsum("te,ted->td", s, y)


def rel_err(a, b):
  a = np.asarray(a, np.float64)
  b = np.asarray(b, np.float64)
  return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))
