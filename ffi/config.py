"""Which CuTe kernel, schedule and tile each op of the cute backend runs: immutable data.

A `CuteConfig` is frozen and hashable, so a jitted program sees it as static data and caches
one executable per configuration. The defaults are the measured choices (docs/design.md,
section 4); pass another for one call with `sonicmoe_jax.moe(..., kernel_config={"cute":
CuteConfig(store_cluster_n=2)})`. Rules that depend on the layer's shape ("auto" values, the
thresholds) are resolved by ffi/ops.py when an op is traced. Importing this module needs no
CuTe DSL: a configuration can be built anywhere.
"""
from __future__ import annotations

import dataclasses

UP_PROJ_KERNELS = ("grouped", "pingpong")
DH_KERNELS = ("auto", "registers", "tma_store", "pingpong", "pingpong_tma")
DH_BLOCK_NS = (64, 128, 256)
STORE_KERNELS = ("grouped", "pingpong", "pingpong_tma")
STORE_BLOCK_NS = (128, 192)
STORE_TILE_MS = ("auto", 128, 192)       # pingpong.TILE_M, pingpong.ROW_TILE_M
STORE_CLUSTER_NS = (1, 2)                # pingpong.CLUSTER_NS
STORE_WIDE_KERNELS = ("grouped", "persistent")
STORE_WIDE_BLOCK_NS = ("auto", 128, 192, 256)
STORE_WIDE_CLUSTER_NS = (1, 2)           # persistent.CLUSTER_SIZES
STORE_WIDE_CLUSTER_MS = ("auto", 1, 2)
WGRAD_KERNELS = ("grouped", "persistent")
WGRAD_CLUSTER_MS = (1, 2)                # persistent.CLUSTER_SIZES
WGRAD_BLOCK_NS = ("auto", 128, 192, 256)
WEIGHT_GRADS = ("dw1", "dw2")


