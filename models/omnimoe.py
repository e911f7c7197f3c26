"""OmniMoE (seed 003): atomic experts, a Cartesian-product router, expert-centric scheduling.

Atomic expert i is a pair of d-vectors (W[i], V[i]); a token x with routed experts I and
weights g gets y = (g * silu(x W_I^T)) V_I + MLP(x) (Dynamic Expert Assembly; the seed's gated
scalar activation is taken as silu), with a shared dense SwiGLU MLP.

Router: N = Nr x Nc experts on a grid; row and column log-softmaxes p_r, p_c; expert (i, j)
scores p_r[i] + p_c[j]. The exact top-K over the implicit grid never materialises N scores:
with each token's rows and columns sorted, the pair at row rank a and column rank b is beaten
by every (a' <= a, b' <= b) pair, so row rank a holds at most K // (a + 1) of the top K
(about K ln K candidates), always a prefix of the column ranks. cartesian_topk takes the top K
of the scored candidates, or, where that costs more, finds the K-th largest score by
bisection over its float32 bits. g = softmax over the selected scores.

Execution (same math, two schedules):
  * token-centric (PEER-style): gather each token's K rows of W and V;
  * expert-centric: flatten (token, expert) tasks, split the experts into groups of B
    consecutive ids (a group's rows of W and V are one contiguous block, read in place), sort
    tasks by (group, token), merge tasks of one token in one group into a row, and run each
    group as two dense GEMMs (rows x B scores, then rows x B times B x d) through the xla
    backend's grouped GEMMs (or the Pallas kernels, the first gathering x's rows itself); each
    token's rows are summed back (by gather through the schedule's rows-by-token list on a
    GPU with CuTe DSL, else a scatter-add). Its
    custom_vjp keeps only the inputs and the schedule and recomputes the grouped forward in the
    backward.
Both run over chunks of tokens (in_token_chunks; the expert-centric backward in smaller chunks
than its forward) sized so that one chunk's gathers or task rows take at most CHUNK_BYTES:
memory is bounded at any T and k (the expert-centric chunks each read the weights of the
groups their tasks fall in).
"""
from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from sonicmoe_jax import backends
from sonicmoe_jax.core import routing, swiglu, xla_ops

_F32 = jnp.float32


def grid_shape(num_experts: int) -> tuple[int, int]:
  side = math.isqrt(num_experts)
  if side * side != num_experts:
    raise ValueError(f"num_experts must be a perfect square (a sqrt(N) x sqrt(N) grid); got {num_experts}")
  return side, side


