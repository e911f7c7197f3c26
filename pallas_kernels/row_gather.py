"""Row gather out[i] = x[index[i]] with per-thread cp.async copies (Mosaic GPU, Hopper).

Its helpers (issue_gather, commit_empty_group, wait_gathers, TILE_TRANSFORMS) gather X's rows
inside the up-projection kernel (grouped_gemm.varlen_m's gather_index). The standalone
gather_rows is not in the dispatch table: it runs as fast as XLA's gather and serves as the
helpers' bitwise GPU test. Hopper's TMA cannot gather rows, and one thread issuing a TMA box
per row is several times too slow; here all 128 threads of a warpgroup issue 16-byte
`cp.async` copies straight into the swizzled SMEM tile a wgmma would read.

Tiling: one CTA per [BLOCK_ROWS, BLOCK_COLS] output tile = 128 rows x 128 bytes. Thread t
copies 16-byte chunk t % 8 of rows t // 8 + 16 * j, j = 0..7 (eight threads cover one row's
128 bytes, so each warp instruction reads four whole rows). The tile lives in SMEM tiled
(8, 64) and 128-byte swizzled, so element (r, c) sits at byte
  (r // 8) * 1024 + (r % 8) * 128 + ((c // 8) ^ (r % 8)) * 16 + (c % 8) * 2,
which is where each chunk is written; a TMA store then writes the tile to out.
Mosaic GPU interpret mode cannot run inline MLIR: off the GPU this falls back to XLA's gather.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax._src.lib.mlir import ir
from jax._src.lib.mlir.dialects import arith, llvm, memref, nvvm
from jax.experimental import pallas as pl
from jax.experimental.mosaic.gpu import utils as mgpu_utils
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels import config as cfg_lib
from sonicmoe_jax.core import xla_ops

BLOCK_ROWS = 128
BLOCK_COLS = 64                          # 64 bf16 = 128 bytes: one swizzle row
CHUNK_BYTES = 16                         # one cp.async
CHUNKS_PER_ROW = BLOCK_COLS * 2 // CHUNK_BYTES   # 8
THREADS = 128
ROWS_PER_PASS = THREADS // CHUNKS_PER_ROW        # 16


def _swizzled_chunk_offset(row, chunk):
  """Byte offset of a row's 16-byte chunk in the (8, 64)-tiled, 128B-swizzled tile (i32 ops)."""
  i32 = ir.IntegerType.get_signless(32)
  c = lambda v: mgpu_utils.c(v, i32)
  row_in_group = arith.remui(row, c(8))
  group = arith.divui(row, c(8))
  swizzled = arith.xori(chunk, row_in_group)
  return arith.addi(arith.addi(arith.muli(group, c(8 * 128)), arith.muli(row_in_group, c(128))),
                    arith.muli(swizzled, c(CHUNK_BYTES)))


