"""Bad inputs raise clear errors naming the argument and the limit."""
import numpy as np
import jax.numpy as jnp
import pytest

import sonicmoe_jax as sm
from conftest import make_inputs

T, d, n, E = 32, 16, 8, 4


@pytest.fixture
def args():
  return make_inputs(0, T, d, n, E)


def test_wrong_ranks(args):
  x, r, w1, w2 = args
  with pytest.raises(ValueError, match=r"x must have rank 2"):
    sm.moe(x[None], r, w1, w2, k=1)
  with pytest.raises(ValueError, match=r"router_w must have rank 2"):
    sm.moe(x, r[None], w1, w2, k=1)
  with pytest.raises(ValueError, match=r"w1 must have rank 3"):
    sm.moe(x, r, w1[0], w2, k=1)
  with pytest.raises(ValueError, match=r"w2 must have rank 3"):
    sm.moe(x, r, w1, w2[0], k=1)


def test_mismatched_dims(args):
  x, r, w1, w2 = args
  with pytest.raises(ValueError, match=r"router_w: dim 0 \(d, from x\) must be 16; got 8"):
    sm.moe(x, r[:8], w1, w2, k=1)
  with pytest.raises(ValueError, match=r"w1: dim 0 \(E, from router_w\) must be 4"):
    sm.moe(x, r, w1[:3], w2, k=1)
  with pytest.raises(ValueError, match=r"w1: dim 2 .* must be even"):
    sm.moe(x, r, w1[:, :, :15], w2, k=1)
  with pytest.raises(ValueError, match=r"w2: dim 1 \(n, half of w1's dim 2\) must be 8"):
    sm.moe(x, r, w1, w2[:, :5], k=1)
  with pytest.raises(ValueError, match=r"w2: dim 2 \(d, from x\) must be 16"):
    sm.moe(x, r, w1, w2[:, :, :7], k=1)


@pytest.mark.parametrize("k", [0, -1, E + 1])
def test_bad_k(args, k):
  with pytest.raises(ValueError, match=r"k must satisfy 1 <= k <= E \(number of experts = 4\)"):
    sm.moe(*args, k=k)


def test_k_must_be_int(args):
  with pytest.raises(TypeError, match="k must be a Python int"):
    sm.moe(*args, k=2.0)


def test_bad_dtypes(args):
  x, r, w1, w2 = args
  with pytest.raises(TypeError, match="x must have a floating dtype"):
    sm.moe(x.astype(jnp.int32), r, w1, w2, k=1)
  with pytest.raises(TypeError, match="w1 must have x's dtype float32; got bfloat16"):
    sm.moe(x, r, w1.astype(jnp.bfloat16), w2, k=1)


@pytest.mark.parametrize("tile", [0, 3, 96, 2048])
def test_bad_tile(args, tile):
  with pytest.raises(ValueError, match=r"tile must be a power of two in \[1, 1024\]"):
    sm.moe(*args, k=1, rounding="nearest", tile=tile)


def test_rounding_needs_a_tile_of_tokens(args):
  with pytest.raises(ValueError, match=r"T=32 < tile=64"):
    sm.moe(*args, k=1, rounding="nearest", tile=64)


def test_unknown_names(args):
  with pytest.raises(ValueError, match="rounding must be one of"):
    sm.moe(*args, k=1, rounding="sideways", tile=16)
  with pytest.raises(ValueError, match="score_fn must be one of"):
    sm.moe(*args, k=1, score_fn="sigmoid")
  with pytest.raises(ValueError, match="backend must be one of"):
    sm.moe(*args, k=1, backend="triton")
  with pytest.raises(ValueError, match="unknown op names"):
    sm.moe(*args, k=1, backend={"up_projection": "xla"})


def test_flax_layer_config_errors():
  from flax import nnx
  with pytest.raises(ValueError, match="k must satisfy"):
    sm.SonicMoE(16, 8, 4, 5, rngs=nnx.Rngs(0))
  with pytest.raises(ValueError, match="rounding must be one of"):
    sm.SonicMoE(16, 8, 4, 2, rounding="maybe", rngs=nnx.Rngs(0))


def test_auto_backend_falls_back_explicitly_on_gpu_platform():
  from sonicmoe_jax import backends
  from sonicmoe_jax.core import xla_ops
  with pytest.warns(UserWarning, match="cannot run this layer .*float32.*using 'xla'") as caught:
    ops = backends.resolve("auto", platform="gpu", dtype=jnp.float32, d=128, n=64)
  assert ops.up_proj is xla_ops.up_proj and ops.align == 1
  fell_back = [str(w.message) for w in caught if "cannot run this layer" in str(w.message)]
  assert len(fell_back) == 1 and "up_proj, down_proj, dh" in fell_back[0]   # one warning for all
  assert set(ops.backend_by_op().values()) == {"xla"}
  ops = backends.resolve("auto", platform="gpu", dtype=jnp.bfloat16, d=128, n=64)
  assert ops.up_proj is not xla_ops.up_proj and ops.align == 128
  assert ops.backend_by_op()["aggregate"] == "xla" and ops.backend_by_op()["up_proj"] != "xla"
  assert backends.resolve({"dh": "pallas"}, platform="cpu").backend_by_op() == {
      op: "pallas" if op == "dh" else "xla" for op in sm.OP_NAMES}
  assert backends.resolve("auto", platform="cpu").up_proj is xla_ops.up_proj


@pytest.mark.parametrize("name", ["xla", "pallas", "cute"])
def test_every_backend_implements_every_op(name):
  """Any backend by name (or any mix) forms a whole layer: each module's OPS has every op."""
  from sonicmoe_jax import backends
  if name == "cute":
    pytest.importorskip("cutlass")
    pytest.importorskip("jax_tvm_ffi")
  module = backends._backend_module(name)
  assert set(module.OPS) == set(backends.OP_NAMES)
  ops = backends.resolve(name)
  assert all(callable(getattr(ops, op)) for op in backends.OP_NAMES)


def test_inputs_as_jnp_asarray_takes_them():
  """moe takes NumPy arrays and nested lists outside jit as jnp.asarray would (the same output
  as JAX arrays); something that is no array is a TypeError naming the argument."""
  x, router_w, w1, w2 = make_inputs(3, 32, 16, 8, 4, jnp.float32)
  want = sm.moe(x, router_w, w1, w2, k=2).out
  as_np = [np.asarray(a) for a in (x, router_w, w1, w2)]
  np.testing.assert_array_equal(sm.moe(*as_np, k=2).out, want)
  np.testing.assert_array_equal(sm.moe(*(a.tolist() for a in as_np), k=2).out, want)
  with pytest.raises(TypeError, match="router_w must be an array"):
    sm.moe(x, "router", w1, w2, k=2)


def test_contradictory_options_are_refused_and_spellings_match_the_command_lines():
  """renormalize=True applies to score_fn="softmax_all" only; rounding="none" (the command
  lines' spelling) is plain top-K, as None is."""
  args = make_inputs(4, 256, 16, 8, 4, jnp.float32)
  with pytest.raises(ValueError, match="renormalize=True applies to score_fn='softmax_all'"):
    sm.moe(*args, k=2, renormalize=True)
  np.testing.assert_array_equal(sm.moe(*args, k=2, rounding="none").out,
                                sm.moe(*args, k=2, rounding=None).out)
  sm.moe(*args, k=2, score_fn="softmax_all", renormalize=True)   # (allowed)
