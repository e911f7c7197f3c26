"""Train a small SonicMoE language model on a generated Markov language (CPU or GPU).

  python -m models.train                 # the demo: a few minutes on a CPU
  python -m models.train --steps 2000 --d-model 256 --batch 64   # bigger, on a GPU

Prints the loss falling, tokens/s, per-expert load, and the activation memory one MoE layer
keeps for backward (measured), and writes a loss-curve PNG.
"""
from __future__ import annotations

import argparse
import json
import os
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from tqdm import tqdm

import sonicmoe_jax as sm
from sonicmoe_jax.core import xla_ops
from models.data import MarkovCorpus
from models.lm import LMConfig, MoELM, lm_loss


def build_parser() -> argparse.ArgumentParser:
  """The demo's command line (every flag with its help)."""
  p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--steps", type=int, default=400, help="optimizer steps")
  p.add_argument("--batch", type=int, default=32, help="sequences a step")
  p.add_argument("--seq", type=int, default=64, help="tokens a sequence")
  p.add_argument("--d-model", type=int, default=128,
                 help="model width (the Hopper kernels need a multiple of 128)")
  p.add_argument("--d-expert", type=int, default=64,
                 help="expert width n (the cute kernels need a multiple of 128, pallas of 64)")
  p.add_argument("--layers", type=int, default=2, help="decoder layers, each with an MoE")
  p.add_argument("--experts", type=int, default=8, help="experts E per MoE layer")
  p.add_argument("--k", type=int, default=2, help="experts per token")
  p.add_argument("--rounding", default="nearest", help="token rounding in training, or 'none'")
  p.add_argument("--tile", type=int, default=64,
                 help="token-rounding tile: each expert's count a multiple of it")
  p.add_argument("--backend", default="auto",
                 help="the MoE ops' backend: auto, xla, pallas or cute (as sonicmoe_jax.moe)")
  p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16"],
                 help="the model's compute dtype; auto: bfloat16 on a GPU (the Hopper kernels "
                      "take it), float32 elsewhere (in float32 the MoE ops run XLA's)")
  p.add_argument("--lr", type=float, default=1e-2, help="AdamW learning rate")
  p.add_argument("--vocab", type=int, default=32, help="the generated language's vocabulary")
  p.add_argument("--seed", type=int, default=0, help="seeds the model, the data and the language")
  p.add_argument("--eval-every", type=int, default=50, help="steps between held-out evaluations")
  p.add_argument("--out", default="runs/demo", help="folder for loss_curve.png and metrics.json")
  p.add_argument("--quiet", action="store_true",
                 help="no progress bar, per-eval lines or report (main returns the results)")
  p.add_argument("--ffn", default="sonicmoe", choices=["sonicmoe", "omnimoe"],
                 help="feed-forward layer: SonicMoE experts or OmniMoE atomic experts")
  p.add_argument("--omni-experts", type=int, default=1024,
                 help="with --ffn omnimoe: atomic experts N (a square)")
  p.add_argument("--omni-k", type=int, default=64,
                 help="with --ffn omnimoe: atomic experts per token")
  p.add_argument("--mesh", default=None,
                 help="device mesh, e.g. data=2,expert=4: tokens split over every axis, experts "
                      "over 'expert', other parameters replicated or, with --fsdp, split over "
                      "'data' (default: no mesh)")
  p.add_argument("--fsdp", action="store_true", help="with --mesh: shard non-expert parameters over 'data'")
  p.add_argument("--distributed", action="store_true",
                 help="multi-host: call jax.distributed.initialize() first (one process per host)")
  return p


def parse_args(argv=None):
  return build_parser().parse_args(argv)


