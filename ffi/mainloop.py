"""The mainloop pieces every CuTe GEMM kernel shares (grouped_gemm.py's, pingpong.py's and
persistent.py's): the CTA's tile shape and warp roles, its shared memory, the TMA load ring and
the wgmma k steps.

A CTA computes BLOCK_M x block_n output tiles in k steps of BLOCK_K. Its WARPGROUPS MMA
warpgroups (THREADS threads) each own BLOCK_M / WARPGROUPS of a tile's rows; where a producer
warpgroup loads the stages (the gathering and warp-specialized kernels), setmaxnreg moves
registers from it to them (PRODUCER_REGISTERS, MMA_REGISTERS). The load ring (load_pipeline) is a
`stages`-deep mbarrier pipeline: the producer acquires a free stage and TMA-loads each operand's
k step into it (load_stage; a gathering producer starts the stage itself, start_stage, and copies
the rows: row_gather.py); the consumers wait for full stages, issue one k step's wgmmas
(issue_k_step) and release the previous step's stage once its wgmmas are done (consume_tile,
release_last_stage).
"""
from __future__ import annotations

import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline
from cutlass.cute.nvgpu import cpasync, warpgroup

BLOCK_M = 128
BLOCK_K = 64
WARPGROUPS = 2
THREADS = 128 * WARPGROUPS
SMEM_BYTES = 227 * 1024
BARRIER_BYTES = 1024        # SMEM kept for the pipeline's mbarriers
# gathering, a third warpgroup (warpgroup 0) loads every stage; a stage's full barrier
# completes on the TMA bytes and PRODUCER_ARRIVALS arrivals (the TMA warp's, then two per
# producer thread: its cp.async copies landed, its padding rows' plain stores released)
PRODUCER_ARRIVALS = 1 + 2 * 128   # (ffi/pingpong.py's gathering producer too)
# setmaxnreg budgets (producer, MMA warpgroups): 128 x 56 + 256 x 224 = 64512, what the CTA gets
# at launch (384 threads x 168 registers; an increase past it waits for ever)
PRODUCER_REGISTERS, MMA_REGISTERS = 56, 224


def smem_bytes(block_n: int, num_rhs: int, itemsize: int, stages: int, rows: int = BLOCK_M) -> int:
  """A CTA's SMEM: `stages` pipeline stages (a `rows`-row lhs tile and num_rhs rhs tiles each)
  and 1 KiB for the barriers (the epilogue's buffers reuse the lhs stages)."""
  per_stage = (rows + num_rhs * block_n) * BLOCK_K * itemsize
  return stages * per_stage + BARRIER_BYTES


def stages_that_fit(block_n: int, num_rhs: int, itemsize: int, rows: int = BLOCK_M,
                     reserved: int = 0) -> int:
  """How many pipeline stages fit in SMEM (smem_bytes) beside `reserved` other bytes."""
  per_stage = smem_bytes(block_n, num_rhs, itemsize, 1, rows) - BARRIER_BYTES
  return (SMEM_BYTES - BARRIER_BYTES - reserved) // per_stage


@cute.jit
def prefetch_descriptors(warp, tma_a, tma_b, gather: cutlass.Constexpr):
  """Warp 0: the operands' TMA descriptors into the cache (A's only where it is not gathered)."""
  if warp == 0:
    if cutlass.const_expr(not gather):
      cpasync.prefetch_descriptor(tma_a)
    cpasync.prefetch_descriptor(tma_b)


