"""A small decoder-only language model whose feed-forward layers are SonicMoE layers (flax.nnx)."""
from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from models.omnimoe import OmniMoE
from sonicmoe_jax import SonicMoE


@dataclasses.dataclass(frozen=True)
class LMConfig:
  vocab_size: int = 32
  d_model: int = 64
  num_layers: int = 2
  num_heads: int = 4
  max_len: int = 512
  num_experts: int = 8
  k: int = 2
  d_expert: int = 64
  rounding: str | None = "nearest"
  tile: int = 64
  backend: str = "auto"
  dtype: str = "float32"
  mesh: Any = None           # a Mesh with an "expert" axis: the MoE layers run expert parallel
  ffn: str = "sonicmoe"      # or "omnimoe": atomic experts (models/omnimoe.py)
  omni_experts: int = 1024   # OmniMoE: N atomic experts (a perfect square)
  omni_k: int = 64           # OmniMoE: experts per token
  omni_group: int = 128      # OmniMoE: expert-centric group size B


class Block(nnx.Module):
  def __init__(self, cfg: LMConfig, rngs: nnx.Rngs):
    dtype = jnp.dtype(cfg.dtype)
    self.attn_norm = nnx.RMSNorm(cfg.d_model, rngs=rngs)
    self.attn = nnx.MultiHeadAttention(cfg.num_heads, cfg.d_model, decode=False, dtype=dtype,
                                       rngs=rngs)
    self.moe_norm = nnx.RMSNorm(cfg.d_model, rngs=rngs)
    if cfg.ffn == "omnimoe":
      self.moe = OmniMoE(cfg.d_model, cfg.omni_experts, cfg.omni_k, cfg.d_expert,
                         group=cfg.omni_group, dtype=dtype, rngs=rngs)
      return
    if cfg.ffn != "sonicmoe":
      raise ValueError(f"ffn must be 'sonicmoe' or 'omnimoe'; got {cfg.ffn!r}")
    moe_mesh = cfg.mesh if cfg.mesh is not None and "expert" in cfg.mesh.axis_names else None
    data_axes = tuple(a for a in cfg.mesh.axis_names if a != "expert") if moe_mesh else ()
    self.moe = SonicMoE(cfg.d_model, cfg.d_expert, cfg.num_experts, cfg.k, rounding=cfg.rounding,
                        tile=cfg.tile, backend=cfg.backend, dtype=dtype, mesh=moe_mesh,
                        data_axes=data_axes, rngs=rngs)

  def __call__(self, x, mask):
    x = x + self.attn(self.attn_norm(x), mask=mask)
    y, stats = self.moe(self.moe_norm(x))
    return x + y.astype(x.dtype), stats


class MoELM(nnx.Module):
  """Token + learned position embeddings, `num_layers` x (attention + SonicMoE), tied output."""

  def __init__(self, cfg: LMConfig, rngs: nnx.Rngs):
    self.cfg = cfg
    self.embed = nnx.Embed(cfg.vocab_size, cfg.d_model, rngs=rngs)
    self.pos_embed = nnx.Embed(cfg.max_len, cfg.d_model, rngs=rngs)
    self.blocks = nnx.List([Block(cfg, rngs) for _ in range(cfg.num_layers)]) if hasattr(nnx, "List") \
        else [Block(cfg, rngs) for _ in range(cfg.num_layers)]
    self.final_norm = nnx.RMSNorm(cfg.d_model, rngs=rngs)

  def __call__(self, tokens):
    """tokens [B, L] -> (logits [B, L, V] fp32, list of RouterStats, one per layer)."""
    if tokens.shape[1] > self.cfg.max_len:
      raise ValueError(f"sequence length {tokens.shape[1]} exceeds max_len={self.cfg.max_len}")
    x = self.embed(tokens) + self.pos_embed(jnp.arange(tokens.shape[1]))[None]
    mask = nnx.make_causal_mask(tokens)
    stats = []
    for block in self.blocks:
      x, st = block(x, mask)
      stats.append(st)
    logits = self.embed.attend(self.final_norm(x)).astype(jnp.float32)
    return logits, stats


def lm_loss(model: MoELM, tokens, lb_coef: float = 1e-2, z_coef: float = 1e-3):
  """Next-token cross entropy plus router auxiliary losses; returns (loss, (ce, stats))."""
  logits, stats = model(tokens[:, :-1])
  ce = jnp.mean(-jnp.take_along_axis(jax.nn.log_softmax(logits), tokens[:, 1:, None], -1))
  aux = sum(lb_coef * s.load_balancing_loss + z_coef * s.z_loss for s in stats)
  return ce + aux, (ce, stats)
