"""Tile configurations, shape limits and launch helpers shared by the Mosaic GPU kernels."""
from __future__ import annotations

import contextlib
import dataclasses

import jax
import jax.numpy as jnp
from jax.experimental.pallas import mosaic_gpu as plgpu

BLOCK_M = 128  # rows per M tile; also the plan alignment (pallas_kernels.ops.ALIGN)
SUPPORTED_DTYPES = (jnp.bfloat16, jnp.float16)


@dataclasses.dataclass(frozen=True)
class TileConfig:
  """One kernel's tiling: an M x N output tile, K consumed block_k at a time through a
  `stages`-deep TMA pipeline."""
  block_m: int = BLOCK_M
  block_n: int = 128
  block_k: int = 64
  stages: int = 4


@dataclasses.dataclass(frozen=True)
class PallasConfig:
  """The pallas backend's kernel choices: immutable, hashable data (a jitted program caches
  one executable per configuration); pass one for a call with `sonicmoe_jax.moe(...,
  kernel_config={"pallas": PallasConfig(...)})`.

  up_proj_gather_in_kernel: the up-projection gathers X's rows inside the kernel by cp.async
    (grouped_gemm.varlen_m's gather_index): no gathered copy of X in HBM, so none for XLA to
    keep from the forward to the backward either, and faster than XLA's gather followed by the
    TMA kernel at the paper's configs. False gathers by XLA first.
  dw1_gather_in_kernel: dW1 gathers X's rows inside the weight-gradient kernel instead of XLA
    first: bitwise equal, about a third less step memory, but the op and the step are slower.
  """
  up_proj_gather_in_kernel: bool = True
  dw1_gather_in_kernel: bool = False

  def __post_init__(self):
    for field in dataclasses.fields(self):
      if not isinstance(getattr(self, field.name), bool):
        raise TypeError(f"PallasConfig.{field.name} must be a bool; got "
                        f"{getattr(self, field.name)!r}")


DEFAULT = PallasConfig()

UP_PROJ = TileConfig(block_n=64)     # two accumulators (gate, up): 2 x 128x64 fp32
MATMUL = TileConfig(block_n=128)     # down-projection and dX~ (their N is d)
DH = TileConfig(block_n=64)          # one accumulator plus the heavy dSwiGLU epilogue
WEIGHT_GRAD = TileConfig(block_m=128, block_n=128, block_k=64)


def matmul_tiles(num_cols: int) -> TileConfig:
  """The store GEMMs' tiling for num_cols output columns: MATMUL, or 64-column tiles where
  num_cols is not a multiple of 128."""
  return MATMUL if num_cols % MATMUL.block_n == 0 else TileConfig(block_n=64)


def up_proj_gather_tiles(n: int) -> TileConfig:
  """The up-projection's tiling when it gathers X's rows (their ring of tiles is in SMEM too):
  block_n 128 with 2 stages measured fastest (see PallasConfig.up_proj_gather_in_kernel); 64 with 4 stages
  when n is not a multiple of 128."""
  return TileConfig(block_n=128, stages=2) if n % 128 == 0 else TileConfig(block_n=64, stages=4)


def swizzled_tile(row_elems: int, dtype):
  """SMEM transforms for [rows, row_elems] tiles that wgmma layouts and TMA read without bank
  conflicts: (8, w) tiles with the widest swizzle (128, 64 or 32 bytes) dividing a row."""
  itemsize = jnp.dtype(dtype).itemsize
  swizzle = next(s for s in (128, 64, 32) if row_elems * itemsize % s == 0)
  return (plgpu.TilingTransform((8, swizzle // itemsize)), plgpu.SwizzleTransform(swizzle))


# d's and n's multiples (the column tiles: 64, or 128 where a width is a multiple of it); the
# layer zero-pads other widths up to them (sonicmoe_jax/core/padding.py)
WIDTH_MULTIPLES = (64, 64)


def unsupported(dtype, d: int, n: int):
  """Why these kernels cannot run a layer of this dtype and widths, or None (any widths: the
  layer pads them to WIDTH_MULTIPLES)."""
  del d, n
  if not any(jnp.dtype(dtype) == jnp.dtype(t) for t in SUPPORTED_DTYPES):
    return f"dtype {jnp.dtype(dtype).name} (needs bfloat16 or float16)"
  return None


def check_operands(op: str, **arrays) -> None:
  for name, arr in arrays.items():
    if not any(arr.dtype == jnp.dtype(d) for d in SUPPORTED_DTYPES):
      raise TypeError(f"backend 'pallas' ({op}): {name} must be bfloat16 or float16; got {arr.dtype}. "
                      "Use backend='xla' for float32.")


def check_dims(d: int, n: int) -> None:
  """The kernels tile d and n by 64 (or 128 where they are multiples of it)."""
  for name, width, what, multiple in (("d", d, "model width", WIDTH_MULTIPLES[0]),
                                      ("n", n, "expert width", WIDTH_MULTIPLES[1])):
    if width % multiple:
      raise ValueError(f"backend 'pallas' kernels need {name} ({what}) to be a multiple of "
                       f"{multiple}; got {name}={width} (the layer pads it: sonicmoe_jax.moe)")


_LOWERING_FOR_GPU = False


@contextlib.contextmanager
def lowering_for_gpu():
  """Trace the real GPU kernels even off the GPU (for jax.export with platforms=("cuda",))."""
  global _LOWERING_FOR_GPU
  old, _LOWERING_FOR_GPU = _LOWERING_FOR_GPU, True
  try:
    yield
  finally:
    _LOWERING_FOR_GPU = old


def interpret_mode():
  """Mosaic GPU interpret mode off the GPU (tests on CPU), None on the GPU."""
  if _LOWERING_FOR_GPU or jax.default_backend() == "gpu":
    return None
  from jax._src.pallas.mosaic_gpu.interpret.params import InterpretGPUParams
  return InterpretGPUParams()


def num_sms() -> int:
  """Persistent grid size: one CTA per SM on the GPU (132 on an H100 or H200 SXM), a few when interpreted."""
  dev = jax.devices()[0]
  if dev.platform == "gpu":
    return getattr(dev, "core_count", None) or 132
  return 132 if _LOWERING_FOR_GPU else 2


def compiler_params():
  return plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Warpgroup)
