"""OmniMoE latency and memory, side by side (seed 003's setup): d = 1024, activated parameters
swept 3M-28M (K paired with it as in the paper's Table A: table_a_point), tokens 1K-16K;
OmniMoE expert-centric, PEER-style token-centric, a coarse
DeepSeekMoE layer and a dense SwiGLU MLP of equal activated parameters. OmniMoE runs twice:
its grouped GEMMs through the xla backend's ("omnimoe": tiled batched GEMMs on a GPU),
through our Pallas kernels ("omnimoe_pallas", GPU only) and through our CuTe kernels
("omnimoe_cute", GPU with the cute extra).

  python -m benchmarks.omnimoe_bench                 # GPU
  python -m benchmarks.omnimoe_bench --tiny          # CPU smoke run

Activated parameters per token: OmniMoE 2dK (K rows of W and V) + 3 d d_mlp (shared MLP) +
2 d sqrt(N) (router); DeepSeekMoE 3 d (d_shared + K_r d_expert) + d E_r (router); dense
3 d d_hidden. Every layer holds its weights in the compute dtype (bf16), as a served model
does, so no layer converts its weights per call. Latency: the layer's forward and its
forward+backward (median wall time, block_until_ready); for OmniMoE also its routing and
scheduling alone (schedule_ms: their share of the forward is what the paper reports as the
scheduling share); memory: XLA's temp + output bytes of each compiled program. Points:
sweep_points (the paper's two sweeps and its headline point).
"""
from __future__ import annotations

import argparse
import datetime
import json
import math
import sys

import jax
import jax.numpy as jnp
from flax import nnx

import sonicmoe_jax as sm
from sonicmoe_jax import backends
from models.baselines import DeepSeekMoE, DenseMLP
from models import omnimoe
from models.omnimoe import CHUNK_BYTES, OmniMoE

from benchmarks import bench, device_kernels, output


def table_a_point(d, active, n_atomic):
  """(K, shared MLP width, OmniMoE activated parameters) at about `active` activated parameters,
  paired as the paper's Table A pairs them: K atomic experts per token in proportion to the
  budget, 512 at about 4M up to 4096 at 28M (a multiple of 64); the shared MLP 1.5 K wide (a
  multiple of 128). Counted per token: 2 d K (the K rows of W and V) + 3 d d_mlp (the shared
  SwiGLU MLP) + 2 d sqrt(N) (the router's two projections)."""
  k = min(n_atomic, max(64, round(active * 4096 / 28e6 / 64) * 64))
  d_mlp = max(128, round(1.5 * k / 128) * 128)
  return k, d_mlp, 2 * d * k + 3 * d * d_mlp + 2 * d * math.isqrt(n_atomic)


