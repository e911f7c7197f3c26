"""Backend "cute": CuTe DSL kernels compile for sm_90a and lower as XLA FFI custom calls on a
CPU-only machine; asking for "cute" without the extra gives a clear error. (They run, and are
compared with the xla backend, on the GPU: marked gpu.)"""
import builtins
import importlib
import re
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import sonicmoe_jax as sm
from conftest import PaddingSteps, make_inputs, rel_err


def _have_cute():
  try:   # ffi first: it sets CuTe DSL's target (sm_90a) before CuTe DSL's first use
    importlib.import_module("ffi")
    importlib.import_module("jax_tvm_ffi")
    return True
  except ImportError:
    return False


needs_cute = pytest.mark.skipif(not _have_cute(), reason="nvidia-cutlass-dsl not installed")
FFI_TARGET = "@sonicmoe_cute_"   # the XLA FFI targets of our CuTe kernels (xla_call.TARGET_PREFIX)


def _cuda_module(fn, *args):
  """fn jitted and exported for CUDA (its CuTe kernels compiled for sm_90a): the module text.
  (Traced once first: that registers its kernels' FFI targets, which export is told to allow.)"""
  from ffi import xla_call
  shapes = [jax.ShapeDtypeStruct(a.shape, a.dtype) for a in args]
  jax.jit(fn).trace(*shapes)
  return jax.export.export(jax.jit(fn), platforms=("cuda",),
                           disabled_checks=xla_call.safety_checks())(*shapes).mlir_module()


@pytest.mark.parametrize("missing", ["cutlass", "jax_tvm_ffi"])
def test_missing_extra_gives_clear_error(monkeypatch, missing):
  real_import = builtins.__import__

  def without_extra(name, *a, **k):
    if name == missing or name.startswith(missing + "."):
      raise ImportError(f"No module named '{missing}'")
    return real_import(name, *a, **k)

  monkeypatch.setattr(builtins, "__import__", without_extra)
  monkeypatch.delitem(sys.modules, "ffi.ops", raising=False)
  with pytest.raises(ImportError, match=r"pip install 'sonicmoe-jax\[cute\]'"):
    sm.resolve_backend({"aggregate": "cute"})


@needs_cute
def test_cute_aggregate_compiles_and_lowers_for_cuda():
  T, d, n, E, K = 128, 256, 64, 8, 2
  args = make_inputs(0, T, d, n, E, jnp.bfloat16)

  def layer(*a):
    return sm.moe(*a, k=K, backend={"aggregate": "cute"}).out

  assert FFI_TARGET in _cuda_module(layer, *args)


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


@pytest.mark.gpu
@needs_cute
@pytest.mark.parametrize("d,dtype", [(1536, jnp.bfloat16), (100, jnp.bfloat16), (200, jnp.float32)])
def test_cute_gather_sum_matches_numpy_on_gpu(d, dtype):
  """gather_sum called directly (README): 16-byte vector accesses where d allows (8 bf16 or 4
  fp32 values), one value at a time where it does not (d = 100 bf16); tokens with no slots get
  zeros; weighted and unweighted."""
  from ffi import gather_sum
  rng = np.random.default_rng(d)
  T, P = 300, 1000
  y = jnp.asarray(rng.normal(size=(P, d)), dtype)
  scores = jnp.asarray(rng.random(P), jnp.float32)
  counts = rng.integers(0, 7, T)
  counts[::17] = 0
  offsets = np.concatenate([[0], np.cumsum(counts)]).astype(np.int32)
  slots = rng.integers(0, P, offsets[-1]).astype(np.int32)
  yf = np.asarray(y.astype(jnp.float32))
  for weighted in (True, False):
    s = scores if weighted else None
    got = jax.jit(lambda *a: gather_sum.gather_sum(*a, num_tokens=T))(
        y, s, jnp.asarray(slots), jnp.asarray(offsets))
    w = np.asarray(scores) if weighted else np.ones(P, np.float32)
    want = np.stack([(yf[slots[offsets[t]:offsets[t + 1]]] * w[slots[offsets[t]:offsets[t + 1]], None]
                      ).sum(0) for t in range(T)])
    np.testing.assert_allclose(np.asarray(got.astype(jnp.float32)), want, rtol=2e-2, atol=2e-2)
    assert np.all(np.asarray(got.astype(jnp.float32))[counts == 0] == 0)


def _assert_gathering_matches_pregathered(op, rows, index, *operands, tma_gather=False, **kw):
  """op(rows, *operands, gather_index=index), the kernel gathering rows[index] itself (zeros
  where the index is past the end; its producer warpgroup, by cp.async or with tma_gather by
  TMA), equals op on the rows gathered by XLA first, bit for bit."""
  fused_kw = dict(kw, tma_gather=True) if tma_gather else kw
  fused = jax.jit(lambda r, i, *o: op(r, *o, gather_index=i, **fused_kw))(rows, index, *operands)
  gathered = rows.at[index].get(mode="fill", fill_value=0)
  pregathered = jax.jit(lambda r, *o: op(r, *o, **kw))(gathered, *operands)
  for got, want in zip(jax.tree.leaves(fused), jax.tree.leaves(pregathered)):
    np.testing.assert_array_equal(got, want)


# operands past 2^31 elements (a 32-bit element offset overflows): 30B-n256's unrounded plan
# has [P, d] = [556k, 4096] slot rows (H200 session 8: the aggregate read wrong rows there)
BIG_D = 4096
BIG_ROWS = 2**31 // BIG_D + 256


@pytest.mark.gpu
@needs_cute
def test_cute_aggregate_past_2_31_elements_on_gpu():
  """Token rows gathered from Y's last rows, where slot * d passes 2^31, against float32."""
  from ffi import gather_sum
  T = 64
  y = jax.random.normal(jax.random.key(41), (BIG_ROWS, BIG_D), jnp.bfloat16)
  scores = jax.random.uniform(jax.random.key(42), (BIG_ROWS,), jnp.float32)
  slots = BIG_ROWS - 1 - jax.random.permutation(jax.random.key(43), 256)[:2 * T].astype(jnp.int32)
  offsets = jnp.arange(0, 2 * T + 1, 2, dtype=jnp.int32)
  got = jax.jit(gather_sum.gather_sum, static_argnums=4)(y, scores, slots, offsets, T)
  rows = y[slots].astype(jnp.float32) * scores[slots][:, None]
  want = rows.reshape(T, 2, BIG_D).sum(axis=1)
  assert rel_err(got, want) < 1e-2


@pytest.mark.gpu
@needs_cute
@pytest.mark.parametrize("tma_gather", [False, True])
def test_cute_gathers_past_2_31_elements_on_gpu(tma_gather):
  """up_proj and dW1 gathering X's last rows, where token * d passes 2^31 (dW1's by cp.async
  or TMA): bitwise equal to the kernels on rows gathered by XLA first."""
  from ffi import grouped_gemm
  n, P = 128, 2 * grouped_gemm.BLOCK_M
  x = jax.random.normal(jax.random.key(44), (BIG_ROWS, BIG_D), jnp.bfloat16)
  w1 = (jax.random.normal(jax.random.key(45), (1, BIG_D, 2 * n)) / 64).astype(jnp.bfloat16)
  rhs = jax.random.normal(jax.random.key(46), (P, 2 * n), jnp.bfloat16)
  index = BIG_ROWS - 1 - jax.random.permutation(jax.random.key(47), P).astype(jnp.int32)
  tile_expert, offsets = jnp.zeros((2,), jnp.int32), jnp.array([0, P], jnp.int32)
  _assert_gathering_matches_pregathered(grouped_gemm.up_proj, x, index, w1, tile_expert)
  _assert_gathering_matches_pregathered(grouped_gemm.weight_grad, x, index, rhs, offsets,
                                        num_experts=1, tma_gather=tma_gather)


