"""ffi/persistent.py's kernels (the weight gradients and the wide store GEMMs on persistent
CTAs: static and dynamic tile orders, clusters of 2): their tiles cover each output once, they
compile for sm_90a, refuse what they cannot take, and give grouped_gemm.py's bits on the GPU."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from cute_helpers import FFI_TARGET, cuda_module, needs_cute


@needs_cute
@pytest.mark.parametrize("block_n,stages,transpose_out,dynamic,cluster_m,tma_gather", [
    (128, None, False, False, 1, False), (256, 2, True, False, 1, False),
    (256, None, False, False, 1, False), (256, None, False, True, 1, False),
    (128, 3, True, True, 1, False), (256, None, False, True, 2, False),
    (128, 3, True, False, 2, False), (256, None, False, True, 2, True),
    (192, 3, True, False, 1, True), (256, None, True, True, 2, True)])
def test_cute_persistent_weight_grad_compiles_for_cuda(block_n, stages, transpose_out, dynamic,
                                                       cluster_m, tma_gather):
  """The persistent weight-gradient kernel (its tile loop, ring and epilogue buffers) compiles
  for sm_90a at the tiles and depths the layer and the sweep run, in either tile order, alone
  or in clusters of 2 (with the rows by TMA over M = 384's 3 M tiles: the second cluster's
  second tile past M), the rows by cp.async or TMA (192 wide: the last column tile clipped,
  the epilogue's buffers taken in turn across tiles)."""
  from ffi import persistent
  P, M, N, E, T = 512, 384 if cluster_m == 2 and tma_gather else 256, 512, 4, 300
  offsets = jnp.arange(E + 1, dtype=jnp.int32) * (P // E)
  fn = lambda x, r, i: persistent.weight_grad(x, r, offsets, E, i, block_n=block_n,
                                              stages=stages, transpose_out=transpose_out,
                                              dynamic=dynamic, cluster_m=cluster_m,
                                              tma_gather=tma_gather)
  shapes = [jax.ShapeDtypeStruct((T, M), jnp.bfloat16), jax.ShapeDtypeStruct((P, N), jnp.bfloat16),
            jax.ShapeDtypeStruct((P,), jnp.int32)]
  assert FFI_TARGET in cuda_module(fn, *shapes)


@needs_cute
def test_persistent_cluster_tiles_pair_neighbouring_m_tiles_of_one_column_tile():
  """cluster_tile (on plain integers): the two CTAs of a cluster at each cluster tile take M
  tiles 2j and 2j + 1 of one expert and one column tile; over the cluster tiles, every tile
  once, in tile_work's order (expert, then M tile, then column tile); clusters of 1: the tile
  itself."""
  from ffi import persistent
  m_tiles, n_tiles, experts = 4, 3, 2
  units = m_tiles * n_tiles * experts // 2
  pairs = [[persistent.cluster_tile("wgrad", u, r, m_tiles, n_tiles, 2) for r in (0, 1)]
           for u in range(units)]
  split = lambda t: (t // (m_tiles * n_tiles), t % (m_tiles * n_tiles) // n_tiles, t % n_tiles)
  for t0, t1 in pairs:
    (e0, m0, n0), (e1, m1, n1) = split(t0), split(t1)
    assert (e0, n0) == (e1, n1) and m0 % 2 == 0 and m1 == m0 + 1
  assert sorted(t for pair in pairs for t in pair) == list(range(2 * units))
  assert [pair[0] for pair in pairs] == sorted(pair[0] for pair in pairs)
  assert [persistent.cluster_tile("wgrad", u, 0, m_tiles, n_tiles, 1) for u in range(5)] == \
      list(range(5))


@needs_cute
def test_persistent_store_cluster_tiles_pair_neighbouring_column_tiles_of_one_m_tile():
  """cluster_tile "store": the two CTAs of a cluster take column tiles 2j and 2j + 1 of one M
  tile (the lhs tile they share); over the cluster tiles, every tile once, in order."""
  from ffi import persistent
  m_tiles, n_tiles = 3, 4
  pairs = [[persistent.cluster_tile("store", u, r, m_tiles, n_tiles, 2) for r in (0, 1)]
           for u in range(m_tiles * n_tiles // 2)]
  for t0, t1 in pairs:
    assert t0 // n_tiles == t1 // n_tiles and t0 % n_tiles % 2 == 0 and t1 == t0 + 1
  assert [t for pair in pairs for t in pair] == list(range(m_tiles * n_tiles))


@needs_cute
def test_persistent_store_clusters_along_m_pair_m_tiles_of_one_expert():
  """Clusters along M (cluster_tile "store" along "m", tile_work through schedule.pair_slots):
  the two CTAs of a cluster take one column tile of two M tiles of one expert (an odd count's
  last M tile twice); over the pairs, every (M tile, column tile) is computed, and only an odd
  group's last M tile more than once."""
  from ffi import persistent
  from sonicmoe_jax.core import schedule
  E, n_tiles = 4, 3
  tile_expert = np.array([0, 0, 0, 1, 1, 3, 4, 4])   # groups of 3, 2, 0, 1 M tiles, 2 past them
  slots = np.asarray(schedule.pair_slots(jnp.asarray(tile_expert), E))
  num_pairs = slots[-1]
  assert num_pairs == 5 and len(slots) == schedule.pair_slot_entries(8, E) + 1
  seen = []
  for u in range(num_pairs * n_tiles):
    pair = [persistent.tile_work("store", persistent.cluster_tile("store", u, r, 8, n_tiles, 2,
                                                                  "m"),
                                 tile_expert, 8, n_tiles, 10, E, slots) for r in (0, 1)]
    (m0, n0, _, k0, e0, _), (m1, n1, _, k1, e1, _) = pair
    assert n0 == n1 == u % n_tiles and tile_expert[m0] == tile_expert[m1] and e0 == e1
    assert k0 == k1 == (10 if tile_expert[m0] < E else 0)
    seen += [(m0, n0), (m1, n1)]
  assert sorted(set(seen)) == [(m, n) for m in range(8) for n in range(n_tiles)]
  twice = sorted({m for m, _ in seen if seen.count((m, 0)) > 1})
  assert twice == [2, 5]   # group 0's and group 3's last tiles (odd counts)


@needs_cute
@pytest.mark.parametrize("block_n,stages,transpose_rhs,cols,cluster_n,cluster_m", [
    (256, None, False, None, 1, 1), (192, 2, True, None, 1, 1), (128, None, False, (128, 384), 1, 1),
    (256, None, True, (256, 512), 1, 1), (192, None, False, None, 2, 1),
    (256, 3, True, (256, 512), 2, 1), (192, None, False, None, 1, 2),
    (256, 3, True, (256, 512), 1, 2)])
def test_cute_persistent_matmul_compiles_for_cuda(block_n, stages, transpose_rhs, cols,
                                                  cluster_n, cluster_m):
  """The persistent store GEMM compiles for sm_90a, both rhs layouts, whole and windowed, 192
  wide (the last column tile clipped), in clusters of 2 along N (192 wide: 3 column tiles,
  padded to 4) and along M (M tiles paired by schedule.pair_slots)."""
  from ffi import persistent
  P, K, N, E = 512, 256, 512, 4
  fn = lambda a, b, t: persistent.grouped_matmul(
      a, jnp.swapaxes(b, 1, 2) if transpose_rhs else b, t, transpose_rhs=transpose_rhs,
      block_n=block_n, stages=stages, cols=cols, cluster_n=cluster_n, cluster_m=cluster_m)
  shapes = [jax.ShapeDtypeStruct((P, K), jnp.bfloat16), jax.ShapeDtypeStruct((E, K, N), jnp.bfloat16),
            jax.ShapeDtypeStruct((P // 128,), jnp.int32)]
  assert FFI_TARGET in cuda_module(fn, *shapes)


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
  # (its rows loaded by TMA, the last M and column tiles may be clipped: multiples of 64)
  with pytest.raises(ValueError, match="lhs columns M=288 must be a multiple of 64"):
    persistent.weight_grad(jnp.zeros((300, 288), jnp.bfloat16), rhs, offsets, 4, index,
                           tma_gather=True)
  with pytest.raises(ValueError, match="num_ctas must be a positive int; got 0"):
    persistent.weight_grad(x, rhs, offsets, 4, index, num_ctas=0)
  with pytest.raises(ValueError, match=r"cute persistent weight_grad: block_n=512 is wider than 256"):
    persistent.weight_grad(x, rhs, offsets, 4, index, block_n=512)
  for bad in (3, True, 2.0):
    with pytest.raises(ValueError, match=rf"cluster_m={bad!r} must be one of \(1, 2\)"):
      persistent.weight_grad(x, rhs, offsets, 4, index, cluster_m=bad)
  with pytest.raises(ValueError, match="M=384 must make whole clusters: 3 M tiles of 128 in "
                                       "clusters of cluster_m=2"):
    persistent.weight_grad(jnp.zeros((300, 384), jnp.bfloat16), rhs, offsets, 4, index,
                           cluster_m=2)
  lhs, w, tiles = jnp.zeros((512, 256), jnp.bfloat16), jnp.zeros((4, 256, 512), jnp.bfloat16), \
      jnp.zeros((4,), jnp.int32)
  with pytest.raises(ValueError, match=r"cute persistent grouped_matmul: cols=\(0, 600\) must be"):
    persistent.grouped_matmul(lhs, w, tiles, cols=(0, 600))
  with pytest.raises(ValueError, match=r"cute persistent grouped_matmul: stages=1 must be"):
    persistent.grouped_matmul(lhs, w, tiles, stages=1)
  with pytest.raises(ValueError, match=r"cute persistent grouped_matmul: block_n=512 is wider than 256"):
    persistent.grouped_matmul(lhs, w, tiles, block_n=512)
  with pytest.raises(ValueError, match="cute persistent grouped_matmul: block_n=96 must be a multiple of 64"):
    persistent.grouped_matmul(lhs, w, tiles, block_n=96)
  for bad in (3, True):
    with pytest.raises(ValueError, match=rf"cute persistent grouped_matmul: cluster_n={bad!r} "
                                         r"must be one of \(1, 2\)"):
      persistent.grouped_matmul(lhs, w, tiles, cluster_n=bad)
    with pytest.raises(ValueError, match=rf"cute persistent grouped_matmul: cluster_m={bad!r} "
                                         r"must be one of \(1, 2\)"):
      persistent.grouped_matmul(lhs, w, tiles, cluster_m=bad)
  with pytest.raises(ValueError, match="cluster_m=2 and cluster_n=2: clusters run along one"):
    persistent.grouped_matmul(lhs, w, tiles, cluster_m=2, cluster_n=2)


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
    (128, 3, True, 6, True, 2, True), (256, 2, False, 1, False, 2, True),
    (192, None, False, 3, False, 1, True), (192, 2, True, 5, True, 2, True),
    (64, 3, False, 3, False, 1, False)])
def test_cute_persistent_weight_grad_matches_grouped_on_gpu(block_n, stages, transpose_out,
                                                            num_ctas, dynamic, cluster_m,
                                                            tma_gather):
  """The persistent kernel gives grouped_gemm.weight_grad's bits, gathering X's rows (padding
  slots: index T): experts of 256, 0 (zeros), 640, 128 and 1152 rows, so that a CTA's tiles run
  2, 0, 10, 2 and 18 k steps and its ring of `stages` wraps within and across tiles; num_ctas
  3, 5 and 1 make each CTA loop over many tiles (the default grid: one tile or fewer each), in
  either tile order (dynamic: the CTAs ask a counter; twice in a row, so a second call's
  counter starts at 0 again), alone or in clusters of 2 (M = 512: two cluster rows of M
  tiles; with the rows by TMA M = 384, the second cluster's second M tile wholly past M;
  num_ctas 3 and 1 rounded to one whole cluster), the rows copied by the producer's threads
  or (tma_gather) loaded by TMA, a box a row; 64 and 192 wide (odd epilogue chunks a
  tile: the CTA's tiles start on either buffer; 192 clips N = 512's last column tile). The
  output is written over a freed buffer of NaN, so an element left unstored shows."""
  from ffi import grouped_gemm, persistent
  sizes = [256, 0, 640, 128, 1152]
  offsets = jnp.array(np.concatenate([[0], np.cumsum(sizes)]), jnp.int32)
  T, P, N, E = 1000, sum(sizes) + 128, 512, len(sizes)
  M = 384 if cluster_m == 1 or tma_gather else 512   # (384 in clusters: one tile past M)
  x = jax.random.normal(jax.random.key(71), (T, M)).astype(jnp.bfloat16)
  rhs = jax.random.normal(jax.random.key(72), (P, N)).astype(jnp.bfloat16)
  index = jax.random.randint(jax.random.key(73), (P,), 0, T).at[::5].set(T)
  kw = dict(block_n=block_n, transpose_out=transpose_out)
  jax.block_until_ready(jnp.full((E, M, N), jnp.nan, jnp.bfloat16)).delete()
  run = jax.jit(lambda a, b, o, i: persistent.weight_grad(
      a, b, o, E, i, stages=stages, num_ctas=num_ctas, dynamic=dynamic, cluster_m=cluster_m,
      tma_gather=tma_gather, **kw))
  got = run(x, rhs, offsets, index)
  # (the one-CTA-a-tile kernel clips a last column tile where it loads its rows by TMA)
  want = jax.jit(lambda a, b, o, i: grouped_gemm.weight_grad(
      a, b, o, E, gather_index=i, tma_gather=N % block_n != 0, **kw))(x, rhs, offsets, index)
  assert got.shape == want.shape == ((E, N, M) if transpose_out else (E, M, N))
  assert np.all(np.asarray(want[1], np.float32) == 0) and np.any(np.asarray(want, np.float32) != 0)
  np.testing.assert_array_equal(got, want)
  np.testing.assert_array_equal(run(x, rhs, offsets, index), want)


@pytest.mark.gpu
@needs_cute
@pytest.mark.parametrize("transpose_rhs,block_n,stages,cols,num_ctas,cluster_n,cluster_m", [
    (False, 256, None, None, None, 1, 1), (True, 256, None, None, 3, 1, 1),
    (False, 128, 2, (128, 384), 5, 1, 1), (True, 256, 3, (256, 512), 1, 1, 1),
    (True, 128, None, None, None, 1, 1), (False, 192, None, None, 3, 1, 1),
    (True, 192, 2, (128, 512), 5, 1, 1), (False, 64, 3, None, 3, 1, 1),
    (False, 256, None, None, None, 2, 1), (True, 192, 2, (128, 512), 5, 2, 1),
    (False, 192, None, None, 3, 2, 1), (True, 128, 3, (128, 512), 1, 2, 1),
    (False, 256, None, None, None, 1, 2), (True, 192, 2, (128, 512), 5, 1, 2),
    (False, 192, None, None, 3, 1, 2), (True, 128, 3, None, 1, 1, 2)])
def test_cute_persistent_matmul_matches_grouped_on_gpu(transpose_rhs, block_n, stages, cols,
                                                       num_ctas, cluster_n, cluster_m):
  """The persistent store GEMM gives grouped_gemm.grouped_matmul's bits: experts 0, 1 and 3
  (2 skipped: no tiles), a tile past the last group (zeros), whole and windowed (cols), both
  rhs layouts; num_ctas 1, 3 and 5 make each CTA loop over many tiles (the default grid: one
  tile each). The contraction's 10 k steps wrap rings of 2-4 stages within and across tiles.
  64 and 192 wide, a tile's odd epilogue chunks start the CTA's next tile on the other buffer
  (192: N = 512's last column tile clipped). In clusters of 2 sharing the lhs stages: whole
  pairs of column tiles (256 wide, 384 columns 192 wide) and an odd count padded with a tile
  past the output (512 columns 192 wide; 384 columns 128 wide), CTAs 1 and 3 making one
  cluster. In clusters of 2 sharing the rhs stages: M tiles paired within an expert (experts 1
  and 3 and the tile past the groups odd counts, their last tile computed twice)."""
  from ffi import grouped_gemm, persistent
  E, K, N = 4, 640, 512
  tile_expert = jnp.array([0, 0, 1, 3, 3, 3, E], jnp.int32)
  P = tile_expert.shape[0] * grouped_gemm.BLOCK_M
  lhs = jax.random.normal(jax.random.key(81), (P, K)).astype(jnp.bfloat16)
  rhs = (jax.random.normal(jax.random.key(82), (E, K, N)) / 16).astype(jnp.bfloat16)
  if transpose_rhs:
    rhs = jnp.swapaxes(rhs, 1, 2)
  kw = dict(transpose_rhs=transpose_rhs, block_n=block_n, cols=cols)
  got = jax.jit(lambda a, b, t: persistent.grouped_matmul(
      a, b, t, stages=stages, num_ctas=num_ctas, cluster_n=cluster_n, cluster_m=cluster_m,
      **kw))(lhs, rhs, tile_expert)
  want = jax.jit(lambda a, b, t: grouped_gemm.grouped_matmul(a, b, t, **kw))(lhs, rhs, tile_expert)
  assert got.shape == want.shape == (P, N if cols is None else cols[1] - cols[0])
  assert np.all(np.asarray(want[-128:], np.float32) == 0) and np.any(np.asarray(want, np.float32) != 0)
  np.testing.assert_array_equal(got, want)