def _row_caps(k: int, rows: int, cols: int):
  """The most columns row rank a can hold in a top-k: min(cols, k // (a + 1)), since every
  (a' <= a, b' <= b) pair beats (a, b). Their sum is at least k (the pairs allowed hold the
  top k)."""
  a = np.arange(min(k, rows))
  return np.minimum(cols, k // (a + 1)).astype(np.int32)


def _columns_at_least(row_vals, col_vals, caps, threshold):
  """[T, kr]: for each row rank a, how many of its first caps[a] column ranks b have
  key(row_vals[a] + col_vals[b]) >= threshold [T] (a prefix: col_vals descend). Binary search,
  its steps unrolled; the sums are formed exactly as the scores are."""
  num_tokens, kr = row_vals.shape
  kc = col_vals.shape[1]
  caps = jnp.broadcast_to(jnp.asarray(caps), (num_tokens, kr))
  count = jnp.zeros((num_tokens, kr), jnp.int32)
  step = 1 << (kc.bit_length() - 1)
  while step:   # invariant: the first `count` columns pass
    probe = count + step
    value = jnp.take_along_axis(col_vals, jnp.minimum(probe, kc) - 1, axis=1)
    passes = routing.ordered_bits(row_vals + value) >= threshold[:, None]
    count = jnp.where((probe <= caps) & passes, probe, count)
    step >>= 1
  return count


def cartesian_topk(p_row, p_col, k: int, method: str | None = None):
  """Exact top-k of p_row[:, i] + p_col[:, j] over the implicit grid, never materialising it.

  Every (a' <= a, b' <= b) pair of row and column ranks beats (a, b), so row rank a holds at
  most k // (a + 1) of the top k: about k ln k candidates in all. Two exact methods, picked by
  a cost model (on an H100 the candidate list was 1.8-2.3x faster at k = 576, T = 1K-16K, the
  bisection 1.3x faster at k = 4096, T = 4096: benchmarks/results/2026-12-07-h100-omnimoe-router;
  benchmarks/omnimoe_router_bench.py times both):
    * a candidate list: score the candidates, then one top_k over them per token;
    * bisection: the k-th largest score by bisection over its float32 bits (32 steps, each a
      binary search per row rank), no candidate list.
    * "kernel": the bisection as one CuTe DSL kernel (ffi/cartesian_topk.py: a CTA per token,
      the same pairs in the same order), on a GPU with the cute extra installed.
  Ties at the k-th score go to lower (row rank, column rank) first in all. method:
  "candidates", "bisection" or "kernel" to pick one; None picks the kernel where it runs,
  else by cost.

  Returns (scores [T, k], expert ids [T, k] = i * Nc + j), in no promised order."""
  rows, cols = p_row.shape[1], p_col.shape[1]
  if not 1 <= k <= rows * cols:
    raise ValueError(f"k must satisfy 1 <= k <= N = {rows * cols}; got {k}")
  p_row, p_col = p_row.astype(_F32), p_col.astype(_F32)
  row_vals, row_idx = jax.lax.top_k(p_row, min(k, rows))
  col_vals, col_idx = jax.lax.top_k(p_col, min(k, cols))
  caps = _row_caps(k, rows, cols)
  candidates, kr, kc = int(caps.sum()), len(caps), col_vals.shape[1]
  if method is None and _kernel_runs(rows, cols, k):
    method = "kernel"
  elif method is None:
    cheaper = 32 * kc.bit_length() * kr < candidates * max(1, candidates.bit_length())
    method = "bisection" if cheaper else "candidates"
  if method == "kernel":
    # the kernel picks the pairs; their scores are gathered here (the same float32 sums as the
    # other methods'), so that gradients reach p_row and p_col
    from ffi import cartesian_topk as kernel
    ranked = map(jax.lax.stop_gradient, (row_vals, row_idx, col_vals, col_idx))
    ids = kernel.cartesian_topk(*ranked, k, rows, cols)
    vals = (jnp.take_along_axis(p_row, ids // cols, axis=1) +
            jnp.take_along_axis(p_col, ids % cols, axis=1))
    return vals, ids
  methods = {"candidates": _topk_of_candidates, "bisection": _topk_by_bisection}
  if method not in methods:
    raise ValueError(f"method must be 'candidates', 'bisection', 'kernel' or None; got {method!r}")
  pick = methods[method]
  a, b, vals = pick(row_vals, col_vals, caps, k)
  ids = jnp.take_along_axis(row_idx, a, axis=1) * cols + jnp.take_along_axis(col_idx, b, axis=1)
  return vals, ids.astype(jnp.int32)


def _kernel_runs(rows: int, cols: int, k: int) -> bool:
  """Whether cartesian_topk's kernel runs here: on a GPU, with the cute extra, at this size."""
  if jax.default_backend() != "gpu" or not backends.cute_installed():
    return False
  from ffi import cartesian_topk as kernel
  return kernel.unsupported(rows, cols, k) is None


def _topk_of_candidates(row_vals, col_vals, caps, k: int):
  """(row ranks, column ranks, scores) [T, k] of the top k: every candidate pair scored, then
  a stable top_k over them in (row rank, column rank) order."""
  ra = np.repeat(np.arange(len(caps), dtype=np.int32), caps)
  cb = np.concatenate([np.arange(c, dtype=np.int32) for c in caps])
  vals, pick = jax.lax.top_k(row_vals[:, ra] + col_vals[:, cb], k)
  return jnp.asarray(ra)[pick], jnp.asarray(cb)[pick], vals


def _topk_by_bisection(row_vals, col_vals, caps, k: int):
  """(row ranks, column ranks, scores) [T, k] of the top k, by bisection over the k-th
  score's float32 bits; row rank a takes a prefix of the column ranks; in (row rank, column
  rank) order."""
  at_least = lambda threshold: _columns_at_least(row_vals, col_vals, caps, threshold)
  # bounds: the least candidate's score (every candidate reaches it) and the best score
  least = jnp.min(row_vals + jnp.take(col_vals, jnp.asarray(caps) - 1, axis=1), axis=1)
  # rolled: each step is itself log2(kc) unrolled passes, and 32 copies of them compile slowly
  threshold = routing.kth_largest_key(lambda key: at_least(key).sum(axis=1), k,
                                      routing.ordered_bits(least),
                                      routing.ordered_bits(row_vals[:, 0] + col_vals[:, 0]),
                                      unroll=False)
  reach = at_least(threshold)                                     # >= the k-th score
  above = at_least(threshold + 1)   # (the k-th key is a finite score's, never the top key)
  ties = reach - above
  ties_before = jnp.cumsum(ties, axis=1) - ties
  need = k - above.sum(axis=1, keepdims=True)
  taken = above + jnp.clip(need - ties_before, 0, ties)            # per row rank; sums to k
  ends = jnp.cumsum(taken, axis=1)
  slot = jnp.arange(k, dtype=jnp.int32)
  a = jax.vmap(lambda e: routing.count_below(e, slot, inclusive=True))(ends)     # [T, k]
  b = slot[None, :] - (jnp.take_along_axis(ends, a, axis=1) -
                       jnp.take_along_axis(taken, a, axis=1))
  vals = jnp.take_along_axis(row_vals, a, axis=1) + jnp.take_along_axis(col_vals, b, axis=1)
  return a, b, vals


def route(x, w_row, w_col, k: int):
  """(g [T, k] softmax weights, ids [T, k]) from the Cartesian-product router."""
  p_row = jax.nn.log_softmax(x.astype(_F32) @ w_row.astype(_F32), axis=-1)
  p_col = jax.nn.log_softmax(x.astype(_F32) @ w_col.astype(_F32), axis=-1)
  scores, ids = cartesian_topk(p_row, p_col, k)
  return jax.nn.softmax(scores, axis=-1), ids


# bytes a chunk of tokens may take: the token-centric gathers ([chunk, k, d] rows of W and V),
# or the expert-centric rows of the chunk's tasks (rows of x, dO and dX, scores and activations)
CHUNK_BYTES = 1 << 30


def in_token_chunks(fn, chunk: int, *arrays):
  """fn(*arrays) over chunks of at most `chunk` tokens (rows; split_tokens'): a scan whose
  chunks are each recomputed in the backward, so memory is one chunk's at any T."""
  if chunk >= arrays[0].shape[0]:
    return fn(*arrays)
  chunked, unchunk = split_tokens(chunk, *arrays)
  return unchunk(jax.lax.map(jax.checkpoint(lambda c: fn(*c)), chunked))


def split_tokens(chunk: int, *arrays):
  """(the arrays [T, ...] as [chunks, size, ...], zero-padded; a function taking a
  [chunks, size, ...] result back to [T, ...]): as few chunks as hold T tokens `chunk` at a
  time, of equal sizes (at most `chunk`, and at most T: fewer than one padded token a chunk)."""
  num_tokens = arrays[0].shape[0]
  num_chunks = -(-num_tokens // chunk)
  chunk = -(-num_tokens // num_chunks)
  pad = num_chunks * chunk - num_tokens
  split = lambda a: jnp.pad(a, [(0, pad)] + [(0, 0)] * (a.ndim - 1)).reshape(
      num_chunks, chunk, *a.shape[1:])
  unsplit = lambda a: a.reshape(num_chunks * chunk, *a.shape[2:])[:num_tokens]
  return tuple(map(split, arrays)), unsplit


def token_centric(x, w, v, g, ids, chunk_bytes: int = CHUNK_BYTES):
  """PEER-style: each token gathers its k rows of W and V ([T, k, d] each), in chunks of tokens
  whose gathers take at most chunk_bytes, so memory stays bounded at any T and k."""
  per_token = 2 * ids.shape[1] * x.shape[1] * w.dtype.itemsize
  chunk = max(1, chunk_bytes // per_token)
  return in_token_chunks(lambda x, g, ids: _token_centric_rows(x, w, v, g, ids), chunk, x, g, ids)


def _token_centric_rows(x, w, v, g, ids):
  wx, vx = w[ids], v[ids]                                       # [T, k, d]
  z = jnp.einsum("td,tkd->tk", x, wx, preferred_element_type=_F32)
  a = (g.astype(_F32) * jax.nn.silu(z)).astype(vx.dtype)
  return jnp.einsum("tk,tkd->td", a, vx, preferred_element_type=_F32).astype(x.dtype)


@dataclasses.dataclass(frozen=True)
class Schedule:
  """Expert-centric schedule of the T*k tasks. Group q holds experts q*B .. q*B + B - 1 (so
  its weights are one contiguous block of W and of V, read in place). Rows are (group, token)
  pairs, sorted by group then token; group q's rows start at row_offsets[q] (a multiple of
  `align`, so tiled kernels see one group per row tile). R (rows) is a static bound.

    row_token [R]: token of each row (T for unused rows); row_offsets [Q+1], Q = ceil(N / B);
    task_row, task_col [T*k]: each task's entry (row, expert in group) in the [R, B] scores
    and activations;
    token_rows [R], token_offsets [T+1]: the rows by token (token t's rows are
    token_rows[token_offsets[t]:token_offsets[t+1]]; entries past token_offsets[T] unused),
    for per-token sums that gather rows rather than scatter them;
    group: B (static).
  """
  row_token: jax.Array
  row_offsets: jax.Array
  task_row: jax.Array
  task_col: jax.Array
  token_rows: jax.Array
  token_offsets: jax.Array
  group: int = dataclasses.field(metadata=dict(static=True))

  @property
  def padded_group_sizes(self):
    return jnp.diff(self.row_offsets)

  @property
  def num_groups(self) -> int:
    return self.row_offsets.shape[0] - 1


jax.tree_util.register_dataclass(Schedule)


def _round_up(x, m):
  return (x + m - 1) // m * m


def schedule(ids, num_experts: int, group: int, align: int = 1) -> Schedule:
  num_tokens, k = ids.shape
  m = num_tokens * k
  num_groups = -(-num_experts // group)
  # at most min(Q, m) groups have rows, each padded by at most align - 1
  num_rows = _round_up(m + (min(num_groups, m) * (align - 1) if align > 1 else 0), align)
  flat = ids.reshape(-1)
  task_group = (flat // group).astype(jnp.int32)
  task_col = (flat % group).astype(jnp.int32)
  # by (group, token): a stable sort by group keeps the tasks' token order (one key: a radix
  # sort on the GPU where group and task index pack into 32 bits)
  order, g_sorted = routing.sort_pairs_by_expert(task_group, num_groups)
  t_sorted = order // k
  new_row = jnp.concatenate([jnp.ones((1,), bool),
                             (g_sorted[1:] != g_sorted[:-1]) | (t_sorted[1:] != t_sorted[:-1])])
  dense_row = jnp.cumsum(new_row) - 1
  rows_per_group = jnp.zeros((num_groups,), jnp.int32).at[g_sorted].add(new_row.astype(jnp.int32))
  dense_start = routing.exclusive_cumsum(rows_per_group)
  offsets = routing.aligned_offsets(rows_per_group, align)
  row_sorted = (offsets[g_sorted] + dense_row - dense_start[g_sorted]).astype(jnp.int32)
  task_row = jnp.zeros((m,), jnp.int32).at[order].set(row_sorted)
  row_token = jnp.full((num_rows,), num_tokens, jnp.int32).at[row_sorted].set(t_sorted)
  token_rows, token_offsets = _rows_by_token(task_row, new_row, order, num_rows, num_tokens, k)
  return Schedule(row_token, offsets, task_row, task_col, token_rows, token_offsets, group)


def _rows_by_token(task_row, new_row, order, num_rows: int, num_tokens: int, k: int):
  """(token_rows, token_offsets): each used row listed once under its token, tokens in order
  (the first task of each row, taken in task order, which is token-major); no sort. Entries
  past token_offsets[T] are 0."""
  first = jnp.zeros(new_row.shape, bool).at[order].set(new_row)        # in task order
  position = jnp.where(first, jnp.cumsum(first) - 1, num_rows)
  token_rows = jnp.zeros((num_rows,), jnp.int32).at[position].set(task_row, mode="drop")
  rows_per_token = first.reshape(num_tokens, k).sum(axis=1, dtype=jnp.int32)
  return token_rows, routing.exclusive_cumsum(rows_per_token)


class XlaGroupedOps:
  """The two grouped GEMM shapes of expert-centric execution through the xla backend's grouped
  GEMMs (xla_ops.grouped_matmul: ragged_dot, tiled batched GEMMs on GPUs, NumPy on a CPU)."""
  align = 1

  @staticmethod
  def matmul(lhs, rhs, sched: Schedule, transpose_rhs: bool):
    """Per group q: lhs_q @ rhs[q] (rhs [Q, K, N]) or lhs_q @ rhs[q]^T (rhs [Q, N, K])."""
    rhs = jnp.swapaxes(rhs, 1, 2) if transpose_rhs else rhs
    return xla_ops.grouped_matmul(lhs, rhs, sched.padded_group_sizes)

  @classmethod
  def scores(cls, x, wq, sched: Schedule):
    """Z [R, B]: each row's token's x times its group's W block, transposed (x's rows gathered
    first)."""
    return cls.matmul(_rows(x, sched), wq, sched, transpose_rhs=True)

  @staticmethod
  def weight_grad(lhs, rhs, sched: Schedule):
    """Per group q: lhs_q^T rhs_q, [Q, lhs cols, rhs cols]."""
    return xla_ops.grouped_weight_grad(lhs, rhs, sched.padded_group_sizes)

  @staticmethod
  def token_sums(rows, sched: Schedule, num_tokens: int):
    """[T, d] in rows' dtype: each token's rows summed in fp32 (a scatter-add by row_token)."""
    return jax.ops.segment_sum(rows.astype(_F32), sched.row_token,
                               num_segments=num_tokens).astype(rows.dtype)


def _row_tiles(sched: Schedule, align: int):
  """The group of each `align`-row tile of the schedule's rows (Q past the last group): the
  tile table of the kernels' varlen-M GEMMs."""
  from sonicmoe_jax.core import schedule as tiling
  return tiling.tile_owners(sched.row_offsets, sched.row_token.shape[0], align)


def _gather_sums(rows, sched: Schedule, num_tokens: int):
  """[T, d]: each token's rows summed in fp32 by the CuTe gather-and-sum kernel (each row read
  once, through the schedule's rows-by-token list)."""
  from ffi import gather_sum
  return gather_sum.gather_sum(rows, None, sched.token_rows, sched.token_offsets, num_tokens)


class PallasGroupedOps:
  """The same GEMMs on the Pallas Mosaic GPU kernels (needs bf16/f16, d % 128, B % 128)."""
  align = 128

  @classmethod
  def matmul(cls, lhs, rhs, sched: Schedule, transpose_rhs: bool, gather_index=None):
    from pallas_kernels import grouped_gemm
    return grouped_gemm.matmul(lhs, rhs, _row_tiles(sched, cls.align),
                               transpose_rhs=transpose_rhs, gather_index=gather_index)

  @classmethod
  def scores(cls, x, wq, sched: Schedule):
    """As XlaGroupedOps.scores, x's rows gathered inside the GEMM kernel on a GPU (no [R, d]
    copy of them)."""
    return cls.matmul(x, wq, sched, transpose_rhs=True, gather_index=sched.row_token)

  @staticmethod
  def weight_grad(lhs, rhs, sched: Schedule):
    from pallas_kernels import weight_grad
    return weight_grad.weight_grad(lhs, rhs, sched.row_offsets, sched.num_groups, _F32)

  @staticmethod
  def token_sums(rows, sched: Schedule, num_tokens: int):
    """Each token's rows summed in fp32 by the CuTe gather-and-sum kernel on a GPU where CuTe
    DSL is installed (it reads each row once, through token_rows), else as XlaGroupedOps."""
    from pallas_kernels import config
    if config.interpret_mode() is not None or not backends.cute_installed():
      return XlaGroupedOps.token_sums(rows, sched, num_tokens)
    return _gather_sums(rows, sched, num_tokens)


class CuteGroupedOps(PallasGroupedOps):
  """The same GEMMs on our CuTe kernels (needs the cute extra, a Hopper GPU, bf16/f16, d % 128
  and B % 128): the varlen-M grouped matmul (the scores GEMM gathering x's rows in its
  producer warpgroup), the varlen-K weight gradient, the per-token gather-and-sum."""

  @classmethod
  def matmul(cls, lhs, rhs, sched: Schedule, transpose_rhs: bool, gather_index=None):
    from ffi import grouped_gemm
    return grouped_gemm.grouped_matmul(lhs, rhs, _row_tiles(sched, cls.align),
                                       transpose_rhs=transpose_rhs, gather_index=gather_index)

  @staticmethod
  def weight_grad(lhs, rhs, sched: Schedule):
    from ffi import grouped_gemm
    return grouped_gemm.weight_grad(lhs, rhs, sched.row_offsets, sched.num_groups)

  @staticmethod
  def token_sums(rows, sched: Schedule, num_tokens: int):
    """Each token's rows summed in fp32 by the CuTe gather-and-sum kernel."""
    return _gather_sums(rows, sched, num_tokens)


GROUPED_OPS = {"xla": XlaGroupedOps, "pallas": PallasGroupedOps, "cute": CuteGroupedOps}


def _in_groups(w, sched: Schedule):
  """W [N, d] as [Q, B, d] blocks of B consecutive experts (a reshape; zero rows pad N up to
  Q*B where B does not divide it)."""
  num_groups, group = sched.num_groups, sched.group
  return jnp.pad(w, ((0, num_groups * group - w.shape[0]), (0, 0))).reshape(num_groups, group, -1)


def _rows(x, sched: Schedule):
  """[R, d]: each row's token's row of x (zeros for unused rows)."""
  return x.at[sched.row_token].get(mode="fill", fill_value=0)


def _at_tasks(m, sched: Schedule):
  """[T*k] fp32: the entries of an [R, B] matrix at the tasks' (row, expert in group)."""
  return m[sched.task_row, sched.task_col].astype(_F32)


def _task_matrix(values, sched: Schedule, dtype):
  """[R, B] in dtype: the tasks' values [T*k] at their (row, expert in group), zeros elsewhere
  (summed where tasks share one: a token routed to an expert twice)."""
  return jnp.zeros((sched.row_token.shape[0], sched.group), dtype).at[
      sched.task_row, sched.task_col].add(values.astype(dtype))


def _activations(z, g, sched: Schedule, dtype):
  """A [R, B] = g * silu(Z) at the tasks, zeros elsewhere, and the tasks' (Z, silu(Z)) in fp32:
  the gated activation is computed on the T*k routed scores only."""
  zt = _at_tasks(z, sched)
  silu = jax.nn.silu(zt)
  return _task_matrix(g.reshape(-1).astype(_F32) * silu, sched, dtype), zt, silu


def _expert_centric_forward(ops, x, w, v, g, sched):
  wq, vq = _in_groups(w, sched), _in_groups(v, sched)                             # [Q, B, d]
  z = ops.scores(x, wq, sched)                                                    # [R, B]
  a, _, _ = _activations(z, g, sched, x.dtype)
  out_rows = ops.matmul(a, vq, sched, transpose_rhs=False)                         # [R, d]
  return ops.token_sums(out_rows, sched, x.shape[0]).astype(x.dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def expert_centric(ops, x, w, v, g, sched: Schedule):
  """Expert-centric execution with grouped GEMMs from `ops` (XlaGroupedOps or
  PallasGroupedOps). Keeps only x, g and the schedule; the backward recomputes the gathers and
  the scores GEMM and runs four more grouped GEMMs."""
  return _expert_centric_forward(ops, x, w, v, g, sched)


def _ec_fwd(ops, x, w, v, g, sched):
  return _expert_centric_forward(ops, x, w, v, g, sched), (x, w, v, g, sched)


def _ec_bwd(ops, res, dout):
  x, w, v, g, sched = res
  rows = _rows(x, sched)
  wq, vq = _in_groups(w, sched), _in_groups(v, sched)
  z = ops.matmul(rows, wq, sched, transpose_rhs=True)
  a, zt, silu = _activations(z, g, sched, x.dtype)
  dout_rows = _rows(dout.astype(x.dtype), sched)
  da = _at_tasks(ops.matmul(dout_rows, vq, sched, transpose_rhs=True), sched)     # dO V^T
  sig = jax.nn.sigmoid(zt)
  gt = g.reshape(-1).astype(_F32)
  dz = _task_matrix(da * gt * sig * (1.0 + zt * (1.0 - sig)), sched, x.dtype)
  drows = ops.matmul(dz, wq, sched, transpose_rhs=False)                          # dZ W
  dwq = ops.weight_grad(dz, rows, sched)                                          # dZ^T X
  dvq = ops.weight_grad(a, dout_rows, sched)                                      # A^T dO
  dx = ops.token_sums(drows, sched, x.shape[0])
  dw = dwq.reshape(-1, w.shape[1])[:w.shape[0]]
  dv = dvq.reshape(-1, v.shape[1])[:v.shape[0]]
  dg = (da * silu).reshape(g.shape)
  return (dx.astype(x.dtype), dw.astype(w.dtype), dv.astype(v.dtype), dg.astype(g.dtype),
          jax.tree_util.tree_map(lambda _: None, sched))


expert_centric.defvjp(_ec_fwd, _ec_bwd)


def expert_centric_chunk(d: int, k: int, group: int, chunk_bytes: int = CHUNK_BYTES,
                         backward: bool = True) -> int:
  """Tokens per chunk of expert_centric_in_chunks: a task's rows take at most about 6 d + 12 B
  bytes in the backward (its rows of x, dO and dX, and the scores, activations and their
  gradients across the group), 2 d + 4 B in the forward (its output row, scores and
  activations)."""
  per_task = 6 * d + 12 * group if backward else 2 * d + 4 * group
  return max(1, chunk_bytes // (k * per_task))


def expert_centric_in_chunks(ops, x, w, v, g, ids, num_experts: int, group: int,
                             chunk_bytes: int = CHUNK_BYTES):
  """expert_centric over chunks of tokens, each chunk's tasks scheduled on their own, the rows
  of a chunk taking at most about chunk_bytes: the forward in chunks sized for the forward,
  the backward (which keeps only x, g and ids and recomputes each chunk's forward) in smaller
  chunks sized for it (expert_centric_chunk). A chunk reads the weights of the groups its
  tasks fall in, so fewer, larger chunks read them fewer times."""
  d, k = x.shape[1], ids.shape[1]
  chunks = (expert_centric_chunk(d, k, group, chunk_bytes, backward=False),
            expert_centric_chunk(d, k, group, chunk_bytes))
  return _in_chunks(ops, num_experts, group, chunks, x, w, v, g, ids)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1, 2, 3))
def _in_chunks(ops, num_experts, group, chunks, x, w, v, g, ids):
  run = lambda x, g, ids: _expert_centric_forward(ops, x, w, v, g,
                                                  schedule(ids, num_experts, group, ops.align))
  return in_token_chunks(run, chunks[0], x, g, ids)


def _in_chunks_fwd(ops, num_experts, group, chunks, x, w, v, g, ids):
  return _in_chunks(ops, num_experts, group, chunks, x, w, v, g, ids), (x, w, v, g, ids)


def _in_chunks_bwd(ops, num_experts, group, chunks, res, dout):
  """Each backward chunk's gradients from its own schedule (_ec_bwd); dW and dV summed over the
  chunks in the weights' dtype."""
  x, w, v, g, ids = res
  chunked, unchunk = split_tokens(chunks[1], x, g, ids, dout)

  def step(sums, c):
    xc, gc, idc, dc = c
    sched = schedule(idc, num_experts, group, ops.align)
    dx, dw, dv, dg, _ = _ec_bwd(ops, (xc, w, v, gc, sched), dc)
    return (sums[0] + dw, sums[1] + dv), (dx, dg)

  (dw, dv), (dx, dg) = jax.lax.scan(step, (jnp.zeros_like(w), jnp.zeros_like(v)), chunked)
  return unchunk(dx), dw, dv, unchunk(dg), None


_in_chunks.defvjp(_in_chunks_fwd, _in_chunks_bwd)


def usage_stats(ids, num_experts: int, k: int):
  """(RouterStats with expert usage counts and zero aux losses, KL(usage || uniform))."""
  counts = jnp.zeros((num_experts,), jnp.int32).at[ids.reshape(-1)].add(1)
  p = counts / jnp.maximum(counts.sum(), 1)
  kl = jnp.sum(jnp.where(p > 0, p * jnp.log(jnp.maximum(p, 1e-30) * num_experts), 0.0))
  zero = jnp.zeros((), _F32)
  return routing.RouterStats(topk_counts=counts, expert_counts=counts, changed_pairs=jnp.zeros((), jnp.int32),
                     load_balancing_loss=zero, z_loss=zero), kl


class OmniMoE(nnx.Module):
  """OmniMoE FFN: shared SwiGLU MLP + N atomic experts routed by a Cartesian-product router.

  Args: d_model, num_experts (N, a perfect square), k (experts per token, up to thousands),
  d_mlp (shared MLP width), group (B, experts per expert-centric group), execution
  ("expert_centric" or "token_centric"), grouped ("xla", "pallas" or "cute": the kernels of
  the expert-centric GEMMs; pallas and cute need bf16, d and group multiples of 128, cute the
  cute extra), chunk_bytes (the
  most one chunk of tokens' gathers or task rows may take: larger chunks schedule more tokens
  together, so each expert's weights serve more of them, for more memory), dtype, rngs.
  Call: (y, RouterStats with expert usage counts); `last_unevenness` holds KL(usage || uniform).
  """

  def __init__(self, d_model: int, num_experts: int, k: int, d_mlp: int, *, group: int = 128,
               execution: str = "expert_centric", grouped: str = "xla",
               chunk_bytes: int = CHUNK_BYTES, dtype=jnp.float32, rngs: nnx.Rngs):
    rows, cols = grid_shape(num_experts)
    if not 1 <= k <= num_experts:
      raise ValueError(f"k must satisfy 1 <= k <= num_experts = {num_experts}; got {k}")
    if execution not in ("expert_centric", "token_centric"):
      raise ValueError(f"execution must be 'expert_centric' or 'token_centric'; got {execution!r}")
    if group < 1:
      raise ValueError(f"group must be >= 1; got {group}")
    if grouped not in GROUPED_OPS:
      raise ValueError(f"grouped must be one of {tuple(GROUPED_OPS)}; got {grouped!r}")
    if chunk_bytes < 1:
      raise ValueError(f"chunk_bytes must be >= 1; got {chunk_bytes}")
    self.grouped_ops = GROUPED_OPS[grouped]
    key = rngs.params
    init = jax.nn.initializers.normal(stddev=d_model ** -0.5)
    self.w_row = nnx.Param(init(key(), (d_model, rows)))
    self.w_col = nnx.Param(init(key(), (d_model, cols)))
    self.w = nnx.Param(init(key(), (num_experts, d_model)))
    self.v = nnx.Param(jax.nn.initializers.normal(stddev=k ** -0.5)(key(), (num_experts, d_model)))
    self.mlp_in = nnx.Linear(d_model, 2 * d_mlp, use_bias=False, rngs=rngs)
    self.mlp_out = nnx.Linear(d_mlp, d_model, use_bias=False, rngs=rngs)
    self.num_experts, self.k, self.group, self.execution, self.dtype = num_experts, k, group, execution, dtype
    self.chunk_bytes = chunk_bytes
    self.last_unevenness = nnx.Variable(jnp.zeros((), _F32))

  def route(self, x):
    """(g [T, k] softmax weights, ids [T, k]) for tokens x [T, d] in the layer's dtype."""
    return route(x, self.w_row[...], self.w_col[...], self.k)

  def __call__(self, x):
    lead, d = x.shape[:-1], x.shape[-1]
    x2 = x.reshape(-1, d).astype(self.dtype)
    g, ids = self.route(x2)
    w, v = self.w[...].astype(self.dtype), self.v[...].astype(self.dtype)
    if self.execution == "token_centric":
      routed = token_centric(x2, w, v, g, ids, self.chunk_bytes)
    else:
      routed = expert_centric_in_chunks(self.grouped_ops, x2, w, v, g, ids, self.num_experts,
                                        self.group, self.chunk_bytes)
    shared = self.mlp_out(swiglu.forward(self.mlp_in(x2)).astype(x2.dtype))
    stats, kl = usage_stats(ids, self.num_experts, self.k)
    self.last_unevenness[...] = kl
    return (routed + shared).reshape(*lead, d), stats
