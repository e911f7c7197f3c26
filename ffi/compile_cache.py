"""A disk cache for the compiled CuTe kernels (xla_call compiles one per configuration).

Compiling a kernel (CuTe DSL -> cubin and host code, ~0.4-1 s each) happens the first time a
program using it is traced; without a cache every new process (every training job's start)
compiles again. get_or_compile() writes each compiled function as an object file (CuTe DSL's
export_to_c) and later processes load it back (cute.runtime.load_module) instead of compiling.

An entry is keyed on what determines it: the sources of the kernel function's package (every
ffi/*.py file, hashed: a kernel also runs helpers of the other modules), its name, the
operands' shapes, dtypes and modes and the static configuration (block_n, ...), the installed
nvidia-cutlass-dsl version and the CUTE_DSL_* environment (the target architecture). Changing
any of the package's source files invalidates the entries.

Directory: install(directory) if called, else $SONICMOE_CUTE_CACHE if set ("" turns the cache
off), else ~/.cache/sonicmoe_jax/cute. An entry is <key>.o with <key>.sha256 beside it, both
written atomically (write, then rename); an entry whose digest does not match is compiled again.
"""
from __future__ import annotations

import functools
import hashlib
import importlib.metadata
import os
import pathlib
import sys

ENV_VAR = "SONICMOE_CUTE_CACHE"
_UNSET = object()
_directory = _UNSET   # install()'s choice


def default_directory() -> pathlib.Path | None:
  """The cache directory from the environment, or None when $SONICMOE_CUTE_CACHE is ''."""
  value = os.environ.get(ENV_VAR)
  if value is None:
    return pathlib.Path.home() / ".cache" / "sonicmoe_jax" / "cute"
  return pathlib.Path(value) if value else None


def directory() -> pathlib.Path | None:
  """Where entries are read and written now (None: the cache is off)."""
  return default_directory() if _directory is _UNSET else _directory


def install(path: pathlib.Path | str | None) -> pathlib.Path | None:
  """Use `path` for the entries from now on (None turns the cache off). Returns it."""
  global _directory
  _directory = pathlib.Path(path) if path is not None else None
  return _directory


@functools.cache
def _package_digest(folder: str) -> str:
  """One digest of the .py files in folder (names and contents, in name order)."""
  digest = hashlib.sha256()
  for path in sorted(pathlib.Path(folder).glob("*.py")):
    digest.update(path.name.encode() + b"\0" + path.read_bytes() + b"\0")
  return digest.hexdigest()


def entry_key(fn, spec) -> str:
  """The cache key of kernel `fn` compiled for operands and configuration `spec`."""
  module = sys.modules[fn.__module__]
  parts = [
      fn.__module__, getattr(fn, "__qualname__", repr(fn)),
      _package_digest(str(pathlib.Path(module.__file__).parent)),
      repr(spec), importlib.metadata.version("nvidia-cutlass-dsl"),
      repr(sorted((k, v) for k, v in os.environ.items() if k.startswith("CUTE_DSL_"))),
  ]
  return hashlib.sha256("\0".join(parts).encode()).hexdigest()


def _function_name(key: str) -> str:
  return f"sonicmoe_cute_{key[:24]}"


def load(folder: pathlib.Path, key: str):
  """The cached function, or None if the entry is missing or does not match its digest."""
  import cutlass.cute as cute
  obj, digest = folder / f"{key}.o", folder / f"{key}.sha256"
  try:
    if hashlib.sha256(obj.read_bytes()).hexdigest() != digest.read_text().strip():
      return None
  except OSError:
    return None
  module = cute.runtime.load_module(str(obj), enable_tvm_ffi=True)
  return getattr(module, _function_name(key))


def _store(folder: pathlib.Path, key: str, compiled) -> None:
  folder.mkdir(parents=True, exist_ok=True)
  tmp = folder / f"{key}.tmp{os.getpid()}.o"
  compiled.export_to_c(str(tmp), function_name=_function_name(key))
  digest = hashlib.sha256(tmp.read_bytes()).hexdigest()
  os.replace(tmp, folder / f"{key}.o")
  tmp_digest = folder / f"{key}.tmp{os.getpid()}.sha256"
  tmp_digest.write_text(digest)
  os.replace(tmp_digest, folder / f"{key}.sha256")


def get_or_compile(key: str, compile_kernel):
  """The TVM-FFI function for `key`: from the cache, or compile_kernel() (then stored)."""
  folder = directory()
  if folder is not None:
    cached = load(folder, key)
    if cached is not None:
      return cached
  compiled = compile_kernel()
  if folder is not None:
    try:
      _store(folder, key, compiled)
    except OSError:   # a read-only or full disk: the kernel still runs
      pass
  return compiled
