"""Tile-configuration sweep of the Pallas varlen-M kernels (up_proj, down_proj, dx_tilde, dh)
on the GPU, on pre-gathered inputs of an anchor config's routing plan (up_proj_gather: the
up-projection gathering X's rows in the kernel).

  python -m benchmarks.tile_sweep --configs 30B-n256,7B-n256

Prints one JSON record per (config, kernel, tile) and a table last; a tile that does not fit
or fails to compile is a row with its error. Model TF/s (padding rows not counted).
"""
from __future__ import annotations

import argparse
import itertools
import json

import jax
import jax.numpy as jnp

import sonicmoe_jax as sm
from benchmarks import configs as C
from benchmarks.bench import make_args, time_ms
from pallas_kernels import grouped_gemm, ops
from pallas_kernels.config import TileConfig
from sonicmoe_jax import xla_ops



def _ints(csv):
  return [int(v) for v in csv.split(",")]


def kernels(x, w1, w2, dout, plan, pairs):
  """name -> (jitted fn(cfg, *args), args, model FLOPs of the `pairs` valid rows)."""
  tiles = ops.tiles(plan)
  xg = xla_ops.gather_rows(x, plan.token_index)
  dg = xla_ops.gather_rows(dout, plan.token_index)
  h, a = grouped_gemm.up_proj(xg, w1, tiles)
  P, d = pairs, xg.shape[1]
  n = w2.shape[1]
  jit = lambda f: jax.jit(f, static_argnums=0)
  up = jit(lambda c, xg, w1, t: grouped_gemm.up_proj(xg, w1, t, c))
  up_gather = jit(lambda c, x, w1, i, t: grouped_gemm.up_proj(x, w1, t, c, gather_index=i))
  mm = jit(lambda c, lhs, rhs, t: grouped_gemm.matmul(lhs, rhs, t, transpose_rhs=False, cfg=c))
  mm_t = jit(lambda c, lhs, rhs, t: grouped_gemm.matmul(lhs, rhs, t, transpose_rhs=True, cfg=c))
  dh = jit(lambda c, dg, w2, h, s, t: grouped_gemm.dh(dg, w2, h, s, t, c))
  return {  # name -> (fn(cfg, *args), args, model FLOPs, contraction length)
      "up_proj": (up, (xg, w1, tiles), 2 * P * d * 2 * n, d),
      "up_proj_gather": (up_gather, (x, w1, plan.token_index, tiles), 2 * P * d * 2 * n, d),
      "down_proj": (mm, (a, w2, tiles), 2 * P * n * d, n),
      "dx_tilde": (mm_t, (h, w1, tiles), 2 * P * 2 * n * d, 2 * n),
      "dh": (dh, (dg, w2, h, plan.scores, tiles), 2 * P * n * d, d),
  }


def main(argv=None):
  p = argparse.ArgumentParser()
  p.add_argument("--configs", default="30B-n256,7B-n256")
  p.add_argument("--custom", action="append", default=[], help="T,d,n,E,K (repeatable)")
  p.add_argument("--kernels", default="up_proj,down_proj,dx_tilde,dh")
  p.add_argument("--block-n", default="64,128,256")
  p.add_argument("--stages", default="3,4")
  p.add_argument("--iters", type=int, default=5)
  p.add_argument("--reps", type=int, default=3)
  p.add_argument("--out", default=None)
  a = p.parse_args(argv)
  recs = []
  cases = {c: C.ANCHORS[c] for c in a.configs.split(",") if c}
  cases.update({c: tuple(int(v) for v in c.split(",")) for c in a.custom})
  for name, (T, d, n, E, K) in cases.items():
    (x, wr, w1, w2), dout = make_args(T, d, n, E, K)
    plan = sm.route(sm.router_logits(x, wr), k=K, align=ops.ALIGN)[0]
    table = kernels(x, w1, w2, dout, plan, T * K)
    for kname in a.kernels.split(","):
      fn, args, flops, k_len = table[kname]
      for bn, stages in itertools.product(_ints(a.block_n), _ints(a.stages)):
        cfg = TileConfig(block_n=bn, stages=stages)
        # the depth the kernel runs: the largest <= stages dividing the k steps (chained pipelines)
        chained = grouped_gemm._pipelined_stages(k_len // cfg.block_k, stages)
        rec = dict(config=name, kernel=kname, block_n=bn, stages=stages, chained_stages=chained,
                   ms=None, tflops=None)
        try:
          ms = time_ms(fn, (cfg, *args), a.iters, a.reps)
          rec.update(ms=ms, tflops=flops / ms / 1e9)
        except Exception as e:  # a tile that does not fit is a row
          rec["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:160] if str(e) else ''}"
        recs.append(rec)
        print(json.dumps(rec), flush=True)
  print(f"{'config':11s} {'kernel':10s} {'bn':>4s} {'st':>3s} {'run':>3s} {'ms':>8s} {'TF/s':>6s}")
  for r in recs:
    if r["ms"] is not None:
      print(f"{r['config']:11s} {r['kernel']:10s} {r['block_n']:4d} {r['stages']:3d} "
            f"{r['chained_stages'] or r['stages']:3d} "
            f"{r['ms']:8.3f} {r['tflops']:6.0f}")
  if a.out:
    with open(a.out, "w") as f:
      json.dump(recs, f, indent=1)


if __name__ == "__main__":
  main()
