"""Tile-configuration sweep of the varlen-M kernels (up_proj, down_proj, dx_tilde, dh) and the
varlen-K dW1 kernel on the GPU, on pre-gathered inputs of an anchor config's routing plan (up_proj_gather: the
up-projection gathering X's rows in the kernel). --impl pallas (Pallas Mosaic GPU kernels) or
cute (ffi/grouped_gemm.py's CuTe DSL kernels).

  python -m benchmarks.tile_sweep --configs 30B-n256,7B-n256 [--impl cute]

Prints one JSON record per (config, kernel, tile) and a table last; a tile that does not fit
or fails to compile is a row with its error. Model TF/s (padding rows not counted).
"""
from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import statistics
import time

import jax

import sonicmoe_jax as sm
from benchmarks import configs as C
from benchmarks import output
from benchmarks.bench import make_args, time_ms
from pallas_kernels import grouped_gemm, ops, weight_grad
from sonicmoe_jax.core import schedule
from pallas_kernels.config import TileConfig
from sonicmoe_jax.core import xla_ops



@dataclasses.dataclass(frozen=True)
class CuteTile:
  """A CuTe grouped GEMM's tiling: block_n and pipeline stages (None: as many as fit)."""
  block_n: int
  stages: int | None


def _ints(csv):
  return [int(v) for v in csv.split(",")]


def _gemm_rows(up, up_gather, mm, mm_t, x, w1, w2, plan, tiles, pairs, up_proj):
  """name -> (jitted fn(cfg, *args), args, model FLOPs of the `pairs` valid rows, contraction
  length) of the four varlen-M GEMMs, given each one's fn(cfg, *args)."""
  xg = xla_ops.gather_rows(x, plan.token_index)
  h, a = up_proj(xg, w1, tiles)
  P, d, n = pairs, xg.shape[1], w2.shape[1]
  jit = lambda f: jax.jit(f, static_argnums=0)
  return {
      "up_proj": (jit(up), (xg, w1, tiles), 2 * P * d * 2 * n, d),
      "up_proj_gather": (jit(up_gather), (x, w1, plan.token_index, tiles), 2 * P * d * 2 * n, d),
      "down_proj": (jit(mm), (a, w2, tiles), 2 * P * n * d, n),
      "dx_tilde": (jit(mm_t), (h, w1, tiles), 2 * P * 2 * n * d, 2 * n),
  }


def kernels(x, w1, w2, dout, plan, pairs):
  """The Pallas kernels' rows (_gemm_rows, dh and dw1)."""
  tiles = ops.tiles(plan)
  rows = _gemm_rows(
      lambda c, xg, w1, t: grouped_gemm.up_proj(xg, w1, t, c),
      lambda c, x, w1, i, t: grouped_gemm.up_proj(x, w1, t, c, gather_index=i),
      lambda c, lhs, rhs, t: grouped_gemm.matmul(lhs, rhs, t, transpose_rhs=False, cfg=c),
      lambda c, lhs, rhs, t: grouped_gemm.matmul(lhs, rhs, t, transpose_rhs=True, cfg=c),
      x, w1, w2, plan, tiles, pairs, grouped_gemm.up_proj)
  E = plan.num_experts
  return _with_backward_rows(
      rows, lambda c, dg, w2, h, s, t: grouped_gemm.dh(dg, w2, h, s, t, c),
      lambda c, a, b, o: weight_grad.weight_grad(a, b, o, E, a.dtype, c), x, w2, dout, plan,
      tiles, pairs)


def _with_backward_rows(rows, dh, dw, x, w2, dout, plan, tiles, pairs):
  """rows plus the dH kernel's, dh(cfg, dOg, W2, H, scores, tiles), on _gemm_rows' H, dW1's,
  dw(cfg, Xg, dH, group_offsets), with H standing in for dH, and dW2's, dw(cfg, A', dOg,
  group_offsets), with A standing in for A'."""
  dg = xla_ops.gather_rows(dout, plan.token_index)
  xg, h = rows["up_proj"][1][0], rows["dx_tilde"][1][0]
  d, n = x.shape[1], w2.shape[1]
  jit = lambda f: jax.jit(f, static_argnums=0)
  rows["dh"] = (jit(dh), (dg, w2, h, plan.scores, tiles), 2 * pairs * n * d, d)
  rows["dw1"] = (jit(dw), (xg, h, plan.group_offsets), 2 * pairs * d * 2 * n, None)
  a = rows["down_proj"][1][0]   # A [P, n] standing in for A'
  rows["dw2"] = (jit(dw), (a, dg, plan.group_offsets), 2 * pairs * n * d, None)
  return rows


