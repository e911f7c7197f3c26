"""Traces and exports a program with the CuTe up-projection for CUDA in a fresh process and
prints the seconds it took (the kernel's compile included unless the disk cache has it)."""
import time

import ffi  # noqa: F401  (sets CUTE_DSL_ARCH=sm_90a off the GPU)
import jax
import jax.numpy as jnp

from ffi import grouped_gemm, xla_call

P, d, n, E = 512, 256, 128, 4
args = (jax.ShapeDtypeStruct((P, d), jnp.bfloat16), jax.ShapeDtypeStruct((E, d, 2 * n), jnp.bfloat16),
        jax.ShapeDtypeStruct((P // 128,), jnp.int32))
program = jax.jit(lambda x, w, t: grouped_gemm.up_proj(x, w, t))
t0 = time.time()
program.trace(*args)   # compiles (or reads back) the kernel and registers its FFI target
jax.export.export(program, platforms=("cuda",), disabled_checks=xla_call.safety_checks())(*args)
print(f"lowered in {time.time() - t0:.3f} s")
