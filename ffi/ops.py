"""Backend "cute": the layer's ops as CuTe DSL kernels behind XLA FFI calls.

The router's top-K (topk.py), the aggregation (gather_sum.py) and the grouped GEMMs on three
schedules (grouped_gemm.py, pingpong.py, persistent.py): up_proj (X's rows gathered in the
kernel, SwiGLU epilogue), down_proj and dx_tilde (the store GEMMs), dh (dO's rows gathered,
the dSwiGLU epilogue, dH written over H), and the varlen-K weight gradients dw1 and dw2 (X's
and dO's rows gathered). Each op picks its schedule and tile by the layer's
shape: the choices are a CuteConfig (ffi/config.py: immutable data; every op takes one as
`config`, the measured defaults unless given); docs/design.md (section 4) says what each
kernel does and why it is the default.
All match float32 references and the xla backend (tests/test_cute_*.py).

Implements every op of the dispatch table; mix it with others, e.g.
backend={"aggregate": "cute"}. The GEMMs need the plan aligned to grouped_gemm.BLOCK_M rows
per expert (ALIGN). On a machine without a GPU the kernels are compiled for sm_90a
(CUTE_DSL_ARCH), so programs using them lower and export there too.
"""
from __future__ import annotations

try:
  import cutlass.cute  # noqa: F401
  import jax_tvm_ffi  # noqa: F401
except ImportError as e:  # the optional extra is missing
  raise ImportError(
      "backend 'cute' needs NVIDIA's CuTe DSL and jax-tvm-ffi: pip install 'sonicmoe-jax[cute]' "
      f"(nvidia-cutlass-dsl>=4.8.1, jax-tvm-ffi>=0.1.3); import failed with: {e}") from e

import dataclasses
import warnings

import jax
import jax.numpy as jnp

from ffi import calls, column_select, gather_sum, grouped_gemm, persistent, pingpong, topk
from ffi.config import DEFAULT, CuteConfig
from sonicmoe_jax.core import schedule
from sonicmoe_jax.core import xla_ops

ALIGN = grouped_gemm.BLOCK_M
CONFIG_TYPE = CuteConfig   # what backends.resolve accepts as this backend's kernel_config

# d's and n's multiple: the contraction's k step (BLOCK_K: d is up_proj's and dh's contraction,
# n down_proj's, 2n dx_tilde's; the gathers copy whole k steps) and the TMA epilogue's column
# chunk. Column tiles wider than that need not divide the widths: the last one is clipped.
WIDTH_MULTIPLE = grouped_gemm.BLOCK_K
# the multiples the layer pads d and n up to for these kernels (sonicmoe_jax/core/padding.py)
WIDTH_MULTIPLES = (WIDTH_MULTIPLE, WIDTH_MULTIPLE)


def _dtype_unsupported(dtype):
  if jnp.dtype(dtype) not in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16)):
    return f"inputs must be bfloat16 or float16; got {jnp.dtype(dtype)}"
  return None


def _widths_unsupported(d: int, n: int):
  for name, width in (("d (model width)", d), ("n (expert width)", n)):
    if width % WIDTH_MULTIPLE:
      return f"{name} must be a multiple of {WIDTH_MULTIPLE}; got {width}"
  return None


def unsupported(dtype, d: int, n: int):
  """Why these kernels cannot run a layer of this input dtype and widths (a sentence naming the
  limit), or None."""
  return _dtype_unsupported(dtype) or _widths_unsupported(d, n)


def check_layer(op: str, dtype, d: int, n: int):
  """Op's up-front check that these kernels can run the layer (`unsupported`): TypeError for
  the dtype, ValueError for the widths, each naming the backend, the op and the limit."""
  for error, reason in ((TypeError, _dtype_unsupported(dtype)),
                        (ValueError, _widths_unsupported(d, n))):
    if reason:
      raise error(f"backend 'cute' ({op}): {reason} (backend 'auto' falls back to one that can "
                  f"run it: xla for float32)")


def _tiles(plan):
  return schedule.tile_experts(plan, grouped_gemm.BLOCK_M)


# why top_k's kernel cannot take logits of this many experts and this k (it then runs
# jax.lax.top_k with a warning), or None: what "auto" asks before picking it
top_k_unsupported = topk.unsupported


