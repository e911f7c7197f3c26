"""ffi/ops.py, the cute backend's op table: its kernel configuration (ffi.config.CuteConfig,
passed as sm.moe's kernel_config) reaches the kernels it names (in the lowered program), the layer's default takes cute ops where they measured faster, falls back
where a kernel cannot run, windows its store GEMMs, and matches the xla backend on the GPU."""
import importlib
import re
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import sonicmoe_jax as sm
from benchmarks import configs
from conftest import make_inputs, rel_err
from cute_helpers import CUTE_GEMMS, FFI_TARGET, cuda_module, needs_cute
from ffi.config import CuteConfig
from sonicmoe_jax.core import routing


def cute(**fields):
  """sm.moe's kernel_config: the cute backend with these CuteConfig fields."""
  return {"cute": CuteConfig(**fields)}


@needs_cute
def test_cute_dh_past_its_offsets_takes_the_tma_kernel(monkeypatch):
  """An H past the register paths' 32-bit offsets: the cute dh op runs grouped_gemm.dh with H
  loaded and its outputs stored by TMA (coordinates, no element offsets), whatever dh_kernel
  says, and dw2 decides its dO gather as dh does."""
  from ffi import calls, grouped_gemm
  monkeypatch.setattr(calls, "MAX_REGISTER_ADDRESSED", 1000)
  cute_ops = importlib.import_module("ffi.ops")
  seen = []
  real_dh = grouped_gemm.dh
  monkeypatch.setattr(grouped_gemm, "dh", lambda *a, **k: (seen.append(k), real_dh(*a, **k))[1])
  args = make_inputs(5, 200, 128, 128, 4, jnp.bfloat16)
  loss = lambda *a: jnp.sum(sm.moe(*a, k=2, backend="cute", windows=1,
                                   kernel_config=cute(dh_kernel="registers")).out.astype(jnp.float32))
  jax.eval_shape(jax.grad(loss, argnums=(0, 2, 3)), *args)
  assert [(k["tma_store"], k["h_smem"]) for k in seen] == [(True, True)]
  big = cute_ops._dh_config(1001, CuteConfig(dh_kernel="pingpong"))
  assert big.dh_kernel == "tma_store" and cute_ops._dh_config(1000, CuteConfig()) == CuteConfig()


@needs_cute
def test_cute_dh_past_its_offsets_falls_back_to_xla(monkeypatch):
  """Without dh_h_smem no dH kernel takes an H past its offsets: the cute dh op hands it to
  xla_ops.dh, saying so, and the layer's gradients equal the xla backend's (runs on CPU: no
  cute kernel is called)."""
  from ffi import calls
  monkeypatch.setattr(calls, "MAX_REGISTER_ADDRESSED", 1000)
  T, d, n, E, K = 200, 128, 128, 4, 2
  args = make_inputs(5, T, d, n, E, jnp.float32)

  def grads(backend, **kw):
    loss = lambda *a: jnp.sum(sm.moe(*a, k=K, backend=backend, **kw).out ** 2)
    return jax.grad(loss, argnums=(0, 2, 3))(*args)

  with pytest.warns(UserWarning, match=r"backend 'cute' dh: H \(\d+, 256\) has more than 1000 "
                                       r"elements and dh_h_smem is off"):
    got = grads({op: "xla" for op in sm.OP_NAMES} | {"dh": "cute"},
                kernel_config=cute(dh_h_smem=False))
  for a, b in zip(got, grads("xla")):   # (cute's ALIGN pads the plan: other fp32 sum orders)
    np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5)


# the ops a production layer hands to XLA, warning (none: dbrx's H [133120, 21504], past the
# register paths' 32-bit offsets, takes dH's TMA kernel)
PRODUCTION_FALLBACKS = {}


@needs_cute
@pytest.mark.parametrize("config", sorted(configs.PRODUCTION))
def test_cute_layer_at_production_sizes_stays_on_its_kernels(config):
  """At the released models' layers of the benchmark (T = 32768) the layer's forward and
  gradients trace with every GEMM and the aggregation on their cute kernels: the size rules
  (gathers by XLA past the column-tile limits, TMA stores past 2^31 elements) pick a kernel,
  and an op that falls back to XLA (a warning naming it) is one PRODUCTION_FALLBACKS lists."""
  T, d, n, E, K = configs.PRODUCTION[config]
  shapes = [jax.ShapeDtypeStruct(s, jnp.bfloat16) for s in
            [(T, d), (d, E), (E, d, 2 * n), (E, n, d)]]
  loss = lambda *a: jnp.sum(sm.moe(*a, k=K, backend=CUTE_GEMMS).out.astype(jnp.float32))
  with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    jax.eval_shape(jax.grad(loss, argnums=(0, 1, 2, 3)), *shapes)
  fallbacks = sorted(re.findall(r"backend 'cute' (\w+):", str(w.message))[0] for w in caught
                     if "backend 'cute'" in str(w.message))
  assert tuple(fallbacks) == PRODUCTION_FALLBACKS.get(config, ())


