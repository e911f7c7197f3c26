"""ffi/pingpong.py's kernels (dh, the gathering up-projection and the store GEMMs on
persistent ping-pong CTAs, in clusters and on 192-row tiles): they compile for sm_90a and give
grouped_gemm.py's bits on the GPU."""
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from cute_helpers import FFI_TARGET, cuda_module, needs_cute


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
  assert FFI_TARGET in cuda_module(fn, *shapes)
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
  assert FFI_TARGET in cuda_module(fn, *gathered)
  # its SMEM epilogue (tma_store): buffers of each consumer's own, fewer stages fit
  fit_tma = pingpong.stages_that_fit(block_n, 2, 1, True, "dh")
  assert 2 <= fit_tma < fit
  if block_n == 128:
    fn = lambda g, w, h, s, t, i: pingpong.dh(g, w, h, s, t, block_n=block_n, gather_index=i,
                                              tma_store=True)
    assert FFI_TARGET in cuda_module(fn, *gathered)
  with pytest.raises(ValueError, match=f"stages={fit_tma + 1} must be between 2 and {fit_tma}"):
    jax.eval_shape(lambda *a: pingpong.dh(*a, block_n=block_n, stages=fit_tma + 1,
                                          tma_store=True), *shapes)


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
  assert FFI_TARGET in cuda_module(fn, *shapes)
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
    assert FFI_TARGET in cuda_module(rows192(tma_store=True), shapes[0], shapes[1], table)
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
  targets = {c: set(re.findall(r"@(sonicmoe_cute_\w+)", cuda_module(fn(c), *shapes(768))))
             for c in (1, 2)}
  assert len(targets[1]) == len(targets[2]) == 1 and targets[1] != targets[2]
  # on 192-row tiles (schedule.row_tiles' table), 128 wide: 6 column tiles pair up
  table = jax.ShapeDtypeStruct((3 * (-(-P // 192) + E + 1),), jnp.int32)
  rows192 = lambda a, b, t: pingpong.grouped_matmul(a, b, t, tma_store=True, block_n=128,
                                                    cluster_n=2, tile_m=192)
  rows192_targets = set(re.findall(r"@(sonicmoe_cute_\w+)",
                                   cuda_module(rows192, *shapes(768)[:2], table)))
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
  assert FFI_TARGET in cuda_module(fn, *shapes)
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
  from sonicmoe_jax.core import schedule
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
