"""Token rounding against plain top-K on one card: the layer's forward+backward step and the
routing alone, each mode in turn, in rounds.

  python -m benchmarks.rounding_bench [--custom T,d,n,E,K ...] [--modes none,nearest,...]

For each config and mode ("none" is plain top-K): the GPU kernel time of the layer's step
(loss value and every gradient, as bench.py times it) and of the routing alone (the router's
plan from logits, forward and the backward through the slot scores), from the profiler; the
routing's time apart shows what rounding costs and the rest what the GEMMs save. Modes
alternate within each round (--rounds); the table gives medians and each mode's step over plain
top-K's. `--select xla` runs rounding's selection on XLA instead of the backend's (a check of
what the selection kernel buys). Writes rounding.json (records with the commit and command)
and prints the table.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys

import jax
import jax.numpy as jnp

import sonicmoe_jax as sm
from benchmarks import bench, device_kernels, output
from benchmarks import configs as C
from sonicmoe_jax.core import routing

MODES = ("none", "nearest", "stochastic", "up", "down", "balanced")
# the issue-sized configs: the paper's sparse settings at T = 32768 (K/E = 1/64, 1/128)
DEFAULT_CONFIGS = ("32768,4096,256,256,4", "32768,2048,256,512,4")


def backend_spec(select: str):
  """The layer's backends: "auto", with rounding's selection on XLA for select="xla"."""
  return "auto" if select == "backend" else {"rounded_slots": "xla"}


def step_fn(mode, K, tile, select):
  rounding = None if mode == "none" else mode

  def fn(x, wr, w1, w2):
    return sm.moe(x, wr, w1, w2, k=K, rounding=rounding, tile=tile, rng=jax.random.key(0),
                  backend=backend_spec(select)).out
  return fn


def routing_fn(mode, K, tile, select, d, n, slot_weights):
  """The routing alone, as the layer runs it: the plan from logits, and the backward of its
  slot scores (weighted by slot_weights) to the logits."""
  rounding = None if mode == "none" else mode

  def fn(logits):
    ops = sm.resolve_backend(backend_spec(select), dtype=jnp.bfloat16, d=d, n=n,
                             num_experts=logits.shape[1], k=K)

    def loss(l):
      plan, _ = routing.route(l, k=K, rounding=rounding, tile=tile, rng=jax.random.key(0),
                              align=ops.align, top_k=ops.top_k,
                              rounded_slots=ops.rounded_slots)
      return jnp.sum(plan.scores * slot_weights[:plan.num_slots])
    return jax.grad(loss)(logits)
  return jax.jit(fn)


def kernel_ms(fn, args, top: int = 8):
  """(GPU kernel ms per call of fn(*args), its `top` longest kernels as [name, ms]); (None,
  None) off the GPU."""
  times = device_kernels.kernel_times(fn, args)
  if times is None:
    return None, None
  return times[0], [[name[:80], t] for name, t in times[1][:top]]


def measure(cfg, mode, a, cache):
  """One record: the step's and the routing's times at cfg under mode. cache keeps each jitted
  function (and the inputs) from round to round, so later rounds compile nothing."""
  T, d, n, E, K = cfg
  if cfg not in cache:
    args, dout = bench.make_args(T, d, n, E, K)
    slot_weights = jax.random.normal(jax.random.key(5), (routing.num_slots(T, E, K, a.tile, 128),))
    cache[cfg] = (args + (dout,), (routing.router_logits(args[0], args[1]),), slot_weights)
  step_args, routing_args, slot_weights = cache[cfg]
  if (cfg, mode) not in cache:
    cache[cfg, mode] = (bench.forward_backward(step_fn(mode, K, a.tile, a.select)),
                        routing_fn(mode, K, a.tile, a.select, d, n, slot_weights))
  step, route = cache[cfg, mode]
  rec = dict(config=",".join(map(str, cfg)), mode=mode, select=a.select)
  rec["step_wall_ms"] = bench.time_ms(step, step_args, a.iters, a.reps)
  rec["step_kernel_ms"] = kernel_ms(step, step_args)[0]
  rec["routing_kernel_ms"], rec["routing_kernels"] = kernel_ms(route, routing_args)
  return rec


def table(records):
  rows = ["| config | mode | step kernels ms | vs top-K | step wall ms | routing kernels ms | "
          "routing extra ms |", "|---|---|---|---|---|---|---|"]
  med = lambda rs, key: (statistics.median([r[key] for r in rs if r.get(key) is not None])
                         if any(r.get(key) is not None for r in rs) else None)
  for cfg in dict.fromkeys(r["config"] for r in records):
    base = [r for r in records if r["config"] == cfg and r["mode"] == "none"]
    base_step, base_route = med(base, "step_kernel_ms"), med(base, "routing_kernel_ms")
    for mode in dict.fromkeys(r["mode"] for r in records if r["config"] == cfg):
      rs = [r for r in records if r["config"] == cfg and r["mode"] == mode]
      step, route = med(rs, "step_kernel_ms"), med(rs, "routing_kernel_ms")
      ratio = f"{step / base_step:.3f}" if step and base_step else "-"
      extra = f"{route - base_route:+.3f}" if route is not None and base_route is not None else "-"
      rows.append(f"| {cfg} | {mode} | {bench.fmt(step, '.3f')} | {ratio} | "
                  f"{bench.fmt(med(rs, 'step_wall_ms'), '.3f')} | {bench.fmt(route, '.3f')} | "
                  f"{extra} |")
  return "\n".join(rows)


def build_parser():
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--custom", action="append", default=None,
                 help="T,d,n,E,K (repeatable; default: " + " and ".join(DEFAULT_CONFIGS) + ")")
  p.add_argument("--modes", default=",".join(MODES), help="comma list of " + ", ".join(MODES))
  p.add_argument("--tile", type=int, default=128, help="token-rounding tile")
  p.add_argument("--select", choices=("backend", "xla"), default="backend",
                 help="rounding's selection: the backend's (default) or XLA's")
  p.add_argument("--rounds", type=int, default=2, help="rounds over every mode")
  p.add_argument("--iters", type=int, default=10, help="steps per timed sample (wall time)")
  p.add_argument("--reps", type=int, default=3, help="timed samples; their median is the time")
  p.add_argument("--tiny", action="store_true", help="one tiny config (CPU smoke run)")
  p.add_argument("--out", default="runs/rounding", help="folder for rounding.json")
  p.add_argument("--commit", default=None, help="the commit to record (default: git's HEAD here)")
  return p


def main(argv=None):
  a = build_parser().parse_args(argv)
  sm.memory.take_gpu_memory_as_needed()   # (before JAX takes the GPU)
  modes = a.modes.split(",")
  for mode in modes:
    if mode not in MODES:
      raise SystemExit(f"--modes: unknown mode {mode!r}; modes are {', '.join(MODES)}")
  texts = ["512,256,64,8,2"] if a.tiny else (a.custom or list(DEFAULT_CONFIGS))
  cfgs = [C.parse_config(t)[1] for t in texts]
  if a.tiny:
    a.tile, a.iters, a.reps, a.rounds = 32, 1, 1, 1
  records, cache = [], {}
  for r in range(a.rounds):
    for cfg in cfgs:
      for mode in modes:
        rec = measure(cfg, mode, a, cache)
        rec["round"] = r
        records.append(rec)
        print(json.dumps(rec), flush=True)
  meta = dict(commit=a.commit or bench.commit(), command=" ".join(sys.argv), versions=bench.versions(),
              device=str(jax.devices()[0].device_kind))
  print(table(records))
  output.write_json(a.out, "rounding", dict(meta=meta, records=records))
  return records


if __name__ == "__main__":
  main()
