"""The CuTe GEMM kernels at widths their column tiles do not divide (multiples of 64, not of
128 or 256): the last column (or weight-gradient M) tile is clipped, TMA loading zeros past the
operands' ends and storing nothing past the output's, and SwiGLU's gate and up halves each go
through a TMA descriptor of its own (grouped_gemm.halves), so that a clipped gate tile never
touches the up half. Checked against float32 references on fresh random inputs, each output
allocated over a freed buffer of NaN (an element left unstored shows), and compiled for sm_90a
on any machine."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import sonicmoe_jax as sm
from conftest import make_inputs, rel_err
from cute_helpers import FFI_TARGET, cuda_module, needs_cute

# widths that are multiples of 64 and not of 128: 320 = 2.5 x 128, 192 = 1.5 x 128
D, N = 320, 192
T = 1000   # the gathered rows' source


def _poison(*shapes):
  """Frees buffers of NaN of these shapes, so that the next outputs of those sizes are likely
  allocated over them."""
  for shape in shapes:
    jax.block_until_ready(jnp.full(shape, jnp.nan, jnp.bfloat16)).delete()


def _f32(v):
  return v.astype(jnp.float32)


def _tiles():
  """tile_expert: experts 0, 2 (1 has none) and 3, then a tile past the last group."""
  from ffi import grouped_gemm
  E = 4
  tile_expert = jnp.array([0, 0, 2, 3, 3, E], jnp.int32)
  return E, tile_expert, jnp.repeat(tile_expert, grouped_gemm.BLOCK_M)


def _per_row_product(lhs, rhs, row_expert):
  """float32 lhs_e rhs_e per row (rhs [E, K, N]); zeros on rows past the last group."""
  E = rhs.shape[0]
  w = _f32(rhs)[jnp.minimum(row_expert, E - 1)]
  out = jnp.einsum("pk,pkn->pn", _f32(lhs), w)
  return jnp.where((row_expert < E)[:, None], out, 0.0)


def _check_rows(got, want, row_expert, E):
  assert not np.any(np.isnan(np.asarray(got, np.float32)))
  assert rel_err(got, want) < 1e-2
  np.testing.assert_array_equal(got[row_expert >= E], 0)


@needs_cute
@pytest.mark.parametrize("kernel", ["grouped", "persistent"])
@pytest.mark.parametrize("block_n", [128, 256])
def test_store_gemm_with_clipped_last_tile_compiles_for_cuda(kernel, block_n):
  from ffi import grouped_gemm, persistent
  module = {"grouped": grouped_gemm, "persistent": persistent}[kernel]
  E, tile_expert, _ = _tiles()
  P = tile_expert.shape[0] * grouped_gemm.BLOCK_M
  fn = lambda a, b, t: module.grouped_matmul(a, b, t, block_n=block_n)
  shapes = [jax.ShapeDtypeStruct((P, D), jnp.bfloat16),
            jax.ShapeDtypeStruct((E, D, D), jnp.bfloat16), tile_expert]
  assert FFI_TARGET in cuda_module(fn, *shapes)


@needs_cute
def test_up_proj_and_dh_with_clipped_last_tile_compile_for_cuda():
  from ffi import grouped_gemm
  E, tile_expert, _ = _tiles()
  P = tile_expert.shape[0] * grouped_gemm.BLOCK_M
  up = lambda x, w, t, i: grouped_gemm.up_proj(x, w, t, block_n=128, gather_index=i)
  assert FFI_TARGET in cuda_module(
      up, jax.ShapeDtypeStruct((T, D), jnp.bfloat16),
      jax.ShapeDtypeStruct((E, D, 2 * N), jnp.bfloat16), tile_expert,
      jax.ShapeDtypeStruct((P,), jnp.int32))
  dh = lambda o, w, h, s, t: grouped_gemm.dh(o, w, h, s, t, block_n=256, tma_store=True,
                                             h_smem=True)
  assert FFI_TARGET in cuda_module(
      dh, jax.ShapeDtypeStruct((P, D), jnp.bfloat16),
      jax.ShapeDtypeStruct((E, N, D), jnp.bfloat16),
      jax.ShapeDtypeStruct((P, 2 * N), jnp.bfloat16), jax.ShapeDtypeStruct((P,), jnp.float32),
      tile_expert)


@needs_cute
@pytest.mark.parametrize("kernel", ["grouped", "grouped_tma_gather", "persistent"])
def test_weight_grad_with_clipped_last_tiles_compiles_for_cuda(kernel):
  from ffi import grouped_gemm, persistent
  P, E = 768, 4
  offsets = jnp.array([0, 256, 256, 640, 640], jnp.int32)
  if kernel == "grouped":
    fn = lambda x, r, i: grouped_gemm.weight_grad(x[:P], r, offsets, E, block_n=128)
  elif kernel == "grouped_tma_gather":
    fn = lambda x, r, i: grouped_gemm.weight_grad(x, r, offsets, E, block_n=256, gather_index=i,
                                                  tma_gather=True)
  else:
    fn = lambda x, r, i: persistent.weight_grad(x, r, offsets, E, i, block_n=256,
                                                tma_gather=True, transpose_out=True)
  shapes = [jax.ShapeDtypeStruct((T, D), jnp.bfloat16), jax.ShapeDtypeStruct((P, N), jnp.bfloat16),
            jax.ShapeDtypeStruct((P,), jnp.int32)]
  assert FFI_TARGET in cuda_module(fn, *shapes)


@pytest.mark.gpu
@needs_cute
@pytest.mark.parametrize("kernel,transpose_rhs,block_n,cols", [
    ("grouped", False, 128, None), ("grouped", True, 256, None),
    ("persistent", False, 256, None), ("persistent", True, 128, None),
    ("persistent", True, 256, (64, 384)), ("grouped", False, 128, (64, 384))])
def test_store_gemm_clips_its_last_column_tile_on_gpu(kernel, transpose_rhs, block_n, cols):
  """out = lhs_e rhs_e at 320 or a window of 320 output columns, the last tile clipped (at
  block_n 256 three of its four 64-column chunks lie past the output)."""
  from ffi import grouped_gemm, persistent
  module = {"grouped": grouped_gemm, "persistent": persistent}[kernel]
  E, tile_expert, row_expert = _tiles()
  P, K, width = row_expert.shape[0], 448, 448 if cols else D
  lhs = jax.random.normal(jax.random.key(1), (P, K)).astype(jnp.bfloat16)
  rhs = (jax.random.normal(jax.random.key(2), (E, K, width)) / 8).astype(jnp.bfloat16)
  out_cols = D
  _poison((P, out_cols))
  got = jax.jit(lambda a, b, t: module.grouped_matmul(
      a, jnp.swapaxes(b, 1, 2) if transpose_rhs else b, t, transpose_rhs=transpose_rhs,
      block_n=block_n, cols=cols))(lhs, rhs, tile_expert)
  want = _per_row_product(lhs, rhs, row_expert)
  if cols:
    want = want[:, cols[0]:cols[1]]
  assert got.shape == (P, out_cols)
  _check_rows(got, want, row_expert, E)


@pytest.mark.gpu
@needs_cute
@pytest.mark.parametrize("block_n", [128, 64])
def test_up_proj_clips_the_gate_and_up_halves_on_gpu(block_n):
  """H = [gate | up] and A = silu(gate) up at n = 192 (block_n 128: the second tile half past
  n in each half; 64: whole tiles), X's rows gathered in the kernel (padding slots: zeros)."""
  from ffi import grouped_gemm
  E, tile_expert, row_expert = _tiles()
  P = row_expert.shape[0]
  x = jax.random.normal(jax.random.key(3), (T, D)).astype(jnp.bfloat16)
  w1 = (jax.random.normal(jax.random.key(4), (E, D, 2 * N)) / 8).astype(jnp.bfloat16)
  index = jax.random.randint(jax.random.key(5), (P,), 0, T).at[::7].set(T)
  _poison((P, 2 * N), (P, N))
  h, a = jax.jit(lambda x, w, t, i: grouped_gemm.up_proj(x, w, t, block_n=block_n,
                                                         gather_index=i))(x, w1, tile_expert, index)
  xg = x.at[index].get(mode="fill", fill_value=0)
  h_ref = _per_row_product(xg, w1, row_expert)
  _check_rows(h, h_ref, row_expert, E)
  _check_rows(a, jax.nn.silu(h_ref[:, :N]) * h_ref[:, N:], row_expert, E)