@needs_cute
def test_cute_ops_name_the_layer_limit_they_miss():
  """Backend "cute" asked for a float32 layer fails at trace time naming the op and the limit
  (not a kernel's operand names); its ops called on widths their tiles do not divide name the
  width and its multiple; the layer pads such widths up to them (core/padding.py)."""
  def trace(d, n, dtype, backend="cute"):
    args = make_inputs(0, 256, d, n, 8, dtype)
    loss = lambda *a: jnp.sum(sm.moe(*a, k=2, backend=backend).out.astype(jnp.float32))
    return jax.eval_shape(jax.grad(loss, argnums=(0, 2, 3)), *args)
  with pytest.raises(TypeError, match=r"backend 'cute' \(up_proj\): inputs must be bfloat16 "
                                      r"or float16; got float32"):
    trace(128, 128, jnp.float32)
  cute_ops = importlib.import_module("ffi.ops")
  x, router_w, w1, w2 = make_inputs(0, 256, 200, 72, 8, jnp.bfloat16)
  plan = routing.route(routing.router_logits(x, router_w), k=2, align=cute_ops.ALIGN)[0]
  with pytest.raises(ValueError, match=r"\(up_proj\): d \(model width\) must be a multiple "
                                       r"of 64; got 200"):
    cute_ops.up_proj(x, w1, plan)
  with pytest.raises(ValueError, match=r"\(dw2\): n \(expert width\) must be a multiple "
                                       r"of 64; got 72"):
    cute_ops.dw2(jnp.zeros((plan.num_slots, 72), x.dtype), x[:, :128], plan)
  for backend in ("cute", {op: "xla" for op in sm.OP_NAMES} | {"dw2": "cute"}):
    dx, dw1, dw2 = trace(200, 72, jnp.bfloat16, backend)   # padded to d 256, n 128
    assert (dx.shape, dw1.shape, dw2.shape) == ((256, 200), (8, 200, 144), (8, 72, 200))


@needs_cute
def test_auto_backend_takes_cute_ops_where_measured_faster(monkeypatch):
  """On GPUs "auto" runs the six GEMM ops on cute (where each measured faster) at every width
  (the layer padding d and n to multiples of 64), and the router's top-K where E >= 256 and its
  kernel takes k; pallas elsewhere and without the extra; float32 goes to xla."""
  from sonicmoe_jax import backends
  from sonicmoe_jax.core import xla_ops
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
  # token rounding's placement on cute; its aggregation too (plain top-K's stays XLA's)
  ops = resolve(4096, 256)
  assert ops.rounded_slots is cute_ops.rounded_slots and ops.aggregate is xla_ops.aggregate
  rounding = backends.resolve("auto", platform="gpu", dtype=jnp.bfloat16, d=4096, n=256,
                              token_rounding=True)
  assert rounding.aggregate is cute_ops.aggregate
  with pytest.warns(UserWarning, match="float32"):
    assert resolve(4096, 256, jnp.float32).dh is xla_ops.dh
  for d, n in [(4096, 96), (200, 4096)]:   # the contraction's 64-column k steps
    assert "multiple of 64" in cute_ops.unsupported(jnp.bfloat16, d, n)
  for d, n, kernel_widths in [(2880, 2880, (2880, 2880)), (2944, 1472, (2944, 1472)),
                              (128, 64, (128, 64)), (4096, 192, (4096, 192)),
                              (2952, 1480, (3008, 1536)), (200, 72, (256, 128))]:
    ops = resolve(d, n)   # widths cute's column tiles do not divide: their last tile clipped
    assert ops.backend_by_op()["dh"] == "cute" and ops.kernel_widths(d, n) == kernel_widths
  monkeypatch.setattr(backends, "cute_installed", lambda: False)
  assert resolve(4096, 1024).dh is pallas_ops.dh


