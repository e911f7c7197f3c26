"""Backend "cute": the layer's ops as CuTe DSL kernels behind XLA FFI calls.

The router's top-K (topk.py), the aggregation (gather_sum.py) and the grouped GEMMs on three
schedules (grouped_gemm.py, pingpong.py, persistent.py): up_proj (X's rows gathered in the
kernel, SwiGLU epilogue), down_proj and dx_tilde (the store GEMMs), dh (dO's rows gathered,
the dSwiGLU epilogue, dH written over H), and the varlen-K weight gradients dw1 and dw2 (X's
and dO's rows gathered). The settings below pick each op's schedule and tile by the layer's
shape; docs/design.md (section 4) says what each kernel does and why it is the default.
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

import warnings

import jax
import jax.numpy as jnp

from ffi import gather_sum, grouped_gemm, persistent, pingpong, topk
from pallas_kernels import schedule
from sonicmoe_jax import xla_ops

ALIGN = grouped_gemm.BLOCK_M
# The up-projection gathers X's rows itself (the same bits as gathering first, no [T*K, d]
# copy), on grouped_gemm's kernel ("grouped": its producer warpgroup copies the rows) or the
# ping-pong kernel ("pingpong": the same bits, no faster on 128-row tiles).
UP_PROJ_GATHER_IN_KERNEL = True
UP_PROJ_KERNEL = "grouped"
UP_PROJ_KERNELS = ("grouped", "pingpong")
# dW1 gathers X's rows itself where its output has at most this many column tiles (each tile
# gathers the rows again); wider outputs read one gather made by XLA.
DW1_GATHER_MAX_COLUMN_TILES = 8
# dO's rows for dh and dw2: gathered by both kernels (dW2 then computed transposed, dW2_e^T =
# dO_e^T A'_e) where dH has at most this many column tiles, else gathered once by XLA and read
# by both. Gathering in the kernels saves the [T*K, d] copy and its memory traffic.
DOUT_GATHER_MAX_COLUMN_TILES = 8
# dH's kernel: "registers" (grouped_gemm.dh storing from registers), "tma_store" (the same
# through SMEM and TMA stores), "pingpong" / "pingpong_tma" (pingpong.dh, one consumer's
# epilogue under the other's mainloop, register or TMA stores), or "auto": "pingpong_tma"
# where d (dH's contraction) is at most DH_PINGPONG_MAX_D, else "tma_store". A short mainloop
# (d / 64 k steps a tile) leaves the epilogue a large share of each tile, which ping-pong hides.
DH_KERNEL = "auto"
DH_KERNELS = ("auto", "registers", "tma_store", "pingpong", "pingpong_tma")
DH_PINGPONG_MAX_D = 1536
# dH's widest column tile (halved until it divides n; the ping-pong dh takes at most 128). 256
# makes n = 256 one column tile, so each M tile reads (and gathers) its dO rows once.
DH_BLOCK_N = 256
# dH's epilogue reads H from SMEM, TMA-loaded over the rhs stages once the mainloop is done
# (grouped_gemm.dh's h_smem), instead of from global memory.
DH_H_SMEM = True
# dH written over H's buffer (FFI operand aliasing): the backward holds one [P, 2n] buffer for
# both. Per-op timings of dh alone turn it off (benchmarks/kernels.py): with H an argument of
# the timed program XLA would copy it first, which the layer's step never does.
DH_OVER_H = True
# down_proj's and dx_tilde's kernel: "grouped" (grouped_gemm.grouped_matmul, STORE_STAGES, its
# TMA-store epilogue overlapping the mainloop of the SM's other CTA), "pingpong"
# (pingpong.grouped_matmul, register stores under the other consumer's mainloop) or
# "pingpong_tma" (the same with each consumer's TMA-store epilogue: register stores' 32-bit
# offsets cannot address outputs past 2^31 elements, which take the TMA stores anyway).
STORE_KERNEL = "pingpong_tma"
STORE_KERNELS = ("grouped", "pingpong", "pingpong_tma")
# The ping-pong store kernels' column tile: 192 where it divides the window's columns (a 128 x
# 192 tile reads 77 operand FLOP per byte against 128 x 128's 64; docs/design.md), else 128.
STORE_BLOCK_N = 192
STORE_BLOCK_NS = (128, 192)
# Their rows a tile: the plan's 128-row M tiles, or 192 rows from each expert's start
# (pingpong.ROW_TILE_M: three m64 wgmmas per consumer on 128-wide column tiles; a table of row
# tiles, schedule.row_tiles); "auto": 192 rows where the 192-wide tile does not divide the
# window's columns, else 128 rows.
STORE_TILE_M = "auto"
STORE_TILE_MS = ("auto",) + pingpong.TILE_MS
# Their CTAs per cluster (pingpong.grouped_matmul's cluster_n): 2 pairs neighbouring column
# tiles of one row tile, which share its lhs stages by TMA multicast (where the column tiles
# pair up; else 1). Bitwise the same; in the layer's step it was not faster on either Hopper
# card, so 1.
STORE_CLUSTER_N = 1
STORE_CLUSTER_NS = pingpong.CLUSTER_NS
# The weight gradients' kernel where they gather rows (dw1's X, dw2's dO): "grouped"
# (grouped_gemm.weight_grad, one CTA per output tile) or "persistent" (persistent.py: CTAs
# looping over tiles, the producer filling the next tile's stages under the epilogue; the same
# bits). Both skip each expert's padding k steps (the plan's group_sizes).
WGRAD_KERNEL = "persistent"
WGRAD_KERNELS = ("grouped", "persistent")
# Which of the persistent gathering weight gradients ("dw1", "dw2") take their tiles in the
# order the CTAs ask for them (an atomic counter, a tile ahead) instead of every grid-th: a
# tuple of those names, or "auto": dW1 where an expert's output has at least
# WGRAD_DYNAMIC_MIN_TILES tiles (many CTAs on one expert's operands, which the static order
# lets drift apart and read again from DRAM), dW2 never.
WGRAD_DYNAMIC_ORDER: str | tuple[str, ...] = "auto"
WGRAD_DYNAMIC_MIN_TILES = 128
# CTAs per cluster of the persistent gathering weight gradients (persistent.CLUSTER_SIZES): 2
# neighbouring M tiles share the rhs's stages by TMA multicast (a third less L2-to-SM traffic a
# stage at block_n 256) where M is a multiple of 256, else 1.
WGRAD_CLUSTER_M = 2
# Which weight gradients ("dw1", "dw2") load their gathered rows by TMA, a box a row (the
# kernels' tma_gather), instead of by their producer threads' cp.async (whose stores into SMEM
# cost LSU time the TMA engine does not): a tuple of those names. The up-projection's and dH's
# rows (K-major: a box a row every k step) stay on cp.async, which is faster there.
TMA_GATHER: tuple[str, ...] = ("dw1", "dw2")


def _setting(name: str, value, choices):
  """A kernel setting of this module (`name`), checked against its choices: ValueError naming
  it otherwise."""
  if value not in choices:
    raise ValueError(f"ffi.ops.{name} must be one of {choices}; got {value!r}")
  return value


# n's multiple: the up-projection's column tile (block_n 128: the gate and up halves each) and
# dW2's rows (the varlen-K kernels' 128-row tiles of [n, d])
N_MULTIPLE = 128


def _dtype_unsupported(dtype):
  if jnp.dtype(dtype) not in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16)):
    return f"inputs must be bfloat16 or float16; got {jnp.dtype(dtype)}"
  return None


def _widths_unsupported(d: int, n: int):
  if d % grouped_gemm.BLOCK_M:
    return f"d (model width) must be a multiple of {grouped_gemm.BLOCK_M}; got d={d}"
  if n % N_MULTIPLE:
    return f"n (expert width) must be a multiple of {N_MULTIPLE}; got n={n}"
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


def top_k(logits, k):
  """The router's top-K, one warp per token (topk.py); logits it cannot take (E not a multiple
  of 32 or above 1024, k above 32) go to jax.lax.top_k with a warning (the same result)."""
  reason = top_k_unsupported(logits.shape[1], k)
  if reason:
    warnings.warn(f"backend 'cute' top_k: {reason}; using jax.lax.top_k", stacklevel=2)
    return jax.lax.top_k(logits, k)
  return topk.top_k(logits, k)


def aggregate(y, scores, plan):
  """O_t = sum over token t's slots of score * Y_slot (fp32 sum), as xla_ops.aggregate."""
  return gather_sum.gather_sum(y, scores, plan.token_slots, plan.token_offsets, plan.num_tokens)


