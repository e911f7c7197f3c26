"""Flax modules owning the router and expert weights: `SonicMoE` (flax.nnx) and `SonicMoELinen`.

Both route with plain top-K unless `rounding` names a token-rounding mode, which then applies
in training only (nnx: `module.eval()` / `module.train()` flip `deterministic`; Linen: the
`deterministic` call argument). Rounding is off by default: it needs at least one tile of
tokens per call (T >= tile) and pays off at large batches. Parameters are kept in
`param_dtype` and cast to `dtype` for the expert GEMMs (None: the input's dtype, as Flax layers
do); the router stays fp32.
"""
from __future__ import annotations

from typing import Any, Optional

import jax
import jax.numpy as jnp
from flax import linen as nn
from flax import nnx

from sonicmoe_jax import layer, sharding
from sonicmoe_jax.core import validation
from sonicmoe_jax.core.routing import RouterStats

# Logical partitioning of the parameters (names of mesh axes; None = replicated). A pjit/jit
# training loop gets NamedShardings from them with nnx.get_partition_spec (see models/train.py).
ROUTER_AXES = (None, None)
EXPERT_AXES = ("expert", None, None)


def _init_fns():
  router = jax.nn.initializers.normal(stddev=0.02)
  # fan-in scaled, per expert: w1 [E, d, 2n] reads d inputs, w2 [E, n, d] reads n inputs
  w1 = jax.nn.initializers.variance_scaling(1.0, "fan_in", "truncated_normal", in_axis=1, out_axis=2)
  w2 = jax.nn.initializers.variance_scaling(1.0, "fan_in", "truncated_normal", in_axis=1, out_axis=2)
  return router, w1, w2


def _check_config(num_experts, k, rounding, tile):
  if not isinstance(num_experts, int) or num_experts < 1:
    raise ValueError(f"num_experts must be a positive int; got {num_experts!r}")
  validation.check_k(k, num_experts)
  if rounding not in (None, "none"):
    validation.check_choice("rounding", rounding, validation.ROUNDING_MODES)
  validation.check_tile(tile)


def _apply(x, router_w, w1, w2, dtype, deterministic, rng, rounding, mesh=None, data_axes=("data",),
           **kw):
  """Flattens leading axes, runs the functional layer (no rounding when deterministic); with a
  mesh, the expert-parallel layer over its "expert" axis."""
  x = jnp.asarray(x)
  lead, d = x.shape[:-1], x.shape[-1]
  if x.ndim < 1 or d != router_w.shape[0]:
    raise ValueError(f"x: its last dimension must be the layer's d_model={router_w.shape[0]}; "
                     f"got shape {tuple(x.shape)}")
  dtype = x.dtype if dtype is None else dtype
  args = (x.reshape(-1, d).astype(dtype), router_w, w1.astype(dtype), w2.astype(dtype))
  rounding = None if deterministic else rounding
  if mesh is not None:
    out, stats, _ = sharding.moe_expert_parallel(*args, mesh=mesh, data_axes=data_axes,
                                                 rounding=rounding, rng=rng, **kw)
    return out.reshape(*lead, d), stats
  out = layer.moe(*args, rounding=rounding, rng=rng, **kw)
  return out.out.reshape(*lead, d), out.stats


