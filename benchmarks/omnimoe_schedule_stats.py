"""How dense the expert-centric schedule's GEMMs are: for a random Cartesian router at the
paper's scale, the active experts and, per group size B, the schedule's rows ((token, group)
pairs), tasks per row and the dense group GEMMs' FLOPs over the useful ones (B / tasks per row).

  python -m benchmarks.omnimoe_schedule_stats                # N = 1024^2, K = 4096, T = 1024
  python -m benchmarks.omnimoe_schedule_stats --tiny         # CPU smoke run
"""
from __future__ import annotations

import argparse
import datetime
import json

import jax
import jax.numpy as jnp

from benchmarks import bench, output
from models import omnimoe


def stats(num_tokens: int, d: int, num_experts: int, k: int, groups, seed: int = 0):
  """[{group, rows, tasks_per_row, dense_over_useful, active_experts}] for one routing."""
  keys = jax.random.split(jax.random.key(seed), 3)
  side = omnimoe.grid_shape(num_experts)[0]
  x = jax.random.normal(keys[0], (num_tokens, d))
  w_row, w_col = (jax.random.normal(kk, (d, side)) * d ** -0.5 for kk in keys[1:])
  _, ids = jax.jit(omnimoe.route, static_argnums=3)(x, w_row, w_col, k)
  active = int(jnp.sum(jnp.zeros((num_experts,), bool).at[ids.reshape(-1)].set(True)))
  recs = []
  for group in groups:
    sched = jax.jit(omnimoe.schedule, static_argnums=(1, 2))(ids, num_experts, group)
    rows = int(sched.row_offsets[-1])
    tasks = num_tokens * k
    recs.append(dict(tokens=num_tokens, atomic_experts=num_experts, k=k, group=group,
                     active_experts=active, rows=rows, tasks_per_row=tasks / rows,
                     dense_over_useful=rows * group / tasks))
  return recs


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--tokens", type=int, default=1024)
  p.add_argument("--d", type=int, default=1024)
  p.add_argument("--atomic-experts", type=int, default=1024 * 1024)
  p.add_argument("--k", type=int, default=4096)
  p.add_argument("--groups", default="16,64,128,1024", help="comma list of group sizes B")
  p.add_argument("--tiny", action="store_true", help="a small setup (CPU smoke run)")
  p.add_argument("--out", default="runs/omnimoe_schedule_stats", help="folder for the JSON")
  a = p.parse_args(argv)
  if a.tiny:
    a.tokens, a.d, a.atomic_experts, a.k, a.groups = 64, 32, 256, 16, "4,16"
  recs = stats(a.tokens, a.d, a.atomic_experts, a.k, [int(g) for g in a.groups.split(",")])
  meta = dict(commit=bench.commit(), versions=bench.versions(), device=jax.devices()[0].device_kind,
              date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"))
  for r in recs:
    print(json.dumps(r))
  output.write_json(a.out, "omnimoe_schedule_stats", dict(meta=meta, records=recs))
  return recs


if __name__ == "__main__":
  main()
