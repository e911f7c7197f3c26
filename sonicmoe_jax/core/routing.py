"""Token-choice top-K routing and the routing plan that drives every expert kernel.

Scores. For a token t with router logits l_t (fp32) and top-K set S_t, every (token, expert)
pair gets the score s_te = exp(l_te - c_t):
  * score_fn="softmax_topk" (default): c_t = logsumexp(l_t[S_t]), i.e. softmax over the K
    selected logits (the scores of the chosen experts sum to 1);
  * score_fn="softmax_all": c_t = logsumexp(l_t) (top-K of the softmax over all E), or with
    renormalize=True c_t = logsumexp(l_t[S_t]) again.
Pairs added by token rounding (experts a token did not choose) use the same formula, so their
scores are smaller than the token's chosen scores.

The plan. (token, expert, score) pairs live in P "slots" sorted by expert: expert e's pairs fill
slots group_offsets[e] .. group_offsets[e] + group_sizes[e] - 1. With `align` > 1 (what the
tiled GPU kernels ask for) every group starts at a multiple of `align`, so each M tile of a
grouped GEMM belongs to one expert. P is static so the plan works under jit (see num_slots):
  * plain top-K, align 1: P = T*K, every slot valid;
  * otherwise P bounds the rounded and aligned total; the unused slots are padding
    (valid=False, token T, expert E, score 0) and every kernel writes zeros for them.
For aggregation, token_slots lists the slots ordered by token (padding last) and
token_offsets[t] : token_offsets[t+1] are token t's slots: a token can end with any number
of experts under token rounding.
"""
from __future__ import annotations

import dataclasses
from typing import Optional

import jax
import jax.numpy as jnp

from sonicmoe_jax.core import token_rounding, validation


@dataclasses.dataclass(frozen=True)
class RoutingPlan:
  """(token, expert, score) pairs sorted by expert, with group sizes, offsets and the token CSR.

  Array fields (P = number of slots, see the module docstring):
    token_index: [P] int32, the token of each slot; T for padding slots.
    expert_index: [P] int32, the expert of each slot; E for padding slots.
    scores: [P] float32, the routing score of each slot; 0 for padding slots. Differentiable.
    valid: [P] bool, False for padding slots.
    group_sizes: [E] int32, pairs per expert (rounded counts under token rounding).
    group_offsets: [E+1] int32, first slot of each expert's group (a multiple of align);
      group_offsets[E] ends the last group. Equal to the prefix sums of group_sizes when
      align is 1.
    token_slots: [P] int32, slot ids ordered by token, padding slots last.
    token_offsets: [T+1] int32, token t owns token_slots[token_offsets[t]:token_offsets[t+1]].
  Static fields:
    num_tokens (T), num_experts (E), k (top-K), fixed_k: True when every token has exactly k
    slots and token_slots.reshape(T, k) lists them (plain top-K routing), align: the
    alignment of group starts, max_token_slots: the most slots a token can have where known
    before running (None under token rounding).
  """
  token_index: jax.Array
  expert_index: jax.Array
  scores: jax.Array
  valid: jax.Array
  group_sizes: jax.Array
  group_offsets: jax.Array
  token_slots: jax.Array
  token_offsets: jax.Array
  num_tokens: int = dataclasses.field(metadata=dict(static=True))
  num_experts: int = dataclasses.field(metadata=dict(static=True))
  k: int = dataclasses.field(metadata=dict(static=True))
  fixed_k: bool = dataclasses.field(metadata=dict(static=True))
  align: int = dataclasses.field(default=1, metadata=dict(static=True))
  max_token_slots: Optional[int] = dataclasses.field(default=None, metadata=dict(static=True))

  @property
  def num_slots(self) -> int:
    return self.token_index.shape[0]

  @property
  def padded_group_sizes(self):
    """[E] int32: slots from each group's start to the next one's (group_sizes when align=1)."""
    return jnp.diff(self.group_offsets)


jax.tree_util.register_dataclass(RoutingPlan)


