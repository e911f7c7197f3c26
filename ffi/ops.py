"""Backend "cute": the ops written as CuTe DSL kernels so far (aggregation: gather_sum.py).

Implements a subset of the dispatch table; mix it with others, e.g.
backend={"aggregate": "cute"} (other ops default). On a machine without a GPU the kernels are
compiled for sm_90a (CUTE_DSL_ARCH), so programs using them lower and export there too.
"""
from __future__ import annotations

import os

try:
  import jax
  if jax.default_backend() != "gpu":
    os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")
  import cutlass  # noqa: F401
  import cutlass.jax  # noqa: F401
except ImportError as e:  # the optional extra is missing
  raise ImportError(
      "backend 'cute' needs NVIDIA's CuTe DSL: pip install 'sonicmoe-jax[cute]' "
      f"(nvidia-cutlass-dsl>=4.8.1); import failed with: {e}") from e

from ffi import gather_sum

ALIGN = 1


def aggregate(y, scores, plan):
  """O_t = sum over token t's slots of score * Y_slot (fp32 sum), as xla_ops.aggregate."""
  return gather_sum.gather_sum(y, scores, plan.token_slots, plan.token_offsets, plan.num_tokens)


OPS = dict(aggregate=aggregate)
