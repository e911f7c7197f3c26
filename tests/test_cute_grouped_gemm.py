"""ffi/grouped_gemm.py's kernels (the varlen-M grouped GEMMs, up_proj, dh and the varlen-K
weight gradients on one cooperative kernel) and the pieces every kernel shares (mainloop.py,
row_gather.py, epilogue.py): they compile for sm_90a, refuse what they cannot take, and match
float32 references and their pre-gathered forms on the GPU."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import PaddingSteps, rel_err
from cute_helpers import BIG_D, BIG_ROWS, FFI_TARGET, cuda_module, needs_cute


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
  # H loaded and the outputs stored by TMA: coordinates a dimension each, no element offsets
  out = jax.eval_shape(lambda *a: grouped_gemm.dh(*a, block_n=128, tma_store=True, h_smem=True),
                       *shapes)
  assert out[0].shape == (P, 2 * n)


@pytest.mark.gpu
@needs_cute
def test_cute_dh_past_2_31_elements_on_gpu():
  """dH on its TMA path (H loaded and every output stored by TMA) with H past 2^31 elements:
  the last rows, past where a 32-bit element offset wraps, equal the same kernel's on those
  rows alone (dH, A' and the dS parts)."""
  from ffi import grouped_gemm
  d = n = 256
  P = 2**31 // (2 * n) + 2 * grouped_gemm.BLOCK_M
  tail = 2 * grouped_gemm.BLOCK_M
  dout = jax.random.normal(jax.random.key(48), (P, d), jnp.bfloat16)
  w2 = (jax.random.normal(jax.random.key(49), (1, n, d)) / 16).astype(jnp.bfloat16)
  h = jax.random.normal(jax.random.key(50), (P, 2 * n), jnp.bfloat16)
  scores = jax.random.uniform(jax.random.key(51), (P,), jnp.float32)
  run = jax.jit(lambda g, w, hh, s: grouped_gemm.dh(
      g, w, hh, s, jnp.zeros((g.shape[0] // grouped_gemm.BLOCK_M,), jnp.int32), block_n=256,
      tma_store=True, h_smem=True))
  dh_, a_scaled, ds_parts = run(dout, w2, h, scores)
  want = run(dout[-tail:], w2, h[-tail:], scores[-tail:])
  np.testing.assert_array_equal(dh_[-tail:], want[0])
  np.testing.assert_array_equal(a_scaled[-tail:], want[1])
  np.testing.assert_array_equal(ds_parts[:, -tail:], want[2])


@needs_cute
@pytest.mark.parametrize("kernel,block_n,stages", [
    ("matmul", 256, None), ("matmul_t", 256, 2), ("up_proj", 64, 3), ("dh", 128, None),
    ("dh", 256, None), ("dh_tma", 64, 3), ("dh_gather", 128, None),
    ("weight_grad", 128, 3), ("weight_grad_gather", 128, None), ("weight_grad_gather", 256, 2),
    ("weight_grad_t", 256, None), ("weight_grad_gather_t", 128, 3), ("up_proj_gather", 128, None),
    ("dh_gather", 256, None), ("weight_grad_gather_t", 256, None), ("matmul_ws", 256, None),
    ("up_proj_ws", 128, None), ("dh_ws", 256, None), ("weight_grad_ws", 256, 4),
    ("dh_h_smem", 256, None), ("dh_gather_h_smem", 128, None), ("dh_tma_h_smem", 256, None),
    ("weight_grad_gather+tma", 256, 2), ("matmul_gather", 128, None), ("matmul_t_gather", 256, 3),
    ("weight_grad_gather_t+tma", 128, 3), ("matmul+band", 128, None),
    ("up_proj_gather+band", 128, None), ("dh_tma_h_smem+band", 128, None),
    ("weight_grad+band", 128, None), ("weight_grad_gather+band", 128, None)])
def test_cute_gemm_variants_compile_for_cuda(kernel, block_n, stages):
  """The tile widths and pipeline depths the sweep tries compile for sm_90a; "+tma": the
  gathered rows loaded by TMA (tma_gather); "+band": the tiles in bands of 3 M tiles."""
  from ffi import grouped_gemm
  P, K, N, E = 512, 256, 512, 4
  kw = dict(block_n=block_n, stages=stages)
  if kernel.endswith("+band"):
    kernel, kw = kernel.removesuffix("+band"), dict(kw, band_m_tiles=3)
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
        "matmul_gather": lambda a, b, t: grouped_gemm.grouped_matmul(  # lhs = a's first 300 rows
            a[:300], b, t, gather_index=jnp.arange(P, dtype=jnp.int32) % 301, **kw),
        "matmul_t_gather": lambda a, b, t: grouped_gemm.grouped_matmul(
            a[:300], jnp.swapaxes(b, 1, 2), t, transpose_rhs=True,
            gather_index=jnp.arange(P, dtype=jnp.int32) % 301, **kw),
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
  assert FFI_TARGET in cuda_module(fn, *shapes)


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
  with pytest.raises(ValueError, match="output columns N=96 must be a multiple of 64"):
    grouped_gemm.grouped_matmul(jnp.zeros((256, 64), jnp.bfloat16), jnp.zeros((2, 64, 96), jnp.bfloat16), tiles)
  with pytest.raises(ValueError, match=r"cute up_proj: output columns N=96 must be a multiple of 64"):
    grouped_gemm.up_proj(jnp.zeros((256, 64), jnp.bfloat16), jnp.zeros((2, 64, 192), jnp.bfloat16), tiles)
  with pytest.raises(ValueError, match=r"cute up_proj: block_n=256 is wider than 128 \(its gate"):
    grouped_gemm.up_proj(jnp.zeros((256, 64), jnp.bfloat16), jnp.zeros((2, 64, 512), jnp.bfloat16),
                         tiles, block_n=256)
  ok = (jnp.zeros((256, 64), jnp.bfloat16), jnp.zeros((2, 64, 128), jnp.bfloat16), tiles)
  with pytest.raises(ValueError, match=r"stages=9 must be between 2 and \d+"):
    grouped_gemm.grouped_matmul(*ok, stages=9)
  dout, w2 = jnp.zeros((256, 128), jnp.bfloat16), jnp.zeros((2, 96, 128), jnp.bfloat16)
  with pytest.raises(ValueError, match="cute dh: output columns N=96 must be a multiple of block_n=64"):
    grouped_gemm.dh(dout, w2, jnp.zeros((256, 192), jnp.bfloat16), jnp.zeros((256,)), tiles)
  # (H loaded and the outputs stored by TMA, a last column tile past n is clipped; without,
  # block_n must divide n)
  w2_192 = jnp.zeros((2, 192, 128), jnp.bfloat16)
  with pytest.raises(ValueError, match="cute dh: output columns N=192 must be a multiple of block_n=128"):
    grouped_gemm.dh(dout, w2_192, jnp.zeros((256, 384), jnp.bfloat16), jnp.zeros((256,)), tiles,
                    block_n=128, tma_store=True)
  w2_wide = jnp.zeros((2, 320, 128), jnp.bfloat16)
  with pytest.raises(ValueError, match="cute dh: block_n=320 is wider than 256"):
    grouped_gemm.dh(dout, w2_wide, jnp.zeros((256, 640), jnp.bfloat16), jnp.zeros((256,)), tiles,
                    block_n=320)
  with pytest.raises(ValueError, match="cute weight_grad: lhs columns M=96 must be a multiple of 64"):
    grouped_gemm.weight_grad(jnp.zeros((256, 96), jnp.bfloat16), jnp.zeros((256, 128), jnp.bfloat16),
                             jnp.zeros((3,), jnp.int32), 2)
  # (rows gathered by cp.async: whole tiles only)
  with pytest.raises(ValueError, match="cute weight_grad: lhs columns M=192 must be a multiple of 128"):
    grouped_gemm.weight_grad(jnp.zeros((300, 192), jnp.bfloat16), jnp.zeros((256, 128), jnp.bfloat16),
                             jnp.zeros((3,), jnp.int32), 2, gather_index=jnp.zeros((256,), jnp.int32))
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
  assert FFI_TARGET in cuda_module(fn, *shapes)
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
@pytest.mark.parametrize("block_n,transpose_rhs,d", [(128, True, 512), (256, False, 1024),
                                                     (64, True, 1024)])
def test_cute_grouped_matmul_with_gather_matches_pregathered_on_gpu(block_n, transpose_rhs, d):
  """The plain grouped matmul gathering its rows in the kernel (padding slots: index T, zero
  rows; a tile past the last group) gives the bitwise same product as on rows gathered by XLA
  first, rhs read N- or K-major."""
  from ffi import grouped_gemm
  T, N, E = 1000, 384, 4
  tile_expert = jnp.array([0, 0, 1, 3, 3, E], jnp.int32)
  P = tile_expert.shape[0] * grouped_gemm.BLOCK_M
  x = jax.random.normal(jax.random.key(17), (T, d)).astype(jnp.bfloat16)
  w = (jax.random.normal(jax.random.key(18), (E, N, d) if transpose_rhs else (E, d, N)) / 8
       ).astype(jnp.bfloat16)
  index = jax.random.randint(jax.random.key(19), (P,), 0, T).at[::7].set(T)
  _assert_gathering_matches_pregathered(grouped_gemm.grouped_matmul, x, index, w, tile_expert,
                                        block_n=block_n, transpose_rhs=transpose_rhs)


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
  assert FFI_TARGET in cuda_module(fn, *shapes)
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


def _tile_test_operands(seed: int, tile_expert, num_experts: int, n: int, d: int = 640):
  """(lhs [P, d], rhs [E, d, 2n] scaled by 1/16, H [P, 2n], scores [P]) random for the M tiles
  of tile_expert (P = its tiles x BLOCK_M)."""
  from ffi import grouped_gemm
  P = tile_expert.shape[0] * grouped_gemm.BLOCK_M
  keys = jax.random.split(jax.random.key(seed), 4)
  return (jax.random.normal(keys[0], (P, d)).astype(jnp.bfloat16),
          (jax.random.normal(keys[1], (num_experts, d, 2 * n)) / 16).astype(jnp.bfloat16),
          jax.random.normal(keys[2], (P, 2 * n)).astype(jnp.bfloat16),
          jax.random.uniform(keys[3], (P,)))


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
  E, n = 4, 256
  tile_expert = jnp.array([0, 0, 1, 3, 3, E], jnp.int32)
  lhs, rhs, h, scores = _tile_test_operands(61, tile_expert, E, n)
  P = lhs.shape[0]
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


def test_banded_tiles_cover_each_tile_once_band_by_band():
  """banded_tile (on plain integers): launch-order tiles map onto every (M tile, column tile)
  once; each band of `band` M tiles (the last one the rest) comes whole before the next, its
  tiles column by column with its M tiles neighbouring."""
  from ffi.grouped_gemm import banded_tile
  for m_tiles, n_tiles, band in [(7, 3, 3), (8, 5, 4), (2, 4, 8), (5, 1, 2), (1, 6, 1)]:
    order = [banded_tile(t, m_tiles, n_tiles, band) for t in range(m_tiles * n_tiles)]
    assert sorted(order) == [(m, n) for m in range(m_tiles) for n in range(n_tiles)]
    for first in range(0, m_tiles, band):
      rows = min(band, m_tiles - first)
      start = first * n_tiles
      assert order[start:start + rows * n_tiles] == [
          (first + r, n) for n in range(n_tiles) for r in range(rows)]


@needs_cute
def test_cute_band_m_tiles_must_be_a_non_negative_int():
  from ffi import grouped_gemm
  a, w, t = jnp.zeros((256, 128), jnp.bfloat16), jnp.zeros((2, 128, 128), jnp.bfloat16), \
      jnp.zeros((2,), jnp.int32)
  for bad in (-1, True, 2.0):
    with pytest.raises(ValueError, match=rf"cute grouped_matmul: band_m_tiles must be an int >= 0 "
                                         rf"\(0: launch order\); got {bad!r}"):
      grouped_gemm.grouped_matmul(a, w, t, band_m_tiles=bad)


@pytest.mark.gpu
@needs_cute
@pytest.mark.parametrize("op,band", [
    ("matmul", 4), ("matmul_gather", 2), ("up_proj_gather", 4), ("dh_gather", 4),
    ("dh_tma_h_smem", 3), ("weight_grad", 2), ("weight_grad_gather_tma", 4)])
def test_cute_banded_tile_order_matches_launch_order_on_gpu(op, band):
  """band_m_tiles (the tiles in bands of M tiles) gives the bitwise same outputs as the launch
  order: 7 M tiles (the last band partial), tiles past the last group (zeros), 3 or 4 column
  tiles; weight gradients over experts of 0 to 6 k steps (each expert's tiles in bands)."""
  from ffi import grouped_gemm
  E, n = 4, 384
  tile_expert = jnp.array([0, 0, 1, 3, 3, 3, E], jnp.int32)
  lhs, rhs, h, scores = _tile_test_operands(63, tile_expert, E, n)
  P = lhs.shape[0]
  # (some indices past the rows: zeros)
  index = jax.random.permutation(jax.random.key(64), P + 40)[:P].astype(jnp.int32)
  offsets = jnp.array([0, 256, 256, 640, P], jnp.int32)   # 4, 0, 6 and 4 k steps
  w2 = jnp.swapaxes(rhs[:, :, :n], 1, 2)
  fn = {"matmul": lambda b: grouped_gemm.grouped_matmul(lhs, rhs, tile_expert, block_n=256,
                                                        band_m_tiles=b),
        "matmul_gather": lambda b: grouped_gemm.grouped_matmul(
            lhs, rhs, tile_expert, block_n=256, gather_index=index, band_m_tiles=b),
        "up_proj_gather": lambda b: grouped_gemm.up_proj(lhs, rhs, tile_expert, block_n=128,
                                                         gather_index=index, band_m_tiles=b),
        "dh_gather": lambda b: grouped_gemm.dh(lhs, w2, h, scores, tile_expert, block_n=128,
                                               gather_index=index, over_h=False, band_m_tiles=b),
        "dh_tma_h_smem": lambda b: grouped_gemm.dh(lhs, w2, h, scores, tile_expert, block_n=128,
                                                   tma_store=True, h_smem=True, over_h=False,
                                                   band_m_tiles=b),
        "weight_grad": lambda b: grouped_gemm.weight_grad(lhs, h, offsets, E, block_n=256,
                                                          band_m_tiles=b),
        "weight_grad_gather_tma": lambda b: grouped_gemm.weight_grad(
            lhs, h, offsets, E, block_n=256, gather_index=index, tma_gather=True,
            band_m_tiles=b)}[op]
  got, want = jax.jit(lambda: fn(band))(), jax.jit(lambda: fn(0))()
  for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
    assert np.any(np.asarray(w, np.float32) != 0)
    np.testing.assert_array_equal(g, w)