def up_proj(x, w1, plan):
  """H = X_e W1_e and A = SwiGLU(H) per expert group, X's rows gathered in the kernel (or by XLA
  first: UP_PROJ_GATHER_IN_KERNEL = False) by the UP_PROJ_KERNEL variant."""
  check_layer("up_proj", x.dtype, x.shape[1], w1.shape[2] // 2)
  _setting("UP_PROJ_KERNEL", UP_PROJ_KERNEL, UP_PROJ_KERNELS)
  if UP_PROJ_GATHER_IN_KERNEL and UP_PROJ_KERNEL == "pingpong":
    return pingpong.up_proj(x, w1, _tiles(plan), plan.token_index)
  if UP_PROJ_GATHER_IN_KERNEL:
    return grouped_gemm.up_proj(x, w1, _tiles(plan), gather_index=plan.token_index)
  return grouped_gemm.up_proj(xla_ops.gather_rows(x, plan.token_index), w1, _tiles(plan))


def _wide_tile(cols: int, widest: int) -> int:
  """block_n: `widest`, halved (down to 64) until it divides the output columns."""
  block_n = widest
  while cols % block_n and block_n > 64:
    block_n //= 2
  return block_n


# grouped_gemm's store GEMMs: block_n 128 with a 3-stage pipeline (96 KB of SMEM), so two CTAs
# fit on an SM and one's TMA-store epilogue overlaps the other's mainloop.
STORE_STAGES = 3
# Where the contraction is at least STORE_WIDE_MIN_K long and the output at least
# STORE_WIDE_MIN_N wide, down_proj and dx_tilde run 256-wide tiles on STORE_WIDE_KERNEL instead
# (a long mainloop hides less behind the other consumer's epilogue than the wider tile saves
# in operand traffic): at the paper's configs that is dX~ at n = 1024, d >= 2048.
STORE_WIDE_MIN_K = 2048
STORE_WIDE_MIN_N = 2048
# ... with a producer warp issuing the TMA loads (grouped_gemm's warp_specialized) where the
# output is at least STORE_WIDE_WS_MIN_N wide.
STORE_WIDE_WS_MIN_N = 4096
# Those wide tiles' kernel: "grouped" (grouped_gemm.grouped_matmul, one CTA per tile) or
# "persistent" (persistent.py: each tile's epilogue under the next tile's loads; the same bits).
STORE_WIDE_KERNEL = "persistent"
STORE_WIDE_KERNELS = ("grouped", "persistent")


def _store_matmul(lhs, rhs, plan, transpose_rhs: bool, n_out: int, cols=None):
  """out = lhs_e rhs_e (rhs_e^T with transpose_rhs) per expert group on the STORE_KERNEL, or
  where contraction and output are long (STORE_WIDE_MIN_K, STORE_WIDE_MIN_N) on 256-wide tiles:
  persistent.py's (STORE_WIDE_KERNEL "persistent", the default) or grouped_gemm's ("grouped":
  their TMA loads by a producer warp from STORE_WIDE_WS_MIN_N). n_out: the product's columns
  (they pick the kernel); cols=(lo, hi): out's columns lo .. hi - 1 only (the kernels read rhs
  from column lo: no copy), their tile's width halved until it divides them (the ping-pong
  kernels' 192 wide where STORE_BLOCK_N asks and it divides them; or their 192-row tiles, 128
  wide, where STORE_TILE_M asks: "auto" where 192 wide does not divide them), in clusters of
  STORE_CLUSTER_N CTAs where their column tiles pair up)."""
  _setting("STORE_KERNEL", STORE_KERNEL, STORE_KERNELS)
  width = n_out if cols is None else cols[1] - cols[0]
  wide_kernel = _setting("STORE_WIDE_KERNEL", STORE_WIDE_KERNEL, STORE_WIDE_KERNELS)
  if lhs.shape[1] >= STORE_WIDE_MIN_K and n_out >= STORE_WIDE_MIN_N:
    if wide_kernel == "persistent":
      return persistent.grouped_matmul(lhs, rhs, _tiles(plan), transpose_rhs=transpose_rhs,
                                       block_n=_wide_tile(width, 256), cols=cols)
    return grouped_gemm.grouped_matmul(lhs, rhs, _tiles(plan), transpose_rhs=transpose_rhs,
                                       block_n=_wide_tile(width, 256),
                                       warp_specialized=n_out >= STORE_WIDE_WS_MIN_N, cols=cols)
  block_n = _wide_tile(width, 128)
  if STORE_KERNEL.startswith("pingpong"):
    widest = _setting("STORE_BLOCK_N", STORE_BLOCK_N, STORE_BLOCK_NS)
    # an out past the register stores' 32-bit offsets takes the TMA stores
    tma_store = (STORE_KERNEL == "pingpong_tma"
                 or not pingpong.register_stores_fit(lhs.shape[0], width))
    tile_m = _setting("STORE_TILE_M", STORE_TILE_M, STORE_TILE_MS)
    cluster_n = _setting("STORE_CLUSTER_N", STORE_CLUSTER_N, STORE_CLUSTER_NS)
    if tile_m == "auto":
      tile_m = pingpong.TILE_M if width % widest == 0 else pingpong.ROW_TILE_M
    if tma_store and tile_m == pingpong.ROW_TILE_M:   # (its widest column tile: 128)
      tiles = schedule.plan_row_tiles(plan, tile_m, pingpong.MMA_M)
    else:   # the plan's 128-row M tiles (the register stores' only ones)
      tile_m, tiles = pingpong.TILE_M, _tiles(plan)
      if width % widest == 0:
        block_n = widest
    if not pingpong.cluster_fits(cluster_n, width, block_n):
      cluster_n = 1
    return pingpong.grouped_matmul(lhs, rhs, tiles, transpose_rhs=transpose_rhs, block_n=block_n,
                                   tma_store=tma_store, cols=cols, tile_m=tile_m,
                                   cluster_n=cluster_n)
  return grouped_gemm.grouped_matmul(lhs, rhs, _tiles(plan), transpose_rhs=transpose_rhs,
                                     block_n=block_n, stages=STORE_STAGES, cols=cols)


def down_proj(a, w2, plan, cols=None):
  """Y = A W2_e per expert group (rows in slot order; with cols=(lo, hi) Y's columns
  lo .. hi - 1)."""
  check_layer("down_proj", a.dtype, w2.shape[2], w2.shape[1])
  return _store_matmul(a, w2, plan, False, w2.shape[2], cols)


def _dh_kernel(d: int) -> str:
  """dH's kernel variant for model width d: DH_KERNEL, "auto" resolved (DH_PINGPONG_MAX_D)."""
  if _setting("DH_KERNEL", DH_KERNEL, DH_KERNELS) == "auto":
    return "pingpong_tma" if d <= DH_PINGPONG_MAX_D else "tma_store"
  return DH_KERNEL


def _dh_block_n(n: int, d: int) -> int:
  """dH's column tile: DH_BLOCK_N (at most 128 on the ping-pong kernel), halved to divide n."""
  widest = pingpong.widest_block_n(1, "dh") if _dh_kernel(d).startswith("pingpong") else DH_BLOCK_N
  return _wide_tile(n, min(DH_BLOCK_N, widest))


def _dout_gathered_in_kernel(n: int, d: int) -> bool:
  """Whether dh and dw2 gather dO's rows themselves (DOUT_GATHER_MAX_COLUMN_TILES of dH; the
  two ops decide alike, so that XLA's gather, when made, is one copy shared by both)."""
  return n // _dh_block_n(n, d) <= DOUT_GATHER_MAX_COLUMN_TILES


def dh(dout, w2, h, scores, plan):
  """dA' = dO_e W2_e^T fused with dSwiGLU: dH, dS, A' = s A (dO's rows gathered in the kernel
  or by XLA first: _dout_gathered_in_kernel), by the DH_KERNEL variant (_dh_kernel). An H
  past the kernel's 32-bit epilogue offsets goes to xla_ops.dh with a warning."""
  if h.size > grouped_gemm.MAX_REGISTER_ADDRESSED:
    warnings.warn(f"backend 'cute' dh: H {h.shape} has more than "
                  f"{grouped_gemm.MAX_REGISTER_ADDRESSED} elements; using xla_ops.dh", stacklevel=2)
    return xla_ops.dh(dout, w2, h, scores, plan)
  n, d = w2.shape[1], w2.shape[2]
  check_layer("dh", dout.dtype, d, n)
  kernel = _dh_kernel(d)
  if DH_BLOCK_N not in (64, 128, 256):
    raise ValueError(f"ffi.ops.DH_BLOCK_N must be 64, 128 or 256; got {DH_BLOCK_N!r}")
  block_n = _dh_block_n(n, d)
  if _dout_gathered_in_kernel(n, d):
    rows, gather = dout, dict(gather_index=plan.token_index)
  else:
    rows, gather = xla_ops.gather_rows(dout, plan.token_index), {}
  if kernel.startswith("pingpong"):
    dh_, a_scaled, ds_parts = pingpong.dh(rows, w2, h, scores, _tiles(plan), block_n=block_n,
                                          over_h=DH_OVER_H, tma_store=kernel == "pingpong_tma",
                                          **gather)
  else:
    dh_, a_scaled, ds_parts = grouped_gemm.dh(rows, w2, h, scores, _tiles(plan), block_n=block_n,
                                              tma_store=kernel == "tma_store",
                                              over_h=DH_OVER_H, h_smem=DH_H_SMEM, **gather)
  return dh_, jnp.where(plan.valid, jnp.sum(ds_parts, axis=0), 0.0), a_scaled


def dx_tilde(dh, w1, plan, cols=None):
  """dX~ = dH W1_e^T per expert group (W1 read K-major, not transposed in memory); cols as
  down_proj's."""
  check_layer("dx_tilde", dh.dtype, w1.shape[1], w1.shape[2] // 2)
  return _store_matmul(dh, w1, plan, True, w1.shape[1], cols)


def _gathered_weight_grad(op: str, x, rhs, plan, block_n: int, transpose_out: bool = False):
  """weight_grad (of op, "dw1" or "dw2") with x's rows gathered by the plan's token_index, on
  WGRAD_KERNEL (persistent: in the dynamic tile order where WGRAD_DYNAMIC_ORDER takes op, in
  clusters of WGRAD_CLUSTER_M CTAs where x's width allows; its rows by TMA where TMA_GATHER
  takes op)."""
  args = (x, rhs, plan.group_offsets, plan.num_experts)
  if _setting("WGRAD_KERNEL", WGRAD_KERNEL, WGRAD_KERNELS) == "grouped":
    return grouped_gemm.weight_grad(*args, block_n=block_n, gather_index=plan.token_index,
                                    transpose_out=transpose_out, group_sizes=plan.group_sizes,
                                    tma_gather=_tma_gather(op))
  cluster_m = _setting("WGRAD_CLUSTER_M", WGRAD_CLUSTER_M, persistent.CLUSTER_SIZES)
  if not persistent.cluster_fits(cluster_m, x.shape[1]):   # (x's width: M)
    cluster_m = 1
  return persistent.weight_grad(*args, plan.token_index, block_n=block_n,
                                transpose_out=transpose_out, group_sizes=plan.group_sizes,
                                dynamic=_dynamic_order(op, x.shape[1], rhs.shape[1], block_n),
                                cluster_m=cluster_m, tma_gather=_tma_gather(op))


def _ops_named(name: str, value, alternatives: str = "") -> tuple[str, ...]:
  """A setting naming weight gradients (`name`, its value): a tuple of some of "dw1" and
  "dw2"; ValueError naming it (and its `alternatives`, e.g. "'auto' or ") otherwise."""
  if not isinstance(value, tuple) or set(value) - {"dw1", "dw2"}:
    raise ValueError(f"ffi.ops.{name} must be {alternatives}a tuple of 'dw1' and 'dw2'; got "
                     f"{value!r}")
  return value


def _tma_gather(op: str) -> bool:
  """Whether op's kernel loads its gathered rows by TMA: TMA_GATHER."""
  return op in _ops_named("TMA_GATHER", TMA_GATHER)


def _dynamic_order(op: str, m: int, n: int, block_n: int) -> bool:
  """Whether the persistent weight gradient op ("dw1" or "dw2", out[e] m x n on BLOCK_M x
  block_n tiles) takes the dynamic tile order: WGRAD_DYNAMIC_ORDER, "auto" resolved."""
  if WGRAD_DYNAMIC_ORDER == "auto":
    tiles_an_expert = -(-m // persistent.BLOCK_M) * -(-n // block_n)
    return op == "dw1" and tiles_an_expert >= WGRAD_DYNAMIC_MIN_TILES
  return op in _ops_named("WGRAD_DYNAMIC_ORDER", WGRAD_DYNAMIC_ORDER, alternatives="'auto' or ")


def dw1(x, dh_, plan):
  """dW1_e = X_e^T dH_e over expert e's rows; block_n 256 where 2n allows. X's rows are
  gathered in the kernel (by TMA or cp.async: TMA_GATHER) where dW1 has at most
  DW1_GATHER_MAX_COLUMN_TILES column tiles (each tile gathers the rows again), else by XLA
  first."""
  check_layer("dw1", x.dtype, x.shape[1], dh_.shape[1] // 2)
  block_n = _wide_tile(dh_.shape[1], 256)
  if dh_.shape[1] // block_n <= DW1_GATHER_MAX_COLUMN_TILES:
    return _gathered_weight_grad("dw1", x, dh_, plan, block_n)
  return grouped_gemm.weight_grad(xla_ops.gather_rows(x, plan.token_index), dh_,
                                  plan.group_offsets, plan.num_experts, block_n=block_n,
                                  group_sizes=plan.group_sizes)


def dw2(a_scaled, dout, plan):
  """dW2_e = A'_e^T dO_e over expert e's rows (dO's rows gathered by XLA first), or where
  _dout_gathered_in_kernel computed transposed, dW2_e^T = dO_e^T A'_e with dO's rows gathered
  in the kernel (its gathered operand is the lhs), stored back as [E, n, d] by the kernel's
  M-major epilogue."""
  check_layer("dw2", dout.dtype, dout.shape[1], a_scaled.shape[1])
  if _dout_gathered_in_kernel(a_scaled.shape[1], dout.shape[1]):
    return _gathered_weight_grad("dw2", dout, a_scaled, plan, _wide_tile(a_scaled.shape[1], 256),
                                 transpose_out=True)
  return grouped_gemm.weight_grad(a_scaled, xla_ops.gather_rows(dout, plan.token_index),
                                  plan.group_offsets, plan.num_experts,
                                  group_sizes=plan.group_sizes)


OPS = dict(top_k=top_k, up_proj=up_proj, down_proj=down_proj, aggregate=aggregate, dh=dh,
           dx_tilde=dx_tilde, dw1=dw1, dw2=dw2)
