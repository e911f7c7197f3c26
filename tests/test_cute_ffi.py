"""Backend "cute" as XLA FFI calls: a clear error without the extra, the calls' checks, the
compiled kernels' disk cache, vmap, jax.export (in this process and a new one) and XLA's CUDA
graphs."""
import builtins
import importlib
import re
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import sonicmoe_jax as sm
from conftest import make_inputs, rel_err
from cute_helpers import CUTE_GEMMS, FFI_TARGET, cuda_module, needs_cute


@pytest.mark.parametrize("missing", ["cutlass", "jax_tvm_ffi"])
def test_missing_extra_gives_clear_error(monkeypatch, missing):
  real_import = builtins.__import__

  def without_extra(name, *a, **k):
    if name == missing or name.startswith(missing + "."):
      raise ImportError(f"No module named '{missing}'")
    return real_import(name, *a, **k)

  monkeypatch.setattr(builtins, "__import__", without_extra)
  monkeypatch.delitem(sys.modules, "ffi.ops", raising=False)
  with pytest.raises(ImportError, match=r"pip install 'sonicmoe-jax\[cute\]'"):
    sm.resolve_backend({"aggregate": "cute"})


@needs_cute
def test_cache_key_follows_every_source_of_the_kernel_package(tmp_path, monkeypatch):
  """A kernel's cache entry is keyed on all of its package's sources: editing a helper module
  beside the kernel's own (as pingpong.py runs grouped_gemm.py's epilogue) gives a new key."""
  from ffi import compile_cache
  package = tmp_path / "kernels_pkg"
  package.mkdir()
  (package / "__init__.py").write_text("")
  (package / "helpers.py").write_text("SCALE = 1\n")
  (package / "kernel.py").write_text("def kernel():\n  pass\n")
  monkeypatch.syspath_prepend(str(tmp_path))
  kernel = importlib.import_module("kernels_pkg.kernel").kernel
  key = lambda: (compile_cache._package_digest.cache_clear(),
                 compile_cache.entry_key(kernel, ("spec",)))[1]
  before = key()
  assert key() == before
  (package / "helpers.py").write_text("SCALE = 2\n")
  assert key() != before


@needs_cute
def test_compiled_kernels_are_kept_on_disk(tmp_path, monkeypatch):
  """A kernel compiled while one program is traced is written to the cache directory; a new
  process (here: the registry of targets emptied) reads it back instead of compiling (CuTe
  DSL's compile is made to fail, and with an empty directory that failure does show); a damaged
  entry is compiled again and rewritten."""
  import cutlass.cute as cute
  from ffi import compile_cache, grouped_gemm, xla_call
  shapes = [jax.ShapeDtypeStruct((256, 128), jnp.bfloat16),
            jax.ShapeDtypeStruct((2, 128, 256), jnp.bfloat16), jax.ShapeDtypeStruct((2,), jnp.int32)]
  fn = lambda a, b, t: grouped_gemm.grouped_matmul(a, b, t, stages=3)
  real_compile = cute.compile

  def no_compile(*args, **kwargs):
    raise RuntimeError("compiled again")

  def lowered():   # in a fresh "process": no target registered yet
    monkeypatch.setattr(xla_call, "_registered", {})
    text = cuda_module(lambda *a: fn(*a), *shapes)
    return re.sub(r"\s*loc\(#loc\d*\)", "", "\n".join(
        line for line in text.splitlines() if not line.startswith("#loc")))

  monkeypatch.setattr(xla_call.jax_tvm_ffi, "register_ffi_target", lambda *a, **k: None)
  monkeypatch.setattr(compile_cache, "_directory", tmp_path)
  first = lowered()
  entries = list(tmp_path.glob("*.o"))
  assert len(entries) == 1 and len(list(tmp_path.glob("*.sha256"))) == 1
  monkeypatch.setattr(cute, "compile", no_compile)
  assert lowered() == first
  compile_cache.install(tmp_path / "empty")
  with pytest.raises(RuntimeError, match="compiled again"):
    lowered()
  compile_cache.install(tmp_path)
  entries[0].write_bytes(entries[0].read_bytes()[:-7])   # damaged: compiled and rewritten
  with pytest.raises(RuntimeError, match="compiled again"):
    lowered()
  monkeypatch.setattr(cute, "compile", real_compile)
  assert lowered() == first
  key = entries[0].name[:-2]
  assert compile_cache.load(tmp_path, key) is not None