@dataclasses.dataclass(frozen=True)
class RouterStats:
  """What the router did, for logging and auxiliary losses.

    topk_counts: [E] int32, tokens per expert under plain top-K.
    expert_counts: [E] int32, tokens per expert actually computed (after rounding).
    changed_pairs: int32, (token, expert) pairs dropped or added by rounding.
    load_balancing_loss: switch-style E * sum_e frac_e * mean_prob_e (1.0 when uniform).
    z_loss: mean over tokens of logsumexp(logits)^2.
  """
  topk_counts: jax.Array
  expert_counts: jax.Array
  changed_pairs: jax.Array
  load_balancing_loss: jax.Array
  z_loss: jax.Array


jax.tree_util.register_dataclass(RouterStats)


@jax.custom_vjp
def router_logits(x, router_w):
  """fp32 router logits X Wr, [T, E].

  When X and Wr share a 16-bit float dtype, the GEMM reads them as they are and accumulates in
  fp32 (their products are exact in fp32, so this is the fp32 product of the same values),
  without writing an fp32 copy of X first; other dtypes are cast to fp32. A custom_vjp so that
  the backward keeps X itself rather than an fp32 copy of it; with bfloat16 X and Wr the
  backward's two GEMMs also read bfloat16 operands (dlogits rounded to bfloat16, as a bfloat16
  linear layer's backward would see it; its exponent range is fp32's, so small gradients do
  not flush to zero as they could in float16) with fp32 accumulation: fp32 operands would run them
  several times slower.
  """
  if x.dtype == router_w.dtype and x.dtype in (jnp.bfloat16, jnp.float16):
    return jnp.dot(x, router_w, preferred_element_type=jnp.float32)
  return jnp.dot(x.astype(jnp.float32), router_w.astype(jnp.float32))


def _router_logits_fwd(x, router_w):
  return router_logits(x, router_w), (x, router_w)


def _router_logits_bwd(residuals, dlogits):
  x, router_w = residuals
  if x.dtype == router_w.dtype == jnp.bfloat16:
    g = dlogits.astype(jnp.bfloat16)
    dx = jnp.dot(g, router_w.T, preferred_element_type=jnp.float32)
    dw = jnp.dot(x.T, g, preferred_element_type=jnp.float32)
  else:
    dx = jnp.dot(dlogits, router_w.astype(jnp.float32).T)
    dw = jnp.dot(x.astype(jnp.float32).T, dlogits)
  return dx.astype(x.dtype), dw.astype(router_w.dtype)


router_logits.defvjp(_router_logits_fwd, _router_logits_bwd)


def _score_offsets(logits, topk_logits, score_fn: str, renormalize: bool):
  """c_t [T, 1] of the scores s_te = exp(l_te - c_t) (see module docstring)."""
  if score_fn == "softmax_all" and not renormalize:
    return jax.nn.logsumexp(logits, axis=-1, keepdims=True)
  return jax.nn.logsumexp(topk_logits, axis=-1, keepdims=True)


def _scores(pair_logits, logits, topk_logits, score_fn: str, renormalize: bool):
  """s_te = exp(l_te - c_t) for the pairs whose logits pair_logits holds: [T, K] (the chosen
  pairs) or [T, E] (every pair, for token rounding's ranking). With the default score_fn,
  scoring the chosen pairs only keeps no [T, E] array for the backward."""
  return jnp.exp(pair_logits - _score_offsets(logits, topk_logits, score_fn, renormalize))


