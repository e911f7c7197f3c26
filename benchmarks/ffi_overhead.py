"""Per-call cost of a kernel launched from XLA: a chain of N tiny grouped GEMMs (each reads the
last one's output, so they run one after another) in one jitted program, for the CuTe kernel
behind cutlass.jax's FFI call, the same kernel compiled with TVM-FFI and registered through
jax-tvm-ffi (jax.ffi.ffi_call; when jax_tvm_ffi is installed), the Pallas Mosaic GPU kernel and
XLA's own dot. The time per call is launch + FFI dispatch + a tiny kernel; the difference
between rows is what the call path costs. The two CuTe paths' outputs are compared first.

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
      table["cute (jax-tvm-ffi)"] = tvm_ffi_matmul()
    except ImportError:
      pass
  return table


TVM_TARGET = "sonicmoe_cute_grouped_matmul_tvm_ffi"


def tvm_ffi_matmul(block_n: int = 128, stages: int = 2):
  """ffi/grouped_gemm.py's plain kernel compiled with TVM-FFI (the rows P symbolic, XLA's stream
  as TVM-FFI's environment stream) and registered as an XLA FFI target by jax-tvm-ffi: the
  other way the design card allows to call a CuTe kernel from XLA. Returns fn(lhs, rhs, tiles)."""
  import cutlass
  import cutlass.cute as cute
  import jax_tvm_ffi
  from ffi import grouped_gemm as cute_gemm

  def logical(t, order):   # a JAX row-major array seen in the kernel's mode order
    return cute.make_tensor(t.iterator, cute.select(t.layout, mode=order))

  @cute.jit
  def kernel(lhs, rhs, tile_expert, out, stream):   # (no annotations: this module's are strings)
    # lhs [1, P, K], rhs [E, K, N], out [1, P, N] -> (P, K, 1), (N, K, E), (P, N, 1)
    out_pn = logical(out, [1, 2, 0])
    cute_gemm._launch(stream, logical(lhs, [1, 2, 0]), logical(rhs, [2, 1, 0]), tile_expert,
                      tile_expert, out_pn, out_pn, None, block_n, stages, "store", False)

  rows = cute.sym_int()
  fake = cute.runtime.make_fake_compact_tensor
  compiled = cute.compile(
      kernel, fake(cutlass.BFloat16, (1, rows, K), stride_order=(2, 1, 0), assumed_align=16),
      fake(cutlass.BFloat16, (1, K, K), stride_order=(2, 1, 0), assumed_align=16),
      fake(cutlass.Int32, (cute.sym_int(),), assumed_align=4),
      fake(cutlass.BFloat16, (1, rows, K), stride_order=(2, 1, 0), assumed_align=16),
      cute.runtime.make_fake_stream(use_tvm_ffi_env_stream=True), options="--enable-tvm-ffi")
  jax_tvm_ffi.register_ffi_target(TVM_TARGET, compiled, platform="gpu", allow_cuda_graph=True)
  return lambda v, w, t: jax.ffi.ffi_call(
      TVM_TARGET, jax.ShapeDtypeStruct((1, *v.shape), v.dtype))(v[None], w, t)[0]


def main(argv=None):
  p = argparse.ArgumentParser()
  p.add_argument("--calls", type=int, default=20)
  p.add_argument("--out", default=None)
  a = p.parse_args(argv)
  x = (jax.random.normal(jax.random.key(0), (P, K)) / 16).astype(jnp.bfloat16)
  w = (jax.random.normal(jax.random.key(1), (1, K, K)) / 16).astype(jnp.bfloat16)
  tiles = jnp.zeros((P // 128,), jnp.int32)
  recs = []
  table = steps()
  if "cute (jax-tvm-ffi)" in table:   # the two CuTe paths run the same kernel: same output
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
    with open(a.out, "w") as f:
      json.dump(recs, f, indent=1)


if __name__ == "__main__":
  main()
