"""Router logits and the routing plan at 30B-n256 (T=32768, d=4096, E=256, K=16) on the GPU: the
library's router_logits (bf16 operands, fp32 accumulation, a custom_vjp keeping X) against an
fp32 copy of X with plain autodiff. Prints ms per call; writes $OUT/router_logits.json.

  python -m benchmarks.router_logits
"""
import json
import os

import jax
import jax.numpy as jnp

import sonicmoe_jax as sm
from benchmarks.bench import time_ms

T, d, E, K = 32768, 4096, 256, 16


def fp32_copy_logits(x, w):
  return jnp.dot(x.astype(jnp.float32), w.astype(jnp.float32))


def main():
  x = (jax.random.normal(jax.random.key(0), (T, d)) * 0.5).astype(jnp.bfloat16)
  wr = (jax.random.normal(jax.random.key(1), (d, E)) * 0.02).astype(jnp.bfloat16)
  cot = jax.random.normal(jax.random.key(2), (T, E))
  grad = lambda f: jax.jit(jax.grad(lambda x, w: jnp.sum(f(x, w) * cot), argnums=(0, 1)))
  top_k = sm.resolve_backend("auto").top_k
  route = jax.jit(lambda x, w: sm.route(sm.router_logits(x, w), k=K, tile=128, align=128,
                                        top_k=top_k)[0])
  rows = {
      "logits fwd (bf16 operands, fp32 accumulation)": (jax.jit(sm.router_logits), (x, wr)),
      "logits fwd (fp32 copy of X)": (jax.jit(fp32_copy_logits), (x, wr)),
      "logits fwd+bwd (library custom_vjp)": (grad(sm.router_logits), (x, wr)),
      "logits fwd+bwd (fp32 copy, autodiff)": (grad(fp32_copy_logits), (x, wr)),
      "routing plan (logits, default top_k, plan)": (route, (x, wr)),
  }
  ms = {name: time_ms(fn, args, 10, 5) for name, (fn, args) in rows.items()}
  for name, v in ms.items():
    print(f"{v:8.3f} ms  {name}")
  with open(os.path.join(os.environ.get("OUT", "."), "router_logits.json"), "w") as f:
    json.dump(dict(gpu=jax.devices()[0].device_kind, jax=jax.__version__, T=T, d=d, E=E, K=K,
                   ms=ms), f, indent=1)


if __name__ == "__main__":
  main()