def route(logits, *, k: int, score_fn: str = "softmax_topk", renormalize: bool = False,
          rounding: Optional[str] = None, tile: int = 128, rng=None, align: int = 1,
          top_k=jax.lax.top_k, rounded_slots=None):
  """Builds the routing plan from router logits.

  Args:
    logits: [T, E] router logits (cast to fp32).
    k: experts per token, 1 <= k <= E.
    score_fn: "softmax_topk" or "softmax_all" (see module docstring).
    renormalize: with "softmax_all", divide the chosen scores by their sum (refused with
      "softmax_topk", whose chosen scores sum to 1 already).
    rounding: None (or "none") for plain top-K (evaluation), or a token-rounding mode: "nearest",
      "stochastic", "up", "down", "balanced" (see token_rounding.round_counts).
    tile: the tile that rounded counts are multiples of; needs T >= tile.
    rng: PRNG key for rounding="stochastic".
    align: every expert's group of slots starts at a multiple of this (a power of two).
    top_k: the top-K implementation, (logits, k) -> (values, experts) as jax.lax.top_k (the
      layer passes its backend's, for example the Pallas kernel on GPUs).
    rounded_slots: token rounding's selection placed in the slots, (values [T, E], counts [E],
      offsets [E], num_slots) -> token_index [num_slots] as routing.rounded_slots (None: that
      one; the layer passes its backend's).

  Returns:
    (RoutingPlan, RouterStats).
  """
  validation.check_rank("logits", logits, 2, "[T, E]")
  num_tokens, num_experts = logits.shape
  validation.check_k(k, num_experts)
  validation.check_choice("score_fn", score_fn, validation.SCORE_FUNCTIONS)
  if renormalize and score_fn != "softmax_all":
    raise ValueError(f"renormalize=True applies to score_fn='softmax_all' only (with "
                     f"score_fn={score_fn!r} the chosen scores already sum to 1)")
  if rounding == "none":   # (the command lines' spelling of None)
    rounding = None
  if rounding is not None:
    validation.check_choice("rounding", rounding, validation.ROUNDING_MODES)
    validation.check_tile(tile)
    if num_tokens < tile:
      raise ValueError(f"token rounding needs at least one tile of tokens: T={num_tokens} < tile={tile}")
    if num_tokens * num_experts >= 2**31:
      raise ValueError(f"token rounding indexes (token, expert) pairs in int32: T * E = "
                       f"{num_tokens} * {num_experts} must be below 2**31")

  validation.check_tile(align, name="align")
  logits = logits.astype(jnp.float32)
  # the implementation picks the experts; the logits are re-read here so gradients reach them
  _, topk_experts = top_k(jax.lax.stop_gradient(logits), k)
  topk_logits = jnp.take_along_axis(logits, topk_experts, axis=1)
  if rounding is None:
    topk_scores = _scores(topk_logits, logits, topk_logits, score_fn, renormalize)
    plan = _topk_plan(topk_scores, topk_experts, num_experts, align)
    topk_counts = plan.group_sizes
    changed = jnp.zeros((), jnp.int32)
  else:
    chosen = _chosen_mask(topk_experts, num_experts)
    topk_counts = jnp.sum(chosen, axis=0, dtype=jnp.int32)
    targets = token_rounding.round_counts(topk_counts, tile=tile, num_tokens=num_tokens,
                                          mode=rounding, rng=rng)
    score_offsets = _score_offsets(logits, topk_logits, score_fn, renormalize)
    plan = _rounded_plan(logits, score_offsets, chosen, targets, k, tile, align,
                         place=rounded_slots or _reference_rounded_slots)
    changed = jnp.sum(jnp.abs(targets - topk_counts))

  stats = RouterStats(
      topk_counts=topk_counts,
      expert_counts=plan.group_sizes,
      changed_pairs=changed,
      load_balancing_loss=load_balancing_loss(logits, topk_counts, k),
      z_loss=z_loss(logits),
  )
  return plan, stats


def exclusive_cumsum(counts):
  """[n+1] int32: 0, then the running sums of counts [n] (each group's start, then the end)."""
  return jnp.concatenate([jnp.zeros((1,), jnp.int32), jnp.cumsum(counts).astype(jnp.int32)])


def num_slots(num_tokens: int, num_experts: int, k: int, tile: int = 1, align: int = 1) -> int:
  """Static slot count: T*K, plus fewer than `tile` added pairs per expert under token rounding
  (tile=1 without), plus fewer than `align` padding slots per expert unless tile is a multiple
  of align; never more than E aligned groups of T. A multiple of align."""
  extra = num_experts * (tile - 1)
  if tile % align:
    extra += num_experts * (align - 1)
  most = num_experts * _round_up(num_tokens, align)
  return _round_up(min(num_tokens * k + extra, most), align)


def _round_up(x, m):
  return (x + m - 1) // m * m


