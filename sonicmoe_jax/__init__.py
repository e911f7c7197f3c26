"""sonicmoe-jax: SonicMoE (IO-aware MoE with a minimal-memory backward) for JAX."""
from sonicmoe_jax.backends import OP_NAMES, resolve as resolve_backend
from sonicmoe_jax.flax_layer import SonicMoE, SonicMoELinen
from sonicmoe_jax.grouped import grouped_expert_mlp
from sonicmoe_jax.layer import MoEOutput, expert_mlp, moe
from sonicmoe_jax.memory import activation_bytes_bound, saved_residuals
from sonicmoe_jax.core.routing import (RouterStats, RoutingPlan, load_balancing_loss, route,
                                       router_logits, z_loss)
from sonicmoe_jax.core.token_rounding import round_counts

__version__ = "0.1.0"
