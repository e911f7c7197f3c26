"""Token rounding's placed selection as a CuTe kernel (ffi/column_select.py): it lowers for
CUDA, the op hands what it cannot hold to XLA's, and on the GPU it places what XLA's reference
places (which takes what a stable sort takes) and gives the same rounded plans."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from cute_helpers import FFI_TARGET, cuda_module, needs_cute
from test_routing import SELECTION_SHAPES, check_top_per_column

pytestmark = needs_cute

PLAN_FIELDS = ("token_index", "expert_index", "scores", "valid", "group_sizes", "group_offsets",
               "token_slots", "token_offsets")


def test_cute_rounded_slots_compiles_and_lowers_for_cuda():
  from ffi import column_select
  values = jnp.zeros((32768, 64), jnp.float32)
  counts = jnp.zeros((64,), jnp.int32)
  fn = lambda v, c, o: column_select.rounded_slots(v, c, o, 40000)
  assert FFI_TARGET in cuda_module(fn, values, counts, counts)


def test_cute_rounded_slots_hands_too_many_tokens_to_xla():
  from ffi import column_select, ops
  values = jax.random.normal(jax.random.key(0), (column_select.MAX_TOKENS + 1, 2))
  counts = jnp.array([3, 200], jnp.int32)
  offsets = jnp.array([0, 128], jnp.int32)
  fn = lambda v, c, o: ops.rounded_slots(v, c, o, 512)
  with pytest.warns(UserWarning, match="rounded_slots: T=32769 is above 32768"):
    text = jax.jit(fn).lower(values, counts, offsets).as_text()
  assert "sonicmoe_cute" not in text
  with pytest.raises(ValueError, match="T=32769"):
    column_select.rounded_slots(values, counts, offsets, 512)


def _as_mask(token_index, counts, offsets, num_rows):
  """The [T, E] selection a placed token_index holds (each group's slots read back)."""
  token_index, counts, offsets = (np.asarray(a) for a in (token_index, counts, offsets))
  mask = np.zeros((num_rows, len(counts)), bool)
  for e, (count, first) in enumerate(zip(counts, offsets)):
    rows = token_index[first:first + count]
    assert np.all(np.diff(rows) > 0), f"expert {e}: rows not in order"
    mask[rows, e] = True
  return mask


@pytest.mark.gpu
@pytest.mark.parametrize("T,E,seed", SELECTION_SHAPES + [(32768, 256, 4)])
def test_cute_rounded_slots_place_a_stable_sorts_choice_on_gpu(T, E, seed):
  from ffi import column_select

  def select(values, counts):
    offsets = jnp.concatenate([jnp.zeros((1,), jnp.int32), jnp.cumsum(counts)[:-1]]) + 3
    num_slots = int(jnp.sum(counts)) + 10
    token_index = jax.jit(column_select.rounded_slots, static_argnums=3)(
        values, counts, offsets.astype(jnp.int32), num_slots)
    placed = np.zeros(num_slots, bool)
    for count, first in zip(np.asarray(counts), np.asarray(offsets)):
      placed[first:first + count] = True
    assert np.all(np.asarray(token_index)[~placed] == T), "a slot outside the groups was written"
    return _as_mask(token_index, counts, offsets, T)
  check_top_per_column(select, T, E, seed)


@pytest.mark.gpu
@pytest.mark.parametrize("mode", ["nearest", "stochastic", "up", "down", "balanced"])
def test_cute_rounded_plan_equals_xla_plan_on_gpu(mode):
  from ffi import ops
  from sonicmoe_jax.core import routing
  logits = jax.random.normal(jax.random.key(1), (4096, 64)).astype(jnp.bfloat16).astype(jnp.float32)
  route = lambda place: jax.jit(lambda l: routing.route(
      l, k=4, rounding=mode, tile=128, align=128, rng=jax.random.key(2),
      rounded_slots=place)[0])(logits)
  cute, xla = route(ops.rounded_slots), route(routing.rounded_slots)
  for field in PLAN_FIELDS:
    np.testing.assert_array_equal(getattr(cute, field), getattr(xla, field), err_msg=field)


def test_cute_rounded_slots_under_vmap_place_by_xla():
  """Under jax.vmap the op runs XLA's placement over the batch (the kernel writes over a buffer
  it is handed, which a sequential vmap of the call would share between elements): no kernel
  in the program, the reference's result."""
  from ffi import ops
  from sonicmoe_jax.core import routing
  values = jax.random.normal(jax.random.key(0), (3, 300, 8))
  counts = jnp.array([[40] * 8, [0, 300, 5, 7, 9, 11, 13, 15], [1] * 8], jnp.int32)
  offsets = jnp.arange(8, dtype=jnp.int32) * 320
  fn = jax.jit(jax.vmap(lambda v, c: ops.rounded_slots(v, c, offsets, 2600)))
  assert "sonicmoe_cute" not in fn.lower(values, counts).as_text()
  want = jax.vmap(lambda v, c: routing.rounded_slots(v, c, offsets, 2600))(values, counts)
  np.testing.assert_array_equal(fn(values, counts), want)


def test_cute_layer_with_rounding_lowers_under_grad_and_vmap(monkeypatch):
  """The layer's step with token rounding on cute lowers for CUDA with the placement kernel in
  it (no gradient reaches the placement), and so does its vmap."""
  import sonicmoe_jax as sm
  from conftest import make_inputs
  from ffi import column_select
  placed = []
  kernel = column_select.rounded_slots
  monkeypatch.setattr(column_select, "rounded_slots", lambda *a: placed.append(a) or kernel(*a))
  x, r, w1, w2 = make_inputs(0, 256, 128, 128, 8, jnp.bfloat16)
  loss = lambda x, w1: jnp.sum(sm.moe(x, r, w1, w2, k=2, rounding="nearest", tile=64,
                                      backend="cute").out.astype(jnp.float32))
  assert FFI_TARGET in cuda_module(jax.grad(loss, argnums=(0, 1)), x, w1)
  assert placed
  assert FFI_TARGET in cuda_module(jax.vmap(jax.grad(loss), in_axes=(0, None)), jnp.stack([x, x]), w1)