def make_mesh(spec: str | None):
  """'data=2,expert=4' -> Mesh over the first 8 devices (None for no mesh)."""
  if not spec:
    return None
  axes = [kv.split("=") for kv in spec.split(",")]
  names, sizes = tuple(a for a, _ in axes), tuple(int(v) for _, v in axes)
  count = int(np.prod(sizes))
  if count > jax.device_count():
    raise ValueError(f"--mesh {spec} needs {count} devices; {jax.device_count()} available")
  return jax.sharding.Mesh(np.array(jax.devices()[:count]).reshape(sizes), names)


def fsdp_spec(shape, axis: str, size: int):
  """Shard the largest dimension divisible by `size` over `axis` (replicate if none is)."""
  dims = [i for i, n in enumerate(shape) if n % size == 0 and n >= size]
  if not dims:
    return jax.sharding.PartitionSpec()
  best = max(dims, key=lambda i: shape[i])
  return jax.sharding.PartitionSpec(*[axis if i == best else None for i in range(len(shape))])


def shard_model(model, mesh, fsdp: bool = False):
  """Place parameters by their partitioning metadata. Unannotated ones are replicated, or with
  fsdp=True split over the "data" axis (XLA gathers them where they are used: FSDP-style)."""
  state = nnx.state(model)
  specs = nnx.get_partition_spec(state)
  data = mesh.shape.get("data", 1)

  def placement(spec, value):
    if isinstance(spec, jax.sharding.PartitionSpec) and any(a is not None for a in spec):
      return jax.sharding.NamedSharding(mesh, spec)
    if fsdp and data > 1 and hasattr(value, "shape"):
      return jax.sharding.NamedSharding(mesh, fsdp_spec(value.shape, "data", data))
    return jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())

  shardings = jax.tree_util.tree_map(placement, specs, state)
  nnx.update(model, jax.device_put(state, shardings))


def moe_activation_report(cfg: LMConfig, tokens_per_step: int):
  """Measured bytes one MoE layer keeps for backward, against the bound and plain autodiff."""
  t, d, n, e, k = tokens_per_step, cfg.d_model, cfg.d_expert, cfg.num_experts, cfg.k
  dt = jnp.dtype(cfg.dtype)
  keys = jax.random.split(jax.random.key(0), 4)
  x = jax.random.normal(keys[0], (t, d), dt)
  r = jax.random.normal(keys[1], (d, e)) * 0.02
  w1 = (jax.random.normal(keys[2], (e, d, 2 * n)) * d ** -0.5).astype(dt)
  w2 = (jax.random.normal(keys[3], (e, n, d)) * n ** -0.5).astype(dt)
  kw = dict(k=k, rounding=None if cfg.rounding is None else cfg.rounding, tile=cfg.tile)

  def kept(fn):
    res = sm.saved_residuals(fn, x, r, w1, w2)
    return sum(q.nbytes for q in res if q.source not in ("argument r", "argument a", "argument b"))

  ours = kept(lambda x, r, a, b: sm.moe(x, r, a, b, **kw).out)

  def plain(x, r, a, b):  # the same math differentiated by JAX without our custom_vjp
    plan, _ = sm.route(sm.router_logits(x, r), **kw)
    _, act = xla_ops.up_proj(x, a, plan)
    return xla_ops.aggregate(xla_ops.down_proj(act, b, plan), plan.scores, plan)

  slots = sm.moe(x, r, w1, w2, **kw).plan.num_slots
  return dict(measured=ours, bound=sm.activation_bytes_bound(t, d, n, slots, dt.itemsize),
              plain_autodiff=kept(plain))


def routing_summary(stats, k: int, tile: int):
  """Averages over layers: fraction of (token, expert) decisions changed by rounding, load
  imbalance (max / mean top-K count) and the padding fraction plain top-K has at `tile`."""
  changed, imbalance, waste = [], [], []
  for st in stats:
    f = np.asarray(st.topk_counts, np.float64)
    changed.append(float(st.changed_pairs) / f.sum())
    imbalance.append(f.max() / f.mean())
    padded = np.ceil(f / tile) * tile
    waste.append(float((padded - f).sum() / max(padded.sum(), 1)))
  return dict(changed=float(np.mean(changed)), imbalance=float(np.mean(imbalance)),
              tc_padding=float(np.mean(waste)))