def top_k(logits, k, *, config: CuteConfig = DEFAULT):
  """The router's top-K, one warp per token (topk.py); logits it cannot take (E not a multiple
  of 32 or above 1024, k above 32) go to jax.lax.top_k with a warning (the same result)."""
  del config   # (one kernel)
  reason = top_k_unsupported(logits.shape[1], k)
  if reason:
    warnings.warn(f"backend 'cute' top_k: {reason}; using jax.lax.top_k", stacklevel=2)
    return jax.lax.top_k(logits, k)
  return topk.top_k(logits, k)


def rounded_slots(values, counts, offsets, num_slots, *, config: CuteConfig = DEFAULT):
  """Token rounding's placed selection, one CTA per expert (column_select.py); more tokens
  than it holds in registers (T above column_select.MAX_TOKENS) go to XLA's with a warning
  (the same result), and so does a batch under jax.vmap (the kernel writes its slots over a
  buffer it is handed, which a sequential vmap of the call would share between the batch's
  elements)."""
  del config   # (one kernel)
  reason = column_select.unsupported(values.shape[0])
  if reason:
    warnings.warn(f"backend 'cute' rounded_slots: {reason}; using XLA's", stacklevel=2)
    return xla_ops.rounded_slots(values, counts, offsets, num_slots)
  return _kernel_rounded_slots(values, counts, offsets, num_slots)


@jax.custom_batching.custom_vmap
def _placed_by_kernel(values, counts, offsets, num_slots_like):
  return column_select.rounded_slots(values, counts, offsets, num_slots_like.shape[0])


@_placed_by_kernel.def_vmap
def _placed_by_xla_in_batches(axis_size, in_batched, values, counts, offsets, num_slots_like):
  del axis_size
  place = lambda v, c, o: xla_ops.rounded_slots(v, c, o, num_slots_like.shape[0])
  in_axes = [0 if batched else None for batched in in_batched[:3]]
  return jax.vmap(place, in_axes=in_axes)(values, counts, offsets), True


def _kernel_rounded_slots(values, counts, offsets, num_slots: int):
  # (num_slots travels as an array's shape: custom_vmap takes arrays only)
  return _placed_by_kernel(values, counts, offsets, jnp.zeros((num_slots, 0), jnp.int8))


def aggregate(y, scores, plan, into=None, *, config: CuteConfig = DEFAULT):
  """O_t = sum over token t's slots of score * Y_slot (fp32 sum), as xla_ops.aggregate; into
  as xla_ops.aggregate's, written in place (gather_sum.gather_sum)."""
  del config   # (one kernel)
  return gather_sum.gather_sum(y, scores, plan.token_slots, plan.token_offsets, plan.num_tokens,
                               into=into)


# aggregate writes a column window into the wider result itself: the layer's windows chain
# their sums through it instead of concatenating them (layer.window_sum)
AGGREGATE_INTO = True


def _band(cols: int, block_n: int, config: CuteConfig) -> int:
  """The band_m_tiles of a one-CTA-a-tile kernel whose output is cols wide in block_n tiles:
  config.band_m_tiles from config.band_min_column_tiles column tiles on, else 0 (launch
  order: an M tile's column tiles together)."""
  wide = calls.column_tiles(cols, block_n) >= config.band_min_column_tiles
  return config.band_m_tiles if wide else 0


def up_proj(x, w1, plan, *, config: CuteConfig = DEFAULT):
  """H = X_e W1_e and A = SwiGLU(H) per expert group, X's rows gathered in the kernel (or by XLA
  first: config.up_proj_gather_in_kernel off) by the config.up_proj_kernel variant."""
  n = w1.shape[2] // 2
  check_layer("up_proj", x.dtype, x.shape[1], n)
  if config.up_proj_gather_in_kernel and config.up_proj_kernel == "pingpong":
    return pingpong.up_proj(x, w1, _tiles(plan), plan.token_index)
  block_n = _clipped_tile(n, grouped_gemm.UP_PROJ_MAX_BLOCK_N, config)
  band = _band(n, block_n, config)
  if config.up_proj_gather_in_kernel:
    return grouped_gemm.up_proj(x, w1, _tiles(plan), block_n=block_n,
                                gather_index=plan.token_index, band_m_tiles=band)
  return grouped_gemm.up_proj(xla_ops.gather_rows(x, plan.token_index), w1, _tiles(plan),
                              block_n=block_n, band_m_tiles=band)


def _wide_tile(cols: int, widest: int) -> int:
  """block_n: `widest`, halved (down to 64) until it divides the output columns."""
  block_n = widest
  while cols % block_n and block_n > 64:
    block_n //= 2
  return block_n


