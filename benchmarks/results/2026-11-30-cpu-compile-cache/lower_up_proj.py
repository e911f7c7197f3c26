"""Lowers a program with the CuTe up-projection for CUDA in a fresh process and prints the
seconds it took (the kernel's compile included unless the disk cache has it)."""
import time

import ffi  # noqa: F401  (sets CUTE_DSL_ARCH=sm_90a off the GPU)
import jax
import jax.numpy as jnp

from ffi import grouped_gemm

P, d, n, E = 512, 256, 128, 4
t0 = time.time()
jax.export.export(
    jax.jit(lambda x, w, t: grouped_gemm.up_proj(x, w, t)), platforms=("cuda",),
    disabled_checks=[jax.export.DisabledSafetyCheck.custom_call("CuteDSLRT_NvJaxCutlassCall_v2")],
)(jax.ShapeDtypeStruct((P, d), jnp.bfloat16), jax.ShapeDtypeStruct((E, d, 2 * n), jnp.bfloat16),
  jax.ShapeDtypeStruct((P // 128,), jnp.int32))
print(f"lowered in {time.time() - t0:.3f} s")
