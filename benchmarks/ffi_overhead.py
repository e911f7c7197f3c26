"""Per-call cost of a kernel launched from XLA: a chain of N tiny grouped GEMMs (each reads the
last one's output, so they run one after another) in one jitted program, for the CuTe kernel
behind cutlass.jax's FFI call, the Pallas Mosaic GPU kernel and XLA's own dot. The time per
call is launch + FFI dispatch + a tiny kernel; the difference between rows is what the call
path costs.

  python -m benchmarks.ffi_overhead --calls 20
"""
from __future__ import annotations

import argparse
import json

import jax
import jax.numpy as jnp

from benchmarks.bench import time_ms
from pallas_kernels import grouped_gemm as pallas_gemm

P, K = 128, 128   # one M tile of one expert, two k steps


def chain(step, calls):
  """x -> step(x) `calls` times, unrolled in one program (no loop: a GPU while loop would add
  its own per-iteration cost)."""
  def run(x, w, tiles):
    for _ in range(calls):
      x = step(x, w, tiles)
    return x
  return jax.jit(run)


def steps():
  """name -> one [P, K] @ [1, K, K] grouped GEMM step."""
  table = {
      "xla dot": lambda v, w, t: (v @ w[0]).astype(v.dtype),
      "pallas": lambda v, w, t: pallas_gemm.matmul(v, w, t, transpose_rhs=False),
  }
  if jax.default_backend() == "gpu":   # the CuTe kernels run on the GPU only
    try:
      from ffi import grouped_gemm as cute_gemm
      table["cute (cutlass.jax FFI)"] = lambda v, w, t: cute_gemm.grouped_matmul(v, w, t)
    except ImportError:
      pass
  return table


def main(argv=None):
  p = argparse.ArgumentParser()
  p.add_argument("--calls", type=int, default=20)
  p.add_argument("--out", default=None)
  a = p.parse_args(argv)
  x = (jax.random.normal(jax.random.key(0), (P, K)) / 16).astype(jnp.bfloat16)
  w = (jax.random.normal(jax.random.key(1), (1, K, K)) / 16).astype(jnp.bfloat16)
  tiles = jnp.zeros((P // 128,), jnp.int32)
  recs = []
  for name, step in steps().items():
    ms = time_ms(chain(step, a.calls), (x, w, tiles), 3, 3)
    recs.append(dict(impl=name, calls=a.calls, us_per_call=ms * 1e3 / a.calls))
    print(json.dumps(recs[-1]), flush=True)
  for r in recs:
    print(f"{r['impl']:26s} {r['us_per_call']:8.2f} us per call")
  if a.out:
    with open(a.out, "w") as f:
      json.dump(recs, f, indent=1)


if __name__ == "__main__":
  main()
