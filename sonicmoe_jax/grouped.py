"""The expert computation alone, on rows that another dispatcher has already grouped by expert.

Where routing and the movement of tokens happen elsewhere (an expert-parallel all-to-all such
as `jax.lax.ragged_all_to_all`, a framework's own MoE dispatch), `grouped_expert_mlp` runs the
same kernels and the same minimal-memory backward as `moe` on the rows as they arrive: it keeps
the rows and H for the backward, nothing of the [rows, d] outputs.
"""
from __future__ import annotations

from typing import Hashable, Mapping, Optional

import jax
import jax.numpy as jnp

from sonicmoe_jax import backends, layer
from sonicmoe_jax.core import routing, validation


def grouped_expert_mlp(rows, scores, w1, w2, group_sizes, *,
                       backend: backends.BackendSpec = "auto",
                       windows: Optional[int | tuple[int, int]] = None,
                       kernel_config: Optional[Mapping[str, Hashable]] = None):
  """scores[r] * SwiGLU-MLP_e(rows[r]) for rows grouped by expert.

  Args:
    rows: [R, d] rows grouped by expert: expert e's rows are start_e .. start_e +
      group_sizes[e] - 1, start_e the sum of the sizes before it. Rows from sum(group_sizes)
      on are not computed (their outputs are zeros), so R can be a static bound on the rows
      that arrive.
    scores: [R] routing weight of each row (float; differentiable).
    w1: [E, d, 2n] up-projections, gate half first; rows' dtype.
    w2: [E, n, d] down-projections; rows' dtype.
    group_sizes: [E] integer rows per expert (may be traced); experts may have none.
    backend, windows, kernel_config: as for `moe`.

  Returns:
    [R, d] in rows' dtype: each row's expert output times its score. Differentiable in rows,
    scores, w1 and w2. Summing rows back into tokens (after the return all-to-all, for
    example) is the caller's: `jax.ops.segment_sum(out, token_of_row, num_tokens)`.
  """
  rows, scores, w1, w2, group_sizes = layer.as_arrays(rows=rows, scores=scores, w1=w1, w2=w2,
                                                      group_sizes=group_sizes)
  validation.check_rank("rows", rows, 2, "[R, d]")
  validation.check_rank("scores", scores, 1, "[R]")
  validation.check_rank("group_sizes", group_sizes, 1, "[E]")
  for name, arr in (("rows", rows), ("scores", scores)):
    validation.check_float_dtype(name, arr)
  if not jnp.issubdtype(group_sizes.dtype, jnp.integer):
    raise TypeError(f"group_sizes must be integers; got {group_sizes.dtype}")
  num_rows, d = rows.shape
  if num_rows < 1:
    raise ValueError(f"rows must have at least one row; got shape {tuple(rows.shape)}")
  validation.check_dim("scores", scores.shape[0], num_rows, "dim 0 (R, from rows)")
  n = layer.check_expert_weights(w1, w2, rows, "rows")
  num_experts = w1.shape[0]
  validation.check_dim("group_sizes", group_sizes.shape[0], num_experts, "dim 0 (E, from w1)")

  ops = backends.resolve(backend, dtype=rows.dtype, d=d, n=n, num_experts=num_experts, k=1,
                         kernel_config=kernel_config)
  plan = routing.plan_from_group_sizes(jax.lax.stop_gradient(group_sizes), num_rows,
                                       align=ops.align)
  slot_scores = scores.astype(jnp.float32).at[plan.token_index].get(mode="fill",
                                                                     fill_value=0)  # (0: padding)
  return layer.run_experts(ops, rows, slot_scores, w1, w2, plan,
                           layer.resolve_windows(windows, ops, d))