def _token_csr(token_index, num_tokens: int):
  """(slots ordered by token with padding slots (token T) last, offsets [T+1] into them)."""
  token_slots = jnp.argsort(token_index, stable=True).astype(jnp.int32)
  per_token = jnp.zeros((num_tokens + 1,), jnp.int32).at[token_index].add(1)[:num_tokens]
  return token_slots, exclusive_cumsum(per_token)


def aligned_offsets(counts, align: int):
  """[n+1] int32: each group's first slot when every group of counts [n] starts at a multiple
  of align (its size rounded up), then the end."""
  return exclusive_cumsum(_round_up(counts, align) if align > 1 else counts)


# Plain top-K plans count instead of sorting up to this many experts: the count keeps [T, E]
# arrays (bf16 and fp32), the sort [T * K] ones.
COUNT_MAX_EXPERTS = 1024
COUNT_BLOCK = 128   # rows per block of the blocked prefix count (one lower-triangular matmul)


def group_sizes_mismatch(group_sizes, num_experts: int):
  """Why group_sizes cannot go with num_experts experts (a sentence naming the expected shape),
  or None (also for None: the kernels then run each group to its end)."""
  if group_sizes is not None and group_sizes.shape != (num_experts,):
    return f"group_sizes must be [{num_experts}]; got {group_sizes.shape}"
  return None


def group_row_ranges(group_offsets, group_sizes=None):
  """Each expert's rows as (first slot, end), [2 E] int32, for the varlen-K weight gradients:
  expert e's first slot group_offsets[e] and its end group_offsets[e] + group_sizes[e],
  clamped to its group (without group_sizes, or where a size passes its group: the group's
  end group_offsets[e + 1]). A kernel stops at the end's k step, skipping the group's padding."""
  first, last = group_offsets[:-1].astype(jnp.int32), group_offsets[1:].astype(jnp.int32)
  if group_sizes is None:
    end = last
  else:
    end = jnp.clip(first + group_sizes.astype(jnp.int32), first, last)
  return jnp.stack([first, end], axis=1).reshape(-1)


def group_row_steps(group_rows, expert, rows_per_step: int):
  """(first step, steps) of expert's rows in group_rows (group_row_ranges), in steps of
  rows_per_step slots (its first slot a multiple of it): up to the step holding its last row
  (which may reach into the group's padding; the steps wholly past it are left out). Plain
  arithmetic: a kernel reads it from its operand (a Pallas ref, a CuTe tensor), tests from
  integers."""
  first, end = group_rows[2 * expert], group_rows[2 * expert + 1]
  return first // rows_per_step, (end - first + rows_per_step - 1) // rows_per_step


