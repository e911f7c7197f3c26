"""One forward+backward step of our layer between cudaProfilerStart and cudaProfilerStop, for
Nsight Compute to profile that step's kernels alone (after two untraced steps: compiles):

  ncu --profile-from-start off --clock-control none -k regex:sonicmoe --section SpeedOfLight \\
      python3 -m benchmarks.ncu_step --config 30B-n256 --impl auto

Where that run fails under ncu before its first kernel, profile from the start instead:
--no-profiler and `ncu --launch-count 10` (the first step's GEMMs).

It also prints the step's peak memory as bench measures it (bench.step_bytes); with
XLA_FLAGS=--xla_dump_to=DIR XLA writes the step's memory-usage report there (its largest
buffers and the values sharing each).
"""
from __future__ import annotations

import argparse
import ctypes
import glob
import os
import sys

import jax

from benchmarks import bench
from benchmarks import configs as C


def cuda_runtime():
  """The CUDA runtime library (for cudaProfilerStart / Stop): the pip wheel's that JAX's CUDA
  plugin loads, else the system's. OSError naming where it looked when there is none."""
  paths = [p for d in sys.path for p in glob.glob(os.path.join(d, "nvidia", "*", "lib",
                                                                 "libcudart.so*"))]
  for path in [*paths, "libcudart.so"]:
    try:
      return ctypes.CDLL(path)
    except OSError:
      continue
  raise OSError(f"no libcudart.so in the nvidia wheels on sys.path or the system's ({paths})")


def main(argv=None):
  p = argparse.ArgumentParser()
  p.add_argument("--config", default="30B-n256", help="a benchmarks/configs.py name, or T,d,n,E,K")
  p.add_argument("--impl", default="auto", help="as benchmarks.bench's --impls (one)")
  p.add_argument("--no-profiler", action="store_true",
                 help="run the steps without the profiler calls (off the GPU)")
  a = p.parse_args(argv)
  name, (T, d, n, E, K) = C.lookup(a.config)
  args, dout = bench.make_args(T, d, n, E, K)
  step = bench.forward_backward(bench.impl_fn(a.impl, K, None, 128))
  args = args + (dout,)
  jax.block_until_ready(step(*args))
  jax.block_until_ready(step(*args))
  cudart = None if a.no_profiler else cuda_runtime()
  if cudart is not None:
    cudart.cudaProfilerStart()
  value, _ = jax.block_until_ready(step(*args))
  if cudart is not None:
    cudart.cudaProfilerStop()
  step_mib = bench.step_bytes(step, args)
  step_mib = "n/a" if step_mib is None else f"{step_mib / 2**20:.1f}"
  print(f"{name} {a.impl}: one step profiled (loss {float(value):.4g}; step MiB {step_mib})")


if __name__ == "__main__":
  main()