@needs_cute
def test_cute_dh_refuses_h_past_2_31_elements():
  """dH's epilogue addresses H, dH and A' with 32-bit offsets: a larger H is refused by name."""
  from ffi import grouped_gemm
  P, d, n = 2**31 // 512 + 128, 256, 256
  shapes = [jax.ShapeDtypeStruct(s, t) for s, t in [
      ((P, d), jnp.bfloat16), ((1, n, d), jnp.bfloat16), ((P, 2 * n), jnp.bfloat16),
      ((P,), jnp.float32), ((P // 128,), jnp.int32)]]
  with pytest.raises(ValueError, match=r"cute dh: H \[4194432, 512\] has .* 32-bit offsets"):
    jax.eval_shape(lambda *a: grouped_gemm.dh(*a, block_n=128), *shapes)


@needs_cute
def test_cute_dh_past_its_offsets_falls_back_to_xla(monkeypatch):
  """The cute dh op hands an H too large for its kernel to xla_ops.dh, saying so: the layer's
  gradients equal the xla backend's (runs on CPU: no cute kernel is called)."""
  from ffi import grouped_gemm
  monkeypatch.setattr(grouped_gemm, "MAX_REGISTER_ADDRESSED", 1000)
  T, d, n, E, K = 200, 128, 64, 4, 2
  args = make_inputs(5, T, d, n, E, jnp.float32)

  def grads(backend):
    loss = lambda *a: jnp.sum(sm.moe(*a, k=K, backend=backend).out ** 2)
    return jax.grad(loss, argnums=(0, 2, 3))(*args)

  with pytest.warns(UserWarning, match=r"backend 'cute' dh: H \(\d+, 128\) has more than 1000"):
    got = grads({op: "xla" for op in sm.OP_NAMES} | {"dh": "cute"})
  for a, b in zip(got, grads("xla")):   # (cute's ALIGN pads the plan: other fp32 sum orders)
    np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5)


@needs_cute
def test_auto_backend_takes_cute_ops_where_measured_faster(monkeypatch):
  """On GPUs "auto" runs the six GEMM ops on cute at every width and the router's top-K where
  E >= 256 and its kernel takes k (where each measured faster), pallas elsewhere and without
  the extra; float32 goes to xla."""
  from sonicmoe_jax import backends, xla_ops
  # the modules as the dispatch table imports them (an earlier test may re-import ffi.ops)
  cute_ops, pallas_ops = map(importlib.import_module, ("ffi.ops", "pallas_kernels.ops"))
  resolve = lambda d, n, dtype=jnp.bfloat16: backends.resolve("auto", platform="gpu",
                                                              dtype=dtype, d=d, n=n)
  for d, n in [(4096, 1024), (4096, 256), (1536, 256), (1536, 1024), (2048, 1024)]:
    ops = resolve(d, n)
    assert ((ops.up_proj, ops.down_proj, ops.dh, ops.dx_tilde, ops.dw1, ops.dw2, ops.align)
            == (cute_ops.up_proj, cute_ops.down_proj, cute_ops.dh, cute_ops.dx_tilde, cute_ops.dw1,
                cute_ops.dw2, 128))
    assert ops.top_k is pallas_ops.top_k   # E and k not given
  top_k = lambda E, k: backends.resolve("auto", platform="gpu", dtype=jnp.bfloat16, d=4096, n=256,
                                        num_experts=E, k=k).top_k
  assert top_k(256, 16) is cute_ops.top_k and top_k(1024, 8) is cute_ops.top_k
  assert top_k(128, 8) is pallas_ops.top_k and top_k(64, 8) is pallas_ops.top_k
  assert top_k(256, 64) is pallas_ops.top_k and top_k(2048, 8) is pallas_ops.top_k   # its limits
  with pytest.warns(UserWarning, match="float32"):
    assert resolve(4096, 256, jnp.float32).dh is xla_ops.dh
  assert "multiple of 64" in cute_ops.unsupported(jnp.bfloat16, 4096, 96)
  monkeypatch.setattr(backends, "_cute_installed", lambda: False)
  assert resolve(4096, 1024).dh is pallas_ops.dh


CUTE_GEMMS = {"up_proj": "cute", "down_proj": "cute", "dh": "cute", "dx_tilde": "cute",
              "dw1": "cute", "dw2": "cute", "aggregate": "cute"}


def _top_k_logits(T, E, seed):
  """Random logits with ties (rounded to a coarse grid), -inf entries and a constant row."""
  logits = jnp.round(jax.random.normal(jax.random.key(seed), (T, E)) * 4) / 4
  logits = logits.at[::7, ::5].set(-jnp.inf)
  return logits.at[1].set(0.5)


@needs_cute
def test_cute_layer_step_has_no_device_loops():
  """A forward+backward step on backend "cute", lowered for CUDA, has no while loop: on a GPU
  each step of one waits for the host (two came from the tiles' owner search)."""
  T, d, n, E, K = 1024, 256, 128, 32, 4
  args = make_inputs(0, T, d, n, E, jnp.bfloat16)
  step = jax.value_and_grad(   # (the value too: the whole forward, down_proj and aggregate)
      lambda *a: jnp.sum(sm.moe(*a, k=K, backend="cute").out.astype(jnp.float32)),
      argnums=(0, 1, 2, 3))
  text = _cuda_module(step, *args)
  assert FFI_TARGET in text and "stablehlo.while" not in text


@needs_cute
@pytest.mark.parametrize("T,E,k", [(1000, 128, 8), (37, 32, 1), (64, 256, 16), (5, 1024, 32)])
def test_cute_top_k_compiles_and_lowers_for_cuda(T, E, k):
  from ffi import topk
  assert FFI_TARGET in _cuda_module(lambda l: topk.top_k(l, k),
                                    jax.ShapeDtypeStruct((T, E), jnp.float32))


@needs_cute
def test_cute_top_k_refuses_what_it_cannot_take():
  from ffi import topk
  cute_ops = importlib.import_module("ffi.ops")
  logits = jnp.zeros((16, 48), jnp.float32)
  with pytest.raises(ValueError, match="E=48 is not a multiple of 32"):
    topk.top_k(logits, 2)
  with pytest.raises(ValueError, match="E=2048 is above 1024"):
    topk.top_k(jnp.zeros((4, 2048), jnp.float32), 2)
  with pytest.raises(ValueError, match=r"k=33 must be between 1 and min\(E, 32\)"):
    topk.top_k(jnp.zeros((4, 64), jnp.float32), 33)
  with pytest.raises(TypeError, match="logits must be float32; got bfloat16"):
    topk.top_k(jnp.zeros((4, 64), jnp.bfloat16), 2)
  with pytest.warns(UserWarning, match="backend 'cute' top_k: E=48 .*using jax.lax.top_k"):
    values, experts = cute_ops.top_k(_top_k_logits(16, 48, 0), 3)
  want = jax.lax.top_k(_top_k_logits(16, 48, 0), 3)
  np.testing.assert_array_equal(values, want[0])
  np.testing.assert_array_equal(experts, want[1])


@pytest.mark.gpu
@needs_cute
@pytest.mark.parametrize("T,E,k", [(1000, 128, 8), (37, 32, 1), (333, 256, 16), (5, 1024, 32),
                                   (64, 64, 64 // 2)])
def test_cute_top_k_matches_lax_on_gpu(T, E, k):
  """Values and experts equal jax.lax.top_k's: ties to the lower expert, -inf logits, T not a
  multiple of the CTA's tokens, k = 1 and k = 32."""
  from ffi import topk
  logits = _top_k_logits(T, E, T + E)
  got = jax.jit(lambda l: topk.top_k(l, k))(logits)
  want = jax.lax.top_k(logits, k)
  np.testing.assert_array_equal(got[1], want[1])
  np.testing.assert_array_equal(got[0], want[0])


@needs_cute
@pytest.mark.parametrize("dout_gather_max_column_tiles,dh_kernel,dh_block_n", [
    (0, "registers", 128), (2, "registers", 128), (0, "pingpong", 128), (2, "pingpong", 128),
    (1, "registers", 256), (1, "tma_store", 256), (1, "pingpong_tma", 128), (2, "auto", 256)])
def test_cute_gemms_compile_and_lower_for_cuda(dout_gather_max_column_tiles, dh_kernel,
                                               dh_block_n, monkeypatch):
  """The layer's forward and gradients with the CuTe grouped GEMMs: the kernels compile for
  sm_90a here and the program exports for CUDA with them as FFI calls (forward: up_proj,
  down_proj and aggregate; backward adds dh, dx_tilde, aggregate, dw1 and dw2), with dO's rows
  gathered by XLA or by dh and dw2, with dH's register or TMA stores (H read from SMEM: the
  default DH_H_SMEM) and with the ping-pong kernels (dH with register stores or its SMEM
  epilogue, which "auto" picks at this d; up_proj and the store GEMMs)."""
  cute_ops = importlib.import_module("ffi.ops")
  monkeypatch.setattr(cute_ops, "DOUT_GATHER_MAX_COLUMN_TILES", dout_gather_max_column_tiles)
  monkeypatch.setattr(cute_ops, "DH_KERNEL", dh_kernel)
  monkeypatch.setattr(cute_ops, "DH_BLOCK_N", dh_block_n)
  T, d, n, E, K = 256, 256, max(128, dh_block_n), 8, 2
  pingpong = cute_ops._dh_kernel(d).startswith("pingpong")   # "auto" at d 256: pingpong_tma
  monkeypatch.setattr(cute_ops, "UP_PROJ_KERNEL", "pingpong" if pingpong else "grouped")
  monkeypatch.setattr(cute_ops, "STORE_KERNEL", "pingpong" if pingpong else "grouped")
  dh_block_ns = []   # the dH kernel's column tile, as ffi.ops calls it
  kernel_module = importlib.import_module("ffi.pingpong" if pingpong else "ffi.grouped_gemm")
  real_dh = kernel_module.dh
  monkeypatch.setattr(kernel_module, "dh", lambda *a, block_n, **k: (
      dh_block_ns.append(block_n), real_dh(*a, block_n=block_n, **k))[1])
  args = make_inputs(0, T, d, n, E, jnp.bfloat16)

  def loss(*a):
    return jnp.sum(sm.moe(*a, k=K, backend=CUTE_GEMMS).out.astype(jnp.float32))

  text = _cuda_module(jax.value_and_grad(loss, argnums=(0, 2, 3)), *args)
  assert text.count(FFI_TARGET) >= 8
  assert set(dh_block_ns) == {min(dh_block_n, 128) if pingpong else dh_block_n}
  # dH written over H: dh's FFI call aliases its output 0 to H (operand 3, after dOg, W2,
  # tile_expert and, when it gathers, the gather index); no other call aliases
  h_operand = 4 if dout_gather_max_column_tiles else 3
  assert re.findall(r"output_operand_alias<[^>]*>", text) == [
      f"output_operand_alias<output_tuple_indices = [0], operand_index = {h_operand}, "
      "operand_tuple_indices = []>"]


@needs_cute
def test_dh_over_h_can_be_turned_off(monkeypatch):
  """ffi.ops.DH_OVER_H = False (per-op timings) lowers the layer with no operand aliasing."""
  cute_ops = importlib.import_module("ffi.ops")
  monkeypatch.setattr(cute_ops, "DH_OVER_H", False)
  args = make_inputs(0, 256, 256, 128, 8, jnp.bfloat16)
  loss = lambda *a: jnp.sum(sm.moe(*a, k=2, backend=CUTE_GEMMS).out.astype(jnp.float32))
  text = _cuda_module(jax.value_and_grad(loss, argnums=(0, 2, 3)), *args)
  assert text.count(FFI_TARGET) >= 8 and "output_operand_alias" not in text


@needs_cute
@pytest.mark.parametrize("kernel,block_n,stages", [
    ("matmul", 256, None), ("matmul_t", 256, 2), ("up_proj", 64, 3), ("dh", 128, None),
    ("dh", 256, None), ("dh_tma", 64, 3), ("dh_gather", 128, None),
    ("weight_grad", 128, 3), ("weight_grad_gather", 128, None), ("weight_grad_gather", 256, 2),
    ("weight_grad_t", 256, None), ("weight_grad_gather_t", 128, 3), ("up_proj_gather", 128, None),
    ("dh_gather", 256, None), ("weight_grad_gather_t", 256, None), ("matmul_ws", 256, None),
    ("up_proj_ws", 128, None), ("dh_ws", 256, None), ("weight_grad_ws", 256, 4),
    ("dh_h_smem", 256, None), ("dh_gather_h_smem", 128, None), ("dh_tma_h_smem", 256, None),
    ("weight_grad_gather+tma", 256, 2),
    ("weight_grad_gather_t+tma", 128, 3)])
def test_cute_gemm_variants_compile_for_cuda(kernel, block_n, stages):
  """The tile widths and pipeline depths the sweep tries compile for sm_90a; "+tma": the
  gathered rows loaded by TMA (tma_gather)."""
  from ffi import grouped_gemm
  P, K, N, E = 512, 256, 512, 4
  kw = dict(block_n=block_n, stages=stages)
  if kernel.endswith("+tma"):
    kernel, kw = kernel.removesuffix("+tma"), dict(kw, tma_gather=True)
  fn = {"matmul": lambda a, b, t: grouped_gemm.grouped_matmul(a, b, t, **kw),
        "matmul_t": lambda a, b, t: grouped_gemm.grouped_matmul(
            a, jnp.swapaxes(b, 1, 2), t, transpose_rhs=True, **kw),
        "up_proj": lambda a, b, t: grouped_gemm.up_proj(a, b, t, **kw),
        "matmul_ws": lambda a, b, t: grouped_gemm.grouped_matmul(a, b, t, warp_specialized=True,
                                                                 **kw),
        "up_proj_ws": lambda a, b, t: grouped_gemm.up_proj(a, b, t, warp_specialized=True, **kw),
        "dh_ws": lambda a, b, t: grouped_gemm.dh(
            a, jnp.swapaxes(b, 1, 2)[:, :K], jnp.concatenate([a, a], 1), a[:, 0].astype(jnp.float32),
            t, warp_specialized=True, **kw),
        "weight_grad_ws": lambda a, b, t: grouped_gemm.weight_grad(
            a, jnp.concatenate([a, a], 1), jnp.arange(E + 1, dtype=jnp.int32) * (P // E), E,
            warp_specialized=True, **kw),
        "dh": lambda a, b, t: grouped_gemm.dh(  # dOg [P, d], W2 [E, n, d], H [P, 2n], scores
            a, jnp.swapaxes(b, 1, 2)[:, :K], jnp.concatenate([a, a], 1), a[:, 0].astype(jnp.float32),
            t, **kw),
        "dh_h_smem": lambda a, b, t: grouped_gemm.dh(
            a, jnp.swapaxes(b, 1, 2)[:, :K], jnp.concatenate([a, a], 1), a[:, 0].astype(jnp.float32),
            t, h_smem=True, **kw),
        "dh_gather_h_smem": lambda a, b, t: grouped_gemm.dh(
            a[:300], jnp.swapaxes(b, 1, 2)[:, :K], jnp.concatenate([a, a], 1),
            a[:, 0].astype(jnp.float32), t, gather_index=jnp.arange(P, dtype=jnp.int32) % 301,
            h_smem=True, **kw),
        "dh_tma_h_smem": lambda a, b, t: grouped_gemm.dh(
            a, jnp.swapaxes(b, 1, 2)[:, :K], jnp.concatenate([a, a], 1), a[:, 0].astype(jnp.float32),
            t, tma_store=True, h_smem=True, **kw),
        "dh_tma": lambda a, b, t: grouped_gemm.dh(
            a, jnp.swapaxes(b, 1, 2)[:, :K], jnp.concatenate([a, a], 1), a[:, 0].astype(jnp.float32),
            t, tma_store=True, **kw),
        "dh_gather": lambda a, b, t: grouped_gemm.dh(  # dO = a's first 300 rows
            a[:300], jnp.swapaxes(b, 1, 2)[:, :K], jnp.concatenate([a, a], 1),
            a[:, 0].astype(jnp.float32), t, gather_index=jnp.arange(P, dtype=jnp.int32) % 301, **kw),
        "up_proj_gather": lambda a, b, t: grouped_gemm.up_proj(  # X = a's first 300 rows
            a[:300], b, t, gather_index=jnp.arange(P, dtype=jnp.int32) % 301, **kw),
        "weight_grad": lambda a, b, t: grouped_gemm.weight_grad(  # [E, K, 2K] over P / E rows each
            a, jnp.concatenate([a, a], 1), jnp.arange(E + 1, dtype=jnp.int32) * (P // E), E, **kw),
        "weight_grad_gather": lambda a, b, t: grouped_gemm.weight_grad(  # X = a's first 300 rows
            a[:300], jnp.concatenate([a, a], 1), jnp.arange(E + 1, dtype=jnp.int32) * (P // E), E,
            gather_index=jnp.arange(P, dtype=jnp.int32) % 301, **kw),
        "weight_grad_t": lambda a, b, t: grouped_gemm.weight_grad(  # stored [E, 2K, K]
            a, jnp.concatenate([a, a], 1), jnp.arange(E + 1, dtype=jnp.int32) * (P // E), E,
            transpose_out=True, **kw),
        "weight_grad_gather_t": lambda a, b, t: grouped_gemm.weight_grad(
            a[:300], jnp.concatenate([a, a], 1), jnp.arange(E + 1, dtype=jnp.int32) * (P // E), E,
            gather_index=jnp.arange(P, dtype=jnp.int32) % 301, transpose_out=True, **kw)}[kernel]
  shapes = [jax.ShapeDtypeStruct((P, K), jnp.bfloat16), jax.ShapeDtypeStruct((E, K, N), jnp.bfloat16),
            jax.ShapeDtypeStruct((P // 128,), jnp.int32)]
  assert FFI_TARGET in _cuda_module(fn, *shapes)


@needs_cute
def test_cute_tma_gather_needs_gather_index():
  """tma_gather without rows to gather is refused by name, each kernel naming itself."""
  from ffi import grouped_gemm, persistent
  x = jnp.zeros((256, 128), jnp.bfloat16)
  calls = {
      "persistent weight_grad": lambda: persistent.weight_grad(
          x, x, jnp.array([0, 128, 256], jnp.int32), 2, None, tma_gather=True),
      "weight_grad": lambda: grouped_gemm.weight_grad(x, x, jnp.array([0, 128, 256], jnp.int32),
                                                      2, tma_gather=True)}
  for name, call in calls.items():
    with pytest.raises(ValueError, match=f"cute {name}: tma_gather loads gathered rows; it "
                                         f"needs gather_index"):
      call()


@needs_cute
def test_cute_gemm_rejects_unsupported_operands():
  from ffi import grouped_gemm
  tiles = jnp.zeros((2,), jnp.int32)
  with pytest.raises(ValueError, match="multiple of 64"):
    grouped_gemm.grouped_matmul(jnp.zeros((256, 96), jnp.bfloat16), jnp.zeros((2, 96, 128), jnp.bfloat16), tiles)
  with pytest.raises(ValueError, match="multiple of 128"):
    grouped_gemm.grouped_matmul(jnp.zeros((200, 64), jnp.bfloat16), jnp.zeros((2, 64, 128), jnp.bfloat16), tiles)
  with pytest.raises(ValueError, match="bfloat16 or float16"):
    grouped_gemm.grouped_matmul(jnp.zeros((256, 64)), jnp.zeros((2, 64, 128)), tiles)
  with pytest.raises(ValueError, match="block_n=128"):
    grouped_gemm.grouped_matmul(jnp.zeros((256, 64), jnp.bfloat16), jnp.zeros((2, 64, 96), jnp.bfloat16), tiles)
  with pytest.raises(ValueError, match=r"cute up_proj: output columns N=64 must be a multiple of block_n=128"):
    grouped_gemm.up_proj(jnp.zeros((256, 64), jnp.bfloat16), jnp.zeros((2, 64, 128), jnp.bfloat16), tiles)
  with pytest.raises(ValueError, match=r"cute up_proj: block_n=256 is wider than 128 \(its gate"):
    grouped_gemm.up_proj(jnp.zeros((256, 64), jnp.bfloat16), jnp.zeros((2, 64, 512), jnp.bfloat16),
                         tiles, block_n=256)
  ok = (jnp.zeros((256, 64), jnp.bfloat16), jnp.zeros((2, 64, 128), jnp.bfloat16), tiles)
  with pytest.raises(ValueError, match=r"stages=9 must be between 2 and \d+"):
    grouped_gemm.grouped_matmul(*ok, stages=9)
  dout, w2 = jnp.zeros((256, 128), jnp.bfloat16), jnp.zeros((2, 96, 128), jnp.bfloat16)
  with pytest.raises(ValueError, match="cute dh: output columns N=96 must be a multiple of block_n=64"):
    grouped_gemm.dh(dout, w2, jnp.zeros((256, 192), jnp.bfloat16), jnp.zeros((256,)), tiles)
  w2_wide = jnp.zeros((2, 320, 128), jnp.bfloat16)
  with pytest.raises(ValueError, match="cute dh: block_n=320 is wider than 256"):
    grouped_gemm.dh(dout, w2_wide, jnp.zeros((256, 640), jnp.bfloat16), jnp.zeros((256,)), tiles,
                    block_n=320)
  with pytest.raises(ValueError, match="cute weight_grad: lhs columns M=64 must be a multiple of 128"):
    grouped_gemm.weight_grad(jnp.zeros((256, 64), jnp.bfloat16), jnp.zeros((256, 128), jnp.bfloat16),
                             jnp.zeros((3,), jnp.int32), 2)
  with pytest.raises(ValueError, match=r"cute weight_grad: group_offsets must be \[3\]"):
    grouped_gemm.weight_grad(jnp.zeros((256, 128), jnp.bfloat16), jnp.zeros((256, 128), jnp.bfloat16),
                             jnp.zeros((2,), jnp.int32), 2)
  with pytest.raises(ValueError, match=r"cute dh: need H \[256, 256\]"):
    grouped_gemm.dh(dout, jnp.zeros((2, 128, 128), jnp.bfloat16), jnp.zeros((256, 128), jnp.bfloat16),
                    jnp.zeros((256,)), tiles)


def _per_tile_reference(lhs, rhs, tile_expert):
  """(expert of each row, float32 lhs_e rhs_e per 128-row tile; zeros past the last group)."""
  from ffi import grouped_gemm
  E = rhs.shape[0]
  row_expert = jnp.repeat(tile_expert, grouped_gemm.BLOCK_M)
  w = rhs.astype(jnp.float32)[jnp.minimum(row_expert, E - 1)]
  out = jnp.einsum("pk,pkn->pn", lhs.astype(jnp.float32), w)
  return row_expert, jnp.where((row_expert < E)[:, None], out, 0.0)


@pytest.mark.gpu
@needs_cute
@pytest.mark.parametrize("transpose_rhs,block_n,stages", [
    (False, 128, None), (True, 128, None), (True, 128, 2), (False, 128, 3), (True, 128, 3),
    (False, 256, None), (True, 256, None)])   # (the last two: ffi/ops.py's wide store tiles)
def test_cute_grouped_matmul_against_float32_on_gpu(transpose_rhs, block_n, stages):
  """Tiles of experts 0, 2, 3 (1 has none), then two tiles past the last group (zeros); several
  tile widths and pipeline depths."""
  from ffi import grouped_gemm
  E, K, N = 4, 512, 512   # N a multiple of every block_n
  tile_expert = jnp.array([0, 0, 2, 3, 3, 3, E, E], jnp.int32)
  P = tile_expert.shape[0] * grouped_gemm.BLOCK_M
  lhs = jax.random.normal(jax.random.key(0), (P, K)).astype(jnp.bfloat16)
  rhs = jax.random.normal(jax.random.key(1), (E, K, N)).astype(jnp.bfloat16)
  rhs_arg = jnp.swapaxes(rhs, 1, 2) if transpose_rhs else rhs
  out = jax.jit(lambda a, b, t: grouped_gemm.grouped_matmul(
      a, b, t, transpose_rhs=transpose_rhs, block_n=block_n, stages=stages))(lhs, rhs_arg, tile_expert)
  row_expert, ref = _per_tile_reference(lhs, rhs, tile_expert)
  assert rel_err(out, ref) < 1e-2
  np.testing.assert_array_equal(out[row_expert >= E], 0)


@needs_cute
def test_cute_up_proj_with_gather_compiles_for_cuda():
  from ffi import grouped_gemm
  T, P, d, n, E = 300, 512, 256, 128, 4
  fn = lambda x, w, t, i: grouped_gemm.up_proj(x, w, t, gather_index=i)
  shapes = [jax.ShapeDtypeStruct((T, d), jnp.bfloat16), jax.ShapeDtypeStruct((E, d, 2 * n), jnp.bfloat16),
            jax.ShapeDtypeStruct((P // 128,), jnp.int32), jax.ShapeDtypeStruct((P,), jnp.int32)]
  assert FFI_TARGET in _cuda_module(fn, *shapes)
  with pytest.raises(ValueError, match="rows P=200 must be a multiple of 128"):
    grouped_gemm.up_proj(jnp.zeros((T, d), jnp.bfloat16), jnp.zeros((E, d, 2 * n), jnp.bfloat16),
                         jnp.zeros((2,), jnp.int32), gather_index=jnp.zeros((200,), jnp.int32))


@pytest.mark.gpu
@needs_cute
@pytest.mark.parametrize("block_n,stages,d", [
    (128, None, 512), (64, None, 512), (128, 2, 512), (128, 3, 1024), (64, 2, 1024)])
def test_cute_up_proj_with_gather_matches_pregathered_on_gpu(block_n, stages, d):
  """Gathering X's rows in the kernel (padding slots: index T, zero rows) gives the bitwise
  same H and A as the kernel on rows gathered by XLA first (16 k steps at d = 1024: the
  pipeline's ring wraps; d above T = 1000 there: the k steps are d's, not the rows')."""
  from ffi import grouped_gemm
  T, n, E = 1000, 256, 4
  tile_expert = jnp.array([0, 0, 1, 3, 3, E], jnp.int32)
  P = tile_expert.shape[0] * grouped_gemm.BLOCK_M
  x = jax.random.normal(jax.random.key(7), (T, d)).astype(jnp.bfloat16)
  w1 = (jax.random.normal(jax.random.key(8), (E, d, 2 * n)) / 8).astype(jnp.bfloat16)
  index = jax.random.randint(jax.random.key(9), (P,), 0, T).at[::7].set(T)
  _assert_gathering_matches_pregathered(grouped_gemm.up_proj, x, index, w1, tile_expert,
                                        block_n=block_n, stages=stages)


@pytest.mark.gpu
@needs_cute
@pytest.mark.parametrize("block_n", [128, 64])
def test_cute_up_proj_against_float32_on_gpu(block_n):
  """H = [gate | up] and A = silu(gate) * up, tiles of experts 0, 2 and past the last group."""
  from ffi import grouped_gemm
  E, d, n = 3, 384, 256
  tile_expert = jnp.array([0, 2, 2, E], jnp.int32)
  P = tile_expert.shape[0] * grouped_gemm.BLOCK_M
  x = jax.random.normal(jax.random.key(5), (P, d)).astype(jnp.bfloat16)
  w1 = (jax.random.normal(jax.random.key(6), (E, d, 2 * n)) / 8).astype(jnp.bfloat16)
  h, a = jax.jit(lambda x, w, t: grouped_gemm.up_proj(x, w, t, block_n))(
      x, w1, tile_expert)
  row_expert, h_ref = _per_tile_reference(x, w1, tile_expert)
  gate, up = h_ref[:, :n], h_ref[:, n:]
  assert rel_err(h, h_ref) < 1e-2
  assert rel_err(a, jax.nn.silu(gate) * up) < 1e-2
  np.testing.assert_array_equal(a[row_expert >= E], 0)


@pytest.mark.gpu
@needs_cute
@pytest.mark.parametrize("block_n", [64, 128, 256])
def test_cute_dh_against_float32_on_gpu(block_n):
  """dH = dSwiGLU(s dA', H), A' = s A and dS = rowsum(dA' A) with dA' = dOg W2_e^T; tiles of
  experts 0, 2 (1 has none) and past the last group (all zeros there). The TMA-store epilogue
  and the register stores give the same bits."""
  from ffi import grouped_gemm
  E, d, n = 3, 384, 256
  tile_expert = jnp.array([0, 2, 2, E], jnp.int32)
  P = tile_expert.shape[0] * grouped_gemm.BLOCK_M
  keys = jax.random.split(jax.random.key(11), 4)
  dout_g = jax.random.normal(keys[0], (P, d)).astype(jnp.bfloat16)
  w2 = (jax.random.normal(keys[1], (E, n, d)) / 8).astype(jnp.bfloat16)
  h = (2 * jax.random.normal(keys[2], (P, 2 * n))).astype(jnp.bfloat16)
  scores = jax.random.uniform(keys[3], (P,), minval=0.05, maxval=1.0)
  row_expert = jnp.repeat(tile_expert, grouped_gemm.BLOCK_M)
  h = jnp.where((row_expert < E)[:, None], h, 0)   # the up-projection's zero padding rows
  dh_, a_scaled, ds_parts = jax.jit(lambda *a: grouped_gemm.dh(*a, block_n=block_n))(
      dout_g, w2, h, scores, tile_expert)
  through_tma = jax.jit(lambda *a: grouped_gemm.dh(*a, block_n=block_n, tma_store=True))(
      dout_g, w2, h, scores, tile_expert)
  for got, other in zip((dh_, a_scaled, ds_parts), through_tma):
    np.testing.assert_array_equal(got, other)
  _, da = _per_tile_reference(dout_g, jnp.swapaxes(w2, 1, 2), tile_expert)
  gate, up = h[:, :n].astype(jnp.float32), h[:, n:].astype(jnp.float32)
  sig = jax.nn.sigmoid(gate)
  a = gate * sig * up
  da_s = scores[:, None] * da
  want_dh = jnp.concatenate([da_s * up * sig * (1 + gate * (1 - sig)), da_s * gate * sig], 1)
  assert ds_parts.shape == (n // block_n, P)
  assert rel_err(dh_, want_dh) < 1e-2
  assert rel_err(a_scaled, scores[:, None] * a) < 1e-2
  assert rel_err(ds_parts.sum(0), jnp.sum(da * a, axis=1)) < 1e-2
  padding = row_expert >= E
  np.testing.assert_array_equal(dh_[padding], 0)
  np.testing.assert_array_equal(ds_parts[:, padding], 0)


@needs_cute
@pytest.mark.parametrize("block_n,stages", [(128, None), (64, 3)])
def test_cute_pingpong_dh_compiles_for_cuda(block_n, stages):
  """The ping-pong dH kernel, reading dOg or gathering dO's rows, compiles for sm_90a and
  lowers as an FFI call; its stage count is checked against SMEM and its tile width against
  the accumulator's registers."""
  from ffi import pingpong
  P, d, n, E = 1024, 256, 256, 4
  shapes = [jax.ShapeDtypeStruct(s, t) for s, t in [
      ((P, d), jnp.bfloat16), ((E, n, d), jnp.bfloat16), ((P, 2 * n), jnp.bfloat16),
      ((P,), jnp.float32), ((P // 128,), jnp.int32)]]
  fn = lambda *a: pingpong.dh(*a, block_n=block_n, stages=stages)
  assert FFI_TARGET in _cuda_module(fn, *shapes)
  fit = pingpong.stages_that_fit(block_n, 2)
  with pytest.raises(ValueError, match=f"stages={fit + 1} must be between 2 and {fit}"):
    jax.eval_shape(lambda *a: pingpong.dh(*a, block_n=block_n, stages=fit + 1), *shapes)
  with pytest.raises(ValueError, match=r"cute ping-pong dh: need H \[1024, 512\]"):
    jax.eval_shape(lambda *a: pingpong.dh(*a), *shapes[:2], shapes[1], *shapes[3:])
  with pytest.raises(ValueError, match="dh: block_n=256 is wider than 128"):
    jax.eval_shape(lambda *a: pingpong.dh(*a, block_n=256), *shapes)
  # gathering dO's rows: dO [T, d] and the slots' source rows [P]
  gathered = [jax.ShapeDtypeStruct((300, d), jnp.bfloat16), *shapes[1:],
              jax.ShapeDtypeStruct((P,), jnp.int32)]
  fn = lambda g, w, h, s, t, i: pingpong.dh(g, w, h, s, t, block_n=block_n, stages=stages,
                                            gather_index=i)
  assert FFI_TARGET in _cuda_module(fn, *gathered)
  # its SMEM epilogue (tma_store): buffers of each consumer's own, fewer stages fit
  fit_tma = pingpong.stages_that_fit(block_n, 2, 1, True, "dh")
  assert 2 <= fit_tma < fit
  if block_n == 128:
    fn = lambda g, w, h, s, t, i: pingpong.dh(g, w, h, s, t, block_n=block_n, gather_index=i,
                                              tma_store=True)
    assert FFI_TARGET in _cuda_module(fn, *gathered)
  with pytest.raises(ValueError, match=f"stages={fit_tma + 1} must be between 2 and {fit_tma}"):
    jax.eval_shape(lambda *a: pingpong.dh(*a, block_n=block_n, stages=fit_tma + 1,
                                          tma_store=True), *shapes)


@needs_cute
@pytest.mark.parametrize("row_blocks,block_n", [(1, 128), (1, 64), (2, 128), (2, 64)])
def test_tma_store_epilogue_reads_each_accumulator_element_once(row_blocks, block_n):
  """The TMA-store epilogue's map from a chunk's fragment (values, row blocks, 16-column
  groups) to the accumulator view ((values, column groups), row blocks, 0): every element once,
  each chunk its own 64 columns, row blocks and column groups kept (the ping-pong kernel's two
  m64 accumulators came out in the wrong order on the H200 when read as a contiguous range);
  with one row block it is that contiguous range (grouped_gemm's kernels, bitwise checked)."""
  from ffi.epilogue import EPI_TILE, acc_coord
  values, groups = 8, EPI_TILE[1] // 16                 # stmatrix x4 values; groups per chunk
  chunks = block_n // EPI_TILE[1]
  seen = []
  for chunk in range(chunks):
    for v in range(values * row_blocks * groups):
      (value, group), m, _ = acc_coord(v, chunk, values, row_blocks, groups)
      assert (value, m) == (v % values, v // values % row_blocks)
      assert group // groups == chunk and group % groups == v // (values * row_blocks)
      seen.append(value + values * (group + chunks * groups * m))   # the view's linear index
  assert sorted(seen) == list(range(values * row_blocks * groups * chunks))
  assert (seen == list(range(len(seen)))) == (row_blocks == 1)


@needs_cute
def test_tma_store_epilogue_reads_192_row_tiles_one_row_block_a_buffer():
  """The 192-row ping-pong tiles' epilogue (buffers of one m64 row block: pingpong.ROW_TILE_EPI)
  reads row block r's values of each 64-column chunk from the accumulator view's row block r:
  over the three row blocks and the chunks, every element once."""
  from ffi.epilogue import acc_coord
  from ffi.pingpong import MMA_M, ROW_TILE_EPI, ROW_TILE_M
  values, groups, chunks = 8, ROW_TILE_EPI[1] // 16, 128 // ROW_TILE_EPI[1]
  seen = set()
  for row_block in range(ROW_TILE_M // MMA_M):
    for chunk in range(chunks):
      for v in range(values * groups):
        (value, group), m, _ = acc_coord(v, chunk, values, 1, groups, row_block)
        assert m == row_block and group // groups == chunk
        seen.add((value, group, m))
  assert len(seen) == values * groups * chunks * ROW_TILE_M // MMA_M


@needs_cute
@pytest.mark.parametrize("transpose_rhs,tma_store,block_n", [
    (False, False, 128), (True, True, 128), (False, True, 192), (True, False, 192)])
def test_cute_pingpong_matmul_compiles_for_cuda(transpose_rhs, tma_store, block_n):
  """The ping-pong grouped_matmul (down_proj, and dx_tilde with W1 read K-major; register or
  TMA stores; 128 or 192 wide) compiles for sm_90a and lowers as an FFI call; a tile wider
  than its accumulator's registers, or a ring deeper than SMEM beside the epilogue's buffers,
  is refused."""
  from ffi import pingpong
  P, K, N, E = 1024, 256, 768, 4
  rhs = jax.ShapeDtypeStruct((E, N, K) if transpose_rhs else (E, K, N), jnp.bfloat16)
  shapes = [jax.ShapeDtypeStruct((P, K), jnp.bfloat16), rhs,
            jax.ShapeDtypeStruct((P // 128,), jnp.int32)]
  fn = lambda a, b, t: pingpong.grouped_matmul(a, b, t, transpose_rhs=transpose_rhs,
                                               tma_store=tma_store, block_n=block_n)
  assert FFI_TARGET in _cuda_module(fn, *shapes)
  fit = pingpong.stages_that_fit(block_n, 2, 1, tma_store)
  # 32 (40) KiB stages at block_n 128 (192); 64 KiB of epilogue buffers
  assert fit == {(128, False): 7, (128, True): 5, (192, False): 5, (192, True): 4}[
      block_n, tma_store]
  with pytest.raises(ValueError, match=f"stages={fit + 1} must be between 2 and {fit}"):
    jax.eval_shape(lambda a, b, t: pingpong.grouped_matmul(
        a, b, t, transpose_rhs=transpose_rhs, tma_store=tma_store, block_n=block_n,
        stages=fit + 1), *shapes)
  with pytest.raises(ValueError, match="grouped_matmul: block_n=256 is wider than 192"):
    jax.eval_shape(lambda a, b, t: pingpong.grouped_matmul(
        a, b, t, transpose_rhs=transpose_rhs, block_n=256), *shapes)
  # 192-row tiles: block_n up to 128, TMA stores, schedule.row_tiles' table
  table = jax.ShapeDtypeStruct((3 * (-(-P // 192) + E + 1),), jnp.int32)
  rows192 = lambda **kw: (lambda a, b, t: pingpong.grouped_matmul(
      a, b, t, transpose_rhs=transpose_rhs, **{"tile_m": 192, **kw}))
  if tma_store and block_n == 128:
    assert FFI_TARGET in _cuda_module(rows192(tma_store=True), shapes[0], shapes[1], table)
    assert pingpong.stages_that_fit(128, 2, 1, True, "store", 192) == 4   # 40 KiB + 32 KiB
  with pytest.raises(ValueError, match="block_n=192 is wider than 128 .* of 192 x block_n"):
    jax.eval_shape(rows192(tma_store=True, block_n=192), shapes[0], shapes[1], table)
  with pytest.raises(ValueError, match="tile_m=192 stores its rows by TMA only"):
    jax.eval_shape(rows192(), shapes[0], shapes[1], table)
  with pytest.raises(ValueError, match=r"takes schedule.row_tiles' table .* got shape \(8,\)"):
    jax.eval_shape(rows192(tma_store=True), *shapes)
  with pytest.raises(ValueError, match=r"tile_m=256 must be one of \(128, 192\)"):
    jax.eval_shape(rows192(tma_store=True, tile_m=256), *shapes)
  # 640 columns: 192-wide tiles clip the last one with TMA stores; register stores refuse it
  clipped = [shapes[0], jax.ShapeDtypeStruct((E, 640, K) if transpose_rhs else (E, K, 640),
                                             jnp.bfloat16), shapes[2]]
  fn = lambda a, b, t: pingpong.grouped_matmul(a, b, t, transpose_rhs=transpose_rhs,
                                               tma_store=tma_store, block_n=192)
  if tma_store:
    assert jax.eval_shape(fn, *clipped).shape == (P, 640)
  else:
    with pytest.raises(ValueError, match="N=640 must be a multiple of block_n=192"):
      jax.eval_shape(fn, *clipped)
  # register stores address out by 32-bit offsets: 2^20 x 4096 (30B-n256's size) is refused
  big = [jax.ShapeDtypeStruct((2**20, K), jnp.bfloat16),
         jax.ShapeDtypeStruct((E, 4096, K) if transpose_rhs else (E, K, 4096), jnp.bfloat16),
         jax.ShapeDtypeStruct((2**20 // 128,), jnp.int32)]
  with pytest.raises(ValueError, match="past the register stores' 32-bit offsets"):
    jax.eval_shape(lambda a, b, t: pingpong.grouped_matmul(a, b, t, transpose_rhs=transpose_rhs),
                   *big)


@needs_cute
def test_cute_pingpong_matmul_in_clusters_compiles_for_cuda():
  """The ping-pong grouped_matmul in clusters of 2 along N (cluster_n) compiles for sm_90a to
  a kernel of its own (another FFI target than cluster_n 1's); cluster sizes outside
  CLUSTER_NS and column tiles that do not pair up are refused by name."""
  from ffi import pingpong
  P, K, E = 1024, 256, 4
  shapes = lambda N: [jax.ShapeDtypeStruct((P, K), jnp.bfloat16),
                      jax.ShapeDtypeStruct((E, K, N), jnp.bfloat16),
                      jax.ShapeDtypeStruct((P // 128,), jnp.int32)]
  fn = lambda cluster_n, **kw: (lambda a, b, t: pingpong.grouped_matmul(
      a, b, t, tma_store=True, block_n=192, cluster_n=cluster_n, **kw))
  targets = {c: set(re.findall(r"@(sonicmoe_cute_\w+)", _cuda_module(fn(c), *shapes(768))))
             for c in (1, 2)}
  assert len(targets[1]) == len(targets[2]) == 1 and targets[1] != targets[2]
  # on 192-row tiles (schedule.row_tiles' table), 128 wide: 6 column tiles pair up
  table = jax.ShapeDtypeStruct((3 * (-(-P // 192) + E + 1),), jnp.int32)
  rows192 = lambda a, b, t: pingpong.grouped_matmul(a, b, t, tma_store=True, block_n=128,
                                                    cluster_n=2, tile_m=192)
  rows192_targets = set(re.findall(r"@(sonicmoe_cute_\w+)",
                                   _cuda_module(rows192, *shapes(768)[:2], table)))
  assert len(rows192_targets) == 1 and not rows192_targets & (targets[1] | targets[2])
  for bad in (3, 2.0, True):
    with pytest.raises(ValueError, match=rf"cluster_n={bad!r} must be one of \(1, 2\)"):
      jax.eval_shape(fn(bad), *shapes(768))
  # 640 columns: 4 tiles of 192 (the last clipped) pair up; 384 in a window: 2 pair up;
  # 576: 3 do not, nor a 192-column window's one
  assert jax.eval_shape(fn(2), *shapes(640)).shape == (P, 640)
  assert jax.eval_shape(fn(2, cols=(192, 576)), *shapes(768)).shape == (P, 384)
  with pytest.raises(ValueError, match=r"cluster_n=2 needs the column tiles in whole clusters: "
                                       r"3 tiles of block_n=192 in 576 columns"):
    jax.eval_shape(fn(2), *shapes(576))
  with pytest.raises(ValueError, match=r"1 tiles of block_n=192 in 192 columns"):
    jax.eval_shape(fn(2, cols=(0, 192)), *shapes(768))


@needs_cute
@pytest.mark.parametrize("block_n,stages", [(64, None), (64, 3)])
def test_cute_pingpong_up_proj_compiles_for_cuda(block_n, stages):
  """The ping-pong up-projection (the producer warpgroup gathering X) compiles for sm_90a and
  lowers as an FFI call; shapes and depths it cannot run are refused by name."""
  from ffi import pingpong
  T, P, d, n, E = 300, 1024, 256, 256, 4
  shapes = [jax.ShapeDtypeStruct(s, t) for s, t in [
      ((T, d), jnp.bfloat16), ((E, d, 2 * n), jnp.bfloat16), ((P // 128,), jnp.int32),
      ((P,), jnp.int32)]]
  fn = lambda *a: pingpong.up_proj(*a, block_n=block_n, stages=stages)
  assert FFI_TARGET in _cuda_module(fn, *shapes)
  fit = pingpong.stages_that_fit(block_n, 2, 2)
  assert fit == 7
  with pytest.raises(ValueError, match=f"up_proj: stages={fit + 1} must be between 2 and {fit}"):
    jax.eval_shape(lambda *a: pingpong.up_proj(*a, block_n=block_n, stages=fit + 1), *shapes)
  with pytest.raises(ValueError, match=r"up_proj: n=96 must be a multiple of block_n=64"):
    jax.eval_shape(lambda *a: pingpong.up_proj(*a, block_n=64),
                   shapes[0], jax.ShapeDtypeStruct((E, d, 192), jnp.bfloat16), *shapes[2:])
  with pytest.raises(ValueError, match=r"up_proj: block_n=128 is wider than 64 \(its 2 acc"):
    jax.eval_shape(lambda *a: pingpong.up_proj(*a, block_n=128), *shapes)


def _store_operands(seed, num_tiles, transpose_rhs, N, E=5, K=384):
  """A store GEMM's operands: tile_expert of num_tiles 128-row tiles (sorted; expert 1 without
  rows, E marking tiles past the last group), lhs [P, K], rhs [E, N, K] or [E, K, N]."""
  from ffi import grouped_gemm
  tile_expert = jnp.sort(jax.random.randint(jax.random.key(seed), (num_tiles,), 0, E + 1))
  tile_expert = tile_expert.at[tile_expert == 1].set(2).astype(jnp.int32)
  P = num_tiles * grouped_gemm.BLOCK_M
  lhs = jax.random.normal(jax.random.key(seed + 1), (P, K)).astype(jnp.bfloat16)
  rhs = (jax.random.normal(jax.random.key(seed + 2), (E, N, K) if transpose_rhs else (E, K, N))
         / 8).astype(jnp.bfloat16)
  return tile_expert, lhs, rhs


@pytest.mark.gpu
@needs_cute
@pytest.mark.parametrize("num_tiles,transpose_rhs,tma_store,block_n,N", [
    (1, False, False, 128, 768), (4, True, False, 128, 768), (81, False, False, 128, 768),
    (81, True, False, 128, 768), (1, True, True, 128, 768), (4, False, True, 128, 768),
    (81, True, True, 128, 768), (4, False, True, 192, 768), (81, True, True, 192, 768),
    (300, False, True, 192, 768), (81, False, False, 192, 768),
    # the last column tile clipped: 64 or 128 of its 192 columns in the output
    (81, True, True, 192, 640), (81, False, True, 192, 1024), (300, True, True, 192, 896),
    (1, False, True, 192, 128)])
def test_cute_pingpong_matmul_matches_grouped_matmul_on_gpu(num_tiles, transpose_rhs,
                                                            tma_store, block_n, N):
  """The ping-pong grouped_matmul, storing from registers or by TMA, 128 or 192 wide (with TMA
  stores also where 192 does not divide N: the last tile clipped), gives
  grouped_gemm.grouped_matmul's bits (experts without rows, tiles past the last group: zeros;
  one tile, and several per CTA)."""
  from ffi import grouped_gemm, pingpong
  E = 5
  tile_expert, lhs, rhs = _store_operands(81, num_tiles, transpose_rhs, N, E)
  got = jax.jit(lambda *a: pingpong.grouped_matmul(*a, transpose_rhs=transpose_rhs,
                                                   tma_store=tma_store, block_n=block_n))(
      lhs, rhs, tile_expert)
  want = jax.jit(lambda *a: grouped_gemm.grouped_matmul(*a, transpose_rhs=transpose_rhs))(
      lhs, rhs, tile_expert)
  np.testing.assert_array_equal(got, want)
  assert not np.any(np.asarray(got, np.float32)[np.repeat(np.asarray(tile_expert) >= E, 128)])


@pytest.mark.gpu
@needs_cute
@pytest.mark.parametrize("num_tiles,transpose_rhs,N,block_n,cols", [
    (1, True, 768, 192, None), (4, False, 768, 192, None), (81, True, 768, 192, None),
    (300, True, 1536, 192, None), (300, False, 768, 192, (384, 768)),
    (81, True, 640, 192, None), (81, False, 512, 128, None)])
def test_cute_pingpong_matmul_in_clusters_matches_one_cta_on_gpu(num_tiles, transpose_rhs, N,
                                                                 block_n, cols):
  """The ping-pong grouped_matmul in clusters of 2 (each CTA loading half of an lhs stage and
  multicasting it into both) gives cluster_n 1's bits on every row: experts without rows,
  tiles past the last group, one tile (a grid of one cluster) and several per consumer, a
  window, the last column tile clipped (640); its output written over a freed buffer of NaN
  first, so a row it did not store shows."""
  from ffi import pingpong
  tile_expert, lhs, rhs = _store_operands(86, num_tiles, transpose_rhs, N, K=512)
  P = lhs.shape[0]
  run = lambda cluster_n: jax.jit(lambda *a: pingpong.grouped_matmul(
      *a, transpose_rhs=transpose_rhs, tma_store=True, block_n=block_n, cols=cols,
      cluster_n=cluster_n))(lhs, rhs, tile_expert)
  want = run(1)
  width = N if cols is None else cols[1] - cols[0]
  jax.block_until_ready(jnp.full((P, width), jnp.nan, jnp.bfloat16)).delete()
  got = run(2)
  np.testing.assert_array_equal(got, want)
  assert not np.any(np.isnan(np.asarray(got, np.float32)))
  assert np.any(np.asarray(got, np.float32) != 0)


@pytest.mark.gpu
@needs_cute
@pytest.mark.parametrize("transpose_rhs,N,cols,cluster_n", [
    (True, 768, None, 1), (False, 768, None, 1), (True, 640, None, 1),
    (False, 1024, (256, 768), 1), (True, 1024, (136, 392), 1), (True, 768, None, 2),
    (False, 1024, (256, 768), 2), (True, 1024, (136, 392), 2)])
def test_cute_pingpong_matmul_on_192_row_tiles_matches_grouped_matmul_on_gpu(transpose_rhs, N,
                                                                              cols, cluster_n):
  """The ping-pong grouped_matmul on 192-row tiles (schedule.row_tiles: tiles from each
  group's start, a group's last one stored down to its end) gives grouped_gemm.grouped_matmul's
  bits on every row: groups of 0, 128 (one clipped tile), 256, 384 (two full), 1920 and 2048
  rows, zeros past the last group, columns clipped (640) or a window; alone or in clusters of
  2 (cluster_n: neighbouring column tiles sharing each lhs stage); its output written over a
  freed buffer of NaN first, so a row it did not store shows."""
  from ffi import grouped_gemm, pingpong
  from pallas_kernels import schedule
  sizes = np.array([128, 0, 256, 384, 1920, 0, 2048, 128])
  offsets = jnp.asarray(np.concatenate([[0], np.cumsum(sizes)]), jnp.int32)
  E, K, P = len(sizes), 384, int(sizes.sum()) + 3 * 128
  tile_expert = schedule.tile_owners(offsets, P, 128)
  row_tiles = schedule.row_tiles(offsets, P, pingpong.ROW_TILE_M)
  lhs = jax.random.normal(jax.random.key(84), (P, K)).astype(jnp.bfloat16)
  rhs = (jax.random.normal(jax.random.key(85), (E, N, K) if transpose_rhs else (E, K, N))
         / 8).astype(jnp.bfloat16)
  jax.block_until_ready(jnp.full((P, N), jnp.nan, jnp.bfloat16)).delete()
  got = jax.jit(lambda *a: pingpong.grouped_matmul(*a, transpose_rhs=transpose_rhs, tma_store=True,
                                                   cols=cols, tile_m=pingpong.ROW_TILE_M,
                                                   cluster_n=cluster_n))(lhs, rhs, row_tiles)
  want = jax.jit(lambda *a: grouped_gemm.grouped_matmul(*a, transpose_rhs=transpose_rhs,
                                                        cols=cols))(lhs, rhs, tile_expert)
  np.testing.assert_array_equal(got, want)
  assert not np.any(np.asarray(got, np.float32)[int(offsets[-1]):])


@pytest.mark.gpu
@needs_cute
@pytest.mark.parametrize("num_tiles", [1, 4, 81, 300])
def test_cute_pingpong_up_proj_matches_up_proj_on_gpu(num_tiles):
  """The ping-pong up-projection gives grouped_gemm.up_proj's H bit for bit and its A to
  rounding (both gathering X; padding slots, experts without rows, tiles past the groups;
  300 tiles: several per consumer)."""
  from ffi import grouped_gemm, pingpong
  T, E, d, n = 1000, 5, 384, 256
  tile_expert = jnp.sort(jax.random.randint(jax.random.key(71), (num_tiles,), 0, E + 1))
  tile_expert = tile_expert.at[tile_expert == 1].set(2).astype(jnp.int32)
  P = num_tiles * grouped_gemm.BLOCK_M
  x = jax.random.normal(jax.random.key(72), (T, d)).astype(jnp.bfloat16)
  w1 = (jax.random.normal(jax.random.key(73), (E, d, 2 * n)) / 8).astype(jnp.bfloat16)
  index = jax.random.randint(jax.random.key(74), (P,), 0, T).at[::7].set(T)
  got_h, got_a = jax.jit(lambda *a: pingpong.up_proj(*a, block_n=64))(
      x, w1, tile_expert, index)
  want_h, want_a = jax.jit(lambda x, w, t, i: grouped_gemm.up_proj(
      x, w, t, block_n=64, gather_index=i))(x, w1, tile_expert, index)
  np.testing.assert_array_equal(got_h, want_h)
  np.testing.assert_allclose(np.asarray(got_a, np.float32), np.asarray(want_a, np.float32),
                             rtol=1e-2, atol=1e-2)


@pytest.mark.gpu
@needs_cute
@pytest.mark.parametrize("dh_kernel", ["pingpong", "pingpong_tma"])
def test_cute_layer_with_pingpong_kernels_matches_xla_on_gpu(dh_kernel, monkeypatch):
  """The layer with every op on cute, dH (gathering dO's rows: n = 256; register stores or its
  SMEM epilogue), up_proj, down_proj and dx_tilde (TMA stores) on the ping-pong kernels,
  against the xla backend."""
  cute_ops = importlib.import_module("ffi.ops")
  monkeypatch.setattr(cute_ops, "DH_KERNEL", dh_kernel)
  monkeypatch.setattr(cute_ops, "UP_PROJ_KERNEL", "pingpong")
  monkeypatch.setattr(cute_ops, "STORE_KERNEL", "pingpong_tma")
  T, d, n, E, K = 4096, 1536, 256, 128, 8
  args = make_inputs(3, T, d, n, E, jnp.bfloat16)
  cot = jax.random.normal(jax.random.key(4), (T, d))
  f = lambda backend: jax.grad(lambda *a: jnp.sum(
      sm.moe(*a, k=K, backend=backend).out.astype(jnp.float32) * cot), argnums=(0, 1, 2, 3))(*args)
  for a, b in zip(f(CUTE_GEMMS), f("xla")):
    assert rel_err(a, b) < 1e-2


def _store_targets_under(monkeypatch, setting: str, values, args):
  """{value: the FFI targets the cute layer's value_and_grad lowers to (for CUDA) with ffi.ops'
  `setting` at that value} (k = 2)."""
  cute_ops = importlib.import_module("ffi.ops")
  targets = {}
  for value in values:
    monkeypatch.setattr(cute_ops, setting, value)
    grad = lambda *a: jax.value_and_grad(lambda *b: jnp.sum(sm.moe(
        *b, k=2, backend="cute").out.astype(jnp.float32)))(*a)
    targets[value] = set(re.findall(r"@(sonicmoe_cute_\w+)", _cuda_module(grad, *args)))
  return targets


def _layer_results_under(monkeypatch, setting: str, values, shape, seed: int):
  """{value: the cute layer's loss value and its gradients for every input, with ffi.ops'
  `setting` at that value}, on random inputs of shape (T, d, n, E, K) from seed."""
  cute_ops = importlib.import_module("ffi.ops")
  T, d, n, E, K = shape
  args = make_inputs(seed, T, d, n, E, jnp.bfloat16)
  cot = jax.random.normal(jax.random.key(seed + 1), (T, d))
  results = {}
  for value in values:
    monkeypatch.setattr(cute_ops, setting, value)
    # (a new function each time: jit would reuse the first one's trace)
    results[value] = jax.jit(lambda *a: jax.value_and_grad(lambda *b: jnp.sum(sm.moe(
        *b, k=K, backend="cute").out.astype(jnp.float32) * cot), argnums=(0, 1, 2, 3))(*a))(*args)
  return results


@needs_cute
@pytest.mark.parametrize("d, auto_tile_m", [(768, 128), (384, 192)])
def test_cute_store_tile_m_setting_lowers_the_store_gemms_to_192_row_kernels(
    d, auto_tile_m, monkeypatch):
  """STORE_TILE_M 192 lowers (for CUDA) down_proj and dx_tilde to kernels of their own (the
  192-row ping-pong tiles, taking schedule.row_tiles' table) in each of the default's two
  column windows, the other ops' kernels unchanged; "auto" takes 128 rows where 192-wide
  column tiles divide the windows (d = 768: 384 columns each) and 192 rows where they do not
  (d = 384: 128 and 256 columns)."""
  targets = _store_targets_under(monkeypatch, "STORE_TILE_M", (128, 192, "auto"),
                                 make_inputs(9, 256, d, 128, 4, jnp.bfloat16))
  # (two column windows: each GEMM's windows are two targets)
  assert len(targets[192] - targets[128]) == len(targets[128] - targets[192]) == 4
  assert targets[128] & targets[192]   # the other ops' kernels
  assert targets["auto"] == targets[auto_tile_m]


@pytest.mark.gpu
@needs_cute
@pytest.mark.parametrize("shape", [(4096, 1536, 256, 128, 8), (2048, 2048, 256, 16, 2)])
def test_cute_layer_with_192_row_store_tiles_matches_128_on_gpu(shape, monkeypatch):
  """The default layer with its store GEMMs on 192-row tiles (STORE_TILE_M) gives the same
  bits as on 128-row tiles: output and every gradient (two column windows; a 1024-column
  window at d = 2048 in 128-wide tiles)."""
  results = _layer_results_under(monkeypatch, "STORE_TILE_M", (192, 128), shape, seed=5)
  for got, want in zip(jax.tree.leaves(results[192]), jax.tree.leaves(results[128])):
    np.testing.assert_array_equal(got, want)


@needs_cute
@pytest.mark.parametrize("d, paired", [(768, 4), (384, 2)])
def test_cute_store_cluster_n_setting_lowers_the_store_gemms_to_clustered_kernels(
    d, paired, monkeypatch):
  """STORE_CLUSTER_N 2 lowers (for CUDA) down_proj and dx_tilde to kernels of their own in
  each of the default's two column windows where their column tiles pair up (d = 768: two
  192-wide tiles a window, 4 kernels), and only there (d = 384, on the 192-row tiles 128 wide:
  the 256-column windows' two tiles pair up, the 128-column windows' one does not: 2); the
  other ops' kernels unchanged."""
  targets = _store_targets_under(monkeypatch, "STORE_CLUSTER_N", (1, 2),
                                 make_inputs(9, 256, d, 128, 4, jnp.bfloat16))
  assert len(targets[2] - targets[1]) == len(targets[1] - targets[2]) == paired
  assert targets[1] & targets[2]


@pytest.mark.gpu
@needs_cute
@pytest.mark.parametrize("shape", [(4096, 1536, 256, 128, 8), (2048, 768, 256, 16, 2)])
def test_cute_layer_with_clustered_store_gemms_matches_one_cta_on_gpu(shape, monkeypatch):
  """The default layer with its store GEMMs in clusters of 2 (STORE_CLUSTER_N) gives the same
  bits as without: output and every gradient (two column windows of 768 or 384 columns)."""
  results = _layer_results_under(monkeypatch, "STORE_CLUSTER_N", (2, 1), shape, seed=7)
  for got, want in zip(jax.tree.leaves(results[2]), jax.tree.leaves(results[1])):
    np.testing.assert_array_equal(got, want)


@needs_cute
def test_cute_store_wide_min_k_routes_each_store_gemm_by_its_contraction(monkeypatch):
  """STORE_WIDE_MIN_K picks the store GEMMs' kernel by contraction, each GEMM on its own: at
  n = 1024, d = 2048 (two 1024-column windows) the down-projection (K = n) leaves the wide
  persistent kernel for the 192-row ping-pong one once the threshold passes 1024, dX~ (K =
  2n) once it passes 2048, and the down-projection's 192-row kernels are the same in both."""
  targets = _store_targets_under(monkeypatch, "STORE_WIDE_MIN_K", (1024, 2048, 4096),
                                 make_inputs(13, 256, 2048, 1024, 4, jnp.bfloat16))
  down_rows192 = targets[2048] - targets[1024]   # (each GEMM's two windows: two targets)
  assert len(down_rows192) == len(targets[1024] - targets[2048]) == 2
  assert len(targets[4096] - targets[2048]) == len(targets[2048] - targets[4096]) == 2
  assert down_rows192 <= targets[4096]


@pytest.mark.gpu
@needs_cute
def test_cute_layer_with_down_proj_on_192_row_tiles_matches_the_wide_kernel_on_gpu(monkeypatch):
  """The layer with its down-projection (a 1024-long contraction, 1024-column windows) on
  the 192-row ping-pong tiles (STORE_WIDE_MIN_K 2048) gives the same bits as on the wide
  persistent kernel (1024): output and every gradient."""
  results = _layer_results_under(monkeypatch, "STORE_WIDE_MIN_K", (2048, 1024),
                                 (2048, 2048, 1024, 16, 2), seed=15)
  for got, want in zip(jax.tree.leaves(results[2048]), jax.tree.leaves(results[1024])):
    np.testing.assert_array_equal(got, want)


@needs_cute
def test_setmaxnreg_budgets_fit_what_the_cta_gets_at_launch():
  """Every warp-specialized kernel's (producer, MMA warpgroups) register budgets fit the
  384-thread CTA's launch allocation (168 registers a thread): a consumer's setmaxnreg
  increase past it waits for ever (48 / 232 hung the ping-pong dH on an H200)."""
  from ffi import mainloop, pingpong
  launch = pingpong.THREADS * 168
  budgets = [*pingpong.REGISTERS.values(), pingpong.SMEM_EPILOGUE_GATHER_REGISTERS,
             (mainloop.PRODUCER_REGISTERS, mainloop.MMA_REGISTERS)]
  for producer, consumers in budgets:
    assert producer % 8 == 0 and consumers % 8 == 0, (producer, consumers)
    assert 128 * producer + 256 * consumers <= launch, (producer, consumers)


@needs_cute
def test_cute_dh_kernel_auto_follows_the_model_width(monkeypatch):
  """DH_KERNEL "auto": the ping-pong dH (SMEM epilogue, 128-wide column tiles) up to
  DH_PINGPONG_MAX_D, grouped_gemm's dh (TMA stores, 256 wide) past it; dO's rows gathered by
  both kernels at n 1024 (8 and 4 column tiles), an explicit variant kept at every width."""
  cute_ops = importlib.import_module("ffi.ops")
  monkeypatch.setattr(cute_ops, "DH_KERNEL", "auto")
  limit = cute_ops.DH_PINGPONG_MAX_D
  assert cute_ops._dh_kernel(limit) == "pingpong_tma"
  assert cute_ops._dh_kernel(limit + 512) == "tma_store"
  assert (cute_ops._dh_block_n(256, limit), cute_ops._dh_block_n(256, limit + 512)) == (128, 256)
  assert cute_ops._dout_gathered_in_kernel(1024, limit)
  assert cute_ops._dout_gathered_in_kernel(1024, limit + 512)
  monkeypatch.setattr(cute_ops, "DH_KERNEL", "registers")
  assert cute_ops._dh_kernel(limit) == "registers"


@needs_cute
def test_cute_kernel_settings_are_checked(monkeypatch):
  """A DH_BLOCK_N, DH_KERNEL, UP_PROJ_KERNEL, STORE_KERNEL, STORE_WIDE_KERNEL, STORE_BLOCK_N,
  STORE_TILE_M, STORE_CLUSTER_N or WGRAD_KERNEL outside its list is refused by name (runs on
  CPU: the error comes before any kernel)."""
  cute_ops = importlib.import_module("ffi.ops")
  args = make_inputs(6, 256, 128, 64, 4, jnp.bfloat16)
  grad = lambda: jax.grad(lambda *a: jnp.sum(sm.moe(*a, k=2, backend={
      op: "xla" for op in sm.OP_NAMES} | {"dh": "cute"}).out.astype(jnp.float32)))(*args)
  monkeypatch.setattr(cute_ops, "DH_BLOCK_N", 96)
  with pytest.raises(ValueError, match=r"DH_BLOCK_N must be 64, 128 or 256; got 96"):
    grad()
  monkeypatch.setattr(cute_ops, "DH_KERNEL", "fast")
  with pytest.raises(ValueError, match=r"DH_KERNEL must be one of .*'fast'"):
    grad()
  monkeypatch.setattr(cute_ops, "UP_PROJ_KERNEL", "fast")
  with pytest.raises(ValueError, match=r"UP_PROJ_KERNEL must be one of .*'fast'"):
    sm.moe(*args, k=2, backend={op: "xla" for op in sm.OP_NAMES} | {"up_proj": "cute"})
  monkeypatch.setattr(cute_ops, "STORE_KERNEL", "fast")
  with pytest.raises(ValueError, match=r"STORE_KERNEL must be one of .*'fast'"):
    sm.moe(*args, k=2, backend={op: "xla" for op in sm.OP_NAMES} | {"down_proj": "cute"})
  monkeypatch.setattr(cute_ops, "STORE_KERNEL", "pingpong_tma")
  monkeypatch.setattr(cute_ops, "STORE_WIDE_KERNEL", "fast")
  with pytest.raises(ValueError, match=r"STORE_WIDE_KERNEL must be one of .*'fast'"):
    sm.moe(*args, k=2, backend={op: "xla" for op in sm.OP_NAMES} | {"down_proj": "cute"})
  monkeypatch.setattr(cute_ops, "STORE_WIDE_KERNEL", "persistent")
  monkeypatch.setattr(cute_ops, "STORE_BLOCK_N", 256)
  with pytest.raises(ValueError, match=r"STORE_BLOCK_N must be one of \(128, 192\); got 256"):
    sm.moe(*args, k=2, backend={op: "xla" for op in sm.OP_NAMES} | {"down_proj": "cute"})
  monkeypatch.setattr(cute_ops, "STORE_BLOCK_N", 192)
  monkeypatch.setattr(cute_ops, "STORE_TILE_M", 256)
  with pytest.raises(ValueError,
                     match=r"STORE_TILE_M must be one of \('auto', 128, 192\); got 256"):
    sm.moe(*args, k=2, backend={op: "xla" for op in sm.OP_NAMES} | {"down_proj": "cute"})
  monkeypatch.setattr(cute_ops, "STORE_TILE_M", "auto")
  monkeypatch.setattr(cute_ops, "STORE_CLUSTER_N", 4)
  with pytest.raises(ValueError, match=r"STORE_CLUSTER_N must be one of \(1, 2\); got 4"):
    sm.moe(*args, k=2, backend={op: "xla" for op in sm.OP_NAMES} | {"down_proj": "cute"})
  monkeypatch.setattr(cute_ops, "WGRAD_KERNEL", "fast")
  with pytest.raises(ValueError, match=r"WGRAD_KERNEL must be one of .*'fast'"):
    jax.grad(lambda *a: jnp.sum(sm.moe(*a, k=2, backend={op: "xla" for op in sm.OP_NAMES} | {
        "dw1": "cute"}).out.astype(jnp.float32)), argnums=2)(*args)


@needs_cute
@pytest.mark.parametrize("d,n,takes_192", [(384, 128, 2), (640, 256, 0), (2048, 256, 0)])
def test_cute_store_block_n_setting_lowers_to_its_own_kernels(monkeypatch, d, n, takes_192):
  """STORE_BLOCK_N 192 lowers (for CUDA) down_proj and dx_tilde (takes_192 of the two) to
  other kernels than 128 where 192 divides their columns (d = 384, one window; the loss's
  value keeps the forward's down_proj), and to the same ones where it does not (d = 640 and
  2048). (On the 128-row tiles: STORE_TILE_M "auto" takes 192 rows, 128 wide, where 192 wide
  does not divide the columns.)"""
  cute_ops = importlib.import_module("ffi.ops")
  monkeypatch.setattr(cute_ops, "STORE_TILE_M", 128)
  args = make_inputs(9, 256, d, n, 4, jnp.bfloat16)
  targets = {}
  for block_n in (128, 192):
    monkeypatch.setattr(cute_ops, "STORE_BLOCK_N", block_n)
    # (a new function each time: jit would reuse the first one's trace)
    grad = lambda *a: jax.value_and_grad(lambda *b: jnp.sum(sm.moe(*b, k=2, windows=1, backend={
        op: "xla" for op in sm.OP_NAMES} | {"down_proj": "cute", "dx_tilde": "cute"}).out.astype(
            jnp.float32)))(*a)
    targets[block_n] = set(re.findall(r"@(sonicmoe_cute_\w+)", _cuda_module(grad, *args)))
  assert len(targets[128]) == len(targets[192]) == 2
  assert len(targets[192] - targets[128]) == takes_192


@pytest.mark.gpu
@needs_cute
@pytest.mark.parametrize("num_tiles,block_n,gather,tma_store", [
    (4, 128, False, False), (80, 128, False, False), (81, 64, False, False),
    (81, 128, True, False), (4, 64, True, False), (80, 128, False, True), (81, 128, True, True),
    (4, 64, True, True), (300, 128, True, True)])
def test_cute_pingpong_dh_matches_dh_on_gpu(num_tiles, block_n, gather, tma_store):
  """The ping-pong schedule gives grouped_gemm.dh's bits, reading dOg or gathering dO's rows
  (padding slots among them), with register stores or (tma_store) the SMEM epilogue: M tiles
  of experts with and without rows and past the last group; fewer work tiles than CTAs (one
  consumer busy), and several per CTA (both consumers, an odd count: the turn handed over to
  no one at the end; 300 tiles: each consumer's H barrier through many phases)."""
  from ffi import grouped_gemm, pingpong
  T, E, d, n = 1000, 5, 384, 256
  tile_expert = jnp.sort(jax.random.randint(jax.random.key(61), (num_tiles,), 0, E + 1))
  tile_expert = tile_expert.at[tile_expert == 1].set(2).astype(jnp.int32)   # expert 1: no rows
  P = num_tiles * grouped_gemm.BLOCK_M
  keys = jax.random.split(jax.random.key(62), 5)
  dout = jax.random.normal(keys[0], (T if gather else P, d)).astype(jnp.bfloat16)
  w2 = (jax.random.normal(keys[1], (E, n, d)) / 8).astype(jnp.bfloat16)
  h = (2 * jax.random.normal(keys[2], (P, 2 * n))).astype(jnp.bfloat16)
  h = jnp.where((jnp.repeat(tile_expert, grouped_gemm.BLOCK_M) < E)[:, None], h, 0)
  scores = jax.random.uniform(keys[3], (P,), minval=0.05, maxval=1.0)
  index = {}
  if gather:
    index = dict(gather_index=jax.random.randint(keys[4], (P,), 0, T).at[::7].set(T))
  got = jax.jit(lambda *a: pingpong.dh(*a, block_n=block_n, tma_store=tma_store, **index))(
      dout, w2, h, scores, tile_expert)
  want = jax.jit(lambda *a: grouped_gemm.dh(*a, block_n=block_n, **index))(
      dout, w2, h, scores, tile_expert)
  for g, w in zip(got, want):
    np.testing.assert_array_equal(g, w)


@pytest.mark.gpu
@needs_cute
@pytest.mark.parametrize("block_n,stages", [(128, None), (256, 2)])
def test_cute_weight_grad_against_float32_on_gpu(block_n, stages):
  """out[e] = lhs_e^T rhs_e over expert e's rows: experts of 256, 0 (zeros), 640 and 128 rows,
  then 128 rows past the last group (read by no expert)."""
  from ffi import grouped_gemm
  sizes = [256, 0, 640, 128]
  offsets = jnp.array(np.concatenate([[0], np.cumsum(sizes)]), jnp.int32)
  P, M, N, E = sum(sizes) + 128, 384, 512, len(sizes)
  lhs = jax.random.normal(jax.random.key(21), (P, M)).astype(jnp.bfloat16)
  rhs = jax.random.normal(jax.random.key(22), (P, N)).astype(jnp.bfloat16)
  got = jax.jit(lambda a, b, o: grouped_gemm.weight_grad(a, b, o, E, block_n, stages))(lhs, rhs, offsets)
  assert got.shape == (E, M, N) and got.dtype == jnp.bfloat16
  f32 = lambda v: v.astype(jnp.float32)
  for e in range(E):
    lo, hi = int(offsets[e]), int(offsets[e + 1])
    if lo == hi:
      np.testing.assert_array_equal(got[e], 0)
    else:
      assert rel_err(got[e], f32(lhs[lo:hi]).T @ f32(rhs[lo:hi])) < 1e-2


@pytest.mark.gpu
@needs_cute
@pytest.mark.parametrize("kernel,gather,transpose_out", [
    ("grouped", False, False), ("grouped", True, True), ("persistent", True, False),
    ("persistent", True, True)])
def test_cute_weight_grad_skips_padding_steps_on_gpu(kernel, gather, transpose_out):
  """With group_sizes the kernels stop at each expert's last k step that holds its rows: the
  rows of the steps wholly past them are NaN here and must not reach the output, the padding
  rows inside the last step are zeros (as the plan's). Experts of 200 rows (a group of 256:
  4 steps, the last partly padding), 0 (zeros), 640 (whole), 1 (a group of 128: one step run,
  the second skipped) and 1100 (a group of 1152: 18 steps, the last partly padding); against
  float32 over the real rows."""
  from ffi import grouped_gemm, persistent
  sizes, groups = [200, 0, 640, 1, 1100], [256, 0, 640, 128, 1152]
  offsets = jnp.array(np.concatenate([[0], np.cumsum(groups)]), jnp.int32)
  T, P, M, N, E = 1000, sum(groups), 384, 512, len(sizes)
  steps = PaddingSteps(sizes, groups, grouped_gemm.BLOCK_K)
  assert np.any(steps.kind == 2) and np.any(steps.kind == 1)
  keys = jax.random.split(jax.random.key(91), 3)
  rhs = steps.fill(jax.random.normal(keys[0], (P, N)))
  if gather:
    x, index = steps.gather_source(keys[1], keys[2], T, M)
    rows = x.at[index].get(mode="fill", fill_value=0)
  else:
    rows = steps.fill(jax.random.normal(keys[1], (P, M)))
  kw = dict(block_n=256, transpose_out=transpose_out, group_sizes=jnp.array(sizes, jnp.int32))
  if kernel == "persistent":
    got = jax.jit(lambda: persistent.weight_grad(x, rhs, offsets, E, index, **kw))()
  else:
    got = jax.jit(lambda: grouped_gemm.weight_grad(
        x if gather else rows, rhs, offsets, E, **kw,
        **(dict(gather_index=index) if gather else {})))()
  f32 = lambda v: v.astype(jnp.float32)
  for e, size in enumerate(sizes):
    first = int(offsets[e])
    want = f32(rows[first:first + size]).T @ f32(rhs[first:first + size])
    got_e = got[e].T if transpose_out else got[e]
    assert np.all(np.isfinite(np.asarray(got_e, np.float32))), f"expert {e}: a skipped row counted"
    if size == 0:
      np.testing.assert_array_equal(got_e, 0)
    else:
      assert rel_err(got_e, want) < 1e-2, e


@pytest.mark.gpu
@needs_cute
@pytest.mark.parametrize("block_n,tma_store,d", [
    (128, False, 512), (64, False, 512), (128, True, 512), (256, False, 512), (256, True, 512),
    (128, True, 1280)])
def test_cute_dh_with_gather_matches_pregathered_on_gpu(block_n, tma_store, d):
  """Gathering dO's rows in the dH kernel (padding slots: index T, zero rows) gives the
  bitwise same dH, A' and dS parts as the kernel on rows gathered by XLA first (d above T =
  1000 too: the k steps are d's, not the rows')."""
  from ffi import grouped_gemm
  T, n, E = 1000, 256, 4
  tile_expert = jnp.array([0, 0, 1, 3, 3, E], jnp.int32)
  P = tile_expert.shape[0] * grouped_gemm.BLOCK_M
  dout = jax.random.normal(jax.random.key(51), (T, d)).astype(jnp.bfloat16)
  w2 = (jax.random.normal(jax.random.key(52), (E, n, d)) / 16).astype(jnp.bfloat16)
  h = jax.random.normal(jax.random.key(53), (P, 2 * n)).astype(jnp.bfloat16)
  scores = jax.random.uniform(jax.random.key(54), (P,))
  index = jax.random.randint(jax.random.key(55), (P,), 0, T).at[::7].set(T)
  _assert_gathering_matches_pregathered(grouped_gemm.dh, dout, index, w2, h, scores,
                                        tile_expert, block_n=block_n, tma_store=tma_store)


@needs_cute
def test_cute_weight_grad_names_a_wrong_group_sizes():
  from ffi import grouped_gemm
  offsets = jnp.array([0, 256, 256, 896, 1024], jnp.int32)
  with pytest.raises(ValueError, match=r"cute weight_grad: group_sizes must be \[4\]; got \(5,\)"):
    grouped_gemm.weight_grad(jnp.zeros((1024, 128), jnp.bfloat16),
                             jnp.zeros((1024, 128), jnp.bfloat16), offsets, 4,
                             group_sizes=jnp.zeros((5,), jnp.int32))


@needs_cute
def test_cute_dh_h_smem_needs_its_stages():
  """dh(h_smem=True) takes a ring deep enough to hold H's tile (also past the k steps), and
  names the limit when given fewer stages."""
  from ffi import grouped_gemm
  P, d, n, E = 512, 128, 256, 4   # 2 k steps
  shapes = [jax.ShapeDtypeStruct(s, t) for s, t in [
      ((P, d), jnp.bfloat16), ((E, n, d), jnp.bfloat16), ((P, 2 * n), jnp.bfloat16),
      ((P,), jnp.float32), ((P // 128,), jnp.int32)]]
  fn = lambda *a: grouped_gemm.dh(*a, block_n=128, h_smem=True)
  assert FFI_TARGET in _cuda_module(fn, *shapes)
  minimum = grouped_gemm.H_SMEM_MIN_STAGES
  with pytest.raises(ValueError, match=f"h_smem needs stages >= {minimum}"):
    jax.eval_shape(lambda *a: grouped_gemm.dh(*a, block_n=128, stages=minimum - 1, h_smem=True),
                   *shapes)


@pytest.mark.gpu
@needs_cute
@pytest.mark.parametrize("block_n,gather,tma_store,d", [
    (256, True, False, 640), (128, False, False, 640), (256, False, True, 640),
    (128, True, True, 128), (256, True, False, 128), (256, True, True, 640),
    (128, True, False, 128)])
def test_cute_dh_h_smem_keeps_outputs_on_gpu(block_n, gather, tma_store, d):
  """dH's epilogue reading H from SMEM (TMA-loaded over the rhs stages after the mainloop;
  with tma_store its outputs written there and stored by TMA; experts of 0 to 10 k steps,
  fewer k steps than stages at d 128, a tile past the last group; dO's rows gathered or
  not) gives the bitwise same dH, A' and dS parts as reading it from global
  memory."""
  from ffi import grouped_gemm
  T, n, E = 1000, 256, 4
  tile_expert = jnp.array([0, 0, 1, 3, 3, E], jnp.int32)
  P = tile_expert.shape[0] * grouped_gemm.BLOCK_M
  keys = jax.random.split(jax.random.key(81), 5)
  dout = jax.random.normal(keys[0], (T if gather else P, d)).astype(jnp.bfloat16)
  w2 = (jax.random.normal(keys[1], (E, n, d)) / 16).astype(jnp.bfloat16)
  h = jax.random.normal(keys[2], (P, 2 * n)).astype(jnp.bfloat16)
  scores = jax.random.uniform(keys[3], (P,))
  index = jax.random.randint(keys[4], (P,), 0, T).at[::7].set(T) if gather else None
  run = jax.jit(lambda h_smem: grouped_gemm.dh(
      dout, w2, h, scores, tile_expert, block_n=block_n, gather_index=index, over_h=False,
      tma_store=tma_store, h_smem=h_smem), static_argnums=0)
  for g, w in zip(run(True), run(False)):
    assert np.any(np.asarray(w, np.float32) != 0)
    np.testing.assert_array_equal(g, w)


@pytest.mark.gpu
@needs_cute
@pytest.mark.parametrize("block_n,stages,tma_gather", [
    (128, None, False), (256, None, False), (128, 2, False), (256, 3, False), (256, None, True),
    (128, 2, True)])
def test_cute_weight_grad_with_gather_matches_pregathered_on_gpu(block_n, stages, tma_gather):
  """Gathering X's rows in the weight-gradient kernel (rows are its contraction; padding slots:
  index T, zero rows; experts of 2, 4 and 10 k steps fill the producer's ring of `stages`
  partly, exactly and wrap it; by cp.async or TMA) gives the bitwise same dW as the kernel on
  rows gathered by XLA first."""
  from ffi import grouped_gemm
  sizes = [256, 0, 640, 128]
  offsets = jnp.array(np.concatenate([[0], np.cumsum(sizes)]), jnp.int32)
  T, P, M, N, E = 1000, sum(sizes) + 128, 384, 512, len(sizes)
  x = jax.random.normal(jax.random.key(31), (T, M)).astype(jnp.bfloat16)
  rhs = jax.random.normal(jax.random.key(32), (P, N)).astype(jnp.bfloat16)
  index = jax.random.randint(jax.random.key(33), (P,), 0, T).at[::5].set(T)
  _assert_gathering_matches_pregathered(grouped_gemm.weight_grad, x, index, rhs, offsets,
                                        num_experts=E, block_n=block_n, stages=stages,
                                        tma_gather=tma_gather)


@pytest.mark.gpu
@needs_cute
@pytest.mark.parametrize("op,block_n,stages", [
    ("matmul", 256, None), ("matmul_t", 128, 3), ("up_proj", 128, None), ("dh", 256, None),
    ("weight_grad", 256, None), ("weight_grad", 128, 2)])
def test_cute_warp_specialized_kernels_match_on_gpu(op, block_n, stages):
  """warp_specialized=True (a producer warpgroup issuing the TMA loads) gives the bitwise same
  outputs as the MMA warpgroups' warp 0 issuing them: tiles past the last group (zeros),
  experts of 0 to 10 k steps (the ring filled partly, exactly and wrapped)."""
  from ffi import grouped_gemm
  E, d, n = 4, 640, 256
  tile_expert = jnp.array([0, 0, 1, 3, 3, E], jnp.int32)
  P = tile_expert.shape[0] * grouped_gemm.BLOCK_M
  keys = jax.random.split(jax.random.key(61), 4)
  lhs = jax.random.normal(keys[0], (P, d)).astype(jnp.bfloat16)
  rhs = (jax.random.normal(keys[1], (E, d, 2 * n)) / 16).astype(jnp.bfloat16)
  h = jax.random.normal(keys[2], (P, 2 * n)).astype(jnp.bfloat16)
  scores = jax.random.uniform(keys[3], (P,))
  offsets = jnp.array([0, 256, 256, 640, P], jnp.int32)   # 4, 0, 6 and 2 k steps
  kw = dict(block_n=block_n, stages=stages)
  fn = {"matmul": lambda ws: grouped_gemm.grouped_matmul(lhs, rhs, tile_expert, **kw,
                                                         warp_specialized=ws),
        "matmul_t": lambda ws: grouped_gemm.grouped_matmul(
            lhs, jnp.swapaxes(rhs, 1, 2), tile_expert, transpose_rhs=True, **kw,
            warp_specialized=ws),
        "up_proj": lambda ws: grouped_gemm.up_proj(lhs, rhs, tile_expert, **kw,
                                                   warp_specialized=ws),
        "dh": lambda ws: grouped_gemm.dh(lhs, jnp.swapaxes(rhs[:, :, :n], 1, 2), h, scores,
                                         tile_expert, over_h=False, **kw, warp_specialized=ws),
        "weight_grad": lambda ws: grouped_gemm.weight_grad(lhs, h, offsets, E, **kw,
                                                           warp_specialized=ws)}[op]
  got, want = jax.jit(lambda: fn(True))(), jax.jit(lambda: fn(False))()
  for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
    assert np.any(np.asarray(w, np.float32) != 0)
    np.testing.assert_array_equal(g, w)


@pytest.mark.gpu
@needs_cute
@pytest.mark.parametrize("block_n,gather", [(256, True), (128, False)])
def test_cute_weight_grad_stores_transposed_on_gpu(block_n, gather):
  """transpose_out (the M-major epilogue: [E, N, M]) stores the bitwise same values as the
  [E, M, N] kernel, swapped: experts of 256, 0 (zeros), 640 and 128 rows, reading rows in slot
  order or gathering them (padding slots: index T)."""
  from ffi import grouped_gemm
  sizes = [256, 0, 640, 128]
  offsets = jnp.array(np.concatenate([[0], np.cumsum(sizes)]), jnp.int32)
  T, P, M, N, E = 1000, sum(sizes) + 128, 384, 512, len(sizes)
  lhs = jax.random.normal(jax.random.key(34), (T if gather else P, M)).astype(jnp.bfloat16)
  rhs = jax.random.normal(jax.random.key(35), (P, N)).astype(jnp.bfloat16)
  index = {}
  if gather:
    index = dict(gather_index=jax.random.randint(jax.random.key(36), (P,), 0, T).at[::5].set(T))
  run = lambda t: jax.jit(lambda a, b, o: grouped_gemm.weight_grad(
      a, b, o, E, block_n, transpose_out=t, **index))(lhs, rhs, offsets)
  got, want = run(True), run(False)
  assert got.shape == (E, N, M)
  np.testing.assert_array_equal(got, jnp.swapaxes(want, 1, 2))


@needs_cute
def test_cute_wgrad_dynamic_setting_lowers_with_its_counter(monkeypatch):
  """WGRAD_DYNAMIC_ORDER "auto" with WGRAD_DYNAMIC_MIN_TILES 1: the layer's gathering dW1 (and
  not dW2) runs the persistent kernel in the dynamic tile order, its counter an operand from
  zeros written in place (output 1); a name other than dw1 and dw2 is refused by name."""
  cute_ops = importlib.import_module("ffi.ops")
  monkeypatch.setattr(cute_ops, "WGRAD_DYNAMIC_ORDER", "auto")
  monkeypatch.setattr(cute_ops, "WGRAD_DYNAMIC_MIN_TILES", 1)
  args = make_inputs(0, 256, 256, 128, 8, jnp.bfloat16)

  def loss(*a):
    return jnp.sum(sm.moe(*a, k=2, backend=CUTE_GEMMS).out.astype(jnp.float32))

  text = _cuda_module(jax.value_and_grad(loss, argnums=(0, 2, 3)), *args)
  assert re.search(r"output_operand_alias<output_tuple_indices = \[1\], operand_index = 4,", text)
  assert len(re.findall(r"output_operand_alias<output_tuple_indices = \[1\]", text)) == 1
  monkeypatch.setattr(cute_ops, "WGRAD_DYNAMIC_ORDER", ("dw1", "dx"))
  with pytest.raises(ValueError, match=r"WGRAD_DYNAMIC_ORDER must be 'auto' or a tuple of "
                                       r"'dw1' and 'dw2'; got \('dw1', 'dx'\)"):
    _cuda_module(jax.grad(loss), *args)


@needs_cute
def test_cute_wgrad_cluster_setting_reaches_the_kernel_where_m_allows(monkeypatch):
  """WGRAD_CLUSTER_M 2: the layer's persistent gathering weight gradients run in clusters of 2
  where their M (the gathered rows' width) is a multiple of 256, else alone; 1 (the default):
  alone; a size other than 1 and 2 is refused by name."""
  cute_ops = importlib.import_module("ffi.ops")
  calls = []
  real = cute_ops.persistent.weight_grad

  def spy(x, *args, **kw):
    calls.append((x.shape[1], kw["cluster_m"]))
    return real(x, *args, **kw)

  monkeypatch.setattr(cute_ops.persistent, "weight_grad", spy)

  def loss(*a):
    return jnp.sum(sm.moe(*a, k=2, backend=CUTE_GEMMS).out.astype(jnp.float32))

  for d, cluster_m, want in [(256, 2, 2), (384, 2, 1), (256, 1, 1)]:
    monkeypatch.setattr(cute_ops, "WGRAD_CLUSTER_M", cluster_m)
    calls.clear()
    _cuda_module(jax.grad(loss, argnums=(0, 2, 3)), *make_inputs(0, 256, d, 128, 8, jnp.bfloat16))
    assert calls and all(m == d and c == want for m, c in calls), calls
  monkeypatch.setattr(cute_ops, "WGRAD_CLUSTER_M", 4)
  with pytest.raises(ValueError, match=r"ffi.ops.WGRAD_CLUSTER_M must be one of \(1, 2\); got 4"):
    _cuda_module(jax.grad(loss), *make_inputs(0, 256, 256, 128, 8, jnp.bfloat16))


@needs_cute
@pytest.mark.parametrize("wgrad_kernel", ["persistent", "grouped"])
def test_cute_tma_gather_setting_reaches_the_kernels_it_names(wgrad_kernel, monkeypatch):
  """TMA_GATHER names the weight gradients whose gathered rows TMA loads: dW1 (untransposed)
  and dW2 (transposed), on either weight-gradient kernel; the layer lowers with any; both by
  default; a bare name or another op is refused by name."""
  cute_ops = importlib.import_module("ffi.ops")
  assert cute_ops.TMA_GATHER == ("dw1", "dw2")
  monkeypatch.setattr(cute_ops, "DOUT_GATHER_MAX_COLUMN_TILES", 1 << 30)   # dH, dW2 gather too
  monkeypatch.setattr(cute_ops, "WGRAD_KERNEL", wgrad_kernel)
  calls = []

  def spy(op, module, name):
    real = getattr(module, name)

    def call(*args, **kw):   # (persistent.weight_grad takes its gather_index positionally)
      if kw.get("gather_index") is not None or module is cute_ops.persistent:
        calls.append((op(kw), kw.get("tma_gather", False)))
      return real(*args, **kw)

    monkeypatch.setattr(module, name, call)

  wgrad_module = cute_ops.persistent if wgrad_kernel == "persistent" else cute_ops.grouped_gemm
  spy(lambda kw: "dw2" if kw["transpose_out"] else "dw1", wgrad_module, "weight_grad")

  def loss(*a):
    return jnp.sum(sm.moe(*a, k=2, backend=CUTE_GEMMS).out.astype(jnp.float32))

  args = make_inputs(0, 256, 2048, 128, 8, jnp.bfloat16)
  ops = ("dw1", "dw2")
  for setting in [(), ("dw1",), ("dw2",), ops]:
    monkeypatch.setattr(cute_ops, "TMA_GATHER", setting)
    calls.clear()
    assert FFI_TARGET in _cuda_module(jax.value_and_grad(loss, argnums=(0, 2, 3)), *args)
    assert sorted(calls) == [(op, op in setting) for op in ops], calls
  for bad in ["dw1", ("dw1", "dh")]:
    monkeypatch.setattr(cute_ops, "TMA_GATHER", bad)
    with pytest.raises(ValueError, match=r"ffi.ops.TMA_GATHER must be a tuple of 'dw1' and "
                                         r"'dw2'; got "):
      _cuda_module(jax.grad(loss), *args)


@needs_cute
def test_cute_wgrad_dynamic_auto_takes_dw1_with_many_tiles_an_expert(monkeypatch):
  """WGRAD_DYNAMIC_ORDER "auto" (the default): dW1 in the dynamic order where an expert's
  output has WGRAD_DYNAMIC_MIN_TILES tiles of BLOCK_M x block_n (partial tiles counted), dW2
  never; a tuple names the ops itself; a bare name is refused."""
  cute_ops = importlib.import_module("ffi.ops")
  assert cute_ops.WGRAD_DYNAMIC_ORDER == "auto" and cute_ops.WGRAD_DYNAMIC_MIN_TILES == 128
  order = cute_ops._dynamic_order
  assert order("dw1", 2048, 2048, 256)           # olmoe: 16 x 8 tiles
  assert order("dw1", 4096, 2048, 256)           # 120B-n1024: 32 x 8
  assert not order("dw1", 1536, 2048, 256)       # 7B-n1024: 12 x 8
  assert not order("dw1", 4096, 512, 256)        # 30B-n256: 32 x 2
  assert order("dw1", 1920, 2056, 256)           # 15 x 9 with the partial tiles
  assert not order("dw2", 2048, 4096, 256)
  monkeypatch.setattr(cute_ops, "WGRAD_DYNAMIC_ORDER", ("dw2",))
  assert order("dw2", 256, 256, 256) and not order("dw1", 4096, 4096, 256)
  monkeypatch.setattr(cute_ops, "WGRAD_DYNAMIC_ORDER", "dw1")
  with pytest.raises(ValueError, match="got 'dw1'"):
    order("dw1", 2048, 2048, 256)


@needs_cute
@pytest.mark.parametrize("block_n,stages,transpose_out,dynamic,cluster_m,tma_gather", [
    (128, None, False, False, 1, False), (256, 2, True, False, 1, False),
    (256, None, False, False, 1, False), (256, None, False, True, 1, False),
    (128, 3, True, True, 1, False), (256, None, False, True, 2, False),
    (128, 3, True, False, 2, False), (256, None, False, True, 2, True),
    (128, 3, True, False, 1, True)])
def test_cute_persistent_weight_grad_compiles_for_cuda(block_n, stages, transpose_out, dynamic,
                                                       cluster_m, tma_gather):
  """The persistent weight-gradient kernel (its tile loop, ring and epilogue buffers) compiles
  for sm_90a at the tiles and depths the layer and the sweep run, in either tile order, alone
  or in clusters of 2, the rows by cp.async or TMA."""
  from ffi import persistent
  P, M, N, E, T = 512, 256, 512, 4, 300
  offsets = jnp.arange(E + 1, dtype=jnp.int32) * (P // E)
  fn = lambda x, r, i: persistent.weight_grad(x, r, offsets, E, i, block_n=block_n,
                                              stages=stages, transpose_out=transpose_out,
                                              dynamic=dynamic, cluster_m=cluster_m,
                                              tma_gather=tma_gather)
  shapes = [jax.ShapeDtypeStruct((T, M), jnp.bfloat16), jax.ShapeDtypeStruct((P, N), jnp.bfloat16),
            jax.ShapeDtypeStruct((P,), jnp.int32)]
  assert FFI_TARGET in _cuda_module(fn, *shapes)


@needs_cute
def test_persistent_cluster_tiles_pair_neighbouring_m_tiles_of_one_column_tile():
  """cluster_tile (on plain integers): the two CTAs of a cluster at each cluster tile take M
  tiles 2j and 2j + 1 of one expert and one column tile; over the cluster tiles, every tile
  once, in tile_work's order (expert, then M tile, then column tile); clusters of 1: the tile
  itself."""
  from ffi import persistent
  m_tiles, n_tiles, experts = 4, 3, 2
  units = m_tiles * n_tiles * experts // 2
  pairs = [[persistent.cluster_tile(u, r, m_tiles, n_tiles, 2) for r in (0, 1)]
           for u in range(units)]
  split = lambda t: (t // (m_tiles * n_tiles), t % (m_tiles * n_tiles) // n_tiles, t % n_tiles)
  for t0, t1 in pairs:
    (e0, m0, n0), (e1, m1, n1) = split(t0), split(t1)
    assert (e0, n0) == (e1, n1) and m0 % 2 == 0 and m1 == m0 + 1
  assert sorted(t for pair in pairs for t in pair) == list(range(2 * units))
  assert [pair[0] for pair in pairs] == sorted(pair[0] for pair in pairs)
  assert [persistent.cluster_tile(u, 0, m_tiles, n_tiles, 1) for u in range(5)] == list(range(5))


@needs_cute
@pytest.mark.parametrize("block_n,stages,transpose_rhs,cols", [
    (256, None, False, None), (256, 2, True, None), (128, None, False, (128, 384)),
    (256, None, True, (256, 512))])
def test_cute_persistent_matmul_compiles_for_cuda(block_n, stages, transpose_rhs, cols):
  """The persistent store GEMM compiles for sm_90a, both rhs layouts, whole and windowed."""
  from ffi import persistent
  P, K, N, E = 512, 256, 512, 4
  fn = lambda a, b, t: persistent.grouped_matmul(
      a, jnp.swapaxes(b, 1, 2) if transpose_rhs else b, t, transpose_rhs=transpose_rhs,
      block_n=block_n, stages=stages, cols=cols)
  shapes = [jax.ShapeDtypeStruct((P, K), jnp.bfloat16), jax.ShapeDtypeStruct((E, K, N), jnp.bfloat16),
            jax.ShapeDtypeStruct((P // 128,), jnp.int32)]
  assert FFI_TARGET in _cuda_module(fn, *shapes)


@needs_cute
def test_persistent_tiles_cover_each_output_tile_once_with_its_k_range():
  """The persistent CTAs' tile loop (tile_work, run here on plain integers): every output tile
  once; weight gradients expert by expert over the k steps that hold the expert's rows (none
  for an empty expert, the padding's whole steps skipped); store tiles M tile by M tile, their
  column tiles adjacent, the contraction's k steps where the M tile has an expert and none
  past the last group."""
  from ffi import persistent
  # groups of 256, 0, 640 and 128 rows holding 200, 0, 640 and 1: k steps 4, 0, 10 and 1
  group_rows = np.array([0, 200, 256, 256, 256, 896, 896, 897])
  seen = [persistent.tile_work("wgrad", t, group_rows, 3, 2, 0, 4) for t in range(3 * 2 * 4)]
  assert [(e, m, n) for m, n, _, _, _, e in seen] == [
      (e, m, n) for e in range(4) for m in range(3) for n in range(2)]
  for m, n, k_begin, num_k, rhs_l, e in seen:
    assert (k_begin, num_k, rhs_l) == (group_rows[2 * e] // 64, [4, 0, 10, 1][e], 0)
  tile_expert = np.array([0, 0, 1, 3, 3, 4])   # E = 4: the last M tile is past the groups
  seen = [persistent.tile_work("store", t, tile_expert, 6, 2, 10, 4) for t in range(12)]
  assert [(m, n) for m, n, *_ in seen] == [(m, n) for m in range(6) for n in range(2)]
  for m, n, k_begin, num_k, rhs_l, out_l in seen:
    has_expert = tile_expert[m] < 4
    assert (k_begin, num_k, out_l) == (0, 10 if has_expert else 0, 0)
    assert rhs_l == min(tile_expert[m], 3)


@needs_cute
def test_cute_persistent_weight_grad_refuses_what_it_cannot_take():
  from ffi import persistent
  x, rhs = jnp.zeros((300, 256), jnp.bfloat16), jnp.zeros((512, 512), jnp.bfloat16)
  offsets, index = jnp.arange(5, dtype=jnp.int32) * 128, jnp.zeros((512,), jnp.int32)
  with pytest.raises(ValueError, match=r"cute persistent weight_grad: stages=9 must be between 2 and \d+"):
    persistent.weight_grad(x, rhs, offsets, 4, index, stages=9)
  with pytest.raises(ValueError, match="rhs columns N=512 must be a multiple of block_n=384"):
    persistent.weight_grad(x, rhs, offsets, 4, index, block_n=384)
  with pytest.raises(ValueError, match="num_ctas must be a positive int; got 0"):
    persistent.weight_grad(x, rhs, offsets, 4, index, num_ctas=0)
  with pytest.raises(ValueError, match="cute persistent weight_grad: block_n=64 must be a multiple of 128"):
    persistent.weight_grad(x, rhs, offsets, 4, index, block_n=64)
  for bad in (3, True, 2.0):
    with pytest.raises(ValueError, match=rf"cluster_m={bad!r} must be one of \(1, 2\)"):
      persistent.weight_grad(x, rhs, offsets, 4, index, cluster_m=bad)
  with pytest.raises(ValueError, match="M=384 must be a multiple of cluster_m x BLOCK_M = 256"):
    persistent.weight_grad(jnp.zeros((300, 384), jnp.bfloat16), rhs, offsets, 4, index,
                           cluster_m=2)
  lhs, w, tiles = jnp.zeros((512, 256), jnp.bfloat16), jnp.zeros((4, 256, 512), jnp.bfloat16), \
      jnp.zeros((4,), jnp.int32)
  with pytest.raises(ValueError, match=r"cute persistent grouped_matmul: cols=\(0, 600\) must be"):
    persistent.grouped_matmul(lhs, w, tiles, cols=(0, 600))
  with pytest.raises(ValueError, match=r"cute persistent grouped_matmul: stages=1 must be"):
    persistent.grouped_matmul(lhs, w, tiles, stages=1)
  with pytest.raises(ValueError, match="cute persistent grouped_matmul: block_n=64 must be a multiple of 128"):
    persistent.grouped_matmul(lhs, w, tiles, block_n=64)


@pytest.mark.gpu
@needs_cute
@pytest.mark.parametrize("block_n,stages,transpose_out,num_ctas,dynamic,cluster_m,tma_gather", [
    (128, None, False, None, False, 1, False), (256, None, True, None, False, 1, False),
    (256, 2, False, 3, False, 1, False), (128, 3, True, 5, False, 1, False),
    (256, None, True, 1, False, 1, False), (256, None, False, None, True, 1, False),
    (256, 2, False, 3, True, 1, False), (128, 3, True, 5, True, 1, False),
    (256, None, True, 1, True, 1, False), (256, None, False, None, False, 2, False),
    (256, 2, True, 4, False, 2, False), (256, None, False, None, True, 2, False),
    (128, 3, True, 6, True, 2, False), (256, None, False, 3, True, 2, False),
    (256, 2, True, 1, True, 2, False), (128, None, False, None, False, 1, True),
    (256, 2, True, 3, False, 1, True), (256, None, False, None, True, 2, True),
    (128, 3, True, 6, True, 2, True), (256, 2, False, 1, False, 2, True)])
def test_cute_persistent_weight_grad_matches_grouped_on_gpu(block_n, stages, transpose_out,
                                                            num_ctas, dynamic, cluster_m,
                                                            tma_gather):
  """The persistent kernel gives grouped_gemm.weight_grad's bits, gathering X's rows (padding
  slots: index T): experts of 256, 0 (zeros), 640, 128 and 1152 rows, so that a CTA's tiles run
  2, 0, 10, 2 and 18 k steps and its ring of `stages` wraps within and across tiles; num_ctas
  3, 5 and 1 make each CTA loop over many tiles (the default grid: one tile or fewer each), in
  either tile order (dynamic: the CTAs ask a counter; twice in a row, so a second call's
  counter starts at 0 again), alone or in clusters of 2 (M = 512: two cluster rows of M
  tiles; num_ctas 3 and 1 rounded to one whole cluster), the rows copied by the producer's
  threads or (tma_gather) loaded by TMA, a box a row. The output is written over a freed
  buffer of NaN, so an element left unstored shows."""
  from ffi import grouped_gemm, persistent
  sizes = [256, 0, 640, 128, 1152]
  offsets = jnp.array(np.concatenate([[0], np.cumsum(sizes)]), jnp.int32)
  T, P, N, E = 1000, sum(sizes) + 128, 512, len(sizes)
  M = 384 if cluster_m == 1 else 512
  x = jax.random.normal(jax.random.key(71), (T, M)).astype(jnp.bfloat16)
  rhs = jax.random.normal(jax.random.key(72), (P, N)).astype(jnp.bfloat16)
  index = jax.random.randint(jax.random.key(73), (P,), 0, T).at[::5].set(T)
  kw = dict(block_n=block_n, transpose_out=transpose_out)
  jax.block_until_ready(jnp.full((E, M, N), jnp.nan, jnp.bfloat16)).delete()
  run = jax.jit(lambda a, b, o, i: persistent.weight_grad(
      a, b, o, E, i, stages=stages, num_ctas=num_ctas, dynamic=dynamic, cluster_m=cluster_m,
      tma_gather=tma_gather, **kw))
  got = run(x, rhs, offsets, index)
  want = jax.jit(lambda a, b, o, i: grouped_gemm.weight_grad(
      a, b, o, E, gather_index=i, **kw))(x, rhs, offsets, index)
  assert got.shape == want.shape == ((E, N, M) if transpose_out else (E, M, N))
  assert np.all(np.asarray(want[1], np.float32) == 0) and np.any(np.asarray(want, np.float32) != 0)
  np.testing.assert_array_equal(got, want)
  np.testing.assert_array_equal(run(x, rhs, offsets, index), want)


@pytest.mark.gpu
@needs_cute
@pytest.mark.parametrize("transpose_rhs,block_n,stages,cols,num_ctas", [
    (False, 256, None, None, None), (True, 256, None, None, 3), (False, 128, 2, (128, 384), 5),
    (True, 256, 3, (256, 512), 1), (True, 128, None, None, None)])
def test_cute_persistent_matmul_matches_grouped_on_gpu(transpose_rhs, block_n, stages, cols,
                                                       num_ctas):
  """The persistent store GEMM gives grouped_gemm.grouped_matmul's bits: experts 0, 1 and 3
  (2 skipped: no tiles), a tile past the last group (zeros), whole and windowed (cols), both
  rhs layouts; num_ctas 1, 3 and 5 make each CTA loop over many tiles (the default grid: one
  tile each). The contraction's 10 k steps wrap rings of 2-4 stages within and across tiles."""
  from ffi import grouped_gemm, persistent
  E, K, N = 4, 640, 512
  tile_expert = jnp.array([0, 0, 1, 3, 3, 3, E], jnp.int32)
  P = tile_expert.shape[0] * grouped_gemm.BLOCK_M
  lhs = jax.random.normal(jax.random.key(81), (P, K)).astype(jnp.bfloat16)
  rhs = (jax.random.normal(jax.random.key(82), (E, K, N)) / 16).astype(jnp.bfloat16)
  if transpose_rhs:
    rhs = jnp.swapaxes(rhs, 1, 2)
  kw = dict(transpose_rhs=transpose_rhs, block_n=block_n, cols=cols)
  got = jax.jit(lambda a, b, t: persistent.grouped_matmul(a, b, t, stages=stages,
                                                          num_ctas=num_ctas, **kw))(lhs, rhs, tile_expert)
  want = jax.jit(lambda a, b, t: grouped_gemm.grouped_matmul(a, b, t, **kw))(lhs, rhs, tile_expert)
  assert got.shape == want.shape == (P, N if cols is None else cols[1] - cols[0])
  assert np.all(np.asarray(want[-128:], np.float32) == 0) and np.any(np.asarray(want, np.float32) != 0)
  np.testing.assert_array_equal(got, want)


@pytest.mark.gpu
@needs_cute
def test_cute_layer_with_persistent_store_gemms_matches_grouped_on_gpu(monkeypatch):
  """The layer's output and gradients with STORE_WIDE_KERNEL "persistent" (down_proj and
  dx_tilde on it where their tiles are wide: d 2048, n 1024, and STORE_WIDE_MIN_K 1024 for
  down_proj's contraction; in the default two column windows) are bitwise the grouped
  kernel's."""
  cute_ops = importlib.import_module("ffi.ops")
  monkeypatch.setattr(cute_ops, "STORE_WIDE_MIN_K", 1024)
  args = make_inputs(75, 600, 2048, 1024, 8, jnp.bfloat16)
  def run(*a):
    out, pullback = jax.vjp(lambda *b: sm.moe(*b, k=2, backend="cute").out, *a)
    return out, pullback(jnp.ones_like(out))
  monkeypatch.setattr(cute_ops, "STORE_WIDE_KERNEL", "grouped")
  want = jax.jit(run)(*args)
  monkeypatch.setattr(cute_ops, "STORE_WIDE_KERNEL", "persistent")
  got = jax.jit(lambda *a: run(*a))(*args)
  for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
    np.testing.assert_array_equal(g, w)


@pytest.mark.gpu
@needs_cute
@pytest.mark.parametrize("cluster_m,dynamic_order,tma_gather", [
    (1, (), ()), (2, (), ()), (2, ("dw1", "dw2"), ()), (2, ("dw1",), ("dw1", "dw2"))])
def test_cute_layer_with_persistent_weight_grads_matches_grouped_on_gpu(cluster_m, dynamic_order,
                                                                        tma_gather, monkeypatch):
  """The layer's gradients with WGRAD_KERNEL "persistent" (dW1 and dW2 gathering their rows on
  it; alone or in clusters of 2, in either tile order, the rows by cp.async or TMA) are bitwise
  those with "grouped"."""
  cute_ops = importlib.import_module("ffi.ops")
  args = make_inputs(74, 1000, 512, 256, 16, jnp.bfloat16)
  monkeypatch.setattr(cute_ops, "WGRAD_CLUSTER_M", cluster_m)
  monkeypatch.setattr(cute_ops, "WGRAD_DYNAMIC_ORDER", dynamic_order)
  monkeypatch.setattr(cute_ops, "TMA_GATHER", tma_gather)
  monkeypatch.setattr(cute_ops, "WGRAD_KERNEL", "grouped")
  grad = jax.jit(jax.grad(lambda *a: jnp.sum(sm.moe(*a, k=4, backend="cute").out.astype(
      jnp.float32)), argnums=(2, 3)))
  want = grad(*args)
  monkeypatch.setattr(cute_ops, "WGRAD_KERNEL", "persistent")
  got = jax.jit(jax.grad(lambda *a: jnp.sum(sm.moe(*a, k=4, backend="cute").out.astype(
      jnp.float32)), argnums=(2, 3)))(*args)
  for g, w in zip(got, want):
    np.testing.assert_array_equal(g, w)


@pytest.mark.gpu
@needs_cute
@pytest.mark.parametrize("shape,dout_gather_max_column_tiles,dh_kernel,backend", [
    ((1000, 512, 256, 16, 4), 0, "registers", CUTE_GEMMS),
    ((4096, 1536, 256, 128, 8), 0, "registers", CUTE_GEMMS),
    ((1000, 512, 256, 16, 4), 2, "registers", CUTE_GEMMS),
    ((1000, 512, 1024, 16, 4), 8, "tma_store", CUTE_GEMMS),
    ((4096, 1536, 256, 128, 8), 2, "registers", "cute"),
    ((1000, 2048, 1024, 16, 4), 8, "registers", "cute"),
    ((512, 4096, 1024, 8, 2), 8, "registers", "cute")])
def test_cute_gemms_match_xla_on_gpu(shape, dout_gather_max_column_tiles, dh_kernel, backend,
                                     monkeypatch):
  """Every expert op on cute (dO's rows gathered by XLA, or by dh and dw2; dH's register or TMA
  stores; at d 2048 and 4096, n 1024 dx_tilde on the persistent wide store tiles and down_proj
  on the 192-row ping-pong ones), and backend "cute" for everything (its top-K too), against
  the xla backend: forward and all four gradients."""
  cute_ops = importlib.import_module("ffi.ops")
  monkeypatch.setattr(cute_ops, "DOUT_GATHER_MAX_COLUMN_TILES", dout_gather_max_column_tiles)
  monkeypatch.setattr(cute_ops, "DH_KERNEL", dh_kernel)
  T, d, n, E, K = shape
  args = make_inputs(3, T, d, n, E, jnp.bfloat16)
  cot = jax.random.normal(jax.random.key(4), (T, d))

  def grads(backend):
    f = lambda *a: jnp.sum(sm.moe(*a, k=K, backend=backend).out.astype(jnp.float32) * cot)
    return sm.moe(*args, k=K, backend=backend).out, jax.grad(f, argnums=(0, 1, 2, 3))(*args)
  out_c, g_c = grads(backend)
  out_x, g_x = grads("xla")
  assert rel_err(out_c, out_x) < 1e-2
  for a, b in zip(g_c, g_x):
    assert rel_err(a, b) < 1e-2


@needs_cute
def test_cache_key_follows_every_source_of_the_kernel_package(tmp_path, monkeypatch):
  """A kernel's cache entry is keyed on all of its package's sources: editing a helper module
  beside the kernel's own (as pingpong.py runs grouped_gemm.py's epilogue) gives a new key."""
  from ffi import compile_cache
  package = tmp_path / "kernels_pkg"
  package.mkdir()
  (package / "__init__.py").write_text("")
  (package / "helpers.py").write_text("SCALE = 1\n")
  (package / "kernel.py").write_text("def kernel():\n  pass\n")
  monkeypatch.syspath_prepend(str(tmp_path))
  kernel = importlib.import_module("kernels_pkg.kernel").kernel
  key = lambda: (compile_cache._package_digest.cache_clear(),
                 compile_cache.entry_key(kernel, ("spec",)))[1]
  before = key()
  assert key() == before
  (package / "helpers.py").write_text("SCALE = 2\n")
  assert key() != before


@needs_cute
def test_compiled_kernels_are_kept_on_disk(tmp_path, monkeypatch):
  """A kernel compiled while one program is traced is written to the cache directory; a new
  process (here: the registry of targets emptied) reads it back instead of compiling (CuTe
  DSL's compile is made to fail, and with an empty directory that failure does show); a damaged
  entry is compiled again and rewritten."""
  import cutlass.cute as cute
  from ffi import compile_cache, grouped_gemm, xla_call
  shapes = [jax.ShapeDtypeStruct((256, 128), jnp.bfloat16),
            jax.ShapeDtypeStruct((2, 128, 256), jnp.bfloat16), jax.ShapeDtypeStruct((2,), jnp.int32)]
  fn = lambda a, b, t: grouped_gemm.grouped_matmul(a, b, t, stages=3)
  real_compile = cute.compile

  def no_compile(*args, **kwargs):
    raise RuntimeError("compiled again")

  def lowered():   # in a fresh "process": no target registered yet
    monkeypatch.setattr(xla_call, "_registered", {})
    text = _cuda_module(lambda *a: fn(*a), *shapes)
    return re.sub(r"\s*loc\(#loc\d*\)", "", "\n".join(
        line for line in text.splitlines() if not line.startswith("#loc")))

  monkeypatch.setattr(xla_call.jax_tvm_ffi, "register_ffi_target", lambda *a, **k: None)
  monkeypatch.setattr(compile_cache, "_directory", tmp_path)
  first = lowered()
  entries = list(tmp_path.glob("*.o"))
  assert len(entries) == 1 and len(list(tmp_path.glob("*.sha256"))) == 1
  monkeypatch.setattr(cute, "compile", no_compile)
  assert lowered() == first
  compile_cache.install(tmp_path / "empty")
  with pytest.raises(RuntimeError, match="compiled again"):
    lowered()
  compile_cache.install(tmp_path)
  entries[0].write_bytes(entries[0].read_bytes()[:-7])   # damaged: compiled and rewritten
  with pytest.raises(RuntimeError, match="compiled again"):
    lowered()
  monkeypatch.setattr(cute, "compile", real_compile)
  assert lowered() == first
  key = entries[0].name[:-2]
  assert compile_cache.load(tmp_path, key) is not None


def test_cache_directory_follows_the_environment(monkeypatch, tmp_path):
  from ffi import compile_cache
  monkeypatch.setattr(compile_cache, "_directory", compile_cache._UNSET)
  monkeypatch.setenv(compile_cache.ENV_VAR, str(tmp_path))
  assert compile_cache.directory() == tmp_path
  monkeypatch.setenv(compile_cache.ENV_VAR, "")
  assert compile_cache.directory() is None
  monkeypatch.delenv(compile_cache.ENV_VAR)
  assert compile_cache.directory().parts[-2:] == ("sonicmoe_jax", "cute")
  assert compile_cache.install(None) is None and compile_cache.directory() is None


@needs_cute
def test_vmapped_layer_with_cute_ops_lowers_for_cuda():
  """jax.vmap of the layer (over, say, ensemble members) with every CuTe op: it exports for
  CUDA, the FFI calls inside loops over the batch (identical loop bodies may be shared, so the
  calls are not counted)."""
  T, d, n, E, K = 256, 256, 128, 8, 2
  args = make_inputs(0, T, d, n, E, jnp.bfloat16)
  stacked = [jnp.stack([a, a]) for a in args]

  def loss(*a):
    return jnp.sum(sm.moe(*a, k=K, backend=CUTE_GEMMS).out.astype(jnp.float32))

  text = _cuda_module(jax.vmap(jax.grad(loss, argnums=(0, 2, 3))), *stacked)
  assert FFI_TARGET in text and "stablehlo.while" in text


@pytest.mark.gpu
@needs_cute
def test_vmapped_layer_with_cute_ops_matches_each_element_on_gpu():
  T, d, n, E, K = 512, 256, 128, 8, 2
  per_element = [make_inputs(s, T, d, n, E, jnp.bfloat16) for s in (5, 6)]
  stacked = [jnp.stack(parts) for parts in zip(*per_element)]
  layer = lambda *a: sm.moe(*a, k=K, backend=CUTE_GEMMS).out
  got = jax.jit(jax.vmap(layer))(*stacked)
  for i, args in enumerate(per_element):   # (the router's matmul is batched: not bitwise)
    assert rel_err(got[i], jax.jit(layer)(*args)) < 1e-2


@pytest.mark.gpu
@needs_cute
def test_exported_program_with_cute_ops_runs_on_gpu():
  """jax.export of a program calling CuTe kernels: serialized, read back and run in a process
  where its FFI targets are registered, it gives the jitted program's result."""
  from ffi import xla_call
  T, d, n, E, K = 512, 256, 128, 8, 2
  args = make_inputs(3, T, d, n, E, jnp.bfloat16)
  layer = jax.jit(lambda *a: sm.moe(*a, k=K, backend=CUTE_GEMMS).out)
  expected = layer(*args)   # traced: its kernels' targets are registered
  exported = jax.export.export(layer, disabled_checks=xla_call.safety_checks())(*args)
  again = jax.export.deserialize(exported.serialize())
  assert xla_call.TARGET_PREFIX in again.mlir_module()
  np.testing.assert_array_equal(again.call(*args), expected)


@needs_cute
def test_exported_program_finds_its_kernels_in_the_disk_cache(tmp_path, monkeypatch):
  """register_from_cache registers the targets an exported program calls from the cache the
  exporting process wrote (here: the registry emptied, as in a new process); a target whose
  kernel is missing is named in a LookupError."""
  from ffi import compile_cache, xla_call
  registered = []
  monkeypatch.setattr(xla_call.jax_tvm_ffi, "register_ffi_target",
                      lambda name, *a, **k: registered.append(name))
  monkeypatch.setattr(compile_cache, "_directory", tmp_path)
  monkeypatch.setattr(xla_call, "_registered", {})
  T, d, n, E, K = 256, 256, 128, 8, 2
  args = [jax.ShapeDtypeStruct(a.shape, a.dtype) for a in make_inputs(0, T, d, n, E, jnp.bfloat16)]
  layer = jax.jit(lambda *a: sm.moe(*a, k=K, backend=CUTE_GEMMS).out)
  layer.trace(*args)
  exported = jax.export.export(layer, platforms=("cuda",),
                               disabled_checks=xla_call.safety_checks())(*args)
  targets = sorted(xla_call.targets())
  assert len(targets) >= 3   # up_proj, down_proj, aggregate
  monkeypatch.setattr(xla_call, "_registered", {})
  registered.clear()
  assert xla_call.register_from_cache(exported) == targets
  assert sorted(registered) == targets and sorted(xla_call.targets()) == targets
  monkeypatch.setattr(xla_call, "_registered", {})
  for entry in tmp_path.glob("*.o"):
    entry.unlink()
  with pytest.raises(LookupError, match=f"FFI target {targets[0]} is not in the disk cache"):
    xla_call.register_from_cache(exported)


_RUN_CHAINED_KERNELS = """
import sys
import numpy as np, jax, jax.numpy as jnp
import ffi
from ffi import grouped_gemm
P, K, E = 512, 256, 4
a = jax.random.normal(jax.random.key(0), (P, K)).astype(jnp.bfloat16)
w = (jax.random.normal(jax.random.key(1), (E, K, K)) / 16).astype(jnp.bfloat16)
tiles = jnp.array([0, 1, 1, 3], jnp.int32)

def chain(a, w, tiles):   # cute kernel, an XLA fusion, cute kernel, fusion, cute kernel
  for _ in range(3):
    a = jnp.tanh(grouped_gemm.grouped_matmul(a, w, tiles).astype(jnp.float32)).astype(a.dtype)
  return a

np.save(sys.argv[1], np.asarray(jax.jit(chain)(a, w, tiles).astype(jnp.float32)))
"""


def _custom_calls_in_command_buffers(dump_dir, module="jit_chain"):
  """(inside, outside): the custom-call thunks of `module` inside a top-level command buffer
  (a CUDA graph) and outside one, read from XLA's thunk-sequence dump. Since XLA forms command
  buffers on thunks, after HLO, the HLO text no longer shows them; the dump does. Each thunk
  line reads '<indent><index>: <kind> ...', a command buffer's thunks indented under it."""
  import pathlib
  files = sorted(pathlib.Path(dump_dir).glob(f"*{module}*thunk_sequence_after_thunk_passes*.txt"))
  if not files:   # the passes changed nothing (no command buffer formed): the plain dump
    files = sorted(pathlib.Path(dump_dir).glob(f"*{module}*thunk_sequence*.txt"))
  assert files, f"no thunk-sequence dump for {module} in {dump_dir}"
  inside = outside = 0
  in_command_buffer = False
  for line in files[-1].read_text().splitlines():
    thunk = line.lstrip()
    index, sep, rest = thunk.partition(": ")
    if not sep or not index.isdigit():
      continue
    if thunk == line:   # top level
      in_command_buffer = rest.startswith("kCommandBuffer")
    if rest.startswith("kCustomCall"):
      if in_command_buffer:
        inside += 1
      else:
        outside += 1
  return inside, outside


@pytest.mark.gpu
@needs_cute
def test_cute_kernels_run_inside_cuda_graphs_on_gpu(tmp_path):
  """With XLA's command buffers (CUDA graphs) on for custom calls, the three cute kernels of a
  chain (kernel, fusion, kernel, ...) are captured into a command buffer, read from XLA's
  thunk-sequence dump, and give the same bits as without graphs (each run in its own process:
  XLA_FLAGS are read once)."""
  import os
  import subprocess
  results = {}
  for mode, flags in [("off", "--xla_gpu_enable_command_buffer="),
                      ("on", "--xla_gpu_enable_command_buffer=FUSION,CUSTOM_CALL "
                             "--xla_gpu_graph_min_graph_size=1")]:
    dump = tmp_path / f"dump_{mode}"
    env = dict(os.environ, XLA_FLAGS=f"{flags} --xla_dump_to={dump}",
               XLA_PYTHON_CLIENT_PREALLOCATE="false")
    run = subprocess.run([sys.executable, "-c", _RUN_CHAINED_KERNELS, str(tmp_path / mode)],
                         env=env, capture_output=True, text=True, timeout=300,
                         cwd=str(__import__("pathlib").Path(__file__).parent.parent))
    assert run.returncode == 0, run.stderr[-3000:]
    results[mode] = (_custom_calls_in_command_buffers(dump), np.load(tmp_path / f"{mode}.npy"))
  assert results["off"][0] == (0, 3), results["off"][0]
  assert results["on"][0] == (3, 0), results["on"][0]
  np.testing.assert_array_equal(results["on"][1], results["off"][1])


def test_thunk_dump_reader_counts_custom_calls_in_and_out_of_command_buffers(tmp_path):
  """The dump reader behind the CUDA-graph test, on a hand-written dump: custom calls nested
  under a top-level kCommandBuffer count as inside, top-level ones as outside."""
  (tmp_path / "module_0001.jit_chain.thunk_sequence_after_thunk_passes.txt").write_text(
      "000: kCommandBuffer\n"
      "  000: kCustomCall\n"
      "  001: kKernel\n"
      "  002: kCustomCall\n"
      "001: kCustomCall\n"
      "002: kKernel\n"
      "  body:\n")
  (tmp_path / "module_0002.jit_other.thunk_sequence_after_thunk_passes.txt").write_text(
      "000: kCustomCall\n")
  assert _custom_calls_in_command_buffers(tmp_path) == (2, 1)
  (tmp_path / "module_0003.jit_plain.thunk_sequence.txt").write_text(
      "000: kCustomCall\n001: kKernel\n")
  assert _custom_calls_in_command_buffers(tmp_path, "jit_plain") == (0, 1)


_RUN_EXPORTED = """
import sys
import numpy as np, jax
import ffi
from ffi import xla_call
exported = jax.export.deserialize(open(sys.argv[1], 'rb').read())
xla_call.register_from_cache(exported)
inputs = np.load(sys.argv[2])   # float32 copies, cast back to the exported input dtypes
out = exported.call(*[jax.numpy.asarray(inputs[f'a{i}']).astype(aval.dtype)
                      for i, aval in enumerate(exported.in_avals)])
np.save(sys.argv[3], np.asarray(out.astype(jax.numpy.float32)))
"""


@pytest.mark.gpu
@needs_cute
def test_exported_program_runs_in_a_new_process_on_gpu(tmp_path, monkeypatch):
  """A program with every cute op, exported and run by another process that never traced it:
  the kernels come from the disk cache; the output equals the exporting process's."""
  import subprocess
  from ffi import compile_cache, xla_call
  monkeypatch.setattr(compile_cache, "_directory", tmp_path / "cache")
  # shapes no other test uses: its kernels are compiled (into this cache) here, not already
  # registered by an earlier test
  T, d, n, E, K = 384, 384, 128, 16, 2
  args = make_inputs(4, T, d, n, E, jnp.bfloat16)
  layer = jax.jit(lambda *a: sm.moe(*a, k=K, backend=CUTE_GEMMS).out)
  expected = layer(*args)
  exported = jax.export.export(layer, disabled_checks=xla_call.safety_checks())(*args)
  (tmp_path / "layer.bin").write_bytes(exported.serialize())
  np.savez(tmp_path / "inputs.npz", **{f"a{i}": np.asarray(a, np.float32) for i, a in enumerate(args)})
  env = dict(__import__("os").environ, SONICMOE_CUTE_CACHE=str(tmp_path / "cache"),
             XLA_PYTHON_CLIENT_PREALLOCATE="false")   # this process holds most of the GPU
  subprocess.run([sys.executable, "-c", _RUN_EXPORTED, str(tmp_path / "layer.bin"),
                  str(tmp_path / "inputs.npz"), str(tmp_path / "out.npy")], check=True, env=env,
                 cwd=str(__import__("pathlib").Path(__file__).parent.parent), timeout=300)
  # not bitwise: the new process compiles the XLA parts (router logits, its GEMM algorithms)
  # itself and may pick other algorithms (H200 session 8: 8 of 147,456 outputs 1 bf16 ulp off)
  np.testing.assert_allclose(np.load(tmp_path / "out.npy"), np.asarray(expected, np.float32),
                             rtol=1e-2, atol=1e-3)


@needs_cute
def test_kernel_resources_keep_the_tiles_ffi_ops_relies_on():
  """From the sm_90a cubins: the store GEMMs' tile (block_n 128, 3 stages) fits two CTAs per SM
  (what ffi/ops.py's STORE_STAGES is for), and the dH kernel at block_n 128 does not spill in
  at most 128 registers (the other kernels' spills: KERNEL_SPILLS)."""
  from benchmarks import kernel_resources as kr
  from ffi import mainloop
  store, dh = kr.measure_many([("matmul", 128, 3), ("dh", 128, 0)])
  assert kr.ctas_per_sm(store["registers"], kr.smem_bytes("matmul", 128, 3), mainloop.THREADS) == 2
  assert dh["stack_bytes"] == 0 and 0 < dh["registers"] <= 128


# (kernel_resources variant, block_n, the stack frame in bytes it may have): the ping-pong
# kernels at the tiles ffi/ops.py runs them with (dH 128, reading or gathering dO; up_proj 64;
# the store GEMMs 128, and 192 with TMA stores: 192 accumulator registers, as their 192-row
# tiles at 128) and the defaults
# (ffi/ops.py's choices) at their tiles. The ping-pong dH gathering dO with its SMEM epilogue
# (the default where d <= 1536) has spilled 40 bytes (10 registers of its MMA warpgroups: at
# the (56, 224) register split 80, at (24, 240) 8) since the SwiGLU sigmoid moved to
# ex2/rcp.approx (session 24), which made it faster all the same (and (24, 240) ran slower on
# the H200, session 31); more than that is a regression. The others may not spill.
KERNEL_SPILLS = [("dh_pingpong", 128, 0), ("dh_pingpong_gather", 128, 0),
                 ("up_proj_pingpong", 64, 0), ("matmul_pingpong", 128, 0),
                 ("matmul_pingpong_tma", 128, 0), ("matmul_pingpong_tma", 192, 0),
                 ("matmul_pingpong_tma_rows192", 128, 0),
                 ("up_proj_gather", 128, 0), ("dh_gather_tma_h_smem", 256, 0),
                 ("dh_pingpong_gather_tma", 128, 40), ("wgrad_persistent_gather", 256, 0),
                 ("wgrad_persistent_gather_cluster_tmarows", 256, 0),
                 ("wgrad_persistent_gather_dynamic_cluster_tmarows", 256, 0),
                 ("matmul_persistent", 256, 0)]


@needs_cute
def test_kernels_spill_no_more_than_recorded():
  """A new spill shows in the cubin's stack frame before it shows on a GPU (all of
  KERNEL_SPILLS compiled in one process: one import of JAX and CuTe DSL, not one each)."""
  from benchmarks import kernel_resources as kr
  found = kr.measure_many([(kernel, block_n, 0) for kernel, block_n, _ in KERNEL_SPILLS])
  over = [(kernel, block_n, got["stack_bytes"], max_stack)
          for (kernel, block_n, max_stack), got in zip(KERNEL_SPILLS, found)
          if got["stack_bytes"] > max_stack]
  assert not over, f"(kernel, block_n, stack bytes, recorded most): {over}"
  assert all(got["registers"] > 0 for got in found)


@needs_cute
def test_ffi_call_rejects_bad_modes_and_dtypes():
  from ffi import grouped_gemm, xla_call
  x = jax.ShapeDtypeStruct((128, 64), jnp.bfloat16)
  with pytest.raises(ValueError, match="CuTe FFI call: 1 modes for 3 operands"):
    xla_call.call(grouped_gemm._matmul, [x, x], [x], modes=[None])
  with pytest.raises(TypeError, match="unsupported operand dtype int8"):
    xla_call._fake(jax.ShapeDtypeStruct((4,), jnp.int8))


# (pingpong_tma_192: 192-wide tiles, the last one of a window clipped where 192 does not
# divide its columns)
WINDOW_KERNELS = ["pingpong_tma", "pingpong_tma_192", "pingpong", "grouped", "grouped_ws"]


def _windowed_matmul(kernel, transpose_rhs, cols):
  """The store GEMM `kernel` (ffi.ops' variants) as fn(lhs, rhs, tile_expert), cols a window."""
  from ffi import grouped_gemm, pingpong
  if kernel.startswith("pingpong"):
    return lambda a, b, t: pingpong.grouped_matmul(
        a, b, t, transpose_rhs=transpose_rhs, tma_store=kernel.startswith("pingpong_tma"),
        block_n=192 if kernel.endswith("192") else 128, cols=cols)
  return lambda a, b, t: grouped_gemm.grouped_matmul(
      a, b, t, transpose_rhs=transpose_rhs, block_n=256 if kernel == "grouped_ws" else 128,
      warp_specialized=kernel == "grouped_ws", cols=cols)


@needs_cute
@pytest.mark.parametrize("kernel", WINDOW_KERNELS)
def test_cute_windowed_store_matmuls_compile_for_cuda(kernel):
  """down_proj's and dx_tilde's kernels on a window of columns (the layer's `windows`): they
  compile for sm_90a reading rhs from the window's first column (a view in the kernel: XLA may
  pass a slice at an offset off its 16-byte alignment, which the call refuses); out has the
  window's columns; a window starting off 16 bytes or not a multiple of the tile is refused."""
  P, K, N, E = 1024, 256, 1024, 4
  shapes = [jax.ShapeDtypeStruct((P, K), jnp.bfloat16),
            jax.ShapeDtypeStruct((E, N, K), jnp.bfloat16),
            jax.ShapeDtypeStruct((P // 128,), jnp.int32)]
  fn = _windowed_matmul(kernel, True, (256, 768))
  module = _cuda_module(fn, *shapes)
  assert FFI_TARGET in module and "slice" not in module
  assert jax.eval_shape(fn, *shapes).shape == (P, 512)
  with pytest.raises(ValueError, match="starting at a multiple of 8"):
    jax.eval_shape(_windowed_matmul(kernel, True, (100, 612)), *shapes)
  with pytest.raises(ValueError, match="N=200 must be a multiple of (block_n=|64)"):
    jax.eval_shape(_windowed_matmul(kernel, True, (0, 200)), *shapes)


@needs_cute
@pytest.mark.parametrize("d,n,windows", [(256, 128, 2), (256, 256, 1)])
def test_cute_store_gemms_window_the_layer_by_default_where_d_is_at_least_2n(d, n, windows):
  """backend "cute" resolves to two column windows by default where d >= 2n (moe's
  windows=None)."""
  assert sm.backends.resolve("cute", dtype=jnp.bfloat16, d=d, n=n).windows == windows


@needs_cute
def test_cute_layer_with_windows_compiles_and_lowers_for_cuda():
  """The layer with windows on backend "cute" (its store GEMMs on column windows, each summed
  by gather_sum): forward and backward export for CUDA, one barrier per pass between them."""
  T, d, n, E, K = 256, 256, 128, 32, 4
  args = make_inputs(0, T, d, n, E, jnp.bfloat16)
  loss = lambda *a: jnp.sum(sm.moe(*a, k=K, backend="cute", windows=2).out.astype(jnp.float32))
  module = _cuda_module(jax.grad(loss, argnums=(0, 2, 3)), *args)
  assert module.count("optimization_barrier") >= 2 and FFI_TARGET in module


@pytest.mark.gpu
@needs_cute
@pytest.mark.parametrize("kernel", WINDOW_KERNELS)
@pytest.mark.parametrize("transpose_rhs", [True, False])
@pytest.mark.parametrize("cols", [(0, 256), (256, 768), (768, 1024), (136, 392)])
def test_cute_windowed_store_matmuls_give_the_windows_columns_on_gpu(kernel, transpose_rhs,
                                                                      cols):
  """A window of the product is the whole product's columns bit for bit (rhs read from the
  window's first column, on a tile boundary or not; tiles past the groups: zeros)."""
  E, K, N = 5, 384, 1024
  num_tiles = 20
  tile_expert = jnp.sort(jax.random.randint(jax.random.key(91), (num_tiles,), 0, E + 1))
  P = num_tiles * 128
  lhs = jax.random.normal(jax.random.key(92), (P, K)).astype(jnp.bfloat16)
  shape = (E, N, K) if transpose_rhs else (E, K, N)
  rhs = (jax.random.normal(jax.random.key(93), shape) / 8).astype(jnp.bfloat16)
  tile_expert = tile_expert.astype(jnp.int32)
  whole = jax.jit(_windowed_matmul(kernel, transpose_rhs, None))(lhs, rhs, tile_expert)
  window = jax.jit(_windowed_matmul(kernel, transpose_rhs, cols))(lhs, rhs, tile_expert)
  np.testing.assert_array_equal(window, whole[:, cols[0]:cols[1]])


@pytest.mark.gpu
@needs_cute
@pytest.mark.parametrize("windows", [2, 3, (1, 2)])
def test_layer_with_windows_matches_without_on_gpu(windows):
  """The default backend's layer with windows (a pair: the forward's and the backward's):
  forward and gradients as without (the same kernels on column windows: each output column
  summed as without)."""
  T, d, n, E, K = 2048, 1024, 256, 32, 8
  args = make_inputs(7, T, d, n, E, jnp.bfloat16)
  cot = jax.random.normal(jax.random.key(8), (T, d))

  def run(w):
    f = lambda *a: jnp.sum(sm.moe(*a, k=K, windows=w).out.astype(jnp.float32) * cot)
    return jax.jit(lambda *a: sm.moe(*a, k=K, windows=w).out)(*args), \
        jax.jit(jax.grad(f, argnums=(0, 1, 2, 3)))(*args)
  (out_1, g_1), (out_w, g_w) = run(1), run(windows)
  assert rel_err(out_w, out_1) < 1e-2
  for name, a, b in zip(("dx", "drouter_w", "dw1", "dw2"), g_w, g_1):
    assert rel_err(a, b) < 1e-2, name


@pytest.mark.gpu
@needs_cute
def test_windows_lower_the_steps_peak_memory_on_gpu():
  """The layer's forward+backward with two windows on the default backend (cute's store
  GEMMs): XLA's temporaries at their peak shrink by at least a quarter of the [T K, d] product
  (half of it less the first window's [T, d / 2] sums, a 32nd of it at K = 16). Only where the
  stores run on cute (backends.default_windows): on the pallas backend the windows did not
  lower the peak (H200, session 38: 227,185,944 bytes with one window, 227,186,200 with two);
  its backward also gathers dO (for dH and dW2) and X (for dW1) into [T K, d] copies by XLA,
  which the windows do not touch."""
  T, d, n, E, K = 2048, 1024, 256, 32, 16
  x, router_w, w1, w2 = make_inputs(7, T, d, n, E, jnp.bfloat16)
  dout = jax.random.normal(jax.random.key(8), (T, d), jnp.bfloat16)

  def temp_bytes(windows):
    def step(x, router_w, w1, w2, dout):
      out, pullback = jax.vjp(lambda *a: sm.moe(*a, k=K, windows=windows).out,
                              x, router_w, w1, w2)
      out, dout = jax.lax.optimization_barrier((out, dout))   # the backward after the forward
      return pullback(dout)
    compiled = jax.jit(step).lower(x, router_w, w1, w2, dout).compile()
    return compiled.memory_analysis().temp_size_in_bytes

  product = T * K * d * 2
  whole, halves = temp_bytes(1), temp_bytes(2)
  assert halves < whole - product // 4, (whole, halves)