class SonicMoE(nnx.Module):
  """A SonicMoE feed-forward layer (flax.nnx).

  Args:
    d_model: d, the token width.
    d_expert: n, each expert's hidden width (w1 is [E, d, 2n] with gate and up halves).
    num_experts: E.
    k: experts per token.
    rounding: token-rounding mode used in training ("nearest", "stochastic", "up", "down",
      "balanced"); None (default) or "none": plain top-K (evaluation never rounds). Rounding
      needs at least `tile` tokens a call.
    tile: rounding tile (default 128, the kernels' M tile).
    score_fn, renormalize, backend, windows, kernel_config: as in `sonicmoe_jax.moe`.
    dtype: compute dtype of the expert GEMMs (default None: the input's dtype; bfloat16 is
      what the GPU kernels take).
    param_dtype: storage dtype of the parameters (default float32).
    rngs: nnx.Rngs; its "params" stream initialises the weights, and a "rounding" stream (or
      the default stream) draws stochastic-rounding keys.
    mesh: optional jax.sharding.Mesh with an "expert" axis: the layer then runs expert
      parallel (sonicmoe_jax.sharding); tokens are split over "expert" and `data_axes`.
    data_axes: the mesh axes tokens are split over besides "expert".

  The parameters carry partitioning metadata (w1, w2 over "expert"; router replicated), so
  nnx.get_partition_spec gives the shardings for a jit/pjit training loop.

  Call: `y, stats = layer(x)` with x [..., d]; stats is a RouterStats (counts and aux losses).
  """

  def __init__(self, d_model: int, d_expert: int, num_experts: int, k: int, *,
               rounding: Optional[str] = None, tile: int = 128,
               score_fn: str = "softmax_topk", renormalize: bool = False, backend="auto",
               windows: Optional[int | tuple[int, int]] = None, kernel_config=None,
               dtype=None,
               param_dtype=jnp.float32,
               mesh=None, data_axes=("data",), rngs: nnx.Rngs):
    _check_config(num_experts, k, rounding, tile)
    init_router, init_w1, init_w2 = _init_fns()
    key = rngs.params
    self.router_w = nnx.Param(init_router(key(), (d_model, num_experts), jnp.float32),
                              out_sharding=ROUTER_AXES, eager_sharding=False)
    self.w1 = nnx.Param(init_w1(key(), (num_experts, d_model, 2 * d_expert), param_dtype),
                        out_sharding=EXPERT_AXES, eager_sharding=False)
    self.w2 = nnx.Param(init_w2(key(), (num_experts, d_expert, d_model), param_dtype),
                        out_sharding=EXPERT_AXES, eager_sharding=False)
    self.mesh, self.data_axes = mesh, tuple(data_axes)
    self.k, self.rounding, self.tile = k, rounding, tile
    self.score_fn, self.renormalize, self.backend = score_fn, renormalize, backend
    self.windows = windows
    # (items, not a dict: a module's attributes hold static data as immutable values)
    self.kernel_config = None if kernel_config is None else tuple(sorted(kernel_config.items()))
    self.dtype = dtype
    self.deterministic = False
    self.rngs = rngs if rounding == "stochastic" else None

  def __call__(self, x) -> tuple[jax.Array, RouterStats]:
    rng = None
    if self.rngs is not None and not self.deterministic:
      rng = self.rngs.rounding() if "rounding" in self.rngs else self.rngs()
    return _apply(x, self.router_w[...], self.w1[...], self.w2[...], self.dtype,
                  self.deterministic, rng, k=self.k, rounding=self.rounding, tile=self.tile,
                  score_fn=self.score_fn, renormalize=self.renormalize, backend=self.backend,
                  windows=self.windows,
                  kernel_config=None if self.kernel_config is None else dict(self.kernel_config),
                  mesh=self.mesh,
                  data_axes=self.data_axes)


class SonicMoELinen(nn.Module):
  """The same layer for flax.linen. Call with `deterministic=True` for evaluation; stochastic
  rounding draws from the "rounding" RNG collection."""
  d_model: int
  d_expert: int
  num_experts: int
  k: int
  rounding: Optional[str] = None
  tile: int = 128
  score_fn: str = "softmax_topk"
  renormalize: bool = False
  backend: str = "auto"
  windows: Optional[int | tuple[int, int]] = None
  kernel_config: Optional[Any] = None
  dtype: Optional[jnp.dtype] = None
  param_dtype: jnp.dtype = jnp.float32

  @nn.compact
  def __call__(self, x, deterministic: bool = False):
    _check_config(self.num_experts, self.k, self.rounding, self.tile)
    init_router, init_w1, init_w2 = _init_fns()
    e, d, n = self.num_experts, self.d_model, self.d_expert
    router_w = self.param("router_w", init_router, (d, e), jnp.float32)
    w1 = self.param("w1", init_w1, (e, d, 2 * n), self.param_dtype)
    w2 = self.param("w2", init_w2, (e, n, d), self.param_dtype)
    rng = None
    if self.rounding == "stochastic" and not deterministic:
      rng = self.make_rng("rounding")
    return _apply(x, router_w, w1, w2, self.dtype, deterministic, rng, k=self.k,
                  rounding=self.rounding, tile=self.tile, score_fn=self.score_fn,
                  renormalize=self.renormalize, backend=self.backend, windows=self.windows,
                  kernel_config=self.kernel_config)