def plot(history, evals, floor, path):
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  fig, ax = plt.subplots(figsize=(7, 4))
  ax.plot(*zip(*history), label="train cross-entropy", alpha=0.8)
  if evals:
    ax.plot(*zip(*evals), "o-", label="held-out (plain top-K routing)")
  ax.axhline(floor, color="k", ls="--", lw=1, label=f"entropy floor {floor:.3f}")
  ax.set_xlabel("step")
  ax.set_ylabel("nats / token")
  ax.set_title("SonicMoE LM on the synthetic Markov language")
  ax.legend()
  fig.tight_layout()
  fig.savefig(path, dpi=120)
  plt.close(fig)


def compute_dtype(name: str, platform: str) -> str:
  """--dtype's value: "auto" is bfloat16 on a GPU (the kernels' dtype), float32 elsewhere."""
  if name != "auto":
    return name
  return "bfloat16" if platform == "gpu" else "float32"


def ops_by_backend(cfg: LMConfig) -> str:
  """Which backend runs each of the MoE layer's ops, e.g. 'pallas: top_k; xla: aggregate; ...'."""
  ops = sm.resolve_backend(cfg.backend, dtype=jnp.dtype(cfg.dtype), d=cfg.d_model, n=cfg.d_expert,
                           num_experts=cfg.num_experts, k=cfg.k)
  groups = {}
  for op, backend in ops.backend_by_op().items():
    groups.setdefault(backend, []).append(op)
  return "; ".join(f"{backend}: {', '.join(names)}" for backend, names in sorted(groups.items()))


