"""Calling a CuTe DSL kernel from an XLA program: an XLA FFI custom call.

call(kernel, inputs, outputs, modes=..., **config) compiles `kernel` (one of our cute.jit launch
functions, signature kernel(stream, *tensors, **config)) for these operands' shapes and dtypes
with TVM-FFI (CuTe DSL's `--enable-tvm-ffi`: the compiled function takes DLPack tensors and
launches on the caller's stream), registers it as an XLA FFI target with jax-tvm-ffi (XLA's CUDA
stream is TVM-FFI's environment stream; CUDA-graph capture allowed) and returns
jax.ffi.ffi_call's result. Each configuration is compiled once per process and kept on disk
across processes (compile_cache). Under jax.vmap the call runs once per batch element
(ffi_call's vmap_method="sequential": the kernels have no batch dimension).

Why this path: per call it costs less than cutlass.jax's cutlass_call (a few microseconds less
a call on a chain of tiny grouped GEMMs: benchmarks/ffi_overhead.py measures both, a Pallas
call and XLA's dot).

Operands are JAX's row-major arrays; `modes` gives, per tensor (inputs, then outputs), the
order in which the kernel sees its dimensions (None: as stored): (1, 2, 0) turns a [1, P, K]
array into the kernel's (P, K, 1) view.

Exporting (jax.export): a program using these kernels names one FFI target per compiled
configuration (TARGET_PREFIX + the first 40 digits of its cache key); export it with
disabled_checks=safety_checks() after tracing it once. A process that runs the exported program
must have the same targets registered: tracing the same ops with the same shapes does it, or
register_from_cache(exported) loads them from the disk cache the exporting process wrote.
"""
from __future__ import annotations

import re
import threading
from collections.abc import Sequence

import cutlass
import cutlass.cute as cute
import jax
import jax.numpy as jnp
import jax_tvm_ffi

from ffi import compile_cache

TARGET_PREFIX = "sonicmoe_cute_"
_DTYPES = {jnp.dtype(jnp.bfloat16): cutlass.BFloat16, jnp.dtype(jnp.float16): cutlass.Float16,
           jnp.dtype(jnp.float32): cutlass.Float32, jnp.dtype(jnp.int32): cutlass.Int32}
_registered: dict[str, object] = {}   # target name -> compiled function (kept alive)
_lock = threading.Lock()              # one compile and registration per target
_KEY_DIGITS = 40


def _view(tensor, mode):
  """The tensor with its dimensions in the order `mode` (None: unchanged)."""
  if mode is None:
    return tensor
  return cute.make_tensor(tensor.iterator, cute.select(tensor.layout, mode=list(mode)))


def _entry(kernel, modes, config):
  """The TVM-FFI entry point: the operands as stored, then the (environment) stream."""

  @cute.jit
  def entry(*args):
    *tensors, stream = args
    kernel(stream, *[_view(t, m) for t, m in zip(tensors, modes)], **config)

  return entry


def _fake(operand):
  """A compile-time stand-in for a row-major JAX operand."""
  dtype = jnp.dtype(operand.dtype)
  if dtype not in _DTYPES:
    raise TypeError(f"CuTe FFI call: unsupported operand dtype {dtype}")
  order = tuple(range(len(operand.shape) - 1, -1, -1))   # the last dimension contiguous
  return cute.runtime.make_fake_compact_tensor(_DTYPES[dtype], tuple(operand.shape),
                                               stride_order=order, assumed_align=16)


def target(kernel, inputs: Sequence, outputs: Sequence, modes: Sequence, config: dict) -> str:
  """The FFI target running `kernel` on operands of these shapes and dtypes (compiled, or read
  from the disk cache, and registered on first use)."""
  spec = (tuple((tuple(a.shape), str(jnp.dtype(a.dtype))) for a in (*inputs, *outputs)),
          tuple(None if m is None else tuple(m) for m in modes), tuple(sorted(config.items())))
  key = compile_cache.entry_key(kernel, spec)

  def compile_kernel():
    return cute.compile(_entry(kernel, modes, config), *map(_fake, (*inputs, *outputs)),
                        cute.runtime.make_fake_stream(use_tvm_ffi_env_stream=True),
                        options="--enable-tvm-ffi")

  return _register(key, lambda: compile_cache.get_or_compile(key, compile_kernel))


def _register(key: str, function_of_key) -> str:
  """The target name of cache key `key`, registered with function_of_key() the first time."""
  name = TARGET_PREFIX + key[:_KEY_DIGITS]
  with _lock:
    if name not in _registered:
      function = function_of_key()
      jax_tvm_ffi.register_ffi_target(name, function, platform="gpu", allow_cuda_graph=True)
      _registered[name] = function
  return name


def register_from_cache(exported: jax.export.Exported) -> list[str]:
  """Registers the CuTe FFI targets that an exported program calls, loading each kernel from
  the disk cache (compile_cache.directory(); the exporting process wrote them there), so that a
  deserialized program runs in a process that has not traced its ops. Returns the targets.
  Raises LookupError naming a target whose kernel is not in the cache."""
  names = sorted(set(re.findall(rf"@({TARGET_PREFIX}[0-9a-f]{{{_KEY_DIGITS}}})\b",
                                exported.mlir_module())))
  folder = compile_cache.directory()
  for name in names:
    if name in _registered:
      continue
    digits = name[len(TARGET_PREFIX):]
    keys = [p.stem for p in folder.glob(f"{digits}*.o")
            if len(p.stem) == 64] if folder is not None else []   # (not a writer's temp file)
    function = compile_cache.load(folder, keys[0]) if len(keys) == 1 else None
    if function is None:
      raise LookupError(f"CuTe kernel of FFI target {name} is not in the disk cache {folder} "
                        f"(trace the program's ops in this process, or copy the exporting "
                        f"process's cache directory, ${compile_cache.ENV_VAR})")
    _register(keys[0], lambda: function)
  return names


def call(kernel, inputs: Sequence, outputs: Sequence[jax.ShapeDtypeStruct], *,
         modes: Sequence | None = None, in_place: dict[int, int] | None = None, **config):
  """`kernel` on `inputs` (arrays), writing `outputs` (shapes and dtypes): a list of arrays.
  modes: per input, then per output, its dimensions' order in the kernel (None: as stored).
  in_place: {input index: output index} of outputs the kernel writes over an input's buffer
  (XLA's operand aliasing: it copies the input first where the input is used later). A kernel
  that writes only part of such an output relies on the input's values in the rest; under
  jax.vmap (a sequential loop of calls) the rest does not survive on the GPU, so such callers
  give their own batching rule (jax.custom_batching.custom_vmap) that does without the aliasing."""
  modes = list(modes) if modes is not None else [None] * (len(inputs) + len(outputs))
  if len(modes) != len(inputs) + len(outputs):
    raise ValueError(f"CuTe FFI call: {len(modes)} modes for {len(inputs) + len(outputs)} operands")
  name = target(kernel, inputs, outputs, modes, config)
  return jax.ffi.ffi_call(name, list(outputs), vmap_method="sequential",
                         input_output_aliases=in_place)(*inputs)


def targets() -> tuple[str, ...]:
  """The FFI targets registered in this process so far."""
  return tuple(_registered)


def safety_checks() -> list[jax.export.DisabledSafetyCheck]:
  """jax.export's disabled_checks for every target registered so far (trace the program once
  first, so that its kernels are among them)."""
  return [jax.export.DisabledSafetyCheck.custom_call(name) for name in _registered]