@pytest.mark.gpu
@needs_cute
@pytest.mark.parametrize("block_n,gather", [(128, False), (256, True), (64, True)])
def test_dh_clips_its_last_column_tile_on_gpu(block_n, gather):
  """dH = dSwiGLU(s dA', H), A' = s A and the dS parts at n = 192, H loaded and the outputs
  stored by TMA (h_smem, tma_store): the last column tile clipped (block_n 128 and 256), dO's
  rows gathered or not."""
  from ffi import calls, grouped_gemm
  E, tile_expert, row_expert = _tiles()
  P = row_expert.shape[0]
  keys = jax.random.split(jax.random.key(6), 5)
  dout = jax.random.normal(keys[0], (T if gather else P, D)).astype(jnp.bfloat16)
  w2 = (jax.random.normal(keys[1], (E, N, D)) / 16).astype(jnp.bfloat16)
  h = jnp.where((row_expert < E)[:, None],
                2 * jax.random.normal(keys[2], (P, 2 * N)), 0).astype(jnp.bfloat16)
  scores = jax.random.uniform(keys[3], (P,), minval=0.05, maxval=1.0)
  index = jax.random.randint(keys[4], (P,), 0, T).at[::7].set(T) if gather else None
  _poison((P, 2 * N), (P, N))
  dh_, a_scaled, ds_parts = jax.jit(lambda *a: grouped_gemm.dh(
      *a, tile_expert, block_n=block_n, gather_index=index, tma_store=True, h_smem=True,
      over_h=False))(dout, w2, h, scores)
  dout_g = dout if index is None else dout.at[index].get(mode="fill", fill_value=0)
  da = _per_row_product(dout_g, jnp.swapaxes(w2, 1, 2), row_expert)
  gate, up = _f32(h[:, :N]), _f32(h[:, N:])
  sig = jax.nn.sigmoid(gate)
  a = gate * sig * up
  da_s = scores[:, None] * da
  want_dh = jnp.concatenate([da_s * up * sig * (1 + gate * (1 - sig)), da_s * gate * sig], 1)
  assert ds_parts.shape == (calls.column_tiles(N, block_n), P)
  _check_rows(dh_, want_dh, row_expert, E)
  _check_rows(a_scaled, scores[:, None] * a, row_expert, E)
  assert rel_err(ds_parts.sum(0), jnp.sum(da * a, axis=1)) < 1e-2