def _topk_plan(topk_scores, topk_experts, num_experts: int, align: int,
               method: Optional[str] = None) -> RoutingPlan:
  """The plan of plain top-K routing from each token's K distinct experts and their scores,
  [T, K]: by counting (each expert's tokens in token order from a prefix count down the
  [T, E] chosen mask; no sort) up to COUNT_MAX_EXPERTS experts, else by a sort of the pairs
  by expert. Both give the same plan. method: "count" or "sort" to force one."""
  num_tokens, k = topk_experts.shape
  size = num_slots(num_tokens, num_experts, k, 1, align)
  if method is None:
    method = "count" if num_experts <= COUNT_MAX_EXPERTS else "sort"
  if method == "sort":
    return _pairs_to_plan(topk_experts, topk_scores, num_experts, align, size, fixed_k=True)
  if method != "count":
    raise ValueError(f"method must be 'count', 'sort' or None; got {method!r}")
  ranks, counts = _column_prefix_counts(_chosen_mask(topk_experts, num_experts))
  offsets = aligned_offsets(counts, align)
  # pair (t, j)'s slot: its expert's first slot + the expert's tokens before t
  slot = (offsets[topk_experts] + jnp.take_along_axis(ranks, topk_experts, axis=1) - 1).reshape(-1)
  pair = _pair_of_slot(slot, size)                   # pair t * K + j; the rest by gathers
  valid = pair >= 0
  pair_c = jnp.maximum(pair, 0)
  return RoutingPlan(
      token_index=jnp.where(valid, pair_c // k, num_tokens),
      expert_index=jnp.where(valid, topk_experts.reshape(-1)[pair_c].astype(jnp.int32),
                             num_experts),
      scores=jnp.where(valid, topk_scores.reshape(-1)[pair_c].astype(jnp.float32), 0.0),
      valid=valid, group_sizes=counts, group_offsets=offsets, token_slots=slot,
      token_offsets=jnp.arange(num_tokens + 1, dtype=jnp.int32) * k,
      num_tokens=num_tokens, num_experts=num_experts, k=k, fixed_k=True, align=align,
      max_token_slots=k)


def _pair_of_slot(slot, size: int):
  """[size] int32: the pair each slot holds (-1 for padding slots), from slot [pairs], each
  pair's slot (size or more: none), by one scatter of the pair indices."""
  return jnp.full((size,), -1, jnp.int32).at[slot].set(
      jnp.arange(slot.shape[0], dtype=jnp.int32), mode="drop")


def _column_prefix_counts(mask):
  """(counts [T, E] int32, totals [E] int32) of a [T, E] bool mask: counts[t, e] = how many of
  rows 0..t are True in column e. Blocks of COUNT_BLOCK rows: inside a block one matmul with
  a lower-triangular matrix of ones (bf16 0/1 operands, fp32 sums: exact), then each block
  adds the totals of the blocks before it (a prefix sum over T / COUNT_BLOCK rows). From 2^24
  rows on (past fp32's exact integers) a plain cumulative sum."""
  num_rows, cols = mask.shape
  if num_rows >= 2**24:
    counts = jnp.cumsum(mask, axis=0, dtype=jnp.int32)
    return counts, counts[-1]
  blocks = -(-num_rows // COUNT_BLOCK)
  ones = jnp.pad(mask, ((0, blocks * COUNT_BLOCK - num_rows), (0, 0))).astype(jnp.bfloat16)
  lower = jnp.tril(jnp.ones((COUNT_BLOCK, COUNT_BLOCK), jnp.bfloat16))
  within = jnp.einsum("ij,bje->bie", lower, ones.reshape(blocks, COUNT_BLOCK, cols),
                      preferred_element_type=jnp.float32)
  block_totals = within[:, -1, :]
  before = jnp.cumsum(block_totals, axis=0) - block_totals
  counts = (within + before[:, None, :]).reshape(blocks * COUNT_BLOCK, cols)[:num_rows]
  return counts.astype(jnp.int32), jnp.sum(block_totals, axis=0).astype(jnp.int32)


def _pairs_to_plan(pair_expert, pair_score, num_experts: int, align: int, size: int,
                   fixed_k: bool) -> RoutingPlan:
  """Slots from per-token assignments pair_expert [T, J] (num_experts = none), pair_score [T, J]:
  a stable sort by expert puts expert e's pairs at group_offsets[e] + rank.

  Counts come from the sorted list by binary search and every slot reads its pair by a gather
  (slot -> expert -> position in the sorted list): no scatter-add, one scatter in all (the
  token-order listing of a fixed-k plan).
  """
  num_tokens, j = pair_expert.shape
  flat = pair_expert.reshape(-1).astype(jnp.int32)             # pair i = t * j + column
  order, sorted_expert = sort_pairs_by_expert(flat, num_experts)
  first = count_below(sorted_expert, jnp.arange(num_experts + 1, dtype=jnp.int32),
                       inclusive=False)                        # expert e's pairs: first[e]..
  counts = first[1:] - first[:-1]
  offsets = aligned_offsets(counts, align)

  slot = jnp.arange(size, dtype=jnp.int32)
  expert = group_of_slot(offsets, slot)
  expert_c = jnp.minimum(expert, num_experts - 1)
  rank = slot - offsets[expert_c]
  valid = (expert < num_experts) & (rank < counts[expert_c])
  pair = order[jnp.clip(first[expert_c] + rank, 0, order.shape[0] - 1)]
  token_index = jnp.where(valid, pair // j, num_tokens)
  if fixed_k:  # every token has exactly j slots: list them in token order
    slot_of_sorted = (offsets[sorted_expert] - first[sorted_expert]
                      + jnp.arange(order.shape[0], dtype=jnp.int32))
    token_slots = jnp.zeros_like(order).at[order].set(slot_of_sorted)
    token_offsets = jnp.arange(num_tokens + 1, dtype=jnp.int32) * j
  else:
    token_slots, token_offsets = _token_csr(token_index, num_tokens)
  return RoutingPlan(
      token_index=token_index,
      expert_index=jnp.where(valid, expert, num_experts),
      scores=jnp.where(valid, pair_score.reshape(-1)[pair].astype(jnp.float32), 0.0),
      valid=valid,
      group_sizes=counts, group_offsets=offsets, token_slots=token_slots,
      token_offsets=token_offsets, num_tokens=num_tokens, num_experts=num_experts, k=j,
      fixed_k=fixed_k, align=align, max_token_slots=j)


def sort_pairs_by_expert(flat_expert, num_experts: int):
  """(order, sorted experts): a stable sort of the pairs by expert (sorted position -> pair).

  Each pair's expert and index are packed into one uint32 key, expert * P + pair, so one
  key-only sort (a radix sort on the GPU) does it: a stable argsort sorts (key, index) tuples,
  which costs more on the GPU.
  """
  num_pairs = flat_expert.shape[0]
  if (num_experts + 1) * num_pairs >= 2**32:
    order = jnp.argsort(flat_expert, stable=True).astype(jnp.int32)
    return order, flat_expert[order]
  packed = flat_expert.astype(jnp.uint32) * jnp.uint32(num_pairs) + jnp.arange(num_pairs, dtype=jnp.uint32)
  packed = jnp.sort(packed)
  return (packed % num_pairs).astype(jnp.int32), (packed // num_pairs).astype(jnp.int32)


def group_of_slot(group_offsets, slots):
  """The group each slot lies in, by the groups' first slots group_offsets [G+1] (ascending):
  how many groups end at or before it; G for slots from group_offsets[G] on. slots: an array,
  or an int S for every slot 0 .. S - 1."""
  ends = group_offsets[1:]
  if isinstance(slots, int):
    slots = jnp.arange(slots, dtype=jnp.int32)
  return count_below(ends, slots, inclusive=True)


def count_below(sorted_values, queries, *, inclusive: bool):
  """For each query, how many of the ascending sorted_values are < it (<= it if inclusive).

  jnp.searchsorted's binary search is a loop, which on the GPU runs as a while loop with a
  host round trip per step.
  The steps here are unrolled in Python: one fused elementwise pass of ~log2(n) gathers.
  """
  n = sorted_values.shape[0]
  below = jnp.zeros(queries.shape, jnp.int32)
  step = 1 << (n.bit_length() - 1) if n else 0
  while step:  # invariant: the first `below` values are < query (<= if inclusive)
    probe = jnp.minimum(below + step, n)
    value = sorted_values[probe - 1]
    fits = (value <= queries) if inclusive else (value < queries)
    below = jnp.where((below + step <= n) & fits, probe, below)
    step >>= 1
  return below


def ordered_bits(x):
  """uint32 keys ordered like the float32 values x (finite, no NaN; -0.0 ties with 0.0)."""
  x = x.astype(jnp.float32)
  bits = jax.lax.bitcast_convert_type(jnp.where(x == 0, 0.0, x), jnp.uint32)
  negative = (bits >> 31) == 1
  return jnp.where(negative, ~bits, bits | jnp.uint32(1 << 31))


def kth_largest_key(count_at_least, k, lo, hi, *, unroll: bool = True):
  """The largest uint32 key in [lo, hi] that at least k values reach, by a 32-step bisection:
  count_at_least(key) counts the values whose key is >= key (lo, hi, k and the counts share
  one shape; count_at_least(lo) >= k). Unrolled by default: a rolled loop is a GPU while loop
  with a host round trip per step (roll it where one step is a large program of its own)."""
  def bisect(_, bounds):  # invariant: count_at_least(lo) >= k; the answer is in [lo, hi]
    lo, hi = bounds
    gap = hi - lo
    mid = lo + (gap >> 1) + (gap & 1)
    ok = count_at_least(mid) >= k
    return jnp.where(ok, mid, lo), jnp.where(ok, hi, mid - 1)

  return jax.lax.fori_loop(0, 32, bisect, (lo, hi), unroll=unroll)[0]


def top_per_column(values, counts):
  """select [T, E] bool: the counts[e] largest values of column e, ties to the lower row.

  The same choice as a stable descending sort of each column, found without sorting: a
  32-step bisection on the ordered bits finds each column's counts[e]-th largest key (one
  pass over [T, E] per step), then ties at that key are taken in row order.
  """
  keys = ordered_bits(values)
  counts = counts.astype(jnp.int32)

  # bounds from the keys themselves (they also carry the keys' varying axes under shard_map);
  # a column asked for 0 values ends at its largest key, of which ties_needed takes none
  threshold = kth_largest_key(lambda key: jnp.sum(keys >= key[None, :], axis=0, dtype=jnp.int32),
                              counts, jnp.min(keys, axis=0), jnp.max(keys, axis=0))
  above = keys > threshold[None, :]
  tie = keys == threshold[None, :]
  ties_needed = counts - jnp.sum(above, axis=0, dtype=jnp.int32)
  return above | (tie & (_column_prefix_counts(tie)[0] <= ties_needed[None, :]))


def _chosen_mask(topk_experts, num_experts: int):
  """[T, E] bool, True where the token chose the expert (a fused compare, no scatter)."""
  experts = jnp.arange(num_experts, dtype=topk_experts.dtype)
  return jnp.any(topk_experts[:, :, None] == experts, axis=1)


def rounded_slots(values, counts, offsets, num_slots: int):
  """Token rounding's selection, placed: token_index [num_slots] int32 holding, from slot
  offsets[e] on, the rows of the counts[e] largest values of column e in row order (ties to the
  lower row: top_per_column's choice), and T (values' rows) in every other slot.
  values: [T, E] float32; counts: [E]; offsets: [E] int32, each group's first slot (groups
  must not overlap). The reference (XLA: the selection, a prefix count down each column for
  the ranks, one scatter); backends may run it as a kernel."""
  num_tokens, num_experts = values.shape
  selected = top_per_column(values, counts)
  rank = _column_prefix_counts(selected)[0] - 1                # within the expert
  slot = jnp.where(selected, offsets[None, :num_experts] + rank, num_slots).reshape(-1)
  rows = jnp.broadcast_to(jnp.arange(num_tokens, dtype=jnp.int32)[:, None],
                          (num_tokens, num_experts)).reshape(-1)
  return jnp.full((num_slots,), num_tokens, jnp.int32).at[slot].set(rows, mode="drop")


# rounded_slots under another name, for route (whose argument of that name shadows it)
_reference_rounded_slots = rounded_slots


def _rounded_plan(logits, score_offsets, chosen, targets, k: int, tile: int, align: int,
                  place=rounded_slots) -> RoutingPlan:
  """The plan of the rounded counts `targets`: place (rounded_slots or a backend's) puts each
  expert's selected tokens in its slots; the rest follows from the group offsets. The pairs'
  scores exp(l_te - c_t) rank the tokens ([T, E], no gradient); the slots' own scores are
  computed from their logits alone, so the backward keeps and makes no [T, E] scores."""
  num_tokens, num_experts = logits.shape
  scores = jnp.exp(jax.lax.stop_gradient(logits - score_offsets))
  # Chosen tokens rank before unchosen ones: unchosen scores are biased by -1 (scores <= 1).
  biased = jnp.where(chosen, scores, scores - 1.0)
  size = num_slots(num_tokens, num_experts, k, tile, align)
  offsets = aligned_offsets(targets, align)
  # (integer slots: no gradient flows through the placement)
  token_index = place(biased, targets, offsets[:num_experts], size)
  valid = token_index < num_tokens
  expert = group_of_slot(offsets, size)
  expert_index = jnp.where(valid, expert, num_experts)
  slot_logits = logits.at[token_index, expert_index].get(mode="fill", fill_value=0)
  slot_offsets = score_offsets[:, 0].at[token_index].get(mode="fill", fill_value=0)
  slot_scores = jnp.where(valid, jnp.exp(slot_logits - slot_offsets), 0.0)   # (0: padding)
  token_slots, token_offsets = _token_csr(token_index, num_tokens)
  return RoutingPlan(
      token_index=token_index, expert_index=expert_index,
      scores=slot_scores, valid=valid,
      group_sizes=targets, group_offsets=offsets, token_slots=token_slots,
      token_offsets=token_offsets,
      num_tokens=num_tokens, num_experts=num_experts, k=k, fixed_k=False, align=align)


def plan_from_experts(expert_ids, scores, num_experts: int, align: int = 1) -> RoutingPlan:
  """A plan from given assignments: expert_ids [T, J] int (num_experts marks "none"), scores
  [T, J]. Used where routing happened elsewhere (rows received by expert parallelism)."""
  num_tokens, j = expert_ids.shape
  size = _round_up(num_tokens * j + (num_experts * (align - 1) if align > 1 else 0), align)
  return _pairs_to_plan(expert_ids, scores, num_experts, align, size, fixed_k=False)


def plan_from_group_sizes(group_sizes, num_rows: int, align: int = 1) -> RoutingPlan:
  """The plan of rows already grouped by expert: expert e's rows are rows start_e ..
  start_e + group_sizes[e] - 1 (start_e = group_sizes[0] + ... + group_sizes[e - 1]); each row
  is its own "token" with one slot (token_index is the row), rows from sum(group_sizes) on
  (and groups reaching past num_rows) have none. No sort: every slot finds its row by
  arithmetic on the group offsets. The slot scores are zeros (the caller passes its own).
  group_sizes: [E] int (traced or not); num_rows: R, static."""
  group_sizes = jnp.asarray(group_sizes).astype(jnp.int32)
  num_experts = group_sizes.shape[0]
  size = _round_up(num_rows + (num_experts * (align - 1) if align > 1 else 0), align)
  row_start = exclusive_cumsum(group_sizes)                   # [E+1]
  offsets = aligned_offsets(group_sizes, align)               # [E+1]
  slot = jnp.arange(size, dtype=jnp.int32)
  expert = group_of_slot(offsets, slot)
  expert_c = jnp.minimum(expert, num_experts - 1)
  rank = slot - offsets[expert_c]
  row = row_start[expert_c] + rank
  valid = (expert < num_experts) & (rank < group_sizes[expert_c]) & (row < num_rows)
  token_index = jnp.where(valid, row, num_rows)
  token_slots, token_offsets = _token_csr(token_index, num_rows)
  return RoutingPlan(
      token_index=token_index,
      expert_index=jnp.where(valid, expert, num_experts),
      scores=jnp.zeros((size,), jnp.float32), valid=valid,
      group_sizes=jnp.diff(jnp.minimum(row_start, num_rows)),    # (groups cut at num_rows)
      group_offsets=offsets, token_slots=token_slots, token_offsets=token_offsets,
      num_tokens=num_rows, num_experts=num_experts, k=1, fixed_k=False, align=align,
      max_token_slots=1)


def switch_loss(fraction, mean_prob):
  """E * sum_e f_e * P_e: f_e the fraction of top-K pairs at expert e, P_e its mean router
  probability (both over the same batch, local or global)."""
  return fraction.shape[0] * jnp.sum(fraction * mean_prob)


def load_balancing_loss(logits, topk_counts, k: int):
  """Switch-Transformer load balancing: E * sum_e (f_e / (T k)) * mean_t softmax(l_t)_e."""
  num_tokens = logits.shape[0]
  return switch_loss(topk_counts.astype(jnp.float32) / (num_tokens * k),
                     jnp.mean(jax.nn.softmax(logits, axis=-1), axis=0))


def z_loss(logits):
  """Router z-loss (ST-MoE): mean over tokens of logsumexp(logits)^2."""
  return jnp.mean(jnp.square(jax.nn.logsumexp(logits, axis=-1)))
