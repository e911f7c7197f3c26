"""The models/ training loop on 8 virtual CPU devices: sharded == unsharded (float32, relative
1e-4 on the losses), FSDP too, and an orbax checkpoint of the sharded state restores exactly
with its shardings. (A mesh of one device == no mesh: tests/test_sharding.py's GPU test.)"""
import jax
import numpy as np
import orbax.checkpoint as ocp
import pytest
from flax import nnx

from models import train

ARGS = ["--steps", "6", "--batch", "16", "--seq", "16", "--eval-every", "5", "--rounding", "none",
        "--quiet", "--out"]


def _losses(result):
  return np.array([h[1] for h in result["history"]] + [e[1] for e in result["evals"]])


@pytest.fixture(scope="module")
def single(tmp_path_factory):
  """The run without a mesh (once for the module's tests)."""
  return train.main(ARGS + [str(tmp_path_factory.mktemp("single"))])


@pytest.fixture(scope="module")
def sharded(tmp_path_factory):
  """The run on a data=2, expert=4 mesh (once for the module's tests)."""
  return train.main(ARGS + [str(tmp_path_factory.mktemp("sharded")), "--mesh", "data=2,expert=4"])


def test_sharded_training_matches_single_device(single, sharded):
  np.testing.assert_allclose(_losses(sharded), _losses(single), rtol=1e-4)
  w1 = sharded["model"].blocks[0].moe.w1[...]
  assert w1.sharding.spec[0] == "expert" and len(w1.sharding.device_set) == 8


def test_checkpoint_roundtrip_of_sharded_state(sharded, tmp_path):
  state = nnx.state(sharded["model"])
  ckpt = ocp.StandardCheckpointer()
  ckpt.save(tmp_path / "ckpt", state)
  ckpt.wait_until_finished()
  abstract = jax.tree_util.tree_map(
      lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=a.sharding), state)
  restored = ckpt.restore(tmp_path / "ckpt", abstract)
  for a, b in zip(jax.tree_util.tree_leaves(state), jax.tree_util.tree_leaves(restored)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert a.sharding == b.sharding


def test_fsdp_training_matches_single_device(single, tmp_path):
  fsdp = train.main(ARGS + [str(tmp_path / "b"), "--mesh", "data=4,expert=2", "--fsdp"])
  np.testing.assert_allclose(_losses(fsdp), _losses(single), rtol=1e-4)
  emb = fsdp["model"].embed.embedding[...]
  assert "data" in tuple(emb.sharding.spec)