def _clipped_columns(cols: int, block_n: int) -> int:
  """The columns past an output `cols` wide that its last block_n-wide tile reaches."""
  return calls.column_tiles(cols, block_n) * block_n - cols


def _within_waste(cols: int, block_n: int, config: CuteConfig) -> bool:
  """Whether block_n-wide tiles clip at most config.clipped_waste_percent of `cols`."""
  return 100 * _clipped_columns(cols, block_n) <= config.clipped_waste_percent * cols


def _clipped_tile(cols: int, widest: int, config: CuteConfig, narrowest: int = 64) -> int:
  """block_n of a kernel whose last column tile may be clipped: `widest`, halved (down to
  narrowest) while that tile's columns past the output are more than
  config.clipped_waste_percent of the output's columns."""
  block_n = widest
  while block_n > narrowest and not _within_waste(cols, block_n, config):
    block_n //= 2
  return block_n


def _store_wide_tile(cols: int, config: CuteConfig) -> int:
  """The wide store GEMMs' column tile for an output `cols` wide: config.store_wide_block_n,
  "auto" resolved (of 256 and 192 the one clipping fewer columns, 256 on a tie; 128 where
  that is more than config.clipped_waste_percent of them). At 2880 (gpt-oss-20b) 192 against
  256 took down_proj from 3.84 to 3.28 ms and dX~ from 7.29 to 6.98 on an H100, and dW1
  (5760 columns, 2.2% clipped at 256) from 7.49 to 8.52: the weight gradients, which gather
  their rows again for each column tile, keep 256 (_wgrad_tile)."""
  if config.store_wide_block_n != "auto":
    return config.store_wide_block_n
  block_n = min((256, 192), key=lambda block_n: _clipped_columns(cols, block_n))
  return block_n if _within_waste(cols, block_n, config) else 128


def _store_wide_cluster_m(cols: int, block_n: int, config: CuteConfig) -> int:
  """The wide store GEMMs' CTAs a cluster along M: config.store_wide_cluster_m, "auto"
  resolved (2 where the cols-wide output's block_n-wide column tiles are an odd count, which
  clusters along N would pad with a tile past the output, such as 2880's 15 of 192; measured:
  benchmarks/results/2026-12-07-h100-tile-bands-and-store-clusters/)."""
  if config.store_wide_cluster_m != "auto":
    return config.store_wide_cluster_m
  return 2 if calls.column_tiles(cols, block_n) % 2 else 1


def _store_matmul(lhs, rhs, plan, transpose_rhs: bool, n_out: int, cols, config: CuteConfig):
  """out = lhs_e rhs_e (rhs_e^T with transpose_rhs) per expert group on config.store_kernel,
  or where contraction and output are long (store_wide_min_k, store_wide_min_n) on the wide
  tiles of config.store_wide_kernel (_store_wide_tile's; "persistent" in clusters of
  store_wide_cluster_m, else of store_wide_cluster_n). n_out: the product's columns (they
  pick the kernel); cols=(lo, hi): out's columns lo .. hi - 1 only (the kernels read rhs from
  column lo: no copy). The column tile: _clipped_tile's (the last one may reach past the
  columns), or on the ping-pong register stores halved until it divides them; the ping-pong
  kernels take 192 where store_block_n asks and it divides the columns, or their 192-row
  tiles, 128 wide, where store_tile_m asks; in clusters of store_cluster_n CTAs where their
  column tiles pair up."""
  width = n_out if cols is None else cols[1] - cols[0]
  if lhs.shape[1] >= config.store_wide_min_k and n_out >= config.store_wide_min_n:
    block_n = _store_wide_tile(width, config)
    if config.store_wide_kernel == "persistent":
      cluster_m = _store_wide_cluster_m(width, block_n, config)
      cluster_n = 1 if cluster_m > 1 else config.store_wide_cluster_n
      return persistent.grouped_matmul(lhs, rhs, _tiles(plan), transpose_rhs=transpose_rhs,
                                       block_n=block_n, cols=cols, cluster_m=cluster_m,
                                       cluster_n=cluster_n)
    return grouped_gemm.grouped_matmul(lhs, rhs, _tiles(plan), transpose_rhs=transpose_rhs,
                                       block_n=block_n,
                                       warp_specialized=n_out >= config.store_wide_ws_min_n,
                                       cols=cols)
  if config.store_kernel.startswith("pingpong"):
    widest = config.store_block_n
    # an out past the register stores' 32-bit offsets takes the TMA stores
    tma_store = (config.store_kernel == "pingpong_tma"
                 or not pingpong.register_stores_fit(lhs.shape[0], width))
    # the register stores write whole tiles; the TMA stores clip the last one
    block_n = _clipped_tile(width, 128, config) if tma_store else _wide_tile(width, 128)
    tile_m = config.store_tile_m
    if tile_m == "auto":
      tile_m = pingpong.TILE_M if width % widest == 0 else pingpong.ROW_TILE_M
    if tma_store and tile_m == pingpong.ROW_TILE_M:   # (its widest column tile: 128)
      tiles = schedule.plan_row_tiles(plan, tile_m, pingpong.MMA_M)
    else:   # the plan's 128-row M tiles (the register stores' only ones)
      tile_m, tiles = pingpong.TILE_M, _tiles(plan)
      if width % widest == 0:
        block_n = widest
    cluster_n = config.store_cluster_n
    if not pingpong.cluster_fits(cluster_n, width, block_n):
      cluster_n = 1
    return pingpong.grouped_matmul(lhs, rhs, tiles, transpose_rhs=transpose_rhs, block_n=block_n,
                                   tma_store=tma_store, cols=cols, tile_m=tile_m,
                                   cluster_n=cluster_n)
  block_n = _clipped_tile(width, 128, config)
  return grouped_gemm.grouped_matmul(lhs, rhs, _tiles(plan), transpose_rhs=transpose_rhs,
                                     block_n=block_n, stages=config.store_stages, cols=cols,
                                     band_m_tiles=_band(width, block_n, config))


