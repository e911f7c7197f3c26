"""Zero-padding of the expert computation's widths up to the multiples the GPU kernels tile by.

A layer whose model width d or expert width n is not a multiple of the chosen kernels' column
tile runs on them with its widths padded: X's columns and W1's and W2's rows and columns are
extended with zeros to d' and n', the expert computation runs at (d', n'), and its output is
cut back to d columns. The padding changes no number: the zero columns of X meet zero rows of
W1, the zero gate and up columns of H give SwiGLU(0, 0) = 0 activations, which meet zero rows
of W2, and the output's extra columns (zeros) are dropped; the gradients of the pads are
slices, so the padded parts' gradients are computed and dropped. The cost: one padded copy of
X and of the weights per step, and the FLOPs of the extra columns (at most one tile's worth
per width).
"""
from __future__ import annotations

import jax.numpy as jnp


def padded_width(width: int, multiple: int) -> int:
  """width rounded up to a multiple of `multiple`."""
  return -(-width // multiple) * multiple


def pad_columns(a, width: int):
  """a [..., w] with zero columns appended up to `width` (a itself where w is width)."""
  extra = width - a.shape[-1]
  if extra == 0:
    return a
  return jnp.pad(a, [(0, 0)] * (a.ndim - 1) + [(0, extra)])


def pad_expert_weights(w1, w2, d: int, n: int):
  """w1 [E, d0, 2 n0] (gate half first) and w2 [E, n0, d0] zero-padded to widths d and n: W1's
  gate and up halves are padded each to n columns, so the halves stay n apart."""
  num_experts, d0, two_n0 = w1.shape
  if (d0, two_n0 // 2) == (d, n):
    return w1, w2
  halves = pad_columns(w1.reshape(num_experts, d0, 2, two_n0 // 2), n)
  w1 = jnp.pad(halves, [(0, 0), (0, d - d0), (0, 0), (0, 0)]).reshape(num_experts, d, 2 * n)
  w2 = jnp.pad(w2, [(0, 0), (0, n - w2.shape[1]), (0, d - w2.shape[2])])
  return w1, w2
