"""The custom_vjp keeps X, H and the routing plan only: never Y, dY or any [T*K, d] array."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import sonicmoe_jax as sm
from conftest import make_inputs


def routing_budget_bytes(T, E, P):
  """Generous bytes for routing metadata: a few [P] and [T, E] int32/fp32 arrays."""
  return 4 * (8 * P + 4 * T * E + 2 * T + 2 * E + 2)


@pytest.mark.parametrize("rounding", [None, "nearest"])
@pytest.mark.parametrize("dtype,backend,d,n", [(jnp.bfloat16, "xla", 128, 16), (jnp.float32, "xla", 128, 16),
                                               (jnp.bfloat16, "pallas", 256, 64)],
                         ids=["bf16-xla", "f32-xla", "bf16-pallas"])
def test_residuals_are_x_h_and_plan(rounding, dtype, backend, d, n):
  T, E, K, tile = 128, 8, 4, 16
  x, router_w, w1, w2 = make_inputs(0, T, d, n, E, dtype)
  kw = dict(k=K, rounding=rounding, tile=tile, backend=backend)
  fn = lambda x, r, a, b: sm.moe(x, r, a, b, **kw).out
  P = jax.eval_shape(lambda *a: sm.moe(*a, **kw).plan.token_index, x, router_w, w1, w2).shape[0]
  res = sm.saved_residuals(fn, x, router_w, w1, w2)
  weights = {"argument r", "argument a", "argument b"}
  kept = [r for r in res if r.source not in weights]
  def tkd_sized(r):  # a [T*K, d]-like array: rows of width d, at least T*K of them
    return len(r.shape) >= 2 and r.shape[-1] == d and int(np.prod(r.shape)) >= T * K * d

  for r in kept:
    assert not tkd_sized(r), f"{r} is [T*K, d]-sized"
  h_like = [r for r in kept if r.shape == (P, 2 * n)]
  assert len(h_like) == 1 and h_like[0].dtype == jnp.dtype(dtype).name, h_like
  itemsize = jnp.dtype(dtype).itemsize
  bound = sm.activation_bytes_bound(T, d, n, P, itemsize) + routing_budget_bytes(T, E, P)
  total = sum(r.nbytes for r in kept) + (0 if any(r.source == "argument x" for r in kept) else x.nbytes)
  assert total <= bound, f"kept {total} bytes > bound {bound}: {kept}"
  # the test can fail: plain autodiff of the same sparse math keeps [T*K, d] arrays
  from sonicmoe_jax.core import xla_ops

  def plain(x, r, a, b):
    plan, _ = sm.route(sm.router_logits(x, r), k=K, rounding=rounding, tile=tile)
    _, act = xla_ops.up_proj(x, a, plan)
    return xla_ops.aggregate(xla_ops.down_proj(act, b, plan), plan.scores, plan)

  plain_res = sm.saved_residuals(plain, x, router_w, w1, w2)
  assert any(tkd_sized(r) and not r.source.startswith("argument") for r in plain_res)


@pytest.mark.parametrize("score_fn,renormalize,keeps_t_by_e", [
    ("softmax_topk", False, False), ("softmax_all", True, False), ("softmax_all", False, True)])
def test_plain_topk_keeps_no_router_score_matrix(score_fn, renormalize, keeps_t_by_e):
  """Plain top-K scores only the chosen pairs, so no [T, E] array is kept for the backward
  (the PyTorch SonicMoE keeps none either); only softmax over all E experts needs the full
  softmax (its normalizer's gradient reaches every logit)."""
  T, d, n, E, K = 96, 64, 16, 32, 4
  x, router_w, w1, w2 = make_inputs(1, T, d, n, E, jnp.bfloat16)
  fn = lambda *a: sm.moe(*a, k=K, score_fn=score_fn, renormalize=renormalize,
                         backend="xla").out
  kept = [r for r in sm.saved_residuals(fn, x, router_w, w1, w2)
          if not r.source.startswith("argument") and int(np.prod(r.shape)) >= T * E]
  t_by_e = [r for r in kept if r.shape[0] == T and int(np.prod(r.shape[1:])) == E]
  assert bool(t_by_e) == keeps_t_by_e, kept


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["xla", "pallas"])
def test_backward_gathers_x_again_on_gpu(backend):
  """XLA must not merge dW1's gather of X's rows with the forward's (layer.py's barrier):
  merged, the gathered X [pairs, d] would be kept from the forward to the backward. The
  compiled step then has three row gathers of width d: X forward, X backward, dO (whose two
  uses share one). Without the barrier XLA on the GPU compiles two (measured on the H200)."""
  from pallas_kernels.config import PallasConfig
  # the forward gathers in XLA
  gather_in_xla = {"pallas": PallasConfig(up_proj_gather_in_kernel=False)}
  T, d, n, E, K = 4096, 1024, 256, 32, 4
  x, r, w1, w2 = make_inputs(0, T, d, n, E, jnp.bfloat16)
  loss = lambda *a: jnp.sum(sm.moe(*a, k=K, backend=backend,
                                   kernel_config=gather_in_xla).out.astype(jnp.float32))
  hlo = jax.jit(jax.grad(loss, argnums=(0, 2, 3))).lower(x, r, w1, w2).compile().as_text()
  # 16-bit rows are gathered as 32-bit words (xla_ops.gather_rows): [pairs, 1, d / 2] u32
  row_gathers = [l for l in hlo.splitlines() if " gather(" in l and f",1,{d // 2}]" in l
                 and "= u32[" in l]
  assert len(row_gathers) == 3, row_gathers