@needs_cute
def test_cute_layer_step_has_no_device_loops():
  """A forward+backward step on backend "cute", lowered for CUDA, has no while loop: on a GPU
  each step of one waits for the host (two came from the tiles' owner search)."""
  T, d, n, E, K = 1024, 256, 128, 32, 4
  args = make_inputs(0, T, d, n, E, jnp.bfloat16)
  step = jax.value_and_grad(   # (the value too: the whole forward, down_proj and aggregate)
      lambda *a: jnp.sum(sm.moe(*a, k=K, backend="cute").out.astype(jnp.float32)),
      argnums=(0, 1, 2, 3))
  text = cuda_module(step, *args)
  assert FFI_TARGET in text and "stablehlo.while" not in text


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
  default dh_h_smem) and with the ping-pong kernels (dH with register stores or its SMEM
  epilogue, which "auto" picks at this d; up_proj and the store GEMMs)."""
  cute_ops = importlib.import_module("ffi.ops")
  T, d, n, E, K = 256, 256, max(128, dh_block_n), 8, 2
  fields = dict(dout_gather_max_column_tiles=dout_gather_max_column_tiles, dh_kernel=dh_kernel,
                dh_block_n=dh_block_n)
  # ("auto" at d 256: pingpong_tma)
  pingpong = cute_ops._dh_kernel(d, CuteConfig(**fields)).startswith("pingpong")
  config = cute(**fields, up_proj_kernel="pingpong" if pingpong else "grouped",
                store_kernel="pingpong" if pingpong else "grouped")
  dh_block_ns = []   # the dH kernel's column tile, as ffi.ops calls it
  kernel_module = importlib.import_module("ffi.pingpong" if pingpong else "ffi.grouped_gemm")
  real_dh = kernel_module.dh
  monkeypatch.setattr(kernel_module, "dh", lambda *a, block_n, **k: (
      dh_block_ns.append(block_n), real_dh(*a, block_n=block_n, **k))[1])
  args = make_inputs(0, T, d, n, E, jnp.bfloat16)

  def loss(*a):   # (one window: the aggregate's windows alias their result too)
    return jnp.sum(sm.moe(*a, k=K, backend=CUTE_GEMMS, kernel_config=config,
                          windows=1).out.astype(jnp.float32))

  text = cuda_module(jax.value_and_grad(loss, argnums=(0, 2, 3)), *args)
  assert text.count(FFI_TARGET) >= 8
  assert set(dh_block_ns) == {min(dh_block_n, 128) if pingpong else dh_block_n}
  # dH written over H: dh's FFI call aliases its output 0 to H (operand 3, after dOg, W2,
  # tile_expert and, when it gathers, the gather index); no other call aliases
  h_operand = 4 if dout_gather_max_column_tiles else 3
  assert re.findall(r"output_operand_alias<[^>]*>", text) == [
      f"output_operand_alias<output_tuple_indices = [0], operand_index = {h_operand}, "
      "operand_tuple_indices = []>"]


@needs_cute
def test_dh_over_h_can_be_turned_off():
  """CuteConfig(dh_over_h=False) (per-op timings) lowers the layer with no operand aliasing."""
  args = make_inputs(0, 256, 256, 128, 8, jnp.bfloat16)
  loss = lambda *a: jnp.sum(sm.moe(*a, k=2, backend=CUTE_GEMMS, windows=1, kernel_config=cute(
      dh_over_h=False)).out.astype(jnp.float32))
  text = cuda_module(jax.value_and_grad(loss, argnums=(0, 2, 3)), *args)
  assert text.count(FFI_TARGET) >= 8 and "output_operand_alias" not in text


@pytest.mark.gpu
@needs_cute
@pytest.mark.parametrize("dh_kernel", ["pingpong", "pingpong_tma"])
def test_cute_layer_with_pingpong_kernels_matches_xla_on_gpu(dh_kernel):
  """The layer with every op on cute, dH (gathering dO's rows: n = 256; register stores or its
  SMEM epilogue), up_proj, down_proj and dx_tilde (TMA stores) on the ping-pong kernels,
  against the xla backend."""
  config = cute(dh_kernel=dh_kernel, up_proj_kernel="pingpong", store_kernel="pingpong_tma")
  T, d, n, E, K = 4096, 1536, 256, 128, 8
  args = make_inputs(3, T, d, n, E, jnp.bfloat16)
  cot = jax.random.normal(jax.random.key(4), (T, d))
  f = lambda backend: jax.grad(lambda *a: jnp.sum(
      sm.moe(*a, k=K, backend=backend, kernel_config=config).out.astype(jnp.float32) * cot),
      argnums=(0, 1, 2, 3))(*args)
  for a, b in zip(f(CUTE_GEMMS), f("xla")):
    assert rel_err(a, b) < 1e-2


def _store_targets_under(field: str, values, args, **base):
  """{value: the FFI targets the cute layer's value_and_grad lowers to (for CUDA) with
  CuteConfig's `field` at that value (and the `base` fields)} (k = 2)."""
  targets = {}
  for value in values:
    config = cute(**base, **{field: value})
    grad = lambda *a: jax.value_and_grad(lambda *b: jnp.sum(sm.moe(
        *b, k=2, backend="cute", kernel_config=config).out.astype(jnp.float32)))(*a)
    targets[value] = set(re.findall(r"@(sonicmoe_cute_\w+)", cuda_module(grad, *args)))
  return targets


def _other_cluster_axis_off(field: str) -> dict:
  """The other wide-store cluster field at 1, so that a test of `field` (store_wide_cluster_m
  or store_wide_cluster_n) sees its clusters alone."""
  return {"store_wide_cluster_n": 1} if field.endswith("_m") else {"store_wide_cluster_m": 1}


def _layer_results_under(field: str, values, shape, seed: int, **base):
  """{value: the cute layer's loss value and its gradients for every input, with CuteConfig's
  `field` at that value (and the `base` fields)}, on random inputs of shape (T, d, n, E, K)
  from seed."""
  T, d, n, E, K = shape
  args = make_inputs(seed, T, d, n, E, jnp.bfloat16)
  cot = jax.random.normal(jax.random.key(seed + 1), (T, d))

  def run(config, *a):
    return jax.value_and_grad(lambda *b: jnp.sum(sm.moe(
        *b, k=K, backend="cute", kernel_config={"cute": config}).out.astype(jnp.float32) * cot),
        argnums=(0, 1, 2, 3))(*a)
  run = jax.jit(run, static_argnums=0)   # (a config is static data: one program per config)
  return {value: run(CuteConfig(**base, **{field: value}), *args) for value in values}


@needs_cute
@pytest.mark.parametrize("d, auto_tile_m", [(768, 128), (384, 192)])
def test_cute_store_tile_m_setting_lowers_the_store_gemms_to_192_row_kernels(
    d, auto_tile_m):
  """store_tile_m 192 lowers (for CUDA) down_proj and dx_tilde to kernels of their own (the
  192-row ping-pong tiles, taking schedule.row_tiles' table) in each of the default's two
  column windows, the other ops' kernels unchanged; "auto" takes 128 rows where 192-wide
  column tiles divide the windows (d = 768: 384 columns each) and 192 rows where they do not
  (d = 384: 128 and 256 columns)."""
  targets = _store_targets_under("store_tile_m", (128, 192, "auto"),
                                 make_inputs(9, 256, d, 128, 4, jnp.bfloat16))
  # (two column windows: each GEMM's windows are two targets)
  assert len(targets[192] - targets[128]) == len(targets[128] - targets[192]) == 4
  assert targets[128] & targets[192]   # the other ops' kernels
  assert targets["auto"] == targets[auto_tile_m]


@pytest.mark.gpu
@needs_cute
@pytest.mark.parametrize("shape", [(4096, 1536, 256, 128, 8), (2048, 2048, 256, 16, 2)])
def test_cute_layer_with_192_row_store_tiles_matches_128_on_gpu(shape):
  """The default layer with its store GEMMs on 192-row tiles (store_tile_m) gives the same
  bits as on 128-row tiles: output and every gradient (two column windows; a 1024-column
  window at d = 2048 in 128-wide tiles)."""
  results = _layer_results_under("store_tile_m", (192, 128), shape, seed=5)
  for got, want in zip(jax.tree.leaves(results[192]), jax.tree.leaves(results[128])):
    np.testing.assert_array_equal(got, want)


@needs_cute
@pytest.mark.parametrize("d, paired", [(768, 4), (384, 2)])
def test_cute_store_cluster_n_setting_lowers_the_store_gemms_to_clustered_kernels(
    d, paired):
  """store_cluster_n 2 lowers (for CUDA) down_proj and dx_tilde to kernels of their own in
  each of the default's two column windows where their column tiles pair up (d = 768: two
  192-wide tiles a window, 4 kernels), and only there (d = 384, on the 192-row tiles 128 wide:
  the 256-column windows' two tiles pair up, the 128-column windows' one does not: 2); the
  other ops' kernels unchanged."""
  targets = _store_targets_under("store_cluster_n", (1, 2),
                                 make_inputs(9, 256, d, 128, 4, jnp.bfloat16))
  assert len(targets[2] - targets[1]) == len(targets[1] - targets[2]) == paired
  assert targets[1] & targets[2]


@pytest.mark.gpu
@needs_cute
@pytest.mark.parametrize("shape", [(4096, 1536, 256, 128, 8), (2048, 768, 256, 16, 2)])
def test_cute_layer_with_clustered_store_gemms_matches_one_cta_on_gpu(shape):
  """The default layer with its store GEMMs in clusters of 2 (store_cluster_n) gives the same
  bits as without: output and every gradient (two column windows of 768 or 384 columns)."""
  results = _layer_results_under("store_cluster_n", (2, 1), shape, seed=7)
  for got, want in zip(jax.tree.leaves(results[2]), jax.tree.leaves(results[1])):
    np.testing.assert_array_equal(got, want)


@needs_cute
def test_cute_store_wide_min_k_routes_each_store_gemm_by_its_contraction(monkeypatch):
  """store_wide_min_k picks the store GEMMs' kernel by contraction, each GEMM on its own: at
  n = 1024, d = 2048 (two 1024-column windows) the down-projection (K = n) leaves the wide
  persistent kernel for the 192-row ping-pong one once the threshold passes 1024, dX~ (K =
  2n) once it passes 2048, and the down-projection's 192-row kernels are the same in both."""
  targets = _store_targets_under("store_wide_min_k", (1024, 2048, 4096),
                                 make_inputs(13, 256, 2048, 1024, 4, jnp.bfloat16))
  down_rows192 = targets[2048] - targets[1024]   # (each GEMM's two windows: two targets)
  assert len(down_rows192) == len(targets[1024] - targets[2048]) == 2
  assert len(targets[4096] - targets[2048]) == len(targets[2048] - targets[4096]) == 2
  assert down_rows192 <= targets[4096]


@needs_cute
@pytest.mark.parametrize("field", ["store_wide_cluster_n", "store_wide_cluster_m"])
def test_cute_store_wide_cluster_settings_lower_the_wide_store_gemms_to_clustered_kernels(field):
  """store_wide_cluster_n 2 (clusters along N) and store_wide_cluster_m 2 (along M) lower
  (for CUDA) the store GEMMs on the wide persistent tiles to kernels of their own: at
  n = 1024, d = 2048 dX~ (K = 2n) in each of its two column windows; the down-projection
  (K = n, on the ping-pong kernel) and the other ops unchanged."""
  targets = _store_targets_under(field, (1, 2), make_inputs(13, 256, 2048, 1024, 4, jnp.bfloat16),
                                 **_other_cluster_axis_off(field))
  assert len(targets[2] - targets[1]) == len(targets[1] - targets[2]) == 2
  assert targets[1] & targets[2]


@needs_cute
def test_store_wide_cluster_m_auto_clusters_along_m_where_the_column_tiles_are_odd():
  """store_wide_cluster_m "auto": along M (2) where the wide store GEMM's column tiles are an
  odd count (2880 = 15 x 192), else 1 (4096 = 16 x 256: clusters along N pair them); a number
  as named."""
  cute_ops = importlib.import_module("ffi.ops")
  along_m = lambda cols, block_n, **fields: cute_ops._store_wide_cluster_m(
      cols, block_n, CuteConfig(**fields))
  assert along_m(2880, 192) == 2 and along_m(4096, 256) == 1 and along_m(1000, 256) == 1
  assert along_m(4096, 256, store_wide_cluster_m=2) == 2
  assert along_m(2880, 192, store_wide_cluster_m=1) == 1


@needs_cute
def test_cute_band_settings_order_the_one_cta_a_tile_kernels_in_bands():
  """band_min_column_tiles picks which one-CTA-a-tile kernels launch their tiles in bands of
  band_m_tiles M tiles: at n = 512 the up-projection has 4 column tiles of 128, so a limit of
  4 bands it (a kernel of its own) and the default of 32 does not; band_m_tiles 0 never bands.
  The other ops (ping-pong and persistent kernels) are unchanged."""
  args = make_inputs(21, 256, 256, 512, 4, jnp.bfloat16)
  default = _store_targets_under("band_min_column_tiles", (32, 4), args)
  assert len(default[4] - default[32]) == len(default[32] - default[4]) == 1
  off = _store_targets_under("band_m_tiles", (0,), args, band_min_column_tiles=4)
  assert off[0] == default[32]


@pytest.mark.gpu
@needs_cute
@pytest.mark.parametrize("config", [dict(), dict(dh_kernel="tma_store", store_kernel="grouped",
                                                  wgrad_kernel="grouped")])
def test_cute_layer_with_banded_tiles_matches_launch_order_on_gpu(config):
  """The layer with every one-CTA-a-tile kernel in bands of 3 M tiles (band_min_column_tiles
  1) gives the same bits as in launch order: the up-projection, and with dH, the store GEMMs
  and the weight gradients on the one-CTA-a-tile kernels too."""
  T, d, n, E, K = 1000, 512, 768, 8, 2
  args = make_inputs(23, T, d, n, E, jnp.bfloat16)
  cot = jax.random.normal(jax.random.key(24), (T, d))

  def run(band_min, *a):
    kernels = cute(band_m_tiles=3, band_min_column_tiles=band_min, **config)
    return jax.value_and_grad(lambda *b: jnp.sum(sm.moe(
        *b, k=K, backend="cute", kernel_config=kernels).out.astype(jnp.float32) * cot),
        argnums=(0, 1, 2, 3))(*a)
  run = jax.jit(run, static_argnums=0)
  for got, want in zip(jax.tree.leaves(run(1, *args)), jax.tree.leaves(run(10**6, *args))):
    np.testing.assert_array_equal(got, want)


@pytest.mark.gpu
@needs_cute
@pytest.mark.parametrize("field", ["store_wide_cluster_n", "store_wide_cluster_m"])
@pytest.mark.parametrize("shape", [(2048, 2048, 1024, 16, 2), (600, 2880, 2880, 8, 2)])
def test_cute_layer_with_clustered_wide_store_gemms_matches_one_cta_on_gpu(shape, field):
  """The layer with its wide store GEMMs (dX~ here) in clusters of 2 gives the same bits as
  without: output and every gradient. Sharing the lhs stages (store_wide_cluster_n), d = 2048
  makes whole pairs of column tiles, d = 2880 192-wide tiles, an odd count padded; sharing the
  rhs stages (store_wide_cluster_m), experts' M tiles in pairs, odd counts' last tiles twice."""
  results = _layer_results_under(field, (2, 1), shape, seed=17, **_other_cluster_axis_off(field))
  for got, want in zip(jax.tree.leaves(results[2]), jax.tree.leaves(results[1])):
    np.testing.assert_array_equal(got, want)


@pytest.mark.gpu
@needs_cute
def test_cute_layer_with_down_proj_on_192_row_tiles_matches_the_wide_kernel_on_gpu(monkeypatch):
  """The layer with its down-projection (a 1024-long contraction, 1024-column windows) on
  the 192-row ping-pong tiles (store_wide_min_k 2048) gives the same bits as on the wide
  persistent kernel (1024): output and every gradient."""
  results = _layer_results_under("store_wide_min_k", (2048, 1024),
                                 (2048, 2048, 1024, 16, 2), seed=15)
  for got, want in zip(jax.tree.leaves(results[2048]), jax.tree.leaves(results[1024])):
    np.testing.assert_array_equal(got, want)


@needs_cute
def test_wgrad_block_n_names_the_weight_gradients_tile():
  """wgrad_block_n: the weight gradients' column tile as named, or "auto": 256 while its last
  tile clips at most clipped_waste_percent of the columns (2880: 6.7% at 256, 2.2% at 128)."""
  cute_ops = importlib.import_module("ffi.ops")
  tile = lambda cols, **fields: cute_ops._wgrad_tile(cols, CuteConfig(**fields))
  assert tile(2880) == 256 and tile(2880, clipped_waste_percent=5) == 128
  assert tile(2880, wgrad_block_n=128) == 128 and tile(4096, wgrad_block_n=128) == 128
  assert tile(1536, wgrad_block_n=256) == 256 and tile(2880, wgrad_block_n=192) == 192
  with pytest.raises(ValueError, match=r"CuteConfig.wgrad_block_n must be one of \('auto', 128, 192, 256\)"):
    CuteConfig(wgrad_block_n=320)


@needs_cute
def test_clipped_tiles_take_the_widest_within_the_waste_limit():
  """_clipped_tile: the widest tile whose last, clipped tile reaches at most
  clipped_waste_percent of the output's columns past it (halving down to the narrowest)."""
  cute_ops = importlib.import_module("ffi.ops")
  tile = lambda cols, widest, percent, narrowest=64: cute_ops._clipped_tile(
      cols, widest, CuteConfig(clipped_waste_percent=percent), narrowest)
  assert tile(4096, 256, 0) == 256 and tile(1536, 256, 0) == 256   # whole tiles: none clipped
  assert tile(2880, 256, 10) == 256    # 12 tiles, 192 of 3072 columns past the output: 6.7%
  assert tile(2880, 256, 5) == 128     # 23 tiles: 64 past it, 2.2%
  assert tile(2880, 256, 0) == 64      # 45 whole tiles
  assert tile(192, 256, 10) == 64 and tile(192, 256, 10, narrowest=128) == 128
  assert tile(5760, 256, 5) == 256     # dW1's 2n at gpt-oss-20b: 2.2%


@needs_cute
def test_wide_store_tiles_take_the_one_clipping_fewer_columns():
  """_store_wide_tile "auto": of 256 and 192 the one whose last tile clips fewer columns (256
  on a tie), 128 past clipped_waste_percent; a set store_wide_block_n is taken as it is."""
  cute_ops = importlib.import_module("ffi.ops")
  tile = lambda cols, **fields: cute_ops._store_wide_tile(cols, CuteConfig(**fields))
  assert tile(4096) == 256 and tile(1536) == 256 and tile(512) == 256   # whole 256 tiles
  assert tile(2880) == 192 and tile(5760) == 192   # 15 and 30 whole tiles (256: 192, 128 past)
  assert tile(2944) == 256      # both clip 128 columns
  assert tile(1600) == 192      # 256: 192 past (12%), 192: 128 past (8%); 10% allowed
  assert tile(1600, clipped_waste_percent=5) == 128
  assert tile(2880, store_wide_block_n=256) == 256 and tile(4096, store_wide_block_n=192) == 192


@needs_cute
def test_cute_dh_kernel_auto_follows_the_model_width():
  """dh_kernel "auto": the ping-pong dH (SMEM epilogue, 128-wide column tiles) up to
  dh_pingpong_max_d, grouped_gemm's dh (TMA stores, 256 wide) past it; dO's rows gathered by
  both kernels at n 1024 (8 and 4 column tiles), an explicit variant kept at every width."""
  cute_ops = importlib.import_module("ffi.ops")
  config = CuteConfig()
  assert config.dh_kernel == "auto"
  limit = config.dh_pingpong_max_d
  assert cute_ops._dh_kernel(limit, config) == "pingpong_tma"
  assert cute_ops._dh_kernel(limit + 512, config) == "tma_store"
  assert (cute_ops._dh_block_n(256, limit, config),
          cute_ops._dh_block_n(256, limit + 512, config)) == (128, 256)
  assert cute_ops._dout_gathered_in_kernel(1024, limit, config)
  assert cute_ops._dout_gathered_in_kernel(1024, limit + 512, config)
  assert cute_ops._dh_kernel(limit, CuteConfig(dh_kernel="registers")) == "registers"


def test_cute_config_fields_are_checked():
  """A CuteConfig field outside its list is refused by name when the config is made, before
  anything compiles (no CuTe DSL needed); a config is hashable data, equal by value; the layer
  refuses a kernel_config of the wrong type or for a backend without choices."""
  for fields, message in [
      (dict(dh_block_n=96), r"dh_block_n must be one of \(64, 128, 256\); got 96"),
      (dict(dh_kernel="fast"), r"dh_kernel must be one of .*'fast'"),
      (dict(up_proj_kernel="fast"), r"up_proj_kernel must be one of .*'fast'"),
      (dict(store_kernel="fast"), r"store_kernel must be one of .*'fast'"),
      (dict(store_wide_kernel="fast"), r"store_wide_kernel must be one of .*'fast'"),
      (dict(store_block_n=256), r"store_block_n must be one of \(128, 192\); got 256"),
      (dict(store_tile_m=256), r"store_tile_m must be one of \('auto', 128, 192\); got 256"),
      (dict(store_cluster_n=4), r"store_cluster_n must be one of \(1, 2\); got 4"),
      (dict(wgrad_kernel="fast"), r"wgrad_kernel must be one of .*'fast'"),
      (dict(wgrad_cluster_m=4), r"wgrad_cluster_m must be one of \(1, 2\); got 4"),
      (dict(store_stages=0), r"store_stages must be at least 1"),
      (dict(dout_gather_max_column_tiles=-1), r"dout_gather_max_column_tiles must be a "
                                              r"non-negative int"),
      (dict(tma_gather="dw1"), r"tma_gather must be a tuple of 'dw1' and 'dw2'; got 'dw1'"),
      (dict(tma_gather=("dw1", "dh")), r"tma_gather must be a tuple of 'dw1' and 'dw2'"),
      (dict(wgrad_padded_clusters=("dw3",)), r"wgrad_padded_clusters must be a tuple of 'dw1' "
                                             r"and 'dw2'; got \('dw3',\)"),
      (dict(store_wide_cluster_m=3), r"store_wide_cluster_m must be one of \('auto', 1, 2\)"),
      (dict(wgrad_dynamic_order=("dw1", "dx")), r"wgrad_dynamic_order must be 'auto' or a tuple "
                                                r"of 'dw1' and 'dw2'; got \('dw1', 'dx'\)"),
      (dict(wgrad_dynamic_order="dw1"), r"got 'dw1'")]:
    with pytest.raises(ValueError, match=message):
      CuteConfig(**fields)
  with pytest.raises(TypeError, match="dh_over_h must be a bool"):
    CuteConfig(dh_over_h=1)
  assert CuteConfig(store_cluster_n=2) == CuteConfig(store_cluster_n=2) != CuteConfig()
  assert hash(CuteConfig(tma_gather=("dw1",))) == hash(CuteConfig(tma_gather=("dw1",)))
  args = make_inputs(6, 256, 128, 128, 4, jnp.float32)
  with pytest.raises(TypeError, match=r"kernel_config\['cute'\] must be a ffi.config.CuteConfig"):
    sm.moe(*args, k=2, backend="xla", kernel_config={"cute": {"store_cluster_n": 2}})
  with pytest.raises(ValueError, match="backend 'xla' has no kernel choices"):
    sm.moe(*args, k=2, backend="xla", kernel_config={"xla": CuteConfig()})


@needs_cute
def test_cute_config_is_bound_to_the_ops_as_static_data():
  """resolve binds a kernel_config to the ops of its backend alone (Configured: equal and
  hashable by value, so a jitted layer caches one program per configuration); ops on another
  backend stay the plain functions."""
  from sonicmoe_jax import backends
  cute_ops = importlib.import_module("ffi.ops")
  spec = {op: "xla" for op in sm.OP_NAMES} | {"dh": "cute", "dw1": "cute"}
  resolve = lambda config: backends.resolve(spec, dtype=jnp.bfloat16, d=256, n=128,
                                            kernel_config=config)
  ops = resolve(cute(store_cluster_n=2))
  assert ops.dh == backends.Configured(cute_ops.dh, CuteConfig(store_cluster_n=2))
  assert ops.dh.fn is cute_ops.dh and ops.dw1.config == CuteConfig(store_cluster_n=2)
  assert ops.up_proj is sm.backends.resolve("xla").up_proj
  assert hash(ops) == hash(resolve(cute(store_cluster_n=2))) and ops == resolve(
      cute(store_cluster_n=2))
  assert ops != resolve(cute(store_cluster_n=1)) and resolve(None).dh is cute_ops.dh


@needs_cute
@pytest.mark.parametrize("d,n,takes_192", [(384, 128, 2), (640, 256, 0), (2048, 256, 0)])
def test_cute_store_block_n_setting_lowers_to_its_own_kernels(d, n, takes_192):
  """store_block_n 192 lowers (for CUDA) down_proj and dx_tilde (takes_192 of the two) to
  other kernels than 128 where 192 divides their columns (d = 384, one window; the loss's
  value keeps the forward's down_proj), and to the same ones where it does not (d = 640 and
  2048). (On the 128-row tiles: store_tile_m "auto" takes 192 rows, 128 wide, where 192 wide
  does not divide the columns.)"""
  args = make_inputs(9, 256, d, n, 4, jnp.bfloat16)
  targets = {}
  for block_n in (128, 192):
    config = cute(store_tile_m=128, store_block_n=block_n)
    grad = lambda *a: jax.value_and_grad(lambda *b: jnp.sum(sm.moe(*b, k=2, windows=1, backend={
        op: "xla" for op in sm.OP_NAMES} | {"down_proj": "cute", "dx_tilde": "cute"},
        kernel_config=config).out.astype(jnp.float32)))(*a)
    targets[block_n] = set(re.findall(r"@(sonicmoe_cute_\w+)", cuda_module(grad, *args)))
  assert len(targets[128]) == len(targets[192]) == 2
  assert len(targets[192] - targets[128]) == takes_192


@needs_cute
def test_cute_wgrad_dynamic_setting_lowers_with_its_counter():
  """wgrad_dynamic_order "auto" with wgrad_dynamic_min_tiles 1: the layer's gathering dW1 (and
  not dW2) runs the persistent kernel in the dynamic tile order, its counter an operand from
  zeros written in place (output 1)."""
  args = make_inputs(0, 256, 256, 128, 8, jnp.bfloat16)

  def loss(*a):
    return jnp.sum(sm.moe(*a, k=2, backend=CUTE_GEMMS, kernel_config=cute(
        wgrad_dynamic_order="auto", wgrad_dynamic_min_tiles=1)).out.astype(jnp.float32))

  text = cuda_module(jax.value_and_grad(loss, argnums=(0, 2, 3)), *args)
  assert re.search(r"output_operand_alias<output_tuple_indices = \[1\], operand_index = 4,", text)
  assert len(re.findall(r"output_operand_alias<output_tuple_indices = \[1\]", text)) == 1


@needs_cute
def test_cute_wgrad_cluster_setting_reaches_the_kernel_where_m_allows(monkeypatch):
  """wgrad_cluster_m 2: the layer's persistent gathering weight gradients (dW1, and dW2
  computed transposed: both of M = d, the gathered rows' width) run in clusters of 2 where M
  makes whole clusters of 128-row tiles, or, for those wgrad_padded_clusters names (dW1 by
  default), one tile more is at most clipped_waste_percent of M (1408: 11 tiles, 12 in
  clusters, 9%; not 384's 3 of 4), else alone; 1: alone."""
  cute_ops = importlib.import_module("ffi.ops")
  calls = []
  real = cute_ops.persistent.weight_grad

  def spy(x, *args, **kw):
    calls.append(("dw2" if kw["transpose_out"] else "dw1", x.shape[1], kw["cluster_m"]))
    return real(x, *args, **kw)

  monkeypatch.setattr(cute_ops.persistent, "weight_grad", spy)

  for d, fields, want in [(256, {}, dict(dw1=2, dw2=2)), (384, {}, dict(dw1=1, dw2=1)),
                          (1408, {}, dict(dw1=2, dw2=1)),
                          (1408, dict(wgrad_padded_clusters=("dw1", "dw2")), dict(dw1=2, dw2=2)),
                          (256, dict(wgrad_cluster_m=1), dict(dw1=1, dw2=1))]:
    loss = lambda *a: jnp.sum(sm.moe(*a, k=2, backend=CUTE_GEMMS, kernel_config=cute(
        **fields)).out.astype(jnp.float32))
    calls.clear()
    cuda_module(jax.grad(loss, argnums=(0, 2, 3)), *make_inputs(0, 256, d, 128, 8, jnp.bfloat16))
    assert sorted(op for op, _, _ in calls) == ["dw1", "dw2"], calls
    assert all(m == d and c == want[op] for op, m, c in calls), (d, fields, calls)


@needs_cute
@pytest.mark.parametrize("wgrad_kernel", ["persistent", "grouped"])
def test_cute_tma_gather_setting_reaches_the_kernels_it_names(wgrad_kernel, monkeypatch):
  """tma_gather names the weight gradients whose gathered rows TMA loads: dW1 (untransposed)
  and dW2 (transposed), on either weight-gradient kernel; the layer lowers with any; both by
  default."""
  cute_ops = importlib.import_module("ffi.ops")
  assert CuteConfig().tma_gather == ("dw1", "dw2")
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
  args = make_inputs(0, 256, 2048, 128, 8, jnp.bfloat16)
  ops = ("dw1", "dw2")
  for setting in [(), ("dw1",), ("dw2",), ops]:
    config = cute(tma_gather=setting, wgrad_kernel=wgrad_kernel,
                  dout_gather_max_column_tiles=1 << 30)   # dH, dW2 gather too
    loss = lambda *a: jnp.sum(sm.moe(*a, k=2, backend=CUTE_GEMMS, kernel_config=config).out.astype(
        jnp.float32))
    calls.clear()
    assert FFI_TARGET in cuda_module(jax.value_and_grad(loss, argnums=(0, 2, 3)), *args)
    assert sorted(calls) == [(op, op in setting) for op in ops], calls


@needs_cute
def test_cute_wgrad_dynamic_auto_takes_dw1_with_many_tiles_an_expert():
  """wgrad_dynamic_order "auto" (the default): dW1 in the dynamic order where an expert's
  output has wgrad_dynamic_min_tiles tiles of BLOCK_M x block_n (partial tiles counted), dW2
  never; a tuple names the ops itself."""
  cute_ops = importlib.import_module("ffi.ops")
  config = CuteConfig()
  assert config.wgrad_dynamic_order == "auto" and config.wgrad_dynamic_min_tiles == 128
  order = lambda *a, config=config: cute_ops._dynamic_order(*a, config)
  assert order("dw1", 2048, 2048, 256)           # olmoe: 16 x 8 tiles
  assert order("dw1", 4096, 2048, 256)           # 120B-n1024: 32 x 8
  assert not order("dw1", 1536, 2048, 256)       # 7B-n1024: 12 x 8
  assert not order("dw1", 4096, 512, 256)        # 30B-n256: 32 x 2
  assert order("dw1", 1920, 2056, 256)           # 15 x 9 with the partial tiles
  assert not order("dw2", 2048, 4096, 256)
  named = CuteConfig(wgrad_dynamic_order=("dw2",))
  assert order("dw2", 256, 256, 256, config=named)
  assert not order("dw1", 4096, 4096, 256, config=named)


@pytest.mark.gpu
@needs_cute
def test_cute_layer_with_persistent_store_gemms_matches_grouped_on_gpu():
  """The layer's output and gradients with store_wide_kernel "persistent" (down_proj and
  dx_tilde on it where their tiles are wide: d 2048, n 1024, and store_wide_min_k 1024 for
  down_proj's contraction; in the default two column windows) are bitwise the grouped
  kernel's."""
  args = make_inputs(75, 600, 2048, 1024, 8, jnp.bfloat16)

  def run(kernel, *a):
    config = cute(store_wide_min_k=1024, store_wide_kernel=kernel)
    out, pullback = jax.vjp(lambda *b: sm.moe(*b, k=2, backend="cute",
                                              kernel_config=config).out, *a)
    return out, pullback(jnp.ones_like(out))
  run = jax.jit(run, static_argnums=0)
  want, got = run("grouped", *args), run("persistent", *args)
  for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
    np.testing.assert_array_equal(g, w)


@pytest.mark.gpu
@needs_cute
@pytest.mark.parametrize("cluster_m,dynamic_order,tma_gather", [
    (1, (), ()), (2, (), ()), (2, ("dw1", "dw2"), ()), (2, ("dw1",), ("dw1", "dw2"))])
def test_cute_layer_with_persistent_weight_grads_matches_grouped_on_gpu(cluster_m, dynamic_order,
                                                                        tma_gather):
  """The layer's gradients with wgrad_kernel "persistent" (dW1 and dW2 gathering their rows on
  it; alone or in clusters of 2, in either tile order, the rows by cp.async or TMA) are bitwise
  those with "grouped"."""
  args = make_inputs(74, 1000, 512, 256, 16, jnp.bfloat16)

  def grad(kernel, *a):
    config = cute(wgrad_cluster_m=cluster_m, wgrad_dynamic_order=dynamic_order,
                  tma_gather=tma_gather, wgrad_kernel=kernel)
    return jax.grad(lambda *b: jnp.sum(sm.moe(*b, k=4, backend="cute", kernel_config=config).out
                                       .astype(jnp.float32)), argnums=(2, 3))(*a)
  grad = jax.jit(grad, static_argnums=0)
  want, got = grad("grouped", *args), grad("persistent", *args)
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
    ((512, 4096, 1024, 8, 2), 8, "registers", "cute"),
    ((1000, 128, 128, 8, 2), 0, "registers", "cute"),    # the narrowest widths it takes
    ((1000, 200, 72, 8, 2), 0, "registers", "cute"),     # padded by the layer to 256, 128
    # widths the column tiles do not divide, each kernel's last tile clipped
    ((1000, 320, 192, 8, 2), 8, "tma_store", "cute"),
    ((2000, 2944, 1472, 16, 4), 0, "registers", "cute"),
    ((2000, 2880, 2880, 16, 4), 8, "auto", "cute")])