def _issue_row_copies(num_source_rows, num_rows, _, x_ref, index_ref, tile_ref):
  """Every thread of the warpgroup: its num_rows / 16 chunks (one per pass of 16 rows) by
  cp.async, committed as one group. An index outside [0, num_source_rows) copies 0 bytes of
  row 0: cp.async zero-fills the chunk."""
  i32 = ir.IntegerType.get_signless(32)
  i64 = ir.IntegerType.get_signless(64)
  i8 = ir.IntegerType.get_signless(8)
  c = lambda v: mgpu_utils.c(v, i32)
  tid = arith.remui(mgpu_utils.thread_idx(), c(THREADS))
  chunk = arith.remui(tid, c(CHUNKS_PER_ROW))
  first_row = arith.divui(tid, c(CHUNKS_PER_ROW))
  row_stride_bytes = ir.MemRefType(x_ref.type).get_strides_and_offset()[0][0] * 2
  x_base = llvm.addrspacecast(llvm.PointerType.get(address_space=1), mgpu_utils.memref_ptr(x_ref))
  tile_base = mgpu_utils.memref_ptr(tile_ref)
  for j in range(num_rows // ROWS_PER_PASS):
    row = arith.addi(first_row, c(j * ROWS_PER_PASS))
    token = memref.load(index_ref, [arith.index_cast(ir.IndexType.get(), row)])
    valid = arith.cmpi(arith.CmpIPredicate.ult, token, c(num_source_rows))
    token = arith.select(valid, token, c(0))
    src_bytes = arith.addi(arith.muli(arith.extui(i64, token), mgpu_utils.c(row_stride_bytes, i64)),
                           arith.extui(i64, arith.muli(chunk, c(CHUNK_BYTES))))
    src = mgpu_utils.getelementptr(x_base, [src_bytes], i8)
    dst = mgpu_utils.getelementptr(tile_base, [_swizzled_chunk_offset(row, chunk)], i8)
    nvvm.cp_async_shared_global(dst, src, CHUNK_BYTES, nvvm.LoadCacheModifierKind.CG,
                                cp_size=arith.select(valid, c(CHUNK_BYTES), c(0)))
  nvvm.cp_async_commit_group()


TILE_TRANSFORMS = cfg_lib.swizzled_tile(BLOCK_COLS, jnp.bfloat16)   # (8, 64) tiles, 128B swizzle


def issue_gather(x_ref, index_ref, tile_ref, num_source_rows: int):
  """From one warpgroup: tile_ref[r] = x_ref[index_ref[r]] (zeros for indices outside
  [0, num_source_rows)) by cp.async, as one commit group; wait with wait_gathers.

  x_ref: a GMEM [N, 64] 16-bit column block; index_ref: a GMEM [rows] int32 slice;
  tile_ref: an SMEM [rows, 64] tile with TILE_TRANSFORMS, rows a multiple of 16."""
  num_rows = tile_ref.shape[0]
  if num_rows % ROWS_PER_PASS or tile_ref.shape[1] != BLOCK_COLS:
    raise ValueError(f"row_gather: tile must be [16k, {BLOCK_COLS}]; got {tile_ref.shape}")
  copy = plgpu.inline_mgpu(arg_types=(plgpu.RefType(), plgpu.RefType(), plgpu.RefType(TILE_TRANSFORMS)))
  copy(functools.partial(_issue_row_copies, num_source_rows, num_rows))(x_ref, index_ref, tile_ref)


def commit_empty_group():
  """A commit group with no copies (keeps a fixed number of groups per pipeline step)."""
  @plgpu.inline_mgpu()
  def commit(_):
    nvvm.cp_async_commit_group()
  commit()


def issue_ring_step(kk, num_steps, ring: int, issue_into, groups_per_step: int = 1):
  """A kernel's k step kk into its ring of gathered tiles: issue_into(slot) issues the step's
  groups_per_step gather groups into ring slot kk % ring, or, past the last of num_steps steps,
  as many empty groups (a fixed count per step keeps wait_gathers' arithmetic right). The slot
  is static in each branch: inline Mosaic GPU code takes static SMEM views."""
  for slot in range(ring):
    pl.when((kk < num_steps) & (kk % ring == slot))(functools.partial(issue_into, slot))

  @pl.when(kk >= num_steps)
  def _():
    for _ in range(groups_per_step):
      commit_empty_group()


def gather_off_gpu(rows, gather_index):
  """(rows, gather_index) for a kernel taking gather_index; interpret mode cannot run the
  in-kernel gather (inline Mosaic GPU code), so off the GPU: (rows gathered by XLA, None)."""
  if gather_index is not None and cfg_lib.interpret_mode() is not None:
    return xla_ops.gather_rows(rows, gather_index), None
  return rows, gather_index


def wait_gathers(outstanding: int):
  """Waits until at most `outstanding` of this thread's gather groups are in flight; follow
  with plgpu.commit_smem() before a wgmma or TMA store reads the tiles."""
  @plgpu.inline_mgpu()
  def wait(_):
    nvvm.cp_async_wait_group(outstanding)
  wait()


def unsupported(x, index):
  if x.dtype not in (jnp.bfloat16, jnp.float16):
    return f"x must be bfloat16 or float16; got {x.dtype}"
  if x.ndim != 2 or x.shape[1] % BLOCK_COLS:
    return f"x must be [N, d] with d a multiple of {BLOCK_COLS}; got {x.shape}"
  if index.ndim != 1:
    return f"index must be 1-D; got shape {index.shape}"
  return None


def gather_rows(x, index):
  """x[index] for x [N, d] bf16/f16 (d % 64 == 0) and index [P] int32; rows of indices outside
  [0, N) are zeros (as xla_ops.gather_rows: the plan's padding slots hold index T)."""
  reason = unsupported(x, index)
  if reason:
    raise ValueError(f"row_gather: {reason}")
  if cfg_lib.interpret_mode() is not None:
    return x.at[index].get(mode="fill", fill_value=0, wrap_negative_indices=False)
  num_rows, width = index.shape[0], x.shape[1]
  padded = pl.cdiv(num_rows, BLOCK_ROWS) * BLOCK_ROWS
  index = jnp.pad(index.astype(jnp.int32), (0, padded - num_rows))
  tile = plgpu.SMEM((BLOCK_ROWS, BLOCK_COLS), x.dtype, transforms=TILE_TRANSFORMS)

  def body(x_gmem, index_gmem, out_gmem):
    rows = pl.ds(jax.lax.axis_index("rows") * BLOCK_ROWS, BLOCK_ROWS)
    cols = pl.ds(jax.lax.axis_index("cols") * BLOCK_COLS, BLOCK_COLS)

    def scoped(tile_smem):
      issue_gather(x_gmem.at[:, cols], index_gmem.at[rows], tile_smem, x.shape[0])
      wait_gathers(0)
      plgpu.commit_smem()   # the cp.async writes, visible to the TMA store (async proxy)
      plgpu.copy_smem_to_gmem(tile_smem, out_gmem.at[rows, cols])
      plgpu.wait_smem_to_gmem(0)

    pl.run_scoped(scoped, tile)

  kernel = plgpu.kernel(body, out_type=jax.ShapeDtypeStruct((padded, width), x.dtype),
                        grid=(padded // BLOCK_ROWS, width // BLOCK_COLS), grid_names=("rows", "cols"))
  return kernel(x, index)[:num_rows]