def layers(d, active, n_atomic, tiny, chunk_bytes=CHUNK_BYTES, group=128):
  """The layers compared at one point, each with its activated parameters per token: OmniMoE
  (expert-centric, on XLA's and on our Pallas and CuTe grouped GEMMs), the PEER-style token-centric
  layer (the same parameters), a DeepSeekMoE layer and a dense SwiGLU MLP of about as many."""
  k, d_mlp, params = table_a_point(d, active, n_atomic)
  if tiny:
    k, d_mlp, params = 16, 2 * d, 2 * d * 16 + 3 * d * 2 * d + 2 * d * math.isqrt(n_atomic)
  routed_experts, k_r = 64, 6
  # DeepSeekMoE: the shared MLP as OmniMoE's, the routed experts' width taking the rest
  d_expert = max(64, (params // (3 * d) - d_mlp) // k_r // 64 * 64)
  rngs = nnx.Rngs(0)
  omni = lambda **kw: OmniMoE(d, n_atomic, k, d_mlp, group=group, chunk_bytes=chunk_bytes,
                              dtype=jnp.bfloat16, rngs=rngs, **kw)
  pallas = {} if tiny else {"omnimoe_pallas": (omni(grouped="pallas"), params)}
  if not tiny and backends.cute_installed():
    pallas["omnimoe_cute"] = (omni(grouped="cute"), params)
  return {
      **pallas,
      "omnimoe": (omni(), params),
      "peer_token_centric": (omni(execution="token_centric"), params),
      "deepseekmoe": (DeepSeekMoE(d, d_mlp, routed_experts, k_r, d_expert, rngs=rngs),
                      3 * d * (d_mlp + k_r * d_expert) + d * routed_experts),
      "dense": (DenseMLP(d, params // (3 * d), rngs=rngs), params // (3 * d) * 3 * d),
  }


def _timed(fn, args, iters, reps):
  """(median ms per call, XLA's temp + output bytes) of the jitted fn(*args)."""
  mem = fn.lower(*args).compile().memory_analysis()
  peak = None if mem is None else int(mem.temp_size_in_bytes + mem.output_size_in_bytes)
  return bench.time_ms(fn, args, iters, reps), peak


def scheduling(model: OmniMoE):
  """fn(params, rest, x): the OmniMoE layer's routing and scheduling alone (its router's top-K
  and, expert-centric, every chunk's schedule), the part of its forward the paper reports as
  the scheduling share."""
  graph = nnx.split(model, nnx.Param, ...)[0]

  def run(params, rest, x):
    m = nnx.merge(graph, params, rest)
    x = x.astype(m.dtype)
    g, ids = m.route(x)
    if m.execution == "token_centric":
      return g, ids
    # every schedule of the forward's chunks, whole (none of it left for XLA to drop)
    chunk = omnimoe.expert_centric_chunk(x.shape[1], m.k, m.group, m.chunk_bytes, backward=False)
    chunks, _ = omnimoe.split_tokens(chunk, ids)
    return g, jax.lax.map(lambda c: omnimoe.schedule(c[0], m.num_experts, m.group,
                                                     m.grouped_ops.align), chunks)

  return run


def _output(out):
  """The layer's output (the MoE layers return it with their router statistics)."""
  return out[0] if isinstance(out, tuple) else out


def measure(model, x, iters=10, reps=3, kernels=0):
  """The layer's forward, and its forward+backward (the gradients of every parameter and of x
  for a fixed cotangent): {"fwd_ms", "fwd_bytes", "step_ms", "step_bytes"}, for OmniMoE layers
  "schedule_ms" (routing and scheduling alone: `scheduling`), and with kernels > 0
  (on a GPU) the forward's GPU kernel time per call and its `kernels` longest kernels
  ("fwd_kernel_ms", "fwd_kernels": [(name, ms per call)])."""
  graph, params, rest = nnx.split(model, nnx.Param, ...)
  params = jax.tree.map(lambda p: p.astype(x.dtype), params)   # weights held as they compute

  def forward(params, rest, x):
    return _output(nnx.merge(graph, params, rest)(x))

  cot = jax.random.normal(jax.random.key(1), x.shape, jnp.float32)

  def step(params, rest, x):   # (nnx.grad: the layer may update its own state as it runs)
    loss = lambda m, x: jnp.sum(_output(m(x)).astype(jnp.float32) * cot)
    return nnx.grad(loss, argnums=(0, 1))(nnx.merge(graph, params, rest), x)

  fwd_ms, fwd_bytes = _timed(jax.jit(forward), (params, rest, x), iters, reps)
  step_ms, step_bytes = _timed(jax.jit(step), (params, rest, x), iters, reps)
  times = dict(fwd_ms=fwd_ms, fwd_bytes=fwd_bytes, step_ms=step_ms, step_bytes=step_bytes)
  if isinstance(model, OmniMoE):
    times["schedule_ms"], _ = _timed(jax.jit(scheduling(model)), (params, rest, x), iters, reps)
  profiled = device_kernels.kernel_times(jax.jit(forward), (params, rest, x)) if kernels else None
  if profiled is not None:
    times.update(fwd_kernel_ms=profiled[0], fwd_kernels=profiled[1][:kernels])
  return times


def sweep_points(actives, tokens):
  """The paper's sweep: every activated-parameter budget at the fewest tokens, every token
  count at the smallest budget, and the largest budget at 4096 tokens (its headline point)."""
  points = [(a, tokens[0]) for a in actives] + [(actives[0], t) for t in tokens]
  points.append((actives[-1], 4096))
  return list(dict.fromkeys(points))


def active_experts(model, x):
  """|E_active|: atomic experts chosen by at least one token of x (OmniMoE layers; None else).
  Expert-centric scheduling reads each active expert's parameters once, so its saving over the
  token-centric gather is (tokens x K) / |E_active|."""
  if not isinstance(model, OmniMoE):
    return None
  graph, state = nnx.split(model)
  counts = jax.jit(lambda st, x: nnx.merge(graph, st)(x)[1].topk_counts)(state, x)
  return int(jnp.sum(counts > 0))


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--d", type=int, default=1024)
  p.add_argument("--atomic-experts", type=int, default=1024 * 1024)
  p.add_argument("--active", default="3e6,7e6,14e6,28e6")
  p.add_argument("--tokens", default="1024,4096,16384")
  p.add_argument("--chunk-gib", type=float, default=CHUNK_BYTES / 2 ** 30,
                 help="OmniMoE's chunk of tokens: at most this many GiB of gathers or task rows")
  p.add_argument("--layers", default=None,
                 help="comma list of the layers to run (default: all of them; names as in the JSON)")
  p.add_argument("--group", type=int, default=128,
                 help="OmniMoE's experts per expert-centric group B (the Pallas GEMMs need a multiple of 128)")
  p.add_argument("--kernels", type=int, default=0,
                 help="record the forward's N longest GPU kernels (a profiled run per layer)")
  p.add_argument("--commit", default=None, help="the commit to record (default: git's)")
  p.add_argument("--tiny", action="store_true")
  p.add_argument("--out", default="runs/omnimoe_bench", help="folder to write omnimoe_bench.json into")
  a = p.parse_args(argv)
  sm.memory.take_gpu_memory_as_needed()   # (before JAX takes the GPU)
  if a.tiny:
    a.d, a.atomic_experts, a.active, a.tokens = 64, 256, "60000", "128"
  chunk_bytes = max(1, int(a.chunk_gib * 2 ** 30))
  meta = dict(commit=a.commit or bench.commit(), versions=bench.versions(),
              command=" ".join(["python -m benchmarks.omnimoe_bench"] + (argv or sys.argv[1:])),
              chunk_bytes=chunk_bytes, group=a.group, gpu=jax.devices()[0].device_kind,
              date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"))
  recs = []
  actives = sorted(int(float(v)) for v in a.active.split(","))
  tokens = sorted(int(v) for v in a.tokens.split(","))
  points = [(active, 128) for active in actives] if a.tiny else sweep_points(actives, tokens)
  for active, t in points:
    for name, (model, params) in layers(a.d, active, a.atomic_experts, a.tiny,
                                        chunk_bytes, a.group).items():
      if a.layers and name not in a.layers.split(","):
        continue
      x = jax.random.normal(jax.random.key(0), (t, a.d), jnp.bfloat16)
      try:
        times, status = measure(model, x, iters=2 if a.tiny else 10, kernels=a.kernels), "ok"
      except Exception as e:
        times, status = {}, f"{type(e).__name__}: {str(e)[:200]}"
      rec = dict(impl=name, tokens=t, active_params=params, atomic_experts=a.atomic_experts,
                 k=model.k if isinstance(model, OmniMoE) else None, **times, status=status,
                 active_experts=active_experts(model, x) if status == "ok" else None, **meta)
      recs.append(rec)
      print(json.dumps(rec), flush=True)
      # after every case: a run cut short keeps what it measured
      output.write_json(a.out, "omnimoe_bench", recs, quiet=True)
  print(f"wrote {output.json_path(a.out, 'omnimoe_bench')}")
  return recs


if __name__ == "__main__":
  main()
