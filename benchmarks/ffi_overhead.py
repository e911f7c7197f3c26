"""Per-call cost of a kernel launched from XLA: a chain of N tiny grouped GEMMs (each reads the
last one's output, so they run one after another) in one jitted program, for our CuTe kernel
as the library calls it (TVM-FFI, registered by jax-tvm-ffi: ffi/xla_call.py), the same kernel
behind cutlass.jax's cutlass_call (the other way the design card allows), the Pallas Mosaic GPU
kernel and XLA's own dot. The time per call is launch + FFI dispatch + a tiny kernel; the
difference between rows is what the call path costs. The two CuTe paths' outputs are compared
first.

  python -m benchmarks.ffi_overhead --calls 20
"""
from __future__ import annotations

import argparse
import json

import jax
import jax.numpy as jnp

from benchmarks.bench import time_ms
from pallas_kernels import grouped_gemm as pallas_gemm

from benchmarks import output

P, K = 128, 128   # one M tile of one expert, two k steps
STAGES = 2


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
      table["cute (jax-tvm-ffi)"] = lambda v, w, t: cute_gemm.grouped_matmul(v, w, t, stages=STAGES)
      table["cute (cutlass.jax FFI)"] = cutlass_jax_matmul()
    except ImportError:
      pass
  return table


def cutlass_jax_matmul(block_n: int = 128):
  """ffi/grouped_gemm.py's plain kernel behind cutlass.jax's cutlass_call (it compiles the
  kernel when the program is lowered and calls it through its own FFI target)."""
  import cutlass.jax as cjax
  from ffi import grouped_gemm as cute_gemm
  rows = cjax.TensorSpec(mode=(1, 2, 0))   # [1, P, K] -> (P, K, 1), as xla_call's modes
  call = cjax.cutlass_call(
      cute_gemm._matmul, output_shape_dtype=jax.ShapeDtypeStruct((1, P, K), jnp.bfloat16),
      input_spec=[rows, cjax.TensorSpec(mode=(2, 1, 0)), None], output_spec=rows,
      block_n=block_n, stages=STAGES)
  return lambda v, w, t: call(v[None], w, t)[0]


def main(argv=None):
  p = argparse.ArgumentParser()
  p.add_argument("--calls", type=int, default=20)
  p.add_argument("--out", default=None, help="folder to write ffi_overhead.json into (default: none written)")
  a = p.parse_args(argv)
  x = (jax.random.normal(jax.random.key(0), (P, K)) / 16).astype(jnp.bfloat16)
  w = (jax.random.normal(jax.random.key(1), (1, K, K)) / 16).astype(jnp.bfloat16)
  tiles = jnp.zeros((P // 128,), jnp.int32)
  recs = []
  table = steps()
  if "cute (cutlass.jax FFI)" in table:   # the two CuTe paths run the same kernel: same output
    one = lambda name: jax.jit(table[name])(x, w, tiles)
    print("cute paths equal:", bool(jnp.array_equal(one("cute (cutlass.jax FFI)"),
                                                    one("cute (jax-tvm-ffi)"))), flush=True)
  for name, step in table.items():
    ms = time_ms(chain(step, a.calls), (x, w, tiles), 3, 3)
    recs.append(dict(impl=name, calls=a.calls, us_per_call=ms * 1e3 / a.calls))
    print(json.dumps(recs[-1]), flush=True)
  for r in recs:
    print(f"{r['impl']:26s} {r['us_per_call']:8.2f} us per call")
  if a.out:
    output.write_json(a.out, "ffi_overhead", recs)


if __name__ == "__main__":
  main()