def test_cache_directory_follows_the_environment(monkeypatch, tmp_path):
  from ffi import compile_cache
  monkeypatch.setattr(compile_cache, "_directory", compile_cache._UNSET)
  monkeypatch.setenv(compile_cache.ENV_VAR, str(tmp_path))
  assert compile_cache.directory() == tmp_path
  monkeypatch.setenv(compile_cache.ENV_VAR, "")
  assert compile_cache.directory() is None
  monkeypatch.delenv(compile_cache.ENV_VAR)
  assert compile_cache.directory().parts[-2:] == ("sonicmoe_jax", "cute")
  assert compile_cache.install(None) is None and compile_cache.directory() is None


@needs_cute
def test_vmapped_layer_with_cute_ops_lowers_for_cuda():
  """jax.vmap of the layer (over, say, ensemble members) with every CuTe op: it exports for
  CUDA, the FFI calls inside loops over the batch (identical loop bodies may be shared, so the
  calls are not counted)."""
  T, d, n, E, K = 256, 256, 128, 8, 2
  args = make_inputs(0, T, d, n, E, jnp.bfloat16)
  stacked = [jnp.stack([a, a]) for a in args]

  def loss(*a):
    return jnp.sum(sm.moe(*a, k=K, backend=CUTE_GEMMS).out.astype(jnp.float32))

  text = cuda_module(jax.vmap(jax.grad(loss, argnums=(0, 2, 3))), *stacked)
  assert FFI_TARGET in text and "stablehlo.while" in text


@pytest.mark.gpu
@needs_cute
def test_vmapped_layer_with_cute_ops_matches_each_element_on_gpu():
  T, d, n, E, K = 512, 256, 128, 8, 2
  per_element = [make_inputs(s, T, d, n, E, jnp.bfloat16) for s in (5, 6)]
  stacked = [jnp.stack(parts) for parts in zip(*per_element)]
  layer = lambda *a: sm.moe(*a, k=K, backend=CUTE_GEMMS).out
  got = jax.jit(jax.vmap(layer))(*stacked)
  for i, args in enumerate(per_element):   # (the router's matmul is batched: not bitwise)
    assert rel_err(got[i], jax.jit(layer)(*args)) < 1e-2


@pytest.mark.gpu
@needs_cute
def test_exported_program_with_cute_ops_runs_on_gpu():
  """jax.export of a program calling CuTe kernels: serialized, read back and run in a process
  where its FFI targets are registered, it gives the jitted program's result."""
  from ffi import xla_call
  T, d, n, E, K = 512, 256, 128, 8, 2
  args = make_inputs(3, T, d, n, E, jnp.bfloat16)
  layer = jax.jit(lambda *a: sm.moe(*a, k=K, backend=CUTE_GEMMS).out)
  expected = layer(*args)   # traced: its kernels' targets are registered
  exported = jax.export.export(layer, disabled_checks=xla_call.safety_checks())(*args)
  again = jax.export.deserialize(exported.serialize())
  assert xla_call.TARGET_PREFIX in again.mlir_module()
  np.testing.assert_array_equal(again.call(*args), expected)


@needs_cute
def test_exported_program_finds_its_kernels_in_the_disk_cache(tmp_path, monkeypatch):
  """register_from_cache registers the targets an exported program calls from the cache the
  exporting process wrote (here: the registry emptied, as in a new process); a target whose
  kernel is missing is named in a LookupError."""
  from ffi import compile_cache, xla_call
  registered = []
  monkeypatch.setattr(xla_call.jax_tvm_ffi, "register_ffi_target",
                      lambda name, *a, **k: registered.append(name))
  monkeypatch.setattr(compile_cache, "_directory", tmp_path)
  monkeypatch.setattr(xla_call, "_registered", {})
  T, d, n, E, K = 256, 256, 128, 8, 2
  args = [jax.ShapeDtypeStruct(a.shape, a.dtype) for a in make_inputs(0, T, d, n, E, jnp.bfloat16)]
  layer = jax.jit(lambda *a: sm.moe(*a, k=K, backend=CUTE_GEMMS).out)
  layer.trace(*args)
  exported = jax.export.export(layer, platforms=("cuda",),
                               disabled_checks=xla_call.safety_checks())(*args)
  targets = sorted(xla_call.targets())
  assert len(targets) >= 3   # up_proj, down_proj, aggregate
  monkeypatch.setattr(xla_call, "_registered", {})
  registered.clear()
  assert xla_call.register_from_cache(exported) == targets
  assert sorted(registered) == targets and sorted(xla_call.targets()) == targets
  monkeypatch.setattr(xla_call, "_registered", {})
  for entry in tmp_path.glob("*.o"):
    entry.unlink()
  with pytest.raises(LookupError, match=f"FFI target {targets[0]} is not in the disk cache"):
    xla_call.register_from_cache(exported)


