"""A disk cache for the CuTe kernels that cutlass.jax compiles while a program is lowered.

cutlass.jax compiles a kernel (CuTe DSL -> cubin, ~0.5-1 s each) the first time a program using
it is lowered, and keeps the result in memory only: every new process (every training job's
start) compiles again. install() wraps cutlass.jax's compile step so that each compiled object
is also written to a directory and read back by later processes.

A cache entry is keyed on what determines the object: the kernel function's module source (our
ffi/*.py file, hashed), its name, cutlass.jax's argument spec (shapes, dtypes, layouts, static
keyword arguments such as block_n), the installed nvidia-cutlass-dsl version and the CUTE_DSL_*
environment (the target architecture). Changing a kernel's source file invalidates its entries.

Directory: $SONICMOE_CUTE_CACHE if set ("" turns the cache off), else
~/.cache/sonicmoe_jax/cute. Writes are atomic (write, then rename); an unreadable entry is
compiled again.
"""
from __future__ import annotations

import functools
import hashlib
import importlib.metadata
import os
import pathlib
import sys

ENV_VAR = "SONICMOE_CUTE_CACHE"
_MAGIC = b"sonicmoe-cute-cache-v1\n"


def default_directory() -> pathlib.Path | None:
  """The cache directory, or None when $SONICMOE_CUTE_CACHE is set to ''."""
  value = os.environ.get(ENV_VAR)
  if value is None:
    return pathlib.Path.home() / ".cache" / "sonicmoe_jax" / "cute"
  return pathlib.Path(value) if value else None


@functools.cache
def _source_digest(path: str) -> str:
  return hashlib.sha256(pathlib.Path(path).read_bytes()).hexdigest()


def entry_key(fn, spec) -> str:
  """The cache key of kernel `fn` compiled for cutlass.jax argument spec `spec`."""
  module = sys.modules[fn.__module__]
  parts = [
      fn.__module__, getattr(fn, "__qualname__", repr(fn)), _source_digest(module.__file__),
      repr(spec), importlib.metadata.version("nvidia-cutlass-dsl"),
      repr(sorted((k, v) for k, v in os.environ.items() if k.startswith("CUTE_DSL_"))),
  ]
  return hashlib.sha256("\0".join(parts).encode()).hexdigest()


def _read(path: pathlib.Path):
  """(module, fingerprint) from an entry, or None if it is missing or unreadable."""
  try:
    data = path.read_bytes()
  except OSError:
    return None
  if not data.startswith(_MAGIC) or len(data) < len(_MAGIC) + 32:
    return None
  body = data[len(_MAGIC):]
  fingerprint, module = body[:32], body[32:]
  return (module, fingerprint) if hashlib.sha256(module).digest() == fingerprint else None


def _write(path: pathlib.Path, module: bytes, fingerprint: bytes) -> None:
  path.parent.mkdir(parents=True, exist_ok=True)
  tmp = path.with_suffix(f".tmp{os.getpid()}")
  tmp.write_bytes(_MAGIC + fingerprint + module)
  os.replace(tmp, path)


def _with_disk_cache(compile_kernel, directory: pathlib.Path):
  """compile_kernel (cutlass.jax's get_or_compile_kernel) behind the disk cache."""
  from cutlass.jax.compile import CompileResult

  def get_or_compile_kernel(fn, spec, *, compile_key=None):
    path = directory / f"{entry_key(fn, spec)}.cubin-module"
    hit = _read(path)
    if hit is not None:
      module, fingerprint = hit
      return CompileResult(module=module, fingerprint=fingerprint, spec=spec)
    result = compile_kernel(fn, spec, compile_key=compile_key)
    if hashlib.sha256(result.module).digest() == result.fingerprint:   # as cutlass.jax makes it
      try:
        _write(path, result.module, result.fingerprint)
      except OSError:   # a read-only or full disk: the kernel still runs
        pass
    return result

  get_or_compile_kernel.uncached = compile_kernel
  return get_or_compile_kernel


def install_default() -> None:
  """install() with the default directory unless a cache is already in front of the compile
  step (the kernel modules call this on import; a user's own install() call wins)."""
  from cutlass.jax import primitive
  if not hasattr(getattr(primitive, "get_or_compile_kernel", None), "uncached"):
    install()


def install(directory: pathlib.Path | str | None = None) -> pathlib.Path | None:
  """Put the disk cache in front of cutlass.jax's compile step (a later call with another
  directory moves it). Returns the directory, or None if the cache is off (by
  $SONICMOE_CUTE_CACHE='' or a cutlass.jax without the expected compile hook)."""
  from cutlass.jax import primitive
  directory = pathlib.Path(directory) if directory is not None else default_directory()
  current = getattr(primitive, "get_or_compile_kernel", None)
  if current is None:
    return None
  original = getattr(current, "uncached", current)
  if directory is None:
    primitive.get_or_compile_kernel = original
    return None
  primitive.get_or_compile_kernel = _with_disk_cache(original, directory)
  return directory
