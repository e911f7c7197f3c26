"""Varying-axes types inside `jax.shard_map`: which mesh axes a value varies over, and marking a
value as varying over more of them. Outputs of host callbacks and of some kernels carry no
varying axes of their own; where JAX needs them to match (the branches of a switch, a
gradient against its primal) they are marked like their inputs."""
from __future__ import annotations

import jax


def varying(x, axes):
  """x marked as varying over `axes` (a replicated value's gradient is then summed over them)."""
  if hasattr(jax.lax, "pcast"):
    return jax.lax.pcast(x, tuple(axes), to="varying")
  return jax.lax.pvary(x, tuple(axes))


def varying_axes(x) -> frozenset:
  """The mesh axes a value inside shard_map varies over (its type's manual axis type); empty
  outside shard_map."""
  aval = jax.typeof(x)
  mat = getattr(aval, "mat", None)
  return frozenset(mat.varying) if mat is not None else frozenset(getattr(aval, "vma", ()))


def vary_like(x, *like):
  """x, marked varying over every mesh axis any of `like` varies over."""
  axes = frozenset().union(*(varying_axes(v) for v in like))
  missing = tuple(sorted(axes - varying_axes(x)))
  return varying(x, missing) if missing else x
