"""Token rounding's selection as a CuTe kernel (ffi/column_select.py): it lowers for CUDA, the
op hands what it cannot hold to the XLA selection, and on the GPU it takes what a stable sort
takes, the XLA selection's choice, and the same rounded plans."""
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import sonicmoe_jax as sm
from cute_helpers import FFI_TARGET, cuda_module, needs_cute
from test_routing import SELECTION_SHAPES, check_top_per_column

pytestmark = needs_cute


def test_cute_top_per_column_compiles_and_lowers_for_cuda():
  from ffi import column_select
  values = jnp.zeros((32768, 64), jnp.float32)
  counts = jnp.zeros((64,), jnp.int32)
  assert FFI_TARGET in cuda_module(column_select.top_per_column, values, counts)


def test_cute_top_per_column_hands_too_many_tokens_to_xla():
  from ffi import column_select, ops
  values = jax.random.normal(jax.random.key(0), (column_select.MAX_TOKENS + 1, 2))
  counts = jnp.array([3, 200], jnp.int32)
  with pytest.warns(UserWarning, match="top_per_column: T=32769 is above 32768"):
    text = jax.jit(ops.top_per_column).lower(values, counts).as_text()
  assert "sonicmoe_cute" not in text
  with pytest.raises(ValueError, match="T=32769"):
    column_select.top_per_column(values, counts)


@pytest.mark.gpu
@pytest.mark.parametrize("T,E,seed", SELECTION_SHAPES + [(32768, 256, 4)])
def test_cute_top_per_column_equals_stable_sort_on_gpu(T, E, seed):
  from ffi import column_select
  check_top_per_column(jax.jit(column_select.top_per_column), T, E, seed)


@pytest.mark.gpu
@pytest.mark.parametrize("mode", ["nearest", "stochastic", "up", "down", "balanced"])
def test_cute_rounded_plan_equals_xla_plan_on_gpu(mode):
  from ffi import ops
  from sonicmoe_jax.core import routing
  logits = jax.random.normal(jax.random.key(1), (4096, 64)).astype(jnp.bfloat16).astype(jnp.float32)
  route = lambda select: jax.jit(lambda l: routing.route(
      l, k=4, rounding=mode, tile=128, align=128, rng=jax.random.key(2),
      top_per_column=select)[0])(logits)
  cute, xla = route(ops.top_per_column), route(routing.top_per_column)
  for field in ("token_index", "expert_index", "scores", "valid", "group_sizes",
                "group_offsets", "token_slots", "token_offsets"):
    np.testing.assert_array_equal(getattr(cute, field), getattr(xla, field), err_msg=field)
