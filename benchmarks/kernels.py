"""Per-op breakdown of one backend at the anchor configs: routing, gathers, each kernel.

  python -m benchmarks.kernels --backend pallas --configs olmoe
  python -m benchmarks.kernels --backend dh=cute+dx_tilde=cute --configs 30B-n256   (a per-op mix)

Each op is jitted alone on precomputed inputs (the routing plan included) and timed like
bench.py. GEMM ops report model TF/s (padding rows not counted) and the TF/s of a dense
matmul of the same M, K, N for comparison; memory-bound ops report GB/s (bytes read once +
written once).
"""
from __future__ import annotations

import argparse
import json

import jax
import jax.numpy as jnp

import sonicmoe_jax as sm
from benchmarks import configs as C
from benchmarks import output
from benchmarks.bench import backend_spec, make_args, time_ms
from pallas_kernels import config as pallas_config
from pallas_kernels import grouped_gemm, row_gather, weight_grad
from pallas_kernels import ops as pallas_ops
from sonicmoe_jax import backends
from sonicmoe_jax.core import routing, xla_ops


def segment_sum_aggregate(y, scores, plan):
  """The aggregation as XLA's sorted segment_sum (a scatter-add), for comparison."""
  rows = (y.astype(jnp.float32) * scores[:, None])[plan.token_slots]
  return jax.ops.segment_sum(rows, plan.token_index[plan.token_slots], num_segments=plan.num_tokens,
                             indices_are_sorted=True).astype(y.dtype)


def breakdown(name, cfg, backend, rounding, iters, reps):
  T, d, n, E, K = cfg
  (x, wr, w1, w2), dout = make_args(T, d, n, E, K)
  ops = sm.resolve_backend(backend_spec(backend), dtype=x.dtype, d=d, n=n,   # as the layer does
                           kernel_config=per_op_kernel_config())
  route = jax.jit(lambda x, wr: sm.route(sm.router_logits(x, wr), k=K, rounding=rounding,
                                         tile=128, align=ops.align, top_k=ops.top_k)[0])
  plan = route(x, wr)
  P = T * K
  h, a = jax.jit(ops.up_proj)(x, w1, plan)
  y = jax.jit(ops.down_proj)(a, w2, plan)
  dh_, _, a_s = jax.jit(ops.dh)(dout, w2, h, plan.scores, plan)
  dxt = jax.jit(ops.dx_tilde)(dh_, w1, plan)
  bf = 2
  logits = jax.jit(sm.router_logits)(x, wr)
  topk_xla = jax.jit(lambda lg: jax.lax.top_k(lg, K))
  topk = jax.jit(lambda lg: ops.top_k(lg, K))
  # the cute top-K and aggregation beside the backend's, on GPUs with the extra installed
  cute_topk, cute_aggregate = [], []
  if jax.default_backend() == "gpu" and backends.cute_installed():
    from ffi import ops as cute_ops
    from ffi import topk as cute_topk_kernel
    if cute_topk_kernel.unsupported(E, K) is None:
      cute_topk = [("  (top_k on cute)", jax.jit(lambda lg: cute_topk_kernel.top_k(lg, K)),
                    (logits,), None, T * E * 4)]
    cute_aggregate = [("  (aggregate on cute)", jax.jit(cute_ops.aggregate), (y, plan.scores, plan),
                       None, P * d * bf + T * d * bf)]
  top_logits, top_experts = topk(logits)
  scores = routing._scores(top_logits, logits, top_logits, "softmax_topk", False)
  plan_only = jax.jit(lambda s, e: routing._topk_plan(s, e, E, ops.align))
  plan_sorted = jax.jit(lambda s, e: routing._topk_plan(s, e, E, ops.align, "sort"))
  pallas_only = lambda rows: rows if backend == "pallas" else []
  gather_cfg = pallas_config.up_proj_gather_tiles(n)   # the tiles ops.up_proj gathers with
  up_proj_tiles = lambda cfg, **kw: jax.jit(lambda x, w1: grouped_gemm.up_proj(
      x, w1, pallas_ops.tiles(plan), cfg, **kw))
  rows = [
      ("routing plan", route, (x, wr), None, T * d * bf + d * E * bf),
      ("  of which router logits", jax.jit(sm.router_logits), (x, wr), (T, d, E), None),
      (f"  of which top_k ({backend})", topk, (logits,), None, T * E * 4),
      ("  (top_k as jax.lax.top_k)", topk_xla, (logits,), None, T * E * 4),
      *cute_topk,
      ("  of which counts, slots", plan_only, (scores, top_experts), None, T * K * 4 * 2),
      ("  (by a sort of the pairs)", plan_sorted, (scores, top_experts), None, T * K * 4 * 2),
      ("gather X rows (xla)", jax.jit(lambda x: xla_ops.gather_rows(x, plan.token_index)), (x,), None,
       2 * P * d * bf),
      *pallas_only([("gather X rows (pallas cp.async)",
                      jax.jit(lambda x: row_gather.gather_rows(x, plan.token_index)), (x,), None,
                      2 * P * d * bf)]),
      ("up_proj (+ gather X)", jax.jit(ops.up_proj), (x, w1, plan), (P, d, 2 * n), None),
      *pallas_only([("  up_proj (gather in kernel)",
                     up_proj_tiles(gather_cfg, gather_index=plan.token_index), (x, w1), (P, d, 2 * n),
                     None),
                    ("  up_proj (on rows gathered first)", up_proj_tiles(pallas_config.UP_PROJ),
                     (xla_ops.gather_rows(x, plan.token_index), w1), (P, d, 2 * n), None)]),
      ("down_proj", jax.jit(ops.down_proj), (a, w2, plan), (P, n, d), None),
      ("aggregate", jax.jit(ops.aggregate), (y, plan.scores, plan), None, P * d * bf + T * d * bf),
      *cute_aggregate,
      ("  (as a sorted segment_sum)", jax.jit(segment_sum_aggregate), (y, plan.scores, plan), None,
       P * d * bf + T * d * bf),
      ("dh (+ gather dO)", jax.jit(ops.dh), (dout, w2, h, plan.scores, plan), (P, d, n), None),
      ("dx_tilde", jax.jit(ops.dx_tilde), (dh_, w1, plan), (P, 2 * n, d), None),
      ("aggregate dX", jax.jit(lambda v: ops.aggregate(v, None, plan)), (dxt,), None,
       P * d * bf + T * d * bf),
      ("dw1 (+ gather X)", jax.jit(ops.dw1), (x, dh_, plan), (P, d, 2 * n), None),
      *pallas_only([("  dw1 (gather in kernel, off by default)",
                     jax.jit(lambda x, g: weight_grad.weight_grad(
                         x, g, plan.group_offsets, E, x.dtype, gather_index=plan.token_index)),
                     (x, dh_), (P, d, 2 * n), None)]),
      ("dw2 (+ gather dO)", jax.jit(ops.dw2), (a_s, dout, plan), (P, n, d), None),
  ]
  recs = []
  for op, fn, args, gemm, nbytes in rows:
    ms = time_ms(fn, args, iters, reps)
    rec = dict(config=name, backend=backend, rounding=rounding, op=op, ms=ms)
    if gemm:
      m, kk, nn = gemm
      rec["tflops"] = 2 * m * kk * nn / ms / 1e9
      lhs = jax.random.normal(jax.random.key(0), (m, kk), jnp.bfloat16)
      rhs = jax.random.normal(jax.random.key(1), (kk, nn), jnp.bfloat16)
      dense_ms = time_ms(jax.jit(jnp.matmul), (lhs, rhs), iters, reps)
      rec["dense_tflops"] = 2 * m * kk * nn / dense_ms / 1e9
    else:
      rec["gbps"] = nbytes / ms / 1e6
    recs.append(rec)
    print(json.dumps(rec), flush=True)
  return recs


