"""Backend "cute": CuTe DSL kernels called from XLA programs as XLA FFI custom calls (compiled
with TVM-FFI and registered through jax-tvm-ffi: xla_call.py). Needs the optional extra:
pip install 'sonicmoe-jax[cute]'.

The kernels are Hopper (sm_90a) kernels. CuTe DSL reads its target architecture once, when it
is first used: on a machine without a GPU this package sets CUTE_DSL_ARCH=sm_90a (unless set) so
that programs using the kernels compile and export there; import it (or set the variable)
before anything else uses CuTe DSL.
"""
import os as _os

if "CUTE_DSL_ARCH" not in _os.environ:
  try:
    import jax as _jax
    if _jax.default_backend() != "gpu":
      _os.environ["CUTE_DSL_ARCH"] = "sm_90a"
  except RuntimeError:   # no backend at all: still compile for Hopper
    _os.environ["CUTE_DSL_ARCH"] = "sm_90a"
