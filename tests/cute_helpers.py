"""What the cute backend's tests share (tests/test_cute_*.py): whether the extra is installed,
the lowered program of a function (where its FFI calls show), the GEMM ops, and the sizes past
2^31 elements."""
import importlib

import jax
import pytest


def _have_cute():
  try:   # ffi first: it sets CuTe DSL's target (sm_90a) before CuTe DSL's first use
    importlib.import_module("ffi")
    importlib.import_module("jax_tvm_ffi")
    return True
  except ImportError:
    return False


needs_cute = pytest.mark.skipif(not _have_cute(), reason="nvidia-cutlass-dsl not installed")
FFI_TARGET = "@sonicmoe_cute_"   # the XLA FFI targets of our CuTe kernels (xla_call.TARGET_PREFIX)


def cuda_module(fn, *args):
  """fn jitted and exported for CUDA (its CuTe kernels compiled for sm_90a): the module text.
  (Traced once first: that registers its kernels' FFI targets, which export is told to allow.)"""
  from ffi import xla_call
  shapes = [jax.ShapeDtypeStruct(a.shape, a.dtype) for a in args]
  jax.jit(fn).trace(*shapes)
  return jax.export.export(jax.jit(fn), platforms=("cuda",),
                           disabled_checks=xla_call.safety_checks())(*shapes).mlir_module()


CUTE_GEMMS = {"up_proj": "cute", "down_proj": "cute", "dh": "cute", "dx_tilde": "cute",
              "dw1": "cute", "dw2": "cute", "aggregate": "cute"}


# operands past 2^31 elements (a 32-bit element offset overflows): 30B-n256's unrounded plan
# has [P, d] = [556k, 4096] slot rows (where a 32-bit offset once made the aggregate read wrong rows)
BIG_D = 4096
BIG_ROWS = 2**31 // BIG_D + 256
