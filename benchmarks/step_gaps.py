"""Where a forward+backward step's wall time goes beyond its kernels: the GPU's idle gaps.

  python -m benchmarks.step_gaps --configs 30B-n256 --impls auto,pallas

For each config and impl: the step's wall time (bench.time_ms), its kernels' summed time, and
from one profiled step the GPU's busy time, its idle time inside the step and the longest idle
gaps with the kernels on either side (device_kernels.idle_gaps). A gap after a custom call
points at host work in its handler; gaps everywhere point at the host falling behind.
"""
from __future__ import annotations

import argparse
import json

import jax

from benchmarks import bench
from benchmarks import output
from benchmarks import configs as C
from benchmarks import device_kernels
from benchmarks.kernel_table import short_name


def step_report(impl: str, cfg, iters: int = 5, reps: int = 3, top: int = 8) -> dict:
  T, d, n, E, K = cfg
  fn = bench.impl_fn(impl, K, None, 128)
  args, dout = bench.make_args(T, d, n, E, K)
  step = bench.forward_backward(fn)
  args = args + (dout,)
  wall = bench.time_ms(step, args, iters, reps)
  planes = device_kernels.profile(step, args, steps=1)
  events = device_kernels.stream_events(planes or [])
  span, busy, gaps = device_kernels.idle_gaps(events, top)
  return dict(impl=impl, wall_ms=wall, kernels_ms=sum(e - s for s, e, _ in events) / 1e6,
              span_ms=span, busy_ms=busy, idle_ms=span - busy, kernels=len(events),
              gaps=[(round(g, 4), short_name(a), short_name(b)) for g, a, b in gaps])


def main(argv=None):
  p = argparse.ArgumentParser()
  p.add_argument("--configs", default="30B-n256")
  p.add_argument("--impls", default="auto")
  p.add_argument("--top", type=int, default=8)
  p.add_argument("--out", default=None, help="folder to write step_gaps.json (JSON lines) into")
  a = p.parse_args(argv)
  print("devices", jax.devices())
  recs = []
  for name in a.configs.split(","):
    for impl in a.impls.split(","):
      rec = dict(config=name, **step_report(impl, {**C.ANCHORS, **C.TINY}[name], top=a.top))
      recs.append(rec)
      print(f"{name} {impl}: wall {rec['wall_ms']:.3f} ms, kernels {rec['kernels_ms']:.3f}, "
            f"span {rec['span_ms']:.3f}, busy {rec['busy_ms']:.3f}, idle {rec['idle_ms']:.3f} "
            f"({rec['kernels']} kernels)")
      for g, before, after in rec["gaps"]:
        print(f"   {g:7.3f} ms  after {before[:60]}  before {after[:60]}")
  if a.out:
    output.write_json(a.out, "step_gaps", recs, lines=True)


if __name__ == "__main__":
  main()