@dataclasses.dataclass(frozen=True)
class CuteConfig:
  """The cute backend's kernel choices.

  Up-projection:
    up_proj_gather_in_kernel: the kernel gathers X's rows itself (the same bits as gathering
      first, no [T*K, d] copy); False gathers by XLA first.
    up_proj_kernel: "grouped" (grouped_gemm.py, its producer warpgroup copying the rows) or
      "pingpong" (pingpong.py; the same bits, no faster on 128-row tiles).
  dH:
    dh_kernel: "registers" (grouped_gemm.dh storing from registers), "tma_store" (through
      SMEM and TMA stores), "pingpong" / "pingpong_tma" (one consumer's epilogue under the
      other's mainloop), or "auto": "pingpong_tma" where d <= dh_pingpong_max_d (a short
      mainloop leaves the epilogue a large share of each tile), else "tma_store".
    dh_block_n: dH's widest column tile (halved until it divides n; the ping-pong kernel takes
      at most 128). 256 makes n = 256 one column tile: each M tile reads its dO rows once.
    dh_h_smem: the epilogue reads H from SMEM, TMA-loaded over the rhs stages after the
      mainloop, instead of from global memory.
    dh_over_h: dH written over H's buffer (FFI operand aliasing: one [P, 2n] buffer for both).
      Per-op timings of dh alone turn it off: with H an argument of the timed program XLA
      would copy it first, which the layer's step never does.
    dout_gather_max_column_tiles: dh and dw2 gather dO's rows themselves where dH has at most
      this many column tiles (each tile gathers the rows again), else XLA gathers them once
      for both.
  Store GEMMs (down_proj, dx_tilde):
    store_kernel: "grouped" (one CTA per tile, store_stages deep, two CTAs an SM),
      "pingpong" (register stores under the other consumer's mainloop) or "pingpong_tma"
      (each consumer's TMA-store epilogue; outputs past 2^31 elements always take it).
    store_block_n: the ping-pong column tile, 192 where it divides the window's columns (77
      operand FLOP per byte against 128 x 128's 64), else 128.
    store_tile_m: rows a ping-pong tile: 128 (the plan's M tiles), 192 (from each expert's
      start, 128 columns wide), or "auto": 192 where store_block_n does not divide the window.
    store_cluster_n: CTAs per cluster sharing a row tile's lhs stages by TMA multicast (2
      where the column tiles pair up; 1: none).
    store_stages: the "grouped" store kernel's ring depth (3: two CTAs fit an SM).
    store_wide_min_k, store_wide_min_n: from this contraction and this output width on, the
      store GEMMs run wide tiles on store_wide_kernel ("persistent": each tile's epilogue
      under the next tile's loads; or "grouped"), with a producer warp issuing the TMA loads
      from store_wide_ws_min_n columns on (the "grouped" wide kernel).
    store_wide_cluster_n: CTAs per cluster of the "persistent" wide tiles, sharing an M tile's
      lhs stages by TMA multicast (2: neighbouring column tiles in pairs, an odd count taking
      one tile more, past the output; 1: none).
    store_wide_cluster_m: 2 runs those clusters along M instead: two M tiles of one expert
      (schedule.pair_slots; an expert's odd count of M tiles computing its last one twice)
      share the rhs's stages; "auto": 2 where the column tiles are an odd count (where pairs
      along N would compute a tile past the output: 2880 = 15 x 192), else 1. Where 2, it
      takes precedence over store_wide_cluster_n.
    store_wide_block_n: those wide tiles' columns: 128, 192, 256, or "auto": of 256 and 192
      the one whose last tile clips fewer of the output's columns (256 on a tie; 2880 = 15 x
      192 takes 192), 128 where that is more than clipped_waste_percent of them.
  Column tiles that may be clipped (the kernels loading and storing by TMA, whose last column
  tile may reach past the output: up_proj, dh with dh_h_smem on "tma_store", the store GEMMs
  but the ping-pong register stores, the weight gradients loading by TMA):
    clipped_waste_percent: the widest tile an op takes is halved (down to 64) while its last
      tile's columns past the output are more than this percent of the output's columns.
  Tile order of the one-CTA-a-tile kernels (grouped_gemm: up_proj, dh off the ping-pong
  kernel, the "grouped" store kernel, the weight gradients on "grouped" or past the in-kernel
  gathers' limits):
    band_m_tiles, band_min_column_tiles: from band_min_column_tiles output column tiles on,
      the tiles are launched in bands of band_m_tiles M tiles (a band's column tiles in turn,
      its M tiles neighbouring: each band reads each rhs column block once), else an M
      tile's column tiles together (which, at many column tiles, re-reads all of rhs for
      every M tile). 0: never.
  Weight gradients (dw1, dw2):
    dw1_gather_max_column_tiles: dW1 gathers X's rows itself where its output has at most
      this many column tiles, else reads one gather made by XLA.
    wgrad_block_n: the column tiles of the weight gradients that gather their rows in the
      kernel: 128, 192, 256, or "auto": 256, halved while the last tile's columns past the output
      are more than clipped_waste_percent of them (down to 128 on the persistent kernel, 64
      on "grouped").
    wgrad_kernel: "persistent" (CTAs looping over tiles, the producer filling the next tile's
      stages under the epilogue) or "grouped" (one CTA per tile); the same bits.
    wgrad_dynamic_order: the weight gradients (a tuple of "dw1", "dw2") that take their tiles
      from an atomic counter instead of every grid-th, or "auto": dW1 where an expert's output
      has at least wgrad_dynamic_min_tiles tiles (many CTAs on one expert's operands).
    wgrad_cluster_m: CTAs per cluster sharing the rhs's stages by TMA multicast (2 where M's
      128-row tiles pair up, or, for the weight gradients wgrad_padded_clusters names (a
      tuple of "dw1", "dw2") with their rows loaded by TMA, where the one tile more that
      pairs an odd count is at most clipped_waste_percent of M's rows; dW1 only by default:
      benchmarks/results/2026-12-07-h100-tile-bands-and-store-clusters/).
    tma_gather: the weight gradients (a tuple of "dw1", "dw2") that load their gathered rows
      by TMA, a box a row, instead of by their producer's cp.async.
  """
  up_proj_gather_in_kernel: bool = True
  up_proj_kernel: str = "grouped"
  dh_kernel: str = "auto"
  dh_pingpong_max_d: int = 1536
  dh_block_n: int = 256
  dh_h_smem: bool = True
  dh_over_h: bool = True
  dout_gather_max_column_tiles: int = 16
  store_kernel: str = "pingpong_tma"
  store_block_n: int = 192
  store_tile_m: str | int = "auto"
  store_cluster_n: int = 1
  store_stages: int = 3
  store_wide_min_k: int = 2048
  store_wide_min_n: int = 2048
  store_wide_ws_min_n: int = 4096
  store_wide_kernel: str = "persistent"
  store_wide_block_n: str | int = "auto"
  store_wide_cluster_n: int = 2
  store_wide_cluster_m: str | int = "auto"
  clipped_waste_percent: int = 10
  dw1_gather_max_column_tiles: int = 32
  band_m_tiles: int = 8
  band_min_column_tiles: int = 32
  wgrad_block_n: str | int = "auto"
  wgrad_kernel: str = "persistent"
  wgrad_dynamic_order: str | tuple[str, ...] = "auto"
  wgrad_dynamic_min_tiles: int = 128
  wgrad_cluster_m: int = 2
  wgrad_padded_clusters: tuple[str, ...] = ("dw1",)
  tma_gather: tuple[str, ...] = WEIGHT_GRADS

  def __post_init__(self):
    for name, choices in (("up_proj_kernel", UP_PROJ_KERNELS), ("dh_kernel", DH_KERNELS),
                          ("dh_block_n", DH_BLOCK_NS), ("store_kernel", STORE_KERNELS),
                          ("store_block_n", STORE_BLOCK_NS), ("store_tile_m", STORE_TILE_MS),
                          ("store_cluster_n", STORE_CLUSTER_NS),
                          ("store_wide_kernel", STORE_WIDE_KERNELS),
                          ("store_wide_block_n", STORE_WIDE_BLOCK_NS),
                          ("store_wide_cluster_n", STORE_WIDE_CLUSTER_NS),
                          ("store_wide_cluster_m", STORE_WIDE_CLUSTER_MS),
                          ("wgrad_block_n", WGRAD_BLOCK_NS),
                          ("wgrad_kernel", WGRAD_KERNELS),
                          ("wgrad_cluster_m", WGRAD_CLUSTER_MS)):
      value = getattr(self, name)
      if isinstance(value, bool) or value not in choices:
        raise ValueError(f"CuteConfig.{name} must be one of {choices}; got {value!r}")
    for name in ("up_proj_gather_in_kernel", "dh_h_smem", "dh_over_h"):
      if not isinstance(getattr(self, name), bool):
        raise TypeError(f"CuteConfig.{name} must be a bool; got {getattr(self, name)!r}")
    for name in ("dh_pingpong_max_d", "dout_gather_max_column_tiles", "store_stages",
                 "store_wide_min_k", "store_wide_min_n", "store_wide_ws_min_n",
                 "dw1_gather_max_column_tiles", "wgrad_dynamic_min_tiles", "band_m_tiles",
                 "band_min_column_tiles",
                 "clipped_waste_percent"):
      value = getattr(self, name)
      if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"CuteConfig.{name} must be a non-negative int; got {value!r}")
    if self.store_stages < 1:
      raise ValueError(f"CuteConfig.store_stages must be at least 1; got {self.store_stages}")
    _check_weight_grads("tma_gather", self.tma_gather)
    _check_weight_grads("wgrad_padded_clusters", self.wgrad_padded_clusters)
    if self.wgrad_dynamic_order != "auto":
      _check_weight_grads("wgrad_dynamic_order", self.wgrad_dynamic_order, "'auto' or ")


def _check_weight_grads(name: str, value, alternatives: str = ""):
  if not isinstance(value, tuple) or set(value) - set(WEIGHT_GRADS):
    raise ValueError(f"CuteConfig.{name} must be {alternatives}a tuple of 'dw1' and 'dw2'; got "
                     f"{value!r}")


DEFAULT = CuteConfig()