@cute.jit
def load_pipeline(storage, stages: cutlass.Constexpr, stage_bytes: cutlass.Constexpr,
                  gather: cutlass.Constexpr, consumer_threads: cutlass.Constexpr, tidx,
                  extra_barriers: cutlass.Constexpr = 0, cluster_m: cutlass.Constexpr = 1,
                  cluster_n: cutlass.Constexpr = 1):
  """The kernels' load ring: a PipelineTmaAsync over storage's first 2 x stages mbarriers (it
  initialises them, fences and syncs the CTA, or the cluster). A full barrier completes on the
  stage's TMA bytes and, gathering, every producer thread's copies (PRODUCER_ARRIVALS); an
  empty one on each of the consumer_threads' warps. In a cluster of 2 CTAs, along M
  (cluster_m 2: neighbouring row tiles sharing the rhs's stages by multicast: tma_operand) or
  along N (cluster_n 2: neighbouring column tiles of one row tile sharing the lhs's stages), it
  counts each of both CTAs' consumer warps, lane r of a warp arriving on CTA r's barrier (a
  stage is refilled in both CTAs at once). Thread tidx 0 first initialises extra_barriers more
  after them: a count (one arrival each: an epilogue's H loads) or a tuple of each one's
  arrivals. Returns (the pipeline, the first extra barrier's pointer)."""
  extra = storage.barriers.data_ptr() + 2 * stages
  arrivals = ((1,) * extra_barriers if isinstance(extra_barriers, int) else tuple(extra_barriers))
  if cutlass.const_expr(len(arrivals) > 0):
    if tidx == 0:
      for i in cutlass.range_constexpr(len(arrivals)):
        cute.arch.mbarrier_init(extra + i, arrivals[i])
  consumers, multicast = consumer_threads // 32, {}   # one arrival per consumer warp
  if cutlass.const_expr(cluster_m * cluster_n > 1):   # (the pipeline counts the warps of both CTAs)
    consumers = consumer_threads
    # the multicast mode names the tile coordinate the cluster's CTAs share: N along M, M along N
    multicast = dict(tidx=tidx, mcast_mode_mn=(0, 1) if cluster_m > 1 else (1, 0),
                     enable_multicast_signaling=True)
  loads = pipeline.PipelineTmaAsync.create(
      barrier_storage=storage.barriers.data_ptr(), num_stages=stages,
      producer_group=pipeline.CooperativeGroup(
          pipeline.Agent.Thread, PRODUCER_ARRIVALS if gather else 1),
      consumer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, consumers),
      tx_count=stage_bytes, cta_layout_vmnk=cute.make_layout((1, cluster_m, cluster_n, 1)),
      **multicast)
  return loads, extra


def tma_operand(atom, smem, gmem, cluster_rank=0, cluster_size: int = 1):
  """(atom, gmem tiles by k step, smem stages, multicast mask) of a TMA-loaded operand:
  load_stage's operand. With cluster_size 2 (atom made with num_multicast=2) this CTA, rank
  cluster_rank, loads its half of each tile into both CTAs of the cluster; else the mask is
  None (a plain load)."""
  s_part, g_part = cpasync.tma_partition(atom, cluster_rank, cute.make_layout(cluster_size),
                                         cute.group_modes(smem, 0, 2),
                                         cute.group_modes(gmem, 0, 2))
  mask = None if cluster_size == 1 else cutlass.Int16((1 << cluster_size) - 1)
  return atom, g_part, s_part, mask


def tma_load(operand, k, stage, bar):
  """TMA-load k step k of a tma_operand into SMEM stage `stage`, completing on mbarrier bar
  (with its multicast mask: in every CTA of the cluster, each on its own barrier)."""
  atom, src, dst, mask = operand
  if mask is None:
    cute.copy(atom, src[(None, k)], dst[(None, stage)], tma_bar_ptr=bar)
  else:
    cute.copy(atom, src[(None, k)], dst[(None, stage)], tma_bar_ptr=bar, mcast_mask=mask)


@cute.jit
def issue_k_step(tiled_mma, accs, frag_a, frag_bs, stage):
  """One k step's wgmmas on SMEM stage `stage` (each accumulator with its rhs fragments),
  committed as one group."""
  warpgroup.fence()
  for kb in cutlass.range(cute.size(frag_a, mode=[2]), unroll_full=True):
    for acc, frag_b in zip(accs, frag_bs):
      cute.gemm(tiled_mma, acc, frag_a[None, None, kb, stage], frag_b[None, None, kb, stage], acc)
  warpgroup.commit_group()


