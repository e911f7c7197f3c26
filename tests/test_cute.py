"""Backend "cute": CuTe DSL kernels compile for sm_90a and lower as XLA FFI custom calls on a
CPU-only machine; asking for "cute" without the extra gives a clear error. (They run, and are
compared with the xla backend, on the GPU: marked gpu.)"""
import builtins
import importlib
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import sonicmoe_jax as sm
from conftest import make_inputs, rel_err


def _have_cute():
  try:
    importlib.import_module("cutlass.jax")
    return True
  except ImportError:
    return False


needs_cute = pytest.mark.skipif(not _have_cute(), reason="nvidia-cutlass-dsl not installed")


def test_missing_extra_gives_clear_error(monkeypatch):
  real_import = builtins.__import__

  def no_cutlass(name, *a, **k):
    if name == "cutlass" or name.startswith("cutlass."):
      raise ImportError("No module named 'cutlass'")
    return real_import(name, *a, **k)

  monkeypatch.setattr(builtins, "__import__", no_cutlass)
  monkeypatch.delitem(sys.modules, "ffi.ops", raising=False)
  with pytest.raises(ImportError, match=r"pip install 'sonicmoe-jax\[cute\]'"):
    sm.resolve_backend({"aggregate": "cute"})
  with pytest.raises(NotImplementedError, match="has no implementation of op 'top_k'"):
    monkeypatch.setattr(builtins, "__import__", real_import)
    sm.resolve_backend("cute")


@needs_cute
def test_cute_aggregate_compiles_and_lowers_for_cuda():
  T, d, n, E, K = 128, 256, 64, 8, 2
  args = make_inputs(0, T, d, n, E, jnp.bfloat16)

  def layer(*a):
    return sm.moe(*a, k=K, backend={"aggregate": "cute"}).out

  exported = jax.export.export(
      jax.jit(layer), platforms=("cuda",),
      disabled_checks=[jax.export.DisabledSafetyCheck.custom_call("CuteDSLRT_NvJaxCutlassCall_v2")],
  )(*[jax.ShapeDtypeStruct(a.shape, a.dtype) for a in args])
  assert "CuteDSLRT_NvJaxCutlassCall_v2" in exported.mlir_module()


@pytest.mark.gpu
@needs_cute
@pytest.mark.parametrize("rounding", [None, "nearest"])
def test_cute_aggregate_matches_xla_on_gpu(rounding):
  T, d, n, E, K = 1000, 512, 128, 16, 4
  args = make_inputs(1, T, d, n, E, jnp.bfloat16)
  cot = jax.random.normal(jax.random.key(2), (T, d))
  kw = dict(k=K, rounding=rounding, tile=128)

  def grads(backend):
    f = lambda *a: jnp.sum(sm.moe(*a, backend=backend, **kw).out.astype(jnp.float32) * cot)
    return sm.moe(*args, backend=backend, **kw).out, jax.grad(f, argnums=(0, 2, 3))(*args)
  out_c, g_c = grads({"aggregate": "cute"})
  out_x, g_x = grads("xla")
  assert rel_err(out_c, out_x) < 1e-2
  for a, b in zip(g_c, g_x):
    assert rel_err(a, b) < 1e-2