def main(argv=None):
  args = parse_args(argv)
  sm.memory.take_gpu_memory_as_needed()   # (before JAX takes the GPU)
  rounding = None if args.rounding == "none" else args.rounding
  if args.distributed:
    jax.distributed.initialize()
  mesh = make_mesh(args.mesh)
  cfg = LMConfig(vocab_size=args.vocab, d_model=args.d_model, num_layers=args.layers,
                 num_experts=args.experts, k=args.k, d_expert=args.d_expert, rounding=rounding,
                 tile=args.tile, backend=args.backend, mesh=mesh,
                 dtype=compute_dtype(args.dtype, jax.default_backend()), ffn=args.ffn,
                 omni_experts=args.omni_experts, omni_k=args.omni_k)
  tokens_per_step = args.batch * args.seq
  print(f"sonicmoe-jax {sm.__version__} | jax {jax.__version__} | device {jax.devices()[0].device_kind}")
  print(f"model: {cfg}")
  if args.ffn == "sonicmoe":
    print(f"expert ops run on: {ops_by_backend(cfg)}")
  corpus = MarkovCorpus.make(args.vocab, seed=args.seed)
  floor = corpus.entropy_rate()
  held_out = jnp.asarray(corpus.sample(64, args.seq + 1, seed=10_000))
  print(f"data: order-2 Markov language, vocab {args.vocab}, best achievable loss {floor:.3f} nats/token")

  model = MoELM(cfg, nnx.Rngs(args.seed))
  batch_sharding = None
  if mesh is not None:
    shard_model(model, mesh, fsdp=args.fsdp)
    batch_sharding = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(mesh.axis_names))
    held_out = jax.device_put(held_out, batch_sharding)
    print(f"mesh: {dict(mesh.shape)} over {mesh.devices.size} devices")
  opt = nnx.Optimizer(model, optax.adamw(optax.warmup_cosine_decay_schedule(
      0.0, args.lr, min(50, args.steps // 5 + 1), args.steps, args.lr * 0.1), weight_decay=0.01),
      wrt=nnx.Param)

  @nnx.jit
  def train_step(model, opt, tokens):
    (loss, (ce, stats)), grads = nnx.value_and_grad(lm_loss, has_aux=True)(model, tokens)
    opt.update(model, grads)
    return ce, stats

  @nnx.jit
  def eval_step(model, tokens):
    return lm_loss(model, tokens)[1][0]

  def evaluate():
    model.eval()
    ce = float(eval_step(model, held_out))
    model.train()
    return ce

  history, evals, routing = [], [], []
  t_start = None
  bar = tqdm(range(args.steps), desc="training", unit="step", dynamic_ncols=True, disable=args.quiet)
  for step in bar:
    batch = jnp.asarray(corpus.sample(args.batch, args.seq + 1, seed=args.seed * 1_000_003 + step))
    if batch_sharding is not None:
      batch = jax.device_put(batch, batch_sharding)
    ce, stats = train_step(model, opt, batch)
    if step == 0:
      jax.block_until_ready(ce)
      t_start = time.perf_counter()  # exclude compilation from the throughput
    if step % 10 == 0 or step == args.steps - 1:
      history.append((step, float(ce)))
      routing.append(routing_summary(stats, cfg.k, args.tile))
      bar.set_postfix(loss=f"{float(ce):.3f}")
    if step % args.eval_every == 0 or step == args.steps - 1:
      evals.append((step, evaluate()))
      if not args.quiet:
        tqdm.write(f"step {step:5d}  train {float(ce):.4f}  held-out {evals[-1][1]:.4f}")
  jax.block_until_ready(ce)
  elapsed = time.perf_counter() - t_start
  tok_s = tokens_per_step * max(args.steps - 1, 1) / max(elapsed, 1e-9)

  if args.quiet:
    return dict(history=history, evals=evals, floor=floor, tokens_per_s=tok_s, routing=routing,
                model=model)
  print(f"\nloss: first {history[0][1]:.3f} -> last {history[-1][1]:.3f} (train), "
        f"held-out {evals[-1][1]:.3f}, floor {floor:.3f}")
  print(f"throughput: {tok_s:,.0f} tokens/s ({tokens_per_step} tokens/step, compile excluded)")
  if args.ffn == "omnimoe":
    print("atomic-expert usage in the last step:")
    for i, (st, blk) in enumerate(zip(stats, model.blocks)):
      used = float(np.mean(np.asarray(st.expert_counts) > 0))
      print(f"  layer {i}: {used:.1%} of {args.omni_experts} experts used, "
            f"unevenness KL(usage || uniform) = {float(blk.moe.last_unevenness[...]):.3f}")
    stats = []
  else:
    print("per-expert load in the last step (tokens per expert, after rounding):")
  for i, st in enumerate(stats):
    counts = np.asarray(st.expert_counts)
    top = np.asarray(st.topk_counts)
    print(f"  layer {i}: {counts.tolist()}  (top-K: {top.tolist()}, "
          f"changed by rounding: {int(st.changed_pairs)} of {int(top.sum())} pairs)")
  mem = moe_activation_report(cfg, tokens_per_step) if args.ffn == "sonicmoe" else None
  if mem:
    print(f"activation memory kept for backward per MoE layer (measured): {mem['measured']/2**20:.2f} MiB; "
        f"SonicMoE bound X + H = {mem['bound']/2**20:.2f} MiB + routing plan; "
        f"plain autodiff of the same layer keeps {mem['plain_autodiff']/2**20:.2f} MiB")

  os.makedirs(args.out, exist_ok=True)
  png = os.path.join(args.out, "loss_curve.png")
  plot(history, evals, floor, png)
  with open(os.path.join(args.out, "metrics.json"), "w") as f:
    json.dump(dict(config=vars(args), history=history, evals=evals, floor=floor,
                   tokens_per_s=tok_s, activation_bytes=mem), f, indent=1)
  print(f"wrote {png} and metrics.json")
  return dict(history=history, evals=evals, floor=floor, tokens_per_s=tok_s, memory=mem,
              routing=routing, model=model)


if __name__ == "__main__":
  main()