@pytest.mark.gpu
@needs_cute
@pytest.mark.parametrize("kernel,M,block_n,transpose_out", [
    ("grouped", D, 128, False), ("grouped_tma_gather", D, 256, True),
    ("persistent", D, 256, False), ("persistent", D, 128, True),
    ("persistent_cluster", 448, 256, False), ("persistent_cluster", D, 128, True)])
def test_weight_grad_clips_its_last_m_and_column_tiles_on_gpu(kernel, M, block_n, transpose_out):
  """out[e] = X_e^T rhs_e ([E, M, 192], or transposed [E, 192, M]) with M = 320 or 448 (the
  last M tile half past M) and 192 columns (the last column tile clipped): X's rows read in
  slot order, or gathered by TMA (padding slots: zeros); experts of 256, 0 (zeros), 384 and
  128 rows; on persistent CTAs also in clusters of 2 along M (M = 320's 3 M tiles: the
  second cluster's second tile wholly past M, computed on zeros and stored nowhere)."""
  from ffi import grouped_gemm, persistent
  sizes = [256, 0, 384, 128]
  E = len(sizes)
  offsets = jnp.array(np.concatenate([[0], np.cumsum(sizes)]), jnp.int32)
  P = sum(sizes) + 128
  x = jax.random.normal(jax.random.key(7), (T, M)).astype(jnp.bfloat16)
  rhs = jax.random.normal(jax.random.key(8), (P, N)).astype(jnp.bfloat16)
  index = jax.random.randint(jax.random.key(9), (P,), 0, T).at[::5].set(T)
  xg = x.at[index].get(mode="fill", fill_value=0)
  kw = dict(block_n=block_n, transpose_out=transpose_out)
  if kernel == "grouped":
    run = lambda: grouped_gemm.weight_grad(xg, rhs, offsets, E, **kw)
  elif kernel == "grouped_tma_gather":
    run = lambda: grouped_gemm.weight_grad(x, rhs, offsets, E, gather_index=index,
                                           tma_gather=True, **kw)
  else:
    run = lambda: persistent.weight_grad(x, rhs, offsets, E, index, tma_gather=True,
                                         cluster_m=2 if kernel.endswith("cluster") else 1, **kw)
  _poison((E, M, N))
  got = jax.jit(run)()
  assert got.shape == ((E, N, M) if transpose_out else (E, M, N))
  assert not np.any(np.isnan(np.asarray(got, np.float32)))
  for e in range(E):
    lo, hi = int(offsets[e]), int(offsets[e + 1])
    want = _f32(xg[lo:hi]).T @ _f32(rhs[lo:hi])
    if lo == hi:
      np.testing.assert_array_equal(got[e], 0)
    else:
      assert rel_err(got[e].T if transpose_out else got[e], want) < 1e-2


@needs_cute
@pytest.mark.parametrize("d,n", [(D, N), (2880, 2880)])
def test_cute_layer_runs_such_widths_unpadded(d, n):
  """The layer's forward and gradients on backend "cute" at widths its column tiles do not
  divide (2880: gpt-oss's) lower for CUDA with every expert op a kernel call on the weights as
  they are: W1 [E, d, 2n] and W2 [E, n, d] go to the kernels unpadded."""
  E = 8
  args = make_inputs(0, 256, d, n, E, jnp.bfloat16)
  loss = lambda *a: jnp.sum(sm.moe(*a, k=2, backend="cute", windows=1).out.astype(jnp.float32))
  text = cuda_module(jax.value_and_grad(loss, argnums=(0, 2, 3)), *args)
  calls = [line for line in text.splitlines() if FFI_TARGET in line and "custom_call" in line]
  assert len(calls) >= 8
  w1, w2 = f"tensor<{E}x{d}x{2 * n}xbf16>", f"tensor<{E}x{n}x{d}xbf16>"
  assert any(w1 in line for line in calls) and any(w2 in line for line in calls)