def down_proj(a, w2, plan, cols=None, *, config: CuteConfig = DEFAULT):
  """Y = A W2_e per expert group (rows in slot order; with cols=(lo, hi) Y's columns
  lo .. hi - 1)."""
  check_layer("down_proj", a.dtype, w2.shape[2], w2.shape[1])
  return _store_matmul(a, w2, plan, False, w2.shape[2], cols, config)


def _dh_kernel(d: int, config: CuteConfig) -> str:
  """dH's kernel variant for model width d: config.dh_kernel, "auto" resolved."""
  if config.dh_kernel == "auto":
    return "pingpong_tma" if d <= config.dh_pingpong_max_d else "tma_store"
  return config.dh_kernel


def _dh_clips(d: int, config: CuteConfig) -> bool:
  """Whether dH's kernel may clip its last column tile: grouped_gemm.dh loading H and storing
  every output by TMA ("tma_store" with dh_h_smem)."""
  return _dh_kernel(d, config) == "tma_store" and config.dh_h_smem


def _dh_block_n(n: int, d: int, config: CuteConfig) -> int:
  """dH's column tile: config.dh_block_n (at most 128 on the ping-pong kernel), halved to
  divide n (or, where the kernel clips its last tile, _clipped_tile's)."""
  widest = (pingpong.widest_block_n(1, "dh") if _dh_kernel(d, config).startswith("pingpong")
            else config.dh_block_n)
  widest = min(config.dh_block_n, widest)
  return _clipped_tile(n, widest, config) if _dh_clips(d, config) else _wide_tile(n, widest)


def _dout_gathered_in_kernel(n: int, d: int, config: CuteConfig) -> bool:
  """Whether dh and dw2 gather dO's rows themselves (dout_gather_max_column_tiles of dH; the
  two ops decide alike, so that XLA's gather, when made, is one copy shared by both)."""
  return (calls.column_tiles(n, _dh_block_n(n, d, config))
          <= config.dout_gather_max_column_tiles)


def _dh_config(h_elements: int, config: CuteConfig) -> CuteConfig | None:
  """The configuration dh runs by for an H of h_elements: config, or where H has more elements
  than the register paths' 32-bit offsets reach, config with dh_kernel "tma_store" (with
  dh_h_smem: H loaded and dH, A' stored by TMA, by coordinates a dimension each), or None where
  dh_h_smem is off (no kernel takes it: XLA's dh)."""
  if h_elements <= calls.MAX_REGISTER_ADDRESSED:
    return config
  return dataclasses.replace(config, dh_kernel="tma_store") if config.dh_h_smem else None