_RUN_CHAINED_KERNELS = """
import sys
import numpy as np, jax, jax.numpy as jnp
import ffi
from ffi import grouped_gemm
P, K, E = 512, 256, 4
a = jax.random.normal(jax.random.key(0), (P, K)).astype(jnp.bfloat16)
w = (jax.random.normal(jax.random.key(1), (E, K, K)) / 16).astype(jnp.bfloat16)
tiles = jnp.array([0, 1, 1, 3], jnp.int32)

def chain(a, w, tiles):   # cute kernel, an XLA fusion, cute kernel, fusion, cute kernel
  for _ in range(3):
    a = jnp.tanh(grouped_gemm.grouped_matmul(a, w, tiles).astype(jnp.float32)).astype(a.dtype)
  return a

np.save(sys.argv[1], np.asarray(jax.jit(chain)(a, w, tiles).astype(jnp.float32)))
"""


def _custom_calls_in_command_buffers(dump_dir, module="jit_chain"):
  """(inside, outside): the custom-call thunks of `module` inside a top-level command buffer
  (a CUDA graph) and outside one, read from XLA's thunk-sequence dump. Since XLA forms command
  buffers on thunks, after HLO, the HLO text no longer shows them; the dump does. Each thunk
  line reads '<indent><index>: <kind> ...', a command buffer's thunks indented under it."""
  import pathlib
  files = sorted(pathlib.Path(dump_dir).glob(f"*{module}*thunk_sequence_after_thunk_passes*.txt"))
  if not files:   # the passes changed nothing (no command buffer formed): the plain dump
    files = sorted(pathlib.Path(dump_dir).glob(f"*{module}*thunk_sequence*.txt"))
  assert files, f"no thunk-sequence dump for {module} in {dump_dir}"
  inside = outside = 0
  in_command_buffer = False
  for line in files[-1].read_text().splitlines():
    thunk = line.lstrip()
    index, sep, rest = thunk.partition(": ")
    if not sep or not index.isdigit():
      continue
    if thunk == line:   # top level
      in_command_buffer = rest.startswith("kCommandBuffer")
    if rest.startswith("kCustomCall"):
      if in_command_buffer:
        inside += 1
      else:
        outside += 1
  return inside, outside


@pytest.mark.gpu
@needs_cute
def test_cute_kernels_run_inside_cuda_graphs_on_gpu(tmp_path):
  """With XLA's command buffers (CUDA graphs) on for custom calls, the three cute kernels of a
  chain (kernel, fusion, kernel, ...) are captured into a command buffer, read from XLA's
  thunk-sequence dump, and give the same bits as without graphs (each run in its own process:
  XLA_FLAGS are read once)."""
  import os
  import subprocess
  results = {}
  for mode, flags in [("off", "--xla_gpu_enable_command_buffer="),
                      ("on", "--xla_gpu_enable_command_buffer=FUSION,CUSTOM_CALL "
                             "--xla_gpu_graph_min_graph_size=1")]:
    dump = tmp_path / f"dump_{mode}"
    env = dict(os.environ, XLA_FLAGS=f"{flags} --xla_dump_to={dump}",
               XLA_PYTHON_CLIENT_PREALLOCATE="false")
    run = subprocess.run([sys.executable, "-c", _RUN_CHAINED_KERNELS, str(tmp_path / mode)],
                         env=env, capture_output=True, text=True, timeout=300,
                         cwd=str(__import__("pathlib").Path(__file__).parent.parent))
    assert run.returncode == 0, run.stderr[-3000:]
    results[mode] = (_custom_calls_in_command_buffers(dump), np.load(tmp_path / f"{mode}.npy"))
  assert results["off"][0] == (0, 3), results["off"][0]
  assert results["on"][0] == (3, 0), results["on"][0]
  np.testing.assert_array_equal(results["on"][1], results["off"][1])