def per_op_kernel_config():
  """The kernel configuration ops are timed alone with: the cute dh writes no dH over H (H is an
  argument of the timed program, which XLA would copy first; the layer's step never does)."""
  if not backends.cute_installed():
    return None
  from ffi.config import CuteConfig
  return {"cute": CuteConfig(dh_over_h=False)}


def main(argv=None):
  p = argparse.ArgumentParser()
  p.add_argument("--backend", default="pallas")
  p.add_argument("--configs", default=",".join(C.ANCHORS))
  p.add_argument("--custom", default=None, help="T,d,n,E,K instead of the anchor configs")
  p.add_argument("--rounding", default=None)
  p.add_argument("--iters", type=int, default=5)
  p.add_argument("--reps", type=int, default=3)
  p.add_argument("--tiny", action="store_true")
  p.add_argument("--out", default=None, help="folder to write kernels.json into (default: none written)")
  a = p.parse_args(argv)
  if a.tiny:
    cases = C.TINY
  elif a.custom:
    cfg = tuple(int(v) for v in a.custom.split(","))
    cases = {"T{}-d{}-n{}-E{}-K{}".format(*cfg): cfg}
  else:
    cases = dict(C.lookup(c) for c in a.configs.split(",") if c)
  recs = []
  for name, cfg in cases.items():
    recs += breakdown(name, cfg, a.backend, a.rounding, a.iters, a.reps)
  print(f"{'config':11s} {'op':28s} {'ms':>8s} {'TF/s':>6s} {'dense':>6s} {'GB/s':>6s}")
  for r in recs:
    print(f"{r['config']:11s} {r['op']:28s} {r['ms']:8.3f} {r.get('tflops', 0):6.0f} "
          f"{r.get('dense_tflops', 0):6.0f} {r.get('gbps', 0):6.0f}")
  if a.out:
    output.write_json(a.out, "kernels", recs)
  return recs


if __name__ == "__main__":
  main()