def cute_kernels(x, w1, w2, dout, plan, pairs):
  """The CuTe DSL kernels' rows (cfg a CuteTile):
  - up_proj, up_proj_gather, down_proj, dx_tilde (_gemm_rows); dh; dh_tma: dh storing through
    the TMA-store epilogue; dh_gather: dh gathering dO's rows in the kernel; dh_hsmem,
    dh_tma_hsmem, dh_gather_hsmem, dh_gather_tma_hsmem: dh's epilogue reading H from SMEM
    (_tma: and storing its outputs through it); dh_gemm: dh's GEMM without its epilogue math;
  - the ping-pong kernels (ffi/pingpong.py): up_proj_pingpong, dh_pingpong,
    dh_pingpong_gather (gathering dO), dh_pingpong_gather_tma (with its SMEM epilogue),
    down_proj_pingpong and dx_tilde_pingpong (_tma: with the TMA-store epilogue; _tma_rows192:
    on 192-row tiles; either _cluster2: in clusters of 2 CTAs sharing each lhs stage);
  - dw1, dw1_gather: dW1 gathering X's rows in the kernel; dw2, dw2_gather: dW2 transposed
    gathering dO's rows; dw1_gather_persistent, dw2_gather_persistent, down_proj_persistent,
    dx_tilde_persistent: the same on persistent CTAs (ffi/persistent.py); *_persistent_sized:
    the weight gradients skipping each expert's padding (the layer's), *_sized_dynamic: in the
    dynamic tile order, *_sized_cluster and *_sized_dynamic_cluster: in clusters of 2 CTAs
    sharing the rhs's stages (M a multiple of 256), *_tma: the rows loaded by TMA;
  - up_proj, down_proj, dx_tilde, dh, dw1 and dw2 again as *_ws: a producer warpgroup issuing
    their TMA loads."""
  from ffi import grouped_gemm as cute_gemm, persistent, pingpong  # optional extra
  tiles = schedule.tile_experts(plan, cute_gemm.BLOCK_M)
  rows = _gemm_rows(
      lambda c, xg, w1, t: cute_gemm.up_proj(xg, w1, t, **dataclasses.asdict(c)),
      lambda c, x, w1, i, t: cute_gemm.up_proj(x, w1, t, gather_index=i, **dataclasses.asdict(c)),
      lambda c, lhs, rhs, t: cute_gemm.grouped_matmul(lhs, rhs, t, **dataclasses.asdict(c)),
      lambda c, lhs, rhs, t: cute_gemm.grouped_matmul(lhs, rhs, t, transpose_rhs=True,
                                                      **dataclasses.asdict(c)),
      x, w1, w2, plan, tiles, pairs, cute_gemm.up_proj)
  E = plan.num_experts
  # (dh rows: over_h=False, H being an argument of the timed program: XLA would copy it first)
  rows = _with_backward_rows(
      rows, lambda c, dg, w2, h, s, t: cute_gemm.dh(dg, w2, h, s, t, over_h=False,
                                                  **dataclasses.asdict(c)),
      lambda c, a, b, o: cute_gemm.weight_grad(a, b, o, E, **dataclasses.asdict(c)), x, w2, dout,
      plan, tiles, pairs)
  _, dh_args, dh_flops, dh_n = rows["dh"]   # and dh storing through the TMA-store epilogue
  rows["dh_tma"] = (jax.jit(lambda c, dg, w2, h, s, t: cute_gemm.dh(
      dg, w2, h, s, t, tma_store=True, over_h=False, **dataclasses.asdict(c)), static_argnums=0),
      dh_args, dh_flops, dh_n)
  _, up_args, up_flops, up_n = rows["up_proj_gather"]   # (x, w1, index, tiles)
  rows["up_proj_pingpong"] = (jax.jit(lambda c, x, w1, i, t: pingpong.up_proj(
      x, w1, t, i, **dataclasses.asdict(c)), static_argnums=0), up_args, up_flops, up_n)
  rows["dh_pingpong"] = (jax.jit(lambda c, dg, w2, h, s, t: pingpong.dh(   # the same operands
      dg, w2, h, s, t, over_h=False, **dataclasses.asdict(c)), static_argnums=0),
      dh_args, dh_flops, dh_n)
  row_tiles = schedule.plan_row_tiles(plan, pingpong.ROW_TILE_M, pingpong.MMA_M)
  for name, transpose_rhs in [("down_proj", False), ("dx_tilde", True)]:   # the same operands
    _, mm_args, mm_flops, mm_n = rows[name]
    rows[f"{name}_pingpong"] = (jax.jit(   # stored from registers
        lambda c, lhs, rhs, t, tr=transpose_rhs: pingpong.grouped_matmul(
            lhs, rhs, t, transpose_rhs=tr, **dataclasses.asdict(c)),
        static_argnums=0), mm_args, mm_flops, mm_n)
    # _tma: TMA stores; _rows192: on 192-row tiles from each expert's start (their table instead
    # of tile_expert); _cluster2: in clusters of 2 CTAs sharing each lhs stage (the column tiles
    # an even number)
    for tile_m, rows_suffix, tiles in [(pingpong.TILE_M, "", mm_args[2]),
                                       (pingpong.ROW_TILE_M, "_rows192", row_tiles)]:
      for cluster_n, cluster in [(1, ""), (2, "_cluster2")]:
        rows[f"{name}_pingpong_tma{rows_suffix}{cluster}"] = (jax.jit(
            lambda c, lhs, rhs, t, tr=transpose_rhs, tm=tile_m, cn=cluster_n:
            pingpong.grouped_matmul(lhs, rhs, t, transpose_rhs=tr, tma_store=True, tile_m=tm,
                                    cluster_n=cn, **dataclasses.asdict(c)),
            static_argnums=0), (*mm_args[:2], tiles), mm_flops, mm_n)
  # dO's rows gathered too
  rows["dh_pingpong_gather"] = (jax.jit(lambda c, g, w2, h, s, t, i: pingpong.dh(
      g, w2, h, s, t, gather_index=i, over_h=False, **dataclasses.asdict(c)), static_argnums=0),
      (dout, *dh_args[1:], plan.token_index), dh_flops, dh_n)
  rows["dh_pingpong_gather_tma"] = (jax.jit(lambda c, g, w2, h, s, t, i: pingpong.dh(
      g, w2, h, s, t, gather_index=i, over_h=False, tma_store=True, **dataclasses.asdict(c)),
      static_argnums=0), (dout, *dh_args[1:], plan.token_index), dh_flops, dh_n)
  # dh's GEMM alone (dA' = dOg W2_e^T, stored as it is: no dSwiGLU epilogue), to tell its
  # mainloop from its epilogue
  rows["dh_gemm"] = (jax.jit(lambda c, dg, w2, h, s, t: cute_gemm.grouped_matmul(
      dg, w2, t, transpose_rhs=True, **dataclasses.asdict(c)), static_argnums=0),
      dh_args, dh_flops, dh_n)
  # dh reading H from SMEM (TMA-loaded over the rhs stages after the mainloop): _hsmem, rows
  # in slot order or (_gather) dO's rows gathered, register or (_tma) TMA stores
  for gather in (False, True):
    for tma in (False, True):
      name = f"dh{'_gather' if gather else ''}{'_tma' if tma else ''}_hsmem"
      args = (dout, *dh_args[1:], plan.token_index) if gather else dh_args
      rows[name] = (jax.jit(lambda c, g, w2, h, s, t, *i, tma=tma: cute_gemm.dh(
          g, w2, h, s, t, gather_index=i[0] if i else None, over_h=False, h_smem=True,
          tma_store=tma, **dataclasses.asdict(c)), static_argnums=0), args, dh_flops, dh_n)
  _, (_, h, offsets), dw1_flops, _ = rows["dw1"]
  _, (a, _, _), dw2_flops, _ = rows["dw2"]
  rows["dh_gather"] = (jax.jit(lambda c, g, w2, h, s, t, i: cute_gemm.dh(
      g, w2, h, s, t, gather_index=i, over_h=False, **dataclasses.asdict(c)),
      static_argnums=0), (dout, *dh_args[1:], plan.token_index), dh_flops, dh_n)
  rows["dw1_gather"] = (jax.jit(lambda c, x, h, o, i: cute_gemm.weight_grad(
      x, h, o, E, gather_index=i, **dataclasses.asdict(c)), static_argnums=0),
      (x, h, offsets, plan.token_index), dw1_flops, None)
  # dW2 computed transposed with dO's rows gathered in the kernel (dO^T A', stored [E, n, d] by
  # the kernel's M-major epilogue), A standing in for A' as in the dw2 row
  rows["dw2_gather"] = (jax.jit(lambda c, g, a, o, i: cute_gemm.weight_grad(
      g, a, o, E, gather_index=i, transpose_out=True, **dataclasses.asdict(c)),
      static_argnums=0), (dout, a, offsets, plan.token_index), dw2_flops, None)
  # the same two on persistent CTAs (ffi/persistent.py)
  rows["dw1_gather_persistent"] = (jax.jit(lambda c, x, h, o, i: persistent.weight_grad(
      x, h, o, E, i, **dataclasses.asdict(c)), static_argnums=0),
      (x, h, offsets, plan.token_index), dw1_flops, None)
  rows["dw2_gather_persistent"] = (jax.jit(lambda c, g, a, o, i: persistent.weight_grad(
      g, a, o, E, i, transpose_out=True, **dataclasses.asdict(c)),
      static_argnums=0), (dout, a, offsets, plan.token_index), dw2_flops, None)
  # ... skipping the k steps of each expert's padding rows (group_sizes: what the layer runs),
  # and so with the tiles in the order the CTAs ask for them (persistent.weight_grad dynamic),
  # and in clusters of 2 CTAs (cluster_m), and so with the rows loaded by TMA (_tma)
  for name, transpose_out in [("dw1_gather_persistent", False), ("dw2_gather_persistent", True)]:
    _, args, flops, _ = rows[name]
    for suffix, dynamic, cluster_m, tma in [
        ("_sized", False, 1, False), ("_sized_dynamic", True, 1, False),
        ("_sized_cluster", False, 2, False), ("_sized_dynamic_cluster", True, 2, False),
        ("_sized_cluster_tma", False, 2, True), ("_sized_dynamic_cluster_tma", True, 2, True)]:
      sized = lambda c, a, b, o, i, s, t=transpose_out, d=dynamic, cm=cluster_m, g=tma: (
          persistent.weight_grad(a, b, o, E, i, transpose_out=t, group_sizes=s, dynamic=d,
                                 cluster_m=cm, tma_gather=g, **dataclasses.asdict(c)))
      rows[name + suffix] = (jax.jit(sized, static_argnums=0), (*args, plan.group_sizes), flops,
                             None)
  for name, transpose_rhs in [("down_proj", False), ("dx_tilde", True)]:   # the same operands
    _, mm_args, mm_flops, mm_n = rows[name]
    rows[f"{name}_persistent"] = (jax.jit(
        lambda c, lhs, rhs, t, tr=transpose_rhs: persistent.grouped_matmul(
            lhs, rhs, t, transpose_rhs=tr, **dataclasses.asdict(c)), static_argnums=0),
        mm_args, mm_flops, mm_n)
  # the kernels that do not gather again as *_ws: a producer warpgroup issuing their TMA loads
  ws = lambda c: dict(warp_specialized=True, **dataclasses.asdict(c))
  ws_fns = {
      "up_proj": lambda c, xg, w1, t: cute_gemm.up_proj(xg, w1, t, **ws(c)),
      "down_proj": lambda c, lhs, rhs, t: cute_gemm.grouped_matmul(lhs, rhs, t, **ws(c)),
      "dx_tilde": lambda c, lhs, rhs, t: cute_gemm.grouped_matmul(lhs, rhs, t, transpose_rhs=True,
                                                                  **ws(c)),
      "dh": lambda c, dg, w2, h, s, t: cute_gemm.dh(dg, w2, h, s, t, over_h=False, **ws(c))}
  ws_fns["dw1"] = ws_fns["dw2"] = lambda c, a, b, o: cute_gemm.weight_grad(a, b, o, E, **ws(c))
  for name, fn in ws_fns.items():
    _, args, flops, k_len = rows[name]
    rows[name + "_ws"] = (jax.jit(fn, static_argnums=0), args, flops, k_len)
  return rows


