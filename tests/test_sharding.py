"""Runs the multi-device suite (tests/multidevice) in its own process on 8 virtual CPU devices."""
import os
import subprocess
import sys

import pytest

HERE = os.path.dirname(__file__)


MULTIDEVICE_FILES = sorted(f for f in os.listdir(os.path.join(HERE, "multidevice"))
                           if f.startswith("check_") and f.endswith(".py"))


@pytest.mark.parametrize("check_file", MULTIDEVICE_FILES)
def test_multidevice_suite(check_file):
  """tests/multidevice/<check_file> in a process of 8 CPU devices (one file a test, so that
  pytest-xdist's workers share them)."""
  flags = " ".join([os.environ.get("XLA_FLAGS", ""), "--xla_force_host_platform_device_count=8"])
  env = dict(os.environ, XLA_FLAGS=flags.strip(), JAX_PLATFORMS="cpu")
  proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                         "--rootdir", HERE, os.path.join(HERE, "multidevice", check_file)],
                        env=env, capture_output=True, text=True, cwd=os.path.dirname(HERE))
  print(proc.stdout[-5000:], proc.stderr[-3000:])
  assert proc.returncode == 0, proc.stdout[-5000:]


@pytest.mark.gpu
def test_one_device_mesh_on_gpu_ragged_and_padded_match_single():
  """On one GPU: the expert-parallel layer with a mesh of one device, both transports, and on
  the pallas backend, equals the single-device layer (forward and gradients, bf16, relative
  1e-2)."""
  import jax
  import jax.numpy as jnp
  import numpy as np
  from jax.sharding import Mesh

  import sonicmoe_jax as sm
  from conftest import make_inputs, rel_err
  from sonicmoe_jax import sharding

  mesh = Mesh(np.array(jax.devices()[:1]).reshape(1, 1), ("data", "expert"))
  args = make_inputs(0, 2048, 512, 128, 16, jnp.bfloat16)
  cot = jax.random.normal(jax.random.key(1), (2048, 512))

  def grads(fn):
    return fn(*args), jax.grad(lambda *a: jnp.sum(fn(*a).astype(jnp.float32) * cot), argnums=(0, 1, 2, 3))(*args)

  ref_out, ref_g = grads(lambda *a: sm.moe(*a, k=4).out)
  for backend, transport in [("auto", "padded"), ("auto", "ragged"), ("pallas", "padded")]:
    out, g = grads(jax.jit(lambda *a: sharding.moe_expert_parallel(
        *a, mesh=mesh, k=4, transport=transport, backend=backend)[0]))
    assert rel_err(out, ref_out) < 1e-2, (backend, transport)
    for a, b in zip(g, ref_g):
      assert rel_err(a, b) < 1e-2, (backend, transport)


def test_one_device_mesh_pallas_backend_lowers_for_cuda():
  """The expert-parallel layer on the pallas backend, its real kernels traced off the GPU: their
  outputs carry no varying-axes type under shard_map, which the backward rule must restore
  (found on the H200 with JAX 0.11: a trace-time type error), so its value and gradients trace
  and lower for CUDA. Its numbers against the single-device layer: the GPU test above (the
  interpreted run took 45-70 s of the CPU suite)."""
  import jax
  import jax.numpy as jnp
  import numpy as np
  from jax.sharding import Mesh

  from conftest import make_inputs
  from pallas_kernels import config
  from sonicmoe_jax import sharding

  mesh = Mesh(np.array(jax.devices()[:1]).reshape(1, 1), ("data", "expert"))
  T, d, n, E = 256, 128, 64, 4
  args = [jax.ShapeDtypeStruct(a.shape, a.dtype) for a in make_inputs(0, T, d, n, E, jnp.bfloat16)]
  layer = lambda *a: sharding.moe_expert_parallel(*a, mesh=mesh, k=2, transport="padded",
                                                  backend="pallas")[0]
  step = jax.jit(jax.value_and_grad(lambda *a: jnp.sum(layer(*a).astype(jnp.float32)),
                                    argnums=(0, 1, 2, 3)))
  with config.lowering_for_gpu():
    text = step.trace(*args).lower(lowering_platforms=("cuda",)).as_text()
  assert text.count("mosaic_gpu") >= 6


@pytest.mark.gpu
def test_training_loop_on_gpu_mesh_of_one_matches_no_mesh(tmp_path):
  """The models/ training loop on one GPU: --mesh data=1,expert=1 (the expert-parallel layer
  under shard_map) gives the losses of the unsharded loop (relative 2e-3: the model computes
  in bfloat16 there, and the two programs sum in different orders)."""
  import numpy as np

  from models import train
  args = ["--steps", "6", "--batch", "16", "--seq", "16", "--eval-every", "5", "--rounding", "none",
          "--quiet", "--out"]
  losses = lambda r: np.array([h[1] for h in r["history"]] + [e[1] for e in r["evals"]])
  single = train.main(args + [str(tmp_path / "a")])
  one = train.main(args + [str(tmp_path / "b"), "--mesh", "data=1,expert=1"])
  np.testing.assert_allclose(losses(one), losses(single), rtol=2e-3)
