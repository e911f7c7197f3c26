"""Our GPU kernels' times per step from JAX's profiler, as torch_sonicmoe.kernel_times gives the
PyTorch SonicMoE's: (ms per step summed over every kernel, [(kernel name, ms per step)] longest
first), so that bench.py compares kernels with kernels (no host overhead on either side).

The trace (jax.profiler.trace) holds one XPlane per GPU ("/device:GPU:<i>") whose per-stream
lines ("Stream #<id>(...)") carry one event per kernel or copy run on that stream; other lines
of the plane summarize the same work (XLA modules, ops) and are not counted.
"""
from __future__ import annotations

import glob
import os
import tempfile

import jax

DEVICE_PLANE_PREFIX = "/device:GPU:"
STREAM_LINE_PREFIX = "Stream"
NAME_CHARS = 160   # as torch_sonicmoe.kernel_times keeps


def per_kernel(planes, steps: int):
  """(ms per step, [(name, ms per step)] longest first) from profiler planes: objects with
  .name and .lines, lines with .name and .events, events with .name and .duration_ns (as
  jax.profiler.ProfileData gives them). None when no GPU stream events were traced."""
  per_name = {}
  for plane in planes:
    if not plane.name.startswith(DEVICE_PLANE_PREFIX):
      continue
    for line in plane.lines:
      if not line.name.startswith(STREAM_LINE_PREFIX):
        continue
      for event in line.events:
        name = event.name[:NAME_CHARS]
        per_name[name] = per_name.get(name, 0.0) + event.duration_ns / 1e6 / steps
  if not per_name:
    return None
  ranked = sorted(per_name.items(), key=lambda item: -item[1])
  return sum(per_name.values()), [(name, round(ms, 4)) for name, ms in ranked]


def kernel_times(fn, args, steps: int = 3):
  """per_kernel of `steps` calls of the jitted fn(*args) (one call first, untraced, to
  compile), or None off the GPU."""
  jax.block_until_ready(fn(*args))
  with tempfile.TemporaryDirectory() as trace_dir:
    with jax.profiler.trace(trace_dir):
      for _ in range(steps):
        jax.block_until_ready(fn(*args))
    files = glob.glob(os.path.join(trace_dir, "**", "*.xplane.pb"), recursive=True)
    if not files:
      return None
    data = jax.profiler.ProfileData.from_file(files[0])
    return per_kernel(data.planes, steps)
