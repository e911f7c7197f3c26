"""Backend "cute": the ops written as CuTe DSL kernels: the router's top-K (topk.py),
aggregation (gather_sum.py) and the grouped GEMMs (grouped_gemm.py; pingpong.py's and
persistent.py's schedules of them where the settings below pick those) up_proj
(SwiGLU epilogue; X's rows gathered in the kernel, UP_PROJ_GATHER_IN_KERNEL), down_proj, dh (the
dSwiGLU epilogue), dx_tilde and the varlen-K weight gradients dw1 (X's rows gathered in the
kernel up to DW1_GATHER_MAX_COLUMN_TILES column tiles) and dw2 (dO's rows for dh and dw2
gathered by both kernels up to DOUT_GATHER_MAX_COLUMN_TILES of dH, else once by XLA; where
they gather, on grouped_gemm's kernel or persistent.py's, WGRAD_KERNEL); the gathering
kernels' copies are issued by a producer warpgroup. All match float32 references
(top_k: jax.lax.top_k) and the xla backend on an H200 (tests/test_cute_*.py). Speed against the
pallas backend: benchmarks/results/2026-11-30-h200-session8 to -session14; the shapes where each
of the GEMMs is the GPU default: sonicmoe_jax/backends.py.

Implements every op of the dispatch table; mix it with others, e.g.
backend={"aggregate": "cute"} (other ops default). The GEMMs need the plan aligned to
grouped_gemm.BLOCK_M rows per expert (ALIGN). On a machine without a GPU the kernels are
compiled for sm_90a (CUTE_DSL_ARCH), so programs using them lower and export there too.
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
# The up-projection gathers X's rows itself (bitwise equal to gathering first, H200 session 6)
UP_PROJ_GATHER_IN_KERNEL = True
# Its kernel when gathering: "grouped" (grouped_gemm.up_proj, the MMA warpgroups issuing the
# copies) or "pingpong" (ffi/pingpong.py, the producer warpgroup gathering; bitwise equal, as
# fast on 128-row tiles: 4.06 vs 4.05 ms at 30B-n256, session 10; 64-row: 4.13 vs 3.88).
# (Persistent CTAs whose producer runs on into the next tile, bitwise equal, were slower in
# H200 session 16: 0.654 vs 0.629 ms at 7B-n256, 3.590 vs 3.440 at 30B-n256; removed.)
# (The ping-pong kernel with an SMEM epilogue storing H and A by TMA, bitwise equal, was slower
# in H200 session 18: 0.646 vs 0.569 ms at 7B-n256, 4.272 vs 3.359 at 30B-n256; removed.)
UP_PROJ_KERNEL = "grouped"
UP_PROJ_KERNELS = ("grouped", "pingpong")
# dW1 gathers X's rows itself (bitwise equal to gathering first) where its output has at most
# this many column tiles (each re-gathers the rows). H200 session 8, forward+backward ms with
# dh, dx_tilde, dw1 on cute, the MMA warpgroups gathering (since replaced): 30B-n256 (2 tiles)
# 23.13 gathering in the kernel vs 23.97 after XLA's gather (and 7.0 vs 11.4 GB of step
# memory); 120B-n1024 (8 tiles) 37.57 vs 36.33. With a producer warpgroup gathering (session
# 14, call 6) 8 tiles win too: dW1 alone at 120B-n1024 7.44 ms vs 6.72 + 1.21 for XLA's gather
# (the MMA warpgroups gathering: 8.06; at 30B-n256 3.69 vs their 3.92).
DW1_GATHER_MAX_COLUMN_TILES = 8
# dO's rows for dh and dw2: gathered by both kernels themselves (dW2 then computed transposed:
# dW2_e^T = dO_e^T A'_e) where dH has at most this many column tiles (each re-gathers the
# rows), else once by XLA (the two ops share the [T*K, d] copy). H200 session 9, forward +
# backward ms with dh, dx_tilde, dw1, dw2 on cute, XLA's gather -> the kernels': 7B-n256 (2
# tiles) 3.64 -> 3.50, 30B-n256 (2) 22.60 -> 21.17; 7B-n1024 (8) 3.08 -> 3.20, 120B-n1024 (8)
# 35.91 -> 37.33, olmoe (8) 18.20 -> 18.71 (step memory 9.3 -> 6.6 and 5.7 -> 3.5 GB there),
# the MMA warpgroups gathering (block_n 128). Session 14, a producer warpgroup gathering, at
# block_n 256 (4 tiles at n = 1024): dh + dw2 alone at 120B-n1024 8.26 ms against 9.00 for
# XLA's shared gather and the two on its copy (the MMA warpgroups gathering: 8.75).
DOUT_GATHER_MAX_COLUMN_TILES = 8
# The dH kernel's variant: "registers" (grouped_gemm.dh storing dH and A' from registers),
# "tma_store" (the same through SMEM and TMA stores: 2.56 vs 2.69 ms at 30B-n256 in session
# 8's sweep) or "pingpong" (ffi/pingpong.py; its 64-row-tile version was bitwise equal to
# "registers" but slower: 3.53 vs 2.78 ms at 30B-n256, session 9; on 128-row tiles bitwise
# equal and as fast, session 10: 2.76 vs 2.75 ms, gathering dO 2.93 vs 3.02, one sweep each:
# not enough to switch). With DH_H_SMEM, "tma_store" writes dH over H's
# tile in SMEM and A' over the lhs stages, all stored by TMA: H200 session 16's sweep, ms,
# registers vs tma_store + h_smem (dO gathered in the kernel where it is): 7B-n256 0.738 vs
# 0.538, 30B-n256 2.483 vs 2.160, olmoe 3.131 vs 2.465, 120B-n1024 4.467 vs 3.840; Nsight
# Compute's excess global sectors at 7B-n256 from 32% to none. Those run dH with over_h off; in
# the layer (dH over H) the gain is smaller: dH's kernel 0.504 -> 0.467 ms at 7B-n256, 2.585 ->
# 2.485 at olmoe. (Session 16 also tried the producer loading H's tile as the last k steps
# free the stages: bitwise equal, no gain in the layer; removed.) "pingpong_tma": the ping-pong
# dH with its SMEM epilogue (pingpong.dh's tma_store: each consumer's epilogue, one 64-column
# chunk at a time through buffers of its own, under the other's mainloop; written in session
# 16). "auto": "pingpong_tma" where d (dH's contraction) is at most DH_PINGPONG_MAX_D, else
# "tma_store". (Persistent CTAs with H's tiles loaded under the mainloop into epilogue buffers
# of their own, bitwise equal, were 10-18% slower in H200 session 23 at block_n 128, their
# widest: 30B-n256 2.766 vs 2.347 ms, olmoe 2.986 vs 2.702; removed.)
DH_KERNEL = "auto"
DH_KERNELS = ("auto", "registers", "tma_store", "pingpong", "pingpong_tma")
# A short mainloop (d / 64 k steps per tile) leaves the epilogue a larger share of each tile,
# which the ping-pong kernel hides under the other consumer's mainloop. H200 session 17, the
# layer's dH kernel, ms, tma_store vs pingpong_tma: 7B-n256 (d 1536) 0.467 vs 0.437 (kernels
# fwd+bwd 3.238 vs 3.196); olmoe (d 2048) 2.505 vs 2.558 (16.470 vs 16.583).
DH_PINGPONG_MAX_D = 1536
# dH's widest column tile (block_n: halved until it divides n). 256 (grouped_gemm's dh only; the
# ping-pong dh takes at most 128) makes n = 256 one column tile, so each M tile reads (and
# gathers) its dO rows once instead of twice (174 registers, no stack, one CTA per SM). H200
# session 12's sweep, ms, 256 vs 128 (each at its best stage count): 30B-n256 gathering dO
# 2.600 vs 3.011; 7B-n256 0.737 vs 0.790; olmoe (dO gathered by XLA) 3.368 vs 3.509.
DH_BLOCK_N = 256
# dH's epilogue reads H from SMEM, TMA-loaded over the rhs stages once the mainloop is done
# (grouped_gemm.dh's h_smem; the ping-pong dH reads it from global memory). Session 16: with
# register stores alone 7B-n256 0.738 -> 0.631 ms; with "tma_store" see DH_KERNEL.
DH_H_SMEM = True
# dH written over H's buffer (FFI operand aliasing: the backward then holds one [P, 2n] buffer
# for both). Per-op timings of dh alone turn it off (benchmarks/kernels.py): with H an argument
# of the timed program XLA would copy it first, which the layer's step never does.
DH_OVER_H = True
# down_proj's and dx_tilde's kernel: "grouped" (grouped_gemm.grouped_matmul, STORE_STAGES, its
# TMA-store epilogue overlapping the mainloop of the SM's other CTA), "pingpong"
# (pingpong.grouped_matmul: register stores under the other consumer's mainloop) or
# "pingpong_tma" (the same with each consumer's TMA-store epilogue). H200 session 11, ms at
# 7B-n256 / 30B-n256: down_proj 0.438 / 2.680 grouped, 0.336 / 2.049 pingpong_tma; dx_tilde
# 0.654 / 4.054 and 0.547 / 3.466; the layer 21.70 -> 20.88 at 30B-n256. Register stores: 0.751
# for down_proj at 7B-n256, and their 32-bit offsets cannot address outs past 2^31 elements
# (such outs take the TMA stores).
STORE_KERNEL = "pingpong_tma"
STORE_KERNELS = ("grouped", "pingpong", "pingpong_tma")
# The ping-pong store kernels' column tile: 128, or 192 where it divides the window's columns
# (d = 1536: the 7B configs; a 128 x 192 tile reads 77 operand FLOP per byte against 64,
# benchmarks/NOTES.md "Operand traffic of the store GEMMs"), else 128. H200 session 27
# (results/2026-12-02-h200-session27, call 7), ms, 128 vs 192: alone (full width) 7B-n256
# down_proj 0.345 vs 0.308, dx_tilde 0.547 vs 0.526; 7B-n1024 0.267 vs 0.268, 0.485 vs 0.470;
# the step's kernels, two rounds each: 7B-n256 3.066 / 3.056 vs 3.051 / 3.048, 7B-n1024 2.528
# / 2.544 vs 2.504 / 2.509.
STORE_BLOCK_N = 192
STORE_BLOCK_NS = (128, 192)
# The ping-pong store kernels' rows a tile (with TMA stores): the plan's 128-row M tiles, or
# 192 rows from each expert's start (pingpong.ROW_TILE_M: three m64 wgmmas per consumer on
# 128-wide column tiles, the tile shape quack's 192x128 ping-pong runs; a table of row tiles,
# schedule.row_tiles); "auto": 192 rows where STORE_BLOCK_N's 192-wide tile does not divide
# the window's columns (30B-n256's 2048-column windows), else 128 rows (the 7B configs' 128 x
# 192 tiles, level with 192 x 128 there). H200 session 33 (results/2026-12-03-h200-session33,
# call 2), the step's GEMMs, two rounds, ms, 128 rows (dX~ on clipped 128 x 192 tiles) vs 192
# rows: 30B-n256 dX~ 3.469 / 3.444 vs 3.250 / 3.239, down_proj 1.955 / 1.958 vs 1.939 /
# 1.940; 7B-n256 dX~ 0.480 / 0.480 vs 0.481 / 0.483, down_proj 0.287 / 0.291 vs 0.289 /
# 0.291. (quack's dX~ at 30B-n256, session 32: 3.212 ms on its 192x128 tile.) Session 32's
# 128-row tiles 192 wide with the last one clipped (pingpong.column_tiles) had taken that dX~
# to 3.485 from 3.630 on 128 x 128 (results/2026-12-03-h200-session32, calls 10-13); the
# 192-row tiles replaced them.
STORE_TILE_M = "auto"
STORE_TILE_MS = ("auto",) + pingpong.TILE_MS
# The ping-pong store kernels' CTAs per cluster (pingpong.grouped_matmul's cluster_n): 2 pairs
# neighbouring column tiles of one row tile, which share its lhs stages by TMA multicast (where
# the column tiles are an even number; else 1). On the H200 (session 40, results/2026-12-03-
# h200-session40) they were bitwise right but dX~ 0.7-1.5% slower at 7B-n256 and 30B-n256, the
# down-projection level. On an H100 (session 49, results/2026-12-05-h100-session49) the PyTorch
# SonicMoE's store GEMMs, in clusters of 2 there, led ours at 7B-n256 by 5% (down-projection,
# one window) and 11% (dX~): rebuilt to measure them there. On that H100 (session 50,
# results/2026-12-05-h100-session50) the clustered 192-wide dX~ led alone by 5% on the whole
# product, but in the step at 7B-n256 (two rounds) the down-projection and dX~ each ran 1.6%
# slower in clusters (0.378 / 0.548 vs 0.372 / 0.540 ms): 1 on both cards.
STORE_CLUSTER_N = 1
STORE_CLUSTER_NS = pingpong.CLUSTER_NS


# The weight gradients' kernel where they gather rows (dw1's X, dw2's dO): "grouped"
# (grouped_gemm.weight_grad, one CTA per output tile) or "persistent" (persistent.py:
# CTAs looping over tiles, the producer filling the next tile's stages under the epilogue;
# bitwise the same on the H200). H200 session 21's sweep (block_n 256, stages as fit), ms,
# grouped vs persistent: dW1 30B-n256 3.729 vs 3.546, olmoe 3.353 vs 3.319, 7B-n256 0.596 vs
# 0.557; dW2 1.992 vs 1.915, 1.758 vs 1.726, 0.323 vs 0.311; session 22: dW1 120B-n1024
# 7.438 vs 7.258, 7B-n1024 0.588 vs 0.570; dW2 3.614 vs 3.438, 0.321 vs 0.322. The layer with
# it matches the grouped kernel's on the H200 (session 22, call 3). Since session 28 the
# persistent kernels' epilogue rolls (a tile's last stores read on under the next tile's
# mainloop; results/2026-12-02-h200-session28): alone dX~ 3-4% faster at olmoe and
# 120B-n1024, the rest level; the step's wall time 0.4-2% less in four pairings. Both weight
# gradients get the plan's group_sizes and skip each expert's padding k steps (session 29: in
# the step 3.1% less weight-gradient time at 30B-n256, 1.1-1.6% at the 7B configs, level at
# olmoe and 120B-n1024, where an expert has 32-64 k steps).
WGRAD_KERNEL = "persistent"
WGRAD_KERNELS = ("grouped", "persistent")
# Which of the persistent gathering weight gradients ("dw1", "dw2") take their tiles in the
# order the CTAs ask for them (persistent.weight_grad dynamic: a tile ahead, from an atomic
# counter) instead of every grid-th: a tuple of those names, or "auto": dW1 where an expert's
# output has at least WGRAD_DYNAMIC_MIN_TILES tiles (many CTAs on one expert's operands, which
# the static order lets drift apart), dW2 never. H200 session 43 (results/2026-12-03-h200-
# session43), the step's dW1, two rounds, dynamic / static (tiles an expert): olmoe 0.976 (128),
# 120B-n1024 0.986 (256), 7B-n1024 1.002 (96), 30B-n256 1.009 (64), 7B-n256 1.002 (24); dW2
# dynamic at olmoe 1.006. Under Nsight Compute olmoe's dW1 read 2.8 GB from DRAM dynamic,
# 3.8 GB static (session 42; the operands hold 2.15 GB).
WGRAD_DYNAMIC_ORDER: str | tuple[str, ...] = "auto"
WGRAD_DYNAMIC_MIN_TILES = 128
# CTAs per cluster of the persistent gathering weight gradients (persistent.CLUSTER_SIZES):
# 2, neighbouring M tiles share the rhs's stages by TMA multicast (one third less L2-to-SM
# traffic a stage at block_n 256), where M is a multiple of 256, else 1. Built in session 43
# (the PyTorch SonicMoE's dW1 at olmoe: 256 x 192 tiles in clusters of 2, 0.57 of our L2
# bytes). Measured (benchmarks/results/2026-12-04-h200-session44), the step's dW1 and dW2,
# two rounds, clusters of 2 / 1: olmoe 0.970, 0.994; 120B-n1024 0.964, 0.958 (its other GEMMs
# 0.96-0.97 in that round too: alone in the sweep 0.98-0.99); 30B-n256 0.989, 0.976;
# 7B-n1024 0.985, 0.996; 7B-n256 1.001, 0.996.
WGRAD_CLUSTER_M = 2
# Which weight gradients ("dw1", "dw2") load their gathered rows by TMA, a box a row (the
# kernels' tma_gather), instead of by their producer threads' cp.async: a tuple of those
# names. Built in session 47 after probes of olmoe's dW1
# (the rows' LSU writes into SMEM cost 0.4 ms over the wgmmas' 2.7 there, the rhs's TMA loads,
# twice the bytes, 0.09). Measured (results/2026-12-04-h200-session47), the step's dW1 and
# dW2, two rounds, TMA / cp.async: olmoe 0.943, 0.960; 120B-n1024 0.894, 0.940; 30B-n256
# 0.957, 0.960; 7B-n256 0.960, 0.973; 7B-n1024 0.968, 0.972 (the same bits: GPU tests). The
# up-projection's and dH's rows (K-major: a box a row every k step, 128 a stage) ran 6-40%
# slower by TMA than by cp.async (session 48) and were removed.
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


# The plain-epilogue GEMMs' tile: block_n 128 with a 3-stage pipeline (96 KB of SMEM: two CTAs
# fit on an SM, so one's TMA-store epilogue can overlap the other's mainloop). Session 7's sweep at
# 30B-n256, ms: down_proj 2.81, dx_tilde 4.07 this way; 2.92-2.97 and 4.29-4.33 at block_n 256;
# 3.48 and 4.85 at block_n 128 with as many stages as fit (one CTA per SM).
STORE_STAGES = 3
# Where the contraction is at least STORE_WIDE_MIN_K long and the output at least
# STORE_WIDE_MIN_N wide, down_proj and dx_tilde run grouped_gemm's kernel at block_n 256 with as
# many stages as fit instead (a long mainloop hides less behind the other CTA's epilogue than
# the wider tile saves). H200 session 14 (-session14), alone at 120B-n1024 (call 10), ms:
# dx_tilde (K 2048) 6.954 vs 7.440-7.735 pingpong_tma, down_proj (K 1024) 3.506 vs
# 3.582-3.641; the layer's kernel ms (call 13): 120B-n1024 36.27 -> 33.10, olmoe (d 2048)
# 17.15 -> 16.69, 7B-n1024 (d 1536) 2.71 -> 2.76. Since then the 192-row ping-pong tiles
# (session 33) beat it at K 1024: session 35's sweep (-session35 calls 13-14, alone, 3 rounds
# interleaved), down_proj ms: 120B-n1024 3.294 vs 3.640 persistent, olmoe 1.523 vs 1.606; so
# only dx_tilde (K = 2n = 2048) at those two stays on the wide tiles.
STORE_WIDE_MIN_K = 2048
STORE_WIDE_MIN_N = 2048
# ... and where the output is at least STORE_WIDE_WS_MIN_N wide, with a producer warp issuing
# the TMA loads (warp_specialized; bitwise the same). H200 session 15's sweep, ms, MMA
# warpgroups loading vs the producer: 120B-n1024 (N 4096) dx_tilde 7.029 vs 6.445, down_proj
# 3.492 vs 3.398; olmoe (N 2048) 3.140 vs 3.173 and 1.726 vs 1.751. The layer's kernels at
# 120B-n1024: 33.77 -> 33.47 ms.
STORE_WIDE_WS_MIN_N = 4096
# Those wide tiles' kernel: "grouped" (grouped_gemm.grouped_matmul, one CTA per tile) or
# "persistent" (persistent.py: CTAs looping over tiles, each tile's epilogue under the next
# tile's loads; bitwise the same). Session 22 (results/2026-12-01-h200-session22, calls 3-4),
# alone: olmoe down_proj 1.692 -> 1.580 ms, dx_tilde 3.030 -> 2.950; 120B-n1024 down_proj
# 3.358 (warp-specialized) -> 3.353, dx_tilde 6.959 -> 6.928; the step's kernels olmoe 16.503
# -> 16.167, 120B-n1024 33.183 -> 32.552 (it takes the place of the warp-specialized kernel).
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
