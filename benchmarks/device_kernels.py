"""Our GPU kernels' times per step from JAX's profiler, as torch_sonicmoe.kernel_times gives the
PyTorch SonicMoE's: (ms per step summed over every kernel, [(kernel name, ms per step)] longest
first), so that bench.py compares kernels with kernels (no host overhead on either side).

The trace (jax.profiler.trace) holds one XPlane per GPU ("/device:GPU:<i>") whose per-stream
lines ("Stream #<id>(...)") carry one event per kernel or copy run on that stream; other lines
of the plane summarize the same work (XLA modules, ops) and are not counted.
"""
from __future__ import annotations

import collections
import glob
import os
import tempfile

import jax

DEVICE_PLANE_PREFIX = "/device:GPU:"
STREAM_LINE_PREFIX = "Stream"
NAME_CHARS = 160   # as torch_sonicmoe.kernel_times keeps

Plane = collections.namedtuple("Plane", "name lines")
Line = collections.namedtuple("Line", "name events")
Event = collections.namedtuple("Event", "name start_ns duration_ns")


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


def stream_events(planes):
  """[(start_ns, end_ns, name)] of every kernel or copy on the GPU streams, in start order."""
  events = []
  for plane in planes:
    if not plane.name.startswith(DEVICE_PLANE_PREFIX):
      continue
    for line in plane.lines:
      if line.name.startswith(STREAM_LINE_PREFIX):
        events += [(e.start_ns, e.start_ns + e.duration_ns, e.name[:NAME_CHARS])
                   for e in line.events]
  return sorted(events)


def step_launches(planes, steps: int):
  """[(name, ms)] of every kernel or copy of one step, in launch order: the first of `steps`
  identical steps' stream events (which GEMM is which op, where names alone do not say)."""
  events = stream_events(planes)
  return [(name, round((end - start) / 1e6, 4))
          for start, end, name in events[:len(events) // steps]]


def idle_gaps(events, top: int = 8):
  """Where the GPU sat idle between kernels: (span ms, busy ms, [(gap ms, kernel before, kernel
  after)] longest first) over events from stream_events (overlapping kernels count once)."""
  if not events:
    return 0.0, 0.0, []
  busy, gaps = 0, []
  cur_start, cur_end, cur_name = events[0]
  for start, end, name in events[1:]:
    if start > cur_end:
      busy += cur_end - cur_start
      gaps.append(((start - cur_end) / 1e6, cur_name, name))
      cur_start = start
    if end >= cur_end:
      cur_end, cur_name = end, name
  busy += cur_end - cur_start   # (cur_end: the latest end of all)
  return (cur_end - events[0][0]) / 1e6, busy / 1e6, sorted(gaps, key=lambda g: -g[0])[:top]


def device_planes(planes):
  """The GPU planes' stream lines copied into lists: ProfileData's planes, lines and events
  are one-pass iterators, and per_kernel and step_launches each read them."""
  return [Plane(plane.name, [Line(line.name, [Event(e.name, e.start_ns, e.duration_ns)
                                              for e in line.events])
                             for line in plane.lines if line.name.startswith(STREAM_LINE_PREFIX)])
          for plane in planes if plane.name.startswith(DEVICE_PLANE_PREFIX)]


def profile(fn, args, steps: int = 3):
  """The GPU planes (device_planes) of `steps` calls of the jitted fn(*args) (one call first,
  untraced, to compile), or None when the trace wrote nothing."""
  jax.block_until_ready(fn(*args))
  with tempfile.TemporaryDirectory() as trace_dir:
    with jax.profiler.trace(trace_dir):
      for _ in range(steps):
        jax.block_until_ready(fn(*args))
    files = glob.glob(os.path.join(trace_dir, "**", "*.xplane.pb"), recursive=True)
    if not files:
      return None
    return device_planes(jax.profiler.ProfileData.from_file(files[0]).planes)


def kernel_times(fn, args, steps: int = 3):
  """per_kernel of `steps` calls of the jitted fn(*args) (one call first, untraced, to
  compile) and one step's launches: (ms per step, [(name, ms)] longest first, [(name, ms)] in
  launch order), or None off the GPU."""
  planes = profile(fn, args, steps)
  times = None if planes is None else per_kernel(planes, steps)
  return None if times is None else (*times, step_launches(planes, steps))
