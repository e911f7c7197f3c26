"""jax.vmap for the CuTe FFI calls: cutlass.jax's call has no batching rule, so under vmap each
call runs once per batch element (jax.lax.map over the batched arguments; unbatched ones are
shared). The kernels are launched batch-size times, one after another, each on a whole
problem: vmap of a layer (say over ensemble members or micro-batches) then works and matches
the per-element results."""
from __future__ import annotations

import jax


def one_at_a_time_under_vmap(call):
  """`call` (a function of arrays only, e.g. a cutlass_call) that jax.vmap maps element by
  element."""

  @jax.custom_batching.custom_vmap
  def fn(*args):
    return call(*args)

  @fn.def_vmap
  def _rule(axis_size, in_batched, *args):
    del axis_size
    batched = [a for a, b in zip(args, in_batched) if b]

    def one(elements):
      it = iter(elements)
      return call(*[next(it) if b else a for a, b in zip(args, in_batched)])

    out = jax.lax.map(one, batched)
    return out, jax.tree.map(lambda _: True, out)

  return fn