def dh(dout, w2, h, scores, plan, *, config: CuteConfig = DEFAULT):
  """dA' = dO_e W2_e^T fused with dSwiGLU: dH, dS, A' = s A (dO's rows gathered in the kernel
  or by XLA first: _dout_gathered_in_kernel), by the config.dh_kernel variant. An H past the
  32-bit offsets of the kernels' register paths runs on the TMA one (_dh_config), or without
  dh_h_smem goes to xla_ops.dh with a warning."""
  config = _dh_config(h.size, config)
  if config is None:
    warnings.warn(f"backend 'cute' dh: H {h.shape} has more than "
                  f"{calls.MAX_REGISTER_ADDRESSED} elements and dh_h_smem is off; using "
                  f"xla_ops.dh", stacklevel=2)
    return xla_ops.dh(dout, w2, h, scores, plan)
  n, d = w2.shape[1], w2.shape[2]
  check_layer("dh", dout.dtype, d, n)
  kernel = _dh_kernel(d, config)
  block_n = _dh_block_n(n, d, config)
  if _dout_gathered_in_kernel(n, d, config):
    rows, gather = dout, dict(gather_index=plan.token_index)
  else:
    rows, gather = xla_ops.gather_rows(dout, plan.token_index), {}
  if kernel.startswith("pingpong"):
    dh_, a_scaled, ds_parts = pingpong.dh(rows, w2, h, scores, _tiles(plan), block_n=block_n,
                                          over_h=config.dh_over_h,
                                          tma_store=kernel == "pingpong_tma", **gather)
  else:
    dh_, a_scaled, ds_parts = grouped_gemm.dh(rows, w2, h, scores, _tiles(plan), block_n=block_n,
                                              tma_store=kernel == "tma_store",
                                              over_h=config.dh_over_h, h_smem=config.dh_h_smem,
                                              band_m_tiles=_band(n, block_n, config), **gather)
  return dh_, jnp.where(plan.valid, jnp.sum(ds_parts, axis=0), 0.0), a_scaled


