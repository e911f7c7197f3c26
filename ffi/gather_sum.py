"""Per-token gather-and-sum as a CuTe DSL kernel: O[t] = sum over token t's slots of s * Y[slot].

One CTA per token, 128 threads striding over the row in chunks of `vec` columns (16 bytes: 8
bf16 values, one vector load each); each thread accumulates its chunks in fp32 over the
token's slots (token_slots[token_offsets[t]:token_offsets[t+1]]), optionally weighted by the
slot's score, and writes O[t] in Y's dtype. Bandwidth-bound: reads each slot row once, writes
each token row once. Callable from any jitted JAX program: the kernel is compiled for the GPU
when the program is lowered (CUTE_DSL_ARCH=sm_90a compiles it on a machine without a GPU) and
runs as an XLA FFI custom call on XLA's stream.

A column window of a wider result (`into`): the kernel writes its sums into columns
col_offset .. of the [T, D] output, which is either new (the first window: its other columns
are written by the later windows' calls) or the previous window's output, written in place
(the call aliases it), so the windows' sums are never concatenated in a copy.
"""
from __future__ import annotations

import functools

import cutlass
import cutlass.cute as cute
import jax

from ffi import xla_call
from sonicmoe_jax.core import xla_ops

THREADS = 128
ACCESS_BYTES = 16   # one vector load or store per chunk