def _timings(jobs, iters: int, reps: int, interleave: int):
  """Each job's ms (bench.time_ms), or the exception it raised. interleave R > 0: every job
  compiled and run once, then R rounds in which each job runs `iters` times (round r starting
  at job r, so no job always follows the same one); each job's median over the rounds."""
  if not interleave:
    out = []
    for _, fn, args, _ in jobs:
      try:
        out.append(time_ms(fn, args, iters, reps))
      except Exception as e:
        out.append(e)
    return out
  out, samples = [None] * len(jobs), [[] for _ in jobs]
  for i, (_, fn, args, _) in enumerate(jobs):
    try:
      jax.block_until_ready(fn(*args))
    except Exception as e:
      out[i] = e
  live = [i for i in range(len(jobs)) if out[i] is None]
  for r in range(interleave if live else 0):
    for i in live[r % len(live):] + live[:r % len(live)]:
      _, fn, args, _ = jobs[i]
      t0 = time.perf_counter()
      for _ in range(iters):
        result = fn(*args)
      jax.block_until_ready(result)
      samples[i].append((time.perf_counter() - t0) / iters * 1e3)
  return [e if e is not None else statistics.median(samples[i]) for i, e in enumerate(out)]


def main(argv=None):
  p = argparse.ArgumentParser()
  p.add_argument("--configs", default="30B-n256,7B-n256")
  p.add_argument("--custom", action="append", default=[], help="T,d,n,E,K (repeatable)")
  p.add_argument("--impl", choices=("pallas", "cute"), default="pallas")
  p.add_argument("--kernels", default="up_proj,down_proj,dx_tilde,dh")
  p.add_argument("--block-n", default="64,128,256")
  p.add_argument("--stages", default="3,4", help="0: (cute) as many as fit in SMEM")
  p.add_argument("--iters", type=int, default=5)
  p.add_argument("--reps", type=int, default=3)
  p.add_argument("--interleave", type=int, default=0,
                 help="R > 0: per config, time every row once a round for R rounds (each "
                      "round starting one row later) and report each row's median: rows "
                      "compared under the same clocks")
  p.add_argument("--out", default=None, help="folder to write tile_sweep.json into (default: none written)")
  a = p.parse_args(argv)
  recs = []
  cases = {c: C.ANCHORS[c] for c in a.configs.split(",") if c}
  cases.update({c: tuple(int(v) for v in c.split(",")) for c in a.custom})
  for name, (T, d, n, E, K) in cases.items():
    (x, wr, w1, w2), dout = make_args(T, d, n, E, K)
    plan = sm.route(sm.router_logits(x, wr), k=K, align=ops.ALIGN)[0]
    table = (kernels if a.impl == "pallas" else cute_kernels)(x, w1, w2, dout, plan, T * K)
    jobs = []   # (record, timed function, its arguments, FLOPs)
    for kname in a.kernels.split(","):
      fn, args, flops, k_len = table[kname]
      for bn, stages in itertools.product(_ints(a.block_n), _ints(a.stages)):
        if a.impl == "pallas":
          cfg = TileConfig(block_n=bn, stages=stages)
          # the depth it runs: the largest <= stages dividing the k steps (chained pipelines);
          # the varlen-K dW1 (k_len None) runs `stages`
          chained = grouped_gemm._pipelined_stages(k_len // cfg.block_k, stages) if k_len else None
        else:
          cfg, chained = CuteTile(bn, stages or None), None
        jobs.append((dict(config=name, impl=a.impl, kernel=kname, block_n=bn, stages=stages,
                          chained_stages=chained, ms=None, tflops=None), fn, (cfg, *args), flops))
    for (rec, _, _, flops), ms in zip(jobs, _timings(jobs, a.iters, a.reps, a.interleave)):
      if isinstance(ms, Exception):   # a tile that does not fit is a row
        rec["error"] = f"{type(ms).__name__}: {str(ms).splitlines()[0][:160] if str(ms) else ''}"
      else:
        rec.update(ms=ms, tflops=flops / ms / 1e9)
      recs.append(rec)
      print(json.dumps(rec), flush=True)
  print(f"{'config':11s} {'kernel':14s} {'bn':>4s} {'st':>3s} {'run':>3s} {'ms':>8s} {'TF/s':>6s}")
  for r in recs:
    if r["ms"] is not None:
      print(f"{r['config']:11s} {r['kernel']:14s} {r['block_n']:4d} {r['stages']:3d} "
            f"{r['chained_stages'] or r['stages']:3d} "
            f"{r['ms']:8.3f} {r['tflops']:6.0f}")
  if a.out:
    output.write_json(a.out, "tile_sweep", recs)


if __name__ == "__main__":
  main()