def dx_tilde(dh, w1, plan, cols=None, *, config: CuteConfig = DEFAULT):
  """dX~ = dH W1_e^T per expert group (W1 read K-major, not transposed in memory); cols as
  down_proj's."""
  check_layer("dx_tilde", dh.dtype, w1.shape[1], w1.shape[2] // 2)
  return _store_matmul(dh, w1, plan, True, w1.shape[1], cols, config)


def _dynamic_order(op: str, m: int, n: int, block_n: int, config: CuteConfig) -> bool:
  """Whether the persistent weight gradient op ("dw1" or "dw2", out[e] m x n on BLOCK_M x
  block_n tiles) takes the dynamic tile order: config.wgrad_dynamic_order, "auto" resolved."""
  if config.wgrad_dynamic_order == "auto":
    tiles_an_expert = -(-m // persistent.BLOCK_M) * -(-n // block_n)
    return op == "dw1" and tiles_an_expert >= config.wgrad_dynamic_min_tiles
  return op in config.wgrad_dynamic_order


def _gathered_weight_grad(op: str, x, rhs, plan, block_n: int, config: CuteConfig,
                          transpose_out: bool = False):
  """weight_grad (of op, "dw1" or "dw2") with x's rows gathered by the plan's token_index, on
  config.wgrad_kernel (persistent: in the dynamic tile order where wgrad_dynamic_order takes
  op, in clusters of wgrad_cluster_m CTAs where x's width allows (_clusters_fit); its rows by
  TMA where tma_gather takes op)."""
  args = (x, rhs, plan.group_offsets, plan.num_experts)
  tma_gather = op in config.tma_gather
  if config.wgrad_kernel == "grouped":
    return grouped_gemm.weight_grad(*args, block_n=block_n, gather_index=plan.token_index,
                                    transpose_out=transpose_out, group_sizes=plan.group_sizes,
                                    tma_gather=tma_gather,
                                    band_m_tiles=_band(rhs.shape[1], block_n, config))
  cluster_m = config.wgrad_cluster_m if _clusters_fit(op, x.shape[1], tma_gather, config) else 1
  return persistent.weight_grad(*args, plan.token_index, block_n=block_n,
                                transpose_out=transpose_out, group_sizes=plan.group_sizes,
                                dynamic=_dynamic_order(op, x.shape[1], rhs.shape[1], block_n,
                                                       config),
                                cluster_m=cluster_m, tma_gather=tma_gather)


def _clusters_fit(op: str, m: int, tma_gather: bool, config: CuteConfig) -> bool:
  """Whether the persistent weight gradient op ("dw1" or "dw2") of M = m runs in clusters of
  config.wgrad_cluster_m CTAs along M: where they fit (persistent.cluster_fits) and the M
  tiles that whole clusters add past m's own (an odd count's one more) are none, or, for the
  ops config.wgrad_padded_clusters names, hold at most config.clipped_waste_percent of m's
  rows (2880: 23 M tiles in 12 clusters, 128 rows more, 4.4%)."""
  cluster_m, tiles = config.wgrad_cluster_m, calls.column_tiles(m, persistent.BLOCK_M)
  added_rows = (-tiles % cluster_m) * persistent.BLOCK_M
  padding_allowed = (op in config.wgrad_padded_clusters
                     and 100 * added_rows <= config.clipped_waste_percent * m)
  return persistent.cluster_fits(cluster_m, m, tma_gather) and (added_rows == 0 or padding_allowed)


def _gathers_whole_tiles(op: str, m: int, n: int, block_n: int, config: CuteConfig) -> bool:
  """Whether op's weight gradient ([m, n] an expert, block_n-wide tiles) can gather its rows
  in the kernel: by TMA (config.tma_gather: its last M and column tiles may be clipped), or by
  cp.async where BLOCK_M and block_n divide m and n."""
  return op in config.tma_gather or (m % grouped_gemm.BLOCK_M == 0 and n % block_n == 0)


def _wgrad_tile(cols: int, config: CuteConfig) -> int:
  """A weight gradient's column tile: config.wgrad_block_n, or "auto": _clipped_tile's from
  256 (down to 128 on the persistent kernel)."""
  if config.wgrad_block_n != "auto":
    return config.wgrad_block_n
  return _clipped_tile(cols, 256, config, 128 if config.wgrad_kernel == "persistent" else 64)


def dw1(x, dh_, plan, *, config: CuteConfig = DEFAULT):
  """dW1_e = X_e^T dH_e over expert e's rows on _wgrad_tile's column tiles. X's
  rows are gathered in the kernel (by TMA or cp.async: config.tma_gather) where dW1 has at
  most config.dw1_gather_max_column_tiles column tiles (each tile gathers the rows again) and
  the kernel takes the widths (_gathers_whole_tiles), else by XLA first."""
  d, two_n = x.shape[1], dh_.shape[1]
  check_layer("dw1", x.dtype, d, two_n // 2)
  block_n = _wgrad_tile(two_n, config)
  if (calls.column_tiles(two_n, block_n) <= config.dw1_gather_max_column_tiles
      and _gathers_whole_tiles("dw1", d, two_n, block_n, config)):
    return _gathered_weight_grad("dw1", x, dh_, plan, block_n, config)
  return grouped_gemm.weight_grad(xla_ops.gather_rows(x, plan.token_index), dh_,
                                  plan.group_offsets, plan.num_experts, block_n=block_n,
                                  group_sizes=plan.group_sizes,
                                  band_m_tiles=_band(two_n, block_n, config))


def dw2(a_scaled, dout, plan, *, config: CuteConfig = DEFAULT):
  """dW2_e = A'_e^T dO_e over expert e's rows (dO's rows gathered by XLA first), or where
  _dout_gathered_in_kernel computed transposed, dW2_e^T = dO_e^T A'_e with dO's rows gathered
  in the kernel (its gathered operand is the lhs; where the kernel takes the widths:
  _gathers_whole_tiles), stored back as [E, n, d] by the kernel's M-major epilogue."""
  n, d = a_scaled.shape[1], dout.shape[1]
  check_layer("dw2", dout.dtype, d, n)
  if _dout_gathered_in_kernel(n, d, _dh_config(2 * a_scaled.size, config) or config):
    block_n = _wgrad_tile(n, config)
    if _gathers_whole_tiles("dw2", d, n, block_n, config):
      return _gathered_weight_grad("dw2", dout, a_scaled, plan, block_n, config,
                                   transpose_out=True)
  block_n = _clipped_tile(d, 128, config)
  return grouped_gemm.weight_grad(a_scaled, xla_ops.gather_rows(dout, plan.token_index),
                                  plan.group_offsets, plan.num_experts, block_n=block_n,
                                  group_sizes=plan.group_sizes,
                                  band_m_tiles=_band(d, block_n, config))


OPS = dict(top_k=top_k, rounded_slots=rounded_slots, up_proj=up_proj, down_proj=down_proj,
           aggregate=aggregate, dh=dh, dx_tilde=dx_tilde, dw1=dw1, dw2=dw2)