@cute.kernel
def _gather_sum_kernel(y: cute.Tensor, scores: cute.Tensor, token_slots: cute.Tensor,
                       token_offsets: cute.Tensor, out: cute.Tensor, weighted: cutlass.Constexpr,
                       vec: cutlass.Constexpr, first_chunk: cutlass.Constexpr):
  tidx, _, _ = cute.arch.thread_idx()
  token, _, _ = cute.arch.block_idx()
  start = token_offsets[token]
  end = token_offsets[token + 1]
  for chunk in range(tidx, y.shape[1] // vec, THREADS):
    acc = cute.make_rmem_tensor((vec,), cutlass.Float32)
    acc.fill(0.0)
    row = cute.make_rmem_tensor((vec,), y.element_type)
    for j in range(start, end):
      slot = token_slots[j]
      cute.autovec_copy(cute.local_tile(y[cutlass.Int64(slot), None], (vec,), (chunk,)), row)
      values = row.load().to(cutlass.Float32)
      if cutlass.const_expr(weighted):
        values = values * scores[slot]
      acc.store(acc.load() + values)
    result = cute.make_rmem_tensor((vec,), out.element_type)
    result.store(acc.load().to(out.element_type))
    cute.autovec_copy(result, cute.local_tile(out[cutlass.Int64(token), None], (vec,),
                                              (first_chunk + chunk,)))


@cute.jit
def _gather_sum(stream, y: cute.Tensor, scores: cute.Tensor, token_slots: cute.Tensor,
                token_offsets: cute.Tensor, out: cute.Tensor, weighted: cutlass.Constexpr,
                vec: cutlass.Constexpr, first_chunk: cutlass.Constexpr = 0):
  _gather_sum_kernel(y, scores, token_slots, token_offsets, out, weighted, vec,
                     first_chunk).launch(
      grid=(out.shape[0], 1, 1), block=(THREADS, 1, 1), stream=stream)


@cute.jit
def _gather_sum_over(stream, y: cute.Tensor, scores: cute.Tensor, token_slots: cute.Tensor,
                     token_offsets: cute.Tensor, previous: cute.Tensor, out: cute.Tensor,
                     weighted: cutlass.Constexpr, vec: cutlass.Constexpr,
                     first_chunk: cutlass.Constexpr):
  del previous   # (out is its buffer: the call aliases the two)
  _gather_sum_kernel(y, scores, token_slots, token_offsets, out, weighted, vec,
                     first_chunk).launch(
      grid=(out.shape[0], 1, 1), block=(THREADS, 1, 1), stream=stream)


def gather_sum(y, scores, token_slots, token_offsets, num_tokens: int, into=None):
  """[num_tokens, d] in y's dtype; scores=None sums unweighted. Rows whose width is not a
  multiple of a 16-byte access are read one value at a time.

  into=(out, lo): the sums are columns lo .. lo + d of a wider [num_tokens, D] result, returned
  whole: out is D (an int: a new result, whose other columns are left to later calls) or the
  [num_tokens, D] result of an earlier window, written over in place. Under jax.vmap each
  element's window is summed on its own and XLA writes it into the result (a sequential vmap
  of a call that writes over its input does not keep the input's other columns)."""
  weighted = scores is not None
  if scores is None:
    scores = jax.numpy.zeros((y.shape[0],), jax.numpy.float32)
  scores = scores.astype(jax.numpy.float32)
  vec = _vector_width(y)
  if into is None:
    return _sums(y, scores, token_slots, token_offsets, num_tokens=num_tokens,
                 weighted=weighted, vec=vec)
  base, lo = into
  width = base if isinstance(base, int) else base.shape[1]
  if lo % vec or lo + y.shape[1] > width:
    raise ValueError(f"cute gather_sum: columns {lo} .. {lo + y.shape[1]} do not fit a result "
                     f"{width} wide in {vec}-column chunks")
  new = isinstance(base, int)
  window = jax.custom_batching.custom_vmap(functools.partial(
      _window, num_tokens=num_tokens, weighted=weighted, vec=vec, lo=lo, width=width, new=new))
  window.def_vmap(functools.partial(_windows_placed_by_xla, num_tokens=num_tokens,
                                    weighted=weighted, lo=lo, width=width, new=new))
  # (a new result travels as a [0, D] stand-in: custom_vmap takes arrays only)
  return window(y, scores, token_slots, token_offsets,
                jax.numpy.zeros((0, width), y.dtype) if new else base)


def _vector_width(y):
  """Values per 16-byte access, or 1 where the row width is not a multiple of it."""
  vec = ACCESS_BYTES // y.dtype.itemsize
  return vec if y.shape[1] % vec == 0 else 1


def _sums(y, scores, token_slots, token_offsets, *, num_tokens, weighted, vec):
  out, = xla_call.call(_gather_sum, [y, scores, token_slots, token_offsets],
                       [jax.ShapeDtypeStruct((num_tokens, y.shape[1]), y.dtype)],
                       weighted=weighted, vec=vec)
  return out


def _window(y, scores, token_slots, token_offsets, base, *, num_tokens, weighted, vec, lo,
            width, new):
  """The window's sums written into columns lo .. of a new result or over base, in place."""
  inputs = [y, scores, token_slots, token_offsets]
  result = jax.ShapeDtypeStruct((num_tokens, width), y.dtype)
  if new:
    out, = xla_call.call(_gather_sum, inputs, [result], weighted=weighted, vec=vec,
                         first_chunk=lo // vec)
  else:
    out, = xla_call.call(_gather_sum_over, inputs + [base], [result], in_place={4: 0},
                         weighted=weighted, vec=vec, first_chunk=lo // vec)
  return out


def _windows_placed_by_xla(axis_size, in_batched, y, scores, token_slots, token_offsets, base,
                           *, num_tokens, weighted, lo, width, new):
  """A batch of windows: each element's sums made whole (no aliasing), then set into its
  columns of the batch's results by XLA."""
  def sums(y, scores, token_slots, token_offsets):
    return gather_sum(y, scores if weighted else None, token_slots, token_offsets, num_tokens)
  args = (y, scores, token_slots, token_offsets)
  if any(in_batched[:4]):
    in_axes = [0 if batched else None for batched in in_batched[:4]]
    window = jax.vmap(sums, in_axes=in_axes, axis_size=axis_size)(*args)
  else:
    window = jax.numpy.broadcast_to(sums(*args), (axis_size, num_tokens, y.shape[-1]))
  if new:
    base = width
  elif not in_batched[4]:
    base = jax.numpy.broadcast_to(base, (axis_size, *base.shape))
  return xla_ops.write_window(base, lo, window), True
