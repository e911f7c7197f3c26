"""Backend "pallas_gather" (experimental): the pallas backend with the row gather of X fused
into the up-projection's loads (gather_gemm.py) instead of an XLA pre-gather. GPU only; to be
measured against "pallas" before it can become the default."""
from __future__ import annotations

from pallas_kernels import config, gather_gemm
from pallas_kernels import ops as pallas_ops

ALIGN = pallas_ops.ALIGN
unsupported = pallas_ops.unsupported


def up_proj(x, w1, plan):
  config.check_operands("up_proj", x=x, w1=w1)
  config.check_dims(x.shape[1], w1.shape[2] // 2)
  return gather_gemm.up_proj_gathered(x, w1, plan.token_index, pallas_ops.tiles(plan))


OPS = dict(pallas_ops.OPS, up_proj=up_proj)
