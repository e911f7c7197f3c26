"""SwiGLU and its backward, shared by every backend's epilogues (computed in fp32).

H = [gate | up] along the last axis (gate first), A = silu(gate) * up.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp


def split(h):
  n = h.shape[-1] // 2
  return h[..., :n].astype(jnp.float32), h[..., n:].astype(jnp.float32)


def forward(h):
  """A = silu(gate) * up, fp32."""
  gate, up = split(h)
  return jax.nn.silu(gate) * up


def backward(da, h):
  """Returns (dH, A) in fp32 from dA and H: the dH epilogue recomputes A from H."""
  gate, up = split(h)
  sig = jax.nn.sigmoid(gate)
  silu = gate * sig
  dgate = da * up * sig * (1.0 + gate * (1.0 - sig))
  dup = da * silu
  return jnp.concatenate([dgate, dup], axis=-1), silu * up
