"""Varlen-M grouped GEMM over an expert-aligned routing plan, with fused epilogues.

Rows of `lhs` are the plan's slots; every M tile of `block_m` rows belongs to one expert
(`tile_expert[m]`, see schedule.py), so a tile multiplies by that expert's weight matrix and
stores full tiles (padding rows are zero in, zero out). Tiles past the last group run no GEMM
and store zeros through the same epilogue.

Tiling (one work item = one output tile):
  grid      : (num_m_tiles * num_col_tiles,) work items, row-major (consecutive items share
              the lhs rows and the expert), visited by a persistent loop over the SMs
  mainloop  : for kk in range(K // block_k): acc_j += lhs[m, kk] @ rhs_e[kk, col_j]
              lhs and rhs blocks arrive by TMA through a `stages`-deep pipeline; one
              accumulator per rhs column block (the up-projection uses two: gate and up)
  epilogue  : a small function of (m, col tile, accumulators) that writes the outputs

Epilogues: `store` (Y = A W2, dX~ = dH W1^T), `swiglu` (H and A = silu(gate) * up) and
`dswiglu` (the dH kernel: dS partials, dH, A' from dA', H and the scores).
"""
from __future__ import annotations

import functools
from typing import Callable, Sequence

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels import config as cfg_lib
from pallas_kernels.config import TileConfig

_F32 = jnp.float32