def test_cute_gemms_match_xla_on_gpu(shape, dout_gather_max_column_tiles, dh_kernel, backend):
  """Every expert op on cute (dO's rows gathered by XLA, or by dh and dw2; dH's register or TMA
  stores; at d 2048 and 4096, n 1024 dx_tilde on the persistent wide store tiles and down_proj
  on the 192-row ping-pong ones), and backend "cute" for everything (its top-K too), against
  the xla backend: forward and all four gradients."""
  config = cute(dout_gather_max_column_tiles=dout_gather_max_column_tiles, dh_kernel=dh_kernel)
  T, d, n, E, K = shape
  args = make_inputs(3, T, d, n, E, jnp.bfloat16)
  cot = jax.random.normal(jax.random.key(4), (T, d))

  def grads(backend):
    layer = lambda *a: sm.moe(*a, k=K, backend=backend, kernel_config=config).out
    f = lambda *a: jnp.sum(layer(*a).astype(jnp.float32) * cot)
    return layer(*args), jax.grad(f, argnums=(0, 1, 2, 3))(*args)
  out_c, g_c = grads(backend)
  out_x, g_x = grads("xla")
  assert rel_err(out_c, out_x) < 1e-2
  for a, b in zip(g_c, g_x):
    assert rel_err(a, b) < 1e-2


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
  module = cuda_module(fn, *shapes)
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
  module = cuda_module(jax.grad(loss, argnums=(0, 2, 3)), *args)
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
  lower the peak; its backward also gathers dO (for dH and dW2) and X (for dW1) into [T K, d] copies by XLA,
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