@cute.jit
def consume_tile(loads, consume, release, tiled_mma, accs, frag_a, frag_bs, num_k,
                 gather: cutlass.Constexpr):
  """A consumer warpgroup's mainloop of one tile of a persistent kernel: accs zeroed, then
  each of its num_k ring stages waited for (gathered stages fenced for the async proxy first),
  its wgmmas issued, the previous step's stage released once they are done. Returns the
  advanced states; the last stage is still held and its wgmmas may be running
  (release_last_stage)."""
  for acc in accs:
    acc.fill(0.0)
  for kk in cutlass.range(num_k, unroll=1):
    loads.consumer_wait(consume)
    if cutlass.const_expr(gather):   # the gathered rows are generic-proxy writes
      cute.arch.fence_proxy("async.shared", space="cta")
    issue_k_step(tiled_mma, accs, frag_a, frag_bs, consume.index)
    consume.advance()
    warpgroup.wait_group(1)   # step kk - 1's wgmmas are done, so its stage is free
    if kk > 0:
      loads.consumer_release(release)
      release.advance()
  return consume, release


@cute.jit
def release_last_stage(loads, release, num_k):
  """Once a tile's wgmmas are done, its last stage back to the producer (which is already
  filling the others). Returns the advanced release state."""
  warpgroup.wait_group(0)
  if num_k > 0:
    loads.consumer_release(release)
    release.advance()
  return release


def load_stage(loads, state, operands, k):
  """The producer: TMA loads (tma_load) of k step k of each operand (tma_operand) into stage
  state.index, completing on that stage's mbarrier."""
  loads.producer_acquire(state)
  bar = loads.producer_get_barrier(state)
  for operand in operands:
    tma_load(operand, k, state.index, bar)
  loads.producer_commit(state)


@cute.jit
def start_stage(loads, state, rhs_operands, k, first_warp):
  """A gathering producer's k step k into stage state.index: each of its warps waits until the
  stage is free; its first warp (first_warp: whether this thread is in it; the whole warp: the
  arrive and the copies elect one lane with elect.sync, which one lane alone must not reach)
  arrives with the stage's expected TMA bytes and TMA-loads the rhs tiles. Returns the
  stage's full barrier."""
  loads.sync_object_empty.wait(state.index, state.phase)
  bar = loads.producer_get_barrier(state)
  if first_warp:
    loads.sync_object_full.arrive(state.index, loads.producer_mask)
    for operand in rhs_operands:
      tma_load(operand, k, state.index, bar)
  return bar


def shared_storage(dtype, num_barriers: int, a_elems: int, b_elems: int, num_rhs: int = 1,
                   c_elems: int = 0, tile_slots: int = 0):
  """A GEMM kernel's SMEM struct: num_barriers mbarriers, with tile_slots Int32 tile ids after
  them (tile_ids), then (each 1 KiB aligned) the lhs stages (s_a), num_rhs rhs stage arrays
  (s_b, s_b2) and, with c_elems, an epilogue buffer of its own (s_c)."""
  aligned = lambda elems: cute.struct.Align[cute.struct.MemRange[dtype, elems], 1024]
  fields = dict(barriers=cute.struct.MemRange[cutlass.Int64, num_barriers])
  if tile_slots:
    fields["tile_ids"] = cute.struct.MemRange[cutlass.Int32, tile_slots]
  fields.update(s_a=aligned(a_elems), s_b=aligned(b_elems))
  if num_rhs == 2:
    fields["s_b2"] = aligned(b_elems)
  if c_elems:
    fields["s_c"] = aligned(c_elems)
  return cute.struct(type("SharedStorage", (), {"__annotations__": fields}))
