"""The Cartesian router's exact top-K, each method at each (tokens, K): median ms of the jitted
top-K over random row and column log-probabilities (N = 1024 x 1024 by default), and whether
the methods pick the same experts. cartesian_topk runs its CuTe kernel on a GPU with the cute
extra (timed as "kernel" where it runs), else picks between the two XLA methods by a cost
model that these timings check.

  python -m benchmarks.omnimoe_router_bench                          # GPU
  python -m benchmarks.omnimoe_router_bench --points 64:576 --side 64   # CPU smoke run
"""
from __future__ import annotations

import argparse
import datetime
import json

import jax
import jax.numpy as jnp

from benchmarks import bench, output
from models import omnimoe

METHODS = ("candidates", "bisection")


def point(num_tokens: int, k: int, side: int, seed: int = 0) -> dict:
  """{tokens, k, side, <method>_ms for each method that runs here, same_experts} at one
  point."""
  keys = jax.random.split(jax.random.key(seed), 2)
  p_row = jax.nn.log_softmax(jax.random.normal(keys[0], (num_tokens, side)), -1)
  p_col = jax.nn.log_softmax(jax.random.normal(keys[1], (num_tokens, side)), -1)
  rec = dict(tokens=num_tokens, k=k, side=side)
  picked = {}
  for method in METHODS + (("kernel",) if omnimoe._kernel_runs(side, side, k) else ()):
    fn = jax.jit(lambda r, c, m=method: omnimoe.cartesian_topk(r, c, k, m))
    rec[f"{method}_ms"] = bench.time_ms(fn, (p_row, p_col), iters=1, reps=7)
    picked[method] = jnp.sort(fn(p_row, p_col)[1], axis=1)
  rec["same_experts"] = all(bool(jnp.all(ids == picked["bisection"])) for ids in picked.values())
  return rec


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--points", default="1024:576,4096:576,16384:576,1024:4096,4096:4096",
                 help="comma list of tokens:K")
  p.add_argument("--side", type=int, default=1024, help="the grid's side sqrt(N)")
  p.add_argument("--out", default="runs/omnimoe_router_bench", help="folder for the JSON")
  p.add_argument("--commit", default=None, help="the commit to record (default: git's)")
  a = p.parse_args(argv)
  meta = dict(commit=a.commit or bench.commit(), versions=bench.versions(),
              device=jax.devices()[0].device_kind,
              date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"))
  recs = []
  for spec in a.points.split(","):
    num_tokens, k = (int(v) for v in spec.split(":"))
    recs.append(point(num_tokens, k, a.side))
    print(json.dumps(recs[-1]), flush=True)
    output.write_json(a.out, "omnimoe_router_bench", dict(meta=meta, records=recs), quiet=True)
  print(f"wrote {output.json_path(a.out, 'omnimoe_router_bench')}")
  return recs


if __name__ == "__main__":
  main()
