"""Compile each interpreted Pallas thread body once, not on every run (CPU tests only).

Mosaic GPU interpret mode runs a kernel's threads (warpgroups, and grid blocks) through
`thread_map`, whose callback lowers and compiles the thread's jaxpr with `jit(...).trace(...)
.lower().compile()` on every run: that AOT path skips jit's cache, so each run of each kernel
recompiles its thread bodies (~3 s an interpreted kernel on the 2-core CI host, whatever its
shape). `install()` wraps that runner so that a thread body (the same jaxpr object, thread
index and argument shapes) compiles once per process; each thread keeps its own executable so
the simulated threads still run side by side (they wait on each other at barriers). Where a
JAX version lacks the runner, nothing changes (the tests only run slower).
"""

import collections
import threading

import jax
from jax import core as jax_core
from jax.extend import core as jex_core

# Bodies kept at most (each test's programs trace new jaxprs; the oldest go first).
MAX_ENTRIES = 512

_entries: collections.OrderedDict = collections.OrderedDict()
_lock = threading.Lock()
stats = {"compiles": 0, "hits": 0}


def _eval_body(jaxpr, consts, *args):
  """A thread's body: `consts` bind the jaxpr's constvars (JAX 0.10 hands the runner the
  open jaxpr, later versions the closed one, with the same consts)."""
  if isinstance(jaxpr, jex_core.ClosedJaxpr):
    jaxpr = jaxpr.jaxpr
  jax_core.eval_jaxpr(jaxpr, consts, *args)


def _shapes(tree):
  return tuple((tuple(a.shape), str(a.dtype)) for a in jax.tree.leaves(tree))


def _run_body_cached(jaxpr, consts, *args):
  """thread_map's runner with a cache: args[0] is the thread's index."""
  key = (jaxpr, int(args[0]), _shapes(consts), _shapes(args))
  with _lock:
    compiled = _entries.get(key)
    if compiled is not None:
      _entries.move_to_end(key)
      stats["hits"] += 1
  if compiled is None:
    traced = jax.jit(_eval_body, static_argnums=(0,)).trace(jaxpr, consts, *args)
    compiled = traced.lower().compile()
    with _lock:
      stats["compiles"] += 1
      _entries[key] = compiled
      while len(_entries) > MAX_ENTRIES:
        _entries.popitem(last=False)
  compiled(consts, *args)


def install() -> bool:
  """Route the interpreter's thread bodies through the cache; False where this JAX has no
  such runner (then nothing is changed)."""
  try:
    from jax._src.pallas.mosaic.interpret import thread_map
  except ImportError:
    return False
  if not callable(getattr(thread_map, "_run_jaxpr", None)):
    return False
  thread_map._run_jaxpr = _run_body_cached
  return True