def test_thunk_dump_reader_counts_custom_calls_in_and_out_of_command_buffers(tmp_path):
  """The dump reader behind the CUDA-graph test, on a hand-written dump: custom calls nested
  under a top-level kCommandBuffer count as inside, top-level ones as outside."""
  (tmp_path / "module_0001.jit_chain.thunk_sequence_after_thunk_passes.txt").write_text(
      "000: kCommandBuffer\n"
      "  000: kCustomCall\n"
      "  001: kKernel\n"
      "  002: kCustomCall\n"
      "001: kCustomCall\n"
      "002: kKernel\n"
      "  body:\n")
  (tmp_path / "module_0002.jit_other.thunk_sequence_after_thunk_passes.txt").write_text(
      "000: kCustomCall\n")
  assert _custom_calls_in_command_buffers(tmp_path) == (2, 1)
  (tmp_path / "module_0003.jit_plain.thunk_sequence.txt").write_text(
      "000: kCustomCall\n001: kKernel\n")
  assert _custom_calls_in_command_buffers(tmp_path, "jit_plain") == (0, 1)


_RUN_EXPORTED = """
import sys
import numpy as np, jax
import ffi
from ffi import xla_call
exported = jax.export.deserialize(open(sys.argv[1], 'rb').read())
xla_call.register_from_cache(exported)
inputs = np.load(sys.argv[2])   # float32 copies, cast back to the exported input dtypes
out = exported.call(*[jax.numpy.asarray(inputs[f'a{i}']).astype(aval.dtype)
                      for i, aval in enumerate(exported.in_avals)])
np.save(sys.argv[3], np.asarray(out.astype(jax.numpy.float32)))
"""


@pytest.mark.gpu
@needs_cute
def test_exported_program_runs_in_a_new_process_on_gpu(tmp_path, monkeypatch):
  """A program with every cute op, exported and run by another process that never traced it:
  the kernels come from the disk cache; the output equals the exporting process's."""
  import subprocess
  from ffi import compile_cache, xla_call
  monkeypatch.setattr(compile_cache, "_directory", tmp_path / "cache")
  # shapes no other test uses: its kernels are compiled (into this cache) here, not already
  # registered by an earlier test
  T, d, n, E, K = 384, 384, 128, 16, 2
  args = make_inputs(4, T, d, n, E, jnp.bfloat16)
  layer = jax.jit(lambda *a: sm.moe(*a, k=K, backend=CUTE_GEMMS).out)
  expected = layer(*args)
  exported = jax.export.export(layer, disabled_checks=xla_call.safety_checks())(*args)
  (tmp_path / "layer.bin").write_bytes(exported.serialize())
  np.savez(tmp_path / "inputs.npz", **{f"a{i}": np.asarray(a, np.float32) for i, a in enumerate(args)})
  env = dict(__import__("os").environ, SONICMOE_CUTE_CACHE=str(tmp_path / "cache"),
             XLA_PYTHON_CLIENT_PREALLOCATE="false")   # this process holds most of the GPU
  subprocess.run([sys.executable, "-c", _RUN_EXPORTED, str(tmp_path / "layer.bin"),
                  str(tmp_path / "inputs.npz"), str(tmp_path / "out.npy")], check=True, env=env,
                 cwd=str(__import__("pathlib").Path(__file__).parent.parent), timeout=300)
  # not bitwise: the new process compiles the XLA parts (router logits, its GEMM algorithms)
  # itself and may pick other algorithms (a few outputs can differ by one bf16 ulp)
  np.testing.assert_allclose(np.load(tmp_path / "out.npy"), np.asarray(expected, np.float32),
                             rtol=1e-2, atol=1e-3)


@needs_cute
def test_ffi_call_rejects_bad_modes_and_dtypes():
  from ffi import grouped_gemm, xla_call
  x = jax.ShapeDtypeStruct((128, 64), jnp.bfloat16)
  with pytest.raises(ValueError, match="CuTe FFI call: 1 modes for 3 operands"):
    xla_call.call(grouped_gemm._matmul, [x, x], [x], modes=[None])
  with pytest.raises(TypeError, match="unsupported operand dtype int8"):
    xla_call._fake(jax.ShapeDtypeStruct((4,), jnp.int8))