def _mainloop(lhs_ref, rhs_ref, m, col_blocks: Sequence, k_dim: int, cfg: TileConfig,
              transpose_rhs: bool):
  """Accumulators [block_m, block_n] fp32, one per entry of col_blocks."""
  bm, bn, bk = cfg.block_m, cfg.block_n, cfg.block_k

  def rhs_spec(col):
    if transpose_rhs:  # rhs_e is [N, K]: read a (block_n, block_k) block, transpose in wgmma
      return plgpu.BlockSpec((bn, bk), lambda kk: (col, kk), delay_release=1)
    return plgpu.BlockSpec((bk, bn), lambda kk: (kk, col), delay_release=1)

  def scope(*acc_refs):
    def step(_, lhs_smem, *rhs_smems):
      for acc_ref, rhs_smem in zip(acc_refs, rhs_smems):
        b = plgpu.transpose_ref(rhs_smem, (1, 0)) if transpose_rhs else rhs_smem
        plgpu.wgmma(acc_ref, lhs_smem, b)

    plgpu.emit_pipeline(
        step,
        grid=(k_dim // bk,),
        in_specs=[plgpu.BlockSpec((bm, bk), lambda kk: (m, kk), delay_release=1),
                  *[rhs_spec(c) for c in col_blocks]],
        max_concurrent_steps=cfg.stages,
    )(lhs_ref, *([rhs_ref] * len(col_blocks)))
    return tuple(acc_ref[...] for acc_ref in acc_refs)

  return pl.run_scoped(scope, *[plgpu.ACC((bm, bn), _F32) for _ in col_blocks])


def _annotate(x, layout):
  """A layout hint for Mosaic GPU's layout inference (interpret mode has no layouts)."""
  return x if cfg_lib.interpret_mode() is not None else plgpu.layout_cast(x, layout)


def _zeros(cfg: TileConfig):
  return jnp.zeros((cfg.block_m, cfg.block_n), _F32)


def _store_tiles(tiles_and_dsts):
  """Stage register tiles in SMEM and TMA-store them; tiles_and_dsts: [(array, gmem ref view)]."""
  def scope(*smems):
    for smem, (tile, _) in zip(smems, tiles_and_dsts):
      smem[...] = tile.astype(smem.dtype)
    plgpu.commit_smem()
    for smem, (_, dst) in zip(smems, tiles_and_dsts):
      plgpu.copy_smem_to_gmem(smem, dst)
    plgpu.wait_smem_to_gmem(0, wait_read_only=True)

  pl.run_scoped(scope, *[plgpu.SMEM(t.shape, dst.dtype) for t, dst in tiles_and_dsts])


def for_each_tile(tile_expert_ref, num_m_tiles: int, num_col_tiles: int, num_experts: int,
                  run_tile, empty_tile):
  """The persistent loop over (m tile, column tile) work items, row-major (consecutive items
  share the lhs rows and the expert): run_tile(m, col, expert) where the tile belongs to an
  expert, empty_tile(m, col) for tiles past the last group."""
  @plgpu.nd_loop((num_m_tiles * num_col_tiles,), collective_axes="sm")
  def _work_item(info):
    m, col = info.index[0] // num_col_tiles, info.index[0] % num_col_tiles
    expert = tile_expert_ref[m]
    pl.when(expert < num_experts)(lambda: run_tile(m, col, expert))
    pl.when(expert >= num_experts)(lambda: empty_tile(m, col))


def varlen_m(lhs, rhs, tile_expert, extra_inputs: Sequence[jax.Array], *, col_blocks: Callable,
             num_col_tiles: int, transpose_rhs: bool, epilogue: Callable, out_types,
             cfg: TileConfig):
  """Runs the persistent grouped GEMM; `epilogue(m, col, accs, extra_refs, out_refs)`."""
  num_slots, k_dim = lhs.shape
  num_experts = rhs.shape[0]
  num_m_tiles = num_slots // cfg.block_m
  if k_dim % cfg.block_k:
    raise ValueError(f"contraction dim {k_dim} must be a multiple of block_k={cfg.block_k}")
  num_extra = len(extra_inputs)

  def body(tile_expert_ref, lhs_ref, rhs_ref, *refs):
    extra_refs, out_refs = refs[:num_extra], refs[num_extra:]

    def run_tile(m, col, expert):
      accs = _mainloop(lhs_ref, rhs_ref.at[expert], m, col_blocks(col), k_dim, cfg, transpose_rhs)
      epilogue(m, col, accs, extra_refs, out_refs)

    def empty_tile(m, col):  # past the last group: no GEMM, zeros through the same epilogue
      epilogue(m, col, tuple(_zeros(cfg) for _ in col_blocks(col)), extra_refs, out_refs)

    for_each_tile(tile_expert_ref, num_m_tiles, num_col_tiles, num_experts, run_tile, empty_tile)

  kernel = plgpu.kernel(body, out_type=out_types, grid=(cfg_lib.num_sms(),), grid_names=("sm",),
                        compiler_params=cfg_lib.compiler_params(),
                        interpret=cfg_lib.interpret_mode())
  return kernel(tile_expert, lhs, rhs, *extra_inputs)


# ----------------------------------------------------------------------------- epilogues

def store_epilogue(cfg: TileConfig):
  """out[m tile, col tile] = acc."""
  bm, bn = cfg.block_m, cfg.block_n

  def epilogue(m, col, accs, _extra, outs):
    (acc,), (out_ref,) = accs, outs
    _store_tiles([(acc, out_ref.at[pl.ds(m * bm, bm), pl.ds(col * bn, bn)])])
  return epilogue


def _silu_parts(gate):
  sig = 1.0 / (1.0 + jnp.exp(-gate))
  return sig, gate * sig


def swiglu_epilogue(cfg: TileConfig, n: int):
  """H[:, gate cols] = g, H[:, n + cols] = u, A[:, cols] = silu(g) * u."""
  bm, bn = cfg.block_m, cfg.block_n

  def epilogue(m, col, accs, _extra, outs):
    gate, up = accs
    h_ref, a_ref = outs
    _, silu = _silu_parts(gate)
    rows = pl.ds(m * bm, bm)
    _store_tiles([(gate, h_ref.at[rows, pl.ds(col * bn, bn)]),
                  (up, h_ref.at[rows, pl.ds(n + col * bn, bn)]),
                  (silu * up, a_ref.at[rows, pl.ds(col * bn, bn)])])
  return epilogue


def dswiglu_epilogue(cfg: TileConfig, n: int):
  """From dA' (the accumulator), H and the scores s of the tile's rows:
  dS partial = sum over the tile's columns of dA' * A (A recomputed from H),
  dH = dSwiGLU(s dA', H) into both halves, A' = s A."""
  bm, bn = cfg.block_m, cfg.block_n

  def epilogue(m, col, accs, extra, outs):
    (da_prime,) = accs
    h_ref, scores_ref = extra
    dh_ref, a_scaled_ref, ds_ref = outs
    rows = pl.ds(m * bm, bm)
    gate_cols, up_cols = pl.ds(col * bn, bn), pl.ds(n + col * bn, bn)

    def load_scope(gate_smem, up_smem, s_smem, barriers):
      plgpu.copy_gmem_to_smem(h_ref.at[rows, gate_cols], gate_smem, barriers.at[0])
      plgpu.copy_gmem_to_smem(h_ref.at[rows, up_cols], up_smem, barriers.at[1])
      plgpu.copy_gmem_to_smem(scores_ref.at[rows], s_smem, barriers.at[2])
      for i in range(3):
        plgpu.barrier_wait(barriers.at[i])
      wgmma = plgpu.Layout.WGMMA
      return (_annotate(gate_smem[...], wgmma).astype(_F32),
              _annotate(up_smem[...], wgmma).astype(_F32),
              _annotate(s_smem[...], wgmma.reduce(1)))

    gate, up, s = pl.run_scoped(
        load_scope, plgpu.SMEM((bm, bn), h_ref.dtype), plgpu.SMEM((bm, bn), h_ref.dtype),
        plgpu.SMEM((bm,), _F32), plgpu.Barrier(num_barriers=3))
    sig, silu = _silu_parts(gate)
    a = silu * up
    s_tile = jax.lax.broadcast_in_dim(s, (bm, bn), [0])
    ds = jnp.sum(da_prime * a, axis=1)
    da = s_tile * da_prime
    dgate = da * up * sig * (1.0 + gate * (1.0 - sig))
    dup = da * silu
    _store_tiles([(dgate, dh_ref.at[rows, gate_cols]), (dup, dh_ref.at[rows, up_cols]),
                  (s_tile * a, a_scaled_ref.at[rows, gate_cols]),
                  (ds, ds_ref.at[col, rows])])
  return epilogue


# ----------------------------------------------------------------------------- kernels

def up_proj(xg, w1, tile_expert, cfg: TileConfig = cfg_lib.UP_PROJ):
  """H = Xg W1_e (both halves) and A = SwiGLU(H); Xg: [P, d] rows in slot order."""
  num_slots = xg.shape[0]
  n = w1.shape[2] // 2
  num_cols = n // cfg.block_n
  out_types = (jax.ShapeDtypeStruct((num_slots, 2 * n), xg.dtype),
               jax.ShapeDtypeStruct((num_slots, n), xg.dtype))
  return varlen_m(xg, w1, tile_expert, (), col_blocks=lambda c: (c, num_cols + c),
                  num_col_tiles=num_cols, transpose_rhs=False,
                  epilogue=swiglu_epilogue(cfg, n), out_types=out_types, cfg=cfg)


def _transposed_in_xla(rhs, transpose_rhs: bool):
  """Mosaic GPU interpret mode cannot transpose SMEM refs in wgmma: transpose in XLA there."""
  if transpose_rhs and cfg_lib.interpret_mode() is not None:
    return jnp.swapaxes(rhs, 1, 2), False
  return rhs, transpose_rhs


def matmul(lhs, rhs, tile_expert, *, transpose_rhs: bool, cfg: TileConfig = cfg_lib.MATMUL):
  """out = lhs_e rhs_e (rhs [E, K, N]) or lhs_e rhs_e^T (rhs [E, N, K] with transpose_rhs)."""
  n_out = rhs.shape[1] if transpose_rhs else rhs.shape[2]
  rhs, transpose_rhs = _transposed_in_xla(rhs, transpose_rhs)
  out_type = jax.ShapeDtypeStruct((lhs.shape[0], n_out), lhs.dtype)
  return varlen_m(lhs, rhs, tile_expert, (), col_blocks=lambda c: (c,),
                  num_col_tiles=n_out // cfg.block_n, transpose_rhs=transpose_rhs,
                  epilogue=store_epilogue(cfg), out_types=out_type, cfg=cfg)


def dh(dout_g, w2, h, scores, tile_expert, cfg: TileConfig = cfg_lib.DH):
  """dA' = dOg W2_e^T fused with dSwiGLU: returns dH [P, 2n], A' [P, n], dS partials
  [n // block_n, P] fp32 (sum over axis 0 gives dS)."""
  num_slots = dout_g.shape[0]
  n = w2.shape[1]
  num_cols = n // cfg.block_n
  out_types = (jax.ShapeDtypeStruct((num_slots, 2 * n), h.dtype),
               jax.ShapeDtypeStruct((num_slots, n), h.dtype),
               jax.ShapeDtypeStruct((num_cols, num_slots), _F32))
  w2, transpose = _transposed_in_xla(w2, True)
  return varlen_m(dout_g, w2, tile_expert, (h, scores.astype(_F32)), col_blocks=lambda c: (c,),
                  num_col_tiles=num_cols, transpose_rhs=transpose,
                  epilogue=dswiglu_epilogue(cfg, n), out_types=out_types, cfg=cfg)
