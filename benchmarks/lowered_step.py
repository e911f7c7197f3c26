"""What GPU program the cute layer's forward+backward step lowers to, as digests to compare
before and after a change that is meant to leave it alone (kernel_resources does the same for
the cubins): per shape, a digest of the step lowered for CUDA (source locations and the FFI
targets' names, which hash the package's sources, left out) and one of the kernels it compiles
(each kernel function and its static configuration). Runs on a CPU with the cute extra.

  python -m benchmarks.lowered_step [--shapes 256,256,128,8,2 ...] [--rounding MODE] [--out DIR]
"""
from __future__ import annotations

import argparse
import hashlib
import re

import jax
import jax.numpy as jnp

import sonicmoe_jax as sm
from benchmarks import output
from benchmarks.bench import make_args

SHAPES = ((256, 256, 128, 8, 2), (256, 1536, 256, 8, 2), (256, 2048, 1024, 4, 2),
          (300, 4096, 256, 16, 4))


def digests(shape, backend="cute", rounding=None) -> dict:
  """{"program": digest of the lowered step, "kernels": digest of the (kernel, configuration)
  set, "count": how many kernels} for one (T, d, n, E, K), plain top-K or token rounding."""
  from ffi import compile_cache
  T, d, n, E, K = shape
  (x, wr, w1, w2), _ = make_args(T, d, n, E, K)
  specs = set()
  real = compile_cache.entry_key

  def spy(fn, spec):
    specs.add((fn.__qualname__, repr(spec)))
    return real(fn, spec)

  compile_cache.entry_key = spy
  try:
    loss = lambda *a: jnp.sum(sm.moe(*a, k=K, backend=backend, rounding=rounding,
                                     rng=jax.random.key(0)).out.astype(jnp.float32))
    step = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2, 3)))
    step.trace(x, wr, w1, w2)   # (registers the kernels' FFI targets, which export then allows)
    exported = jax.export.export(step, platforms=("cuda",), disabled_checks=_safety_checks())(
        x, wr, w1, w2)
  finally:
    compile_cache.entry_key = real
  text = re.sub(r"loc\([^)]*\)", "", exported.mlir_module())
  text = re.sub(r"#loc\d*( = .*)?", "", text)    # location aliases and their uses
  text = "\n".join(line for line in text.splitlines() if line.strip())
  text = re.sub(r"sonicmoe_cute_[0-9a-f]+", "TARGET", text)
  sha = lambda s: hashlib.sha256(s.encode()).hexdigest()[:16]
  return dict(shape=list(shape), program=sha(text), kernels=sha(repr(sorted(specs))),
              count=len(specs))


def _safety_checks():
  from ffi import xla_call
  return xla_call.safety_checks()


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--shapes", nargs="*", default=None, help="T,d,n,E,K each (default: four)")
  p.add_argument("--rounding", default=None, help="token-rounding mode (default: plain top-K)")
  p.add_argument("--out", default=None, help="folder to write lowered_step.json into")
  a = p.parse_args(argv)
  shapes = SHAPES if not a.shapes else [tuple(int(v) for v in s.split(",")) for s in a.shapes]
  recs = [digests(shape, rounding=a.rounding) for shape in shapes]
  for r in recs:
    print(f"{tuple(r['shape'])}: program {r['program']}, {r['count']} kernels {r['kernels']}")
  if a.out:
    output.write_json(a.out, "lowered_step", recs)
  return recs


if __name__ == "__main__":
  main()
