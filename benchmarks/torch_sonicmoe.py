"""The PyTorch SonicMoE (PyPI sonic-moe) measured the way benchmarks/bench.py measures our layer,
in a process of its own (PyTorch and JAX share one GPU badly inside one process).

  python benchmarks/torch_sonicmoe.py

reads one request per line on stdin, a JSON object {"config": NAME, "shape": [T, d, n, E, K],
"iters": I, "reps": R}, and answers each with one JSON record on stdout; it stays up between
requests, so that bench.py can alternate ours and theirs in rounds without compiling again.
An empty line or end of input ends it.

The timed step does what a training step does and what ours does: every gradient cleared
first (`.grad = None`, as `optimizer.zero_grad()` does, so no accumulation kernels run), the
forward, the loss's value sum(out * dout) in float32, and the backward from dout (the
gradients of x, the router and both expert weights). The forward alone runs under
`torch.no_grad()`. Each record: wall times (CUDA events around `iters` steps, the median of
`reps`), the GPU kernels of one step (torch.profiler: their sum, each kernel's time, the
launches in order), the bytes the forward keeps for the backward (act_bytes) and the step's
peak beyond its inputs, gradients included (step_bytes).
"""
import importlib.metadata
import json
import statistics
import sys
import time

import torch

PROFILED_STEPS = 3   # as benchmarks/device_kernels.kernel_times profiles ours


def time_ms(fn, iters, reps):
  """The median over `reps` of the mean wall time of `iters` back-to-back calls (CUDA events),
  after two warm-up calls."""
  fn()
  fn()
  torch.cuda.synchronize()
  samples = []
  for _ in range(reps):
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
      fn()
    end.record()
    torch.cuda.synchronize()
    samples.append(start.elapsed_time(end) / iters)
  return statistics.median(samples)


def kernel_times(fn, steps=PROFILED_STEPS):
  """(ms per step summed over every CUDA kernel, [(kernel name, ms per step)] longest first,
  [(kernel name, ms)] of one step's launches in launch order)."""
  from torch.profiler import ProfilerActivity, profile
  fn()
  torch.cuda.synchronize()
  with profile(activities=[ProfilerActivity.CUDA]) as prof:
    for _ in range(steps):
      fn()
    torch.cuda.synchronize()
  per_name, launches = {}, []
  for i, event in enumerate(prof.events()):
    if event.device_type == torch.autograd.DeviceType.CUDA:
      us = getattr(event, "device_time", None)
      us = event.cuda_time if us is None else us
      name = event.name[:160]
      per_name[name] = per_name.get(name, 0.0) + us / 1e3 / steps
      start = getattr(getattr(event, "time_range", None), "start", i)
      launches.append((start, name, round(us / 1e3, 4)))
  ranked = sorted(per_name.items(), key=lambda item: -item[1])
  launches.sort(key=lambda launch: launch[0])
  return (sum(per_name.values()), [(name, round(ms, 4)) for name, ms in ranked],
          [(name, ms) for _, name, ms in launches[:len(launches) // steps]])


def versions():
  """This process's torch, sonic-moe and CuTe DSL versions (not the JAX process's)."""
  v = {"python": sys.version.split()[0]}
  for package in ("torch", "sonic-moe", "quack-kernels", "nvidia-cutlass-dsl"):
    try:
      v[package] = importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
      v[package] = None
  return v


class Layer:
  """One config's layer, inputs and steps."""

  def __init__(self, T, d, n, E, K):
    from sonicmoe import KernelBackendMoE, MoE
    from sonicmoe.enums import ActivationType
    torch.manual_seed(0)
    self.layer = MoE(num_experts=E, num_experts_per_tok=K, hidden_size=d, intermediate_size=n,
                     activation_function=ActivationType.SWIGLU, add_bias=False,
                     std=0.02).to("cuda", torch.bfloat16)
    self.x = (torch.randn(T, d, device="cuda") * 0.5).to(torch.bfloat16).requires_grad_()
    self.dout = torch.randn(T, d, device="cuda", dtype=torch.bfloat16)
    self.backend = KernelBackendMoE.sonicmoe

  def clear_grads(self):
    self.x.grad = None
    for prm in self.layer.parameters():
      prm.grad = None

  def forward(self):
    with torch.no_grad():
      return self.layer(self.x, kernel_backend_moe=self.backend)[0]

  def step(self):
    """One training step's work: cleared gradients, the loss's value, every gradient."""
    self.clear_grads()
    out = self.layer(self.x, kernel_backend_moe=self.backend)[0]
    value = torch.dot(out.view(-1), self.dout.view(-1))   # no [T, d] temporary
    out.backward(self.dout)
    return value

  def act_bytes(self):
    """What the forward leaves allocated for the backward, beyond its output."""
    self.clear_grads()
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    out = self.layer(self.x, kernel_backend_moe=self.backend)[0]
    torch.cuda.synchronize()
    kept = torch.cuda.memory_allocated() - base - out.numel() * out.element_size()
    del out
    return kept

  def step_bytes(self):
    """The peak one step allocates beyond its inputs, gradients included."""
    self.clear_grads()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    self.step()
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() - base


def measure(request):
  """One request's record (a failure is a record with its status)."""
  T, d, n, E, K = request["shape"]
  iters, reps = request["iters"], request["reps"]
  rec = dict(impl="torch_sonicmoe", config=request["config"], status="ok", versions=versions(),
             grads="cleared before each step (.grad = None)")
  layer = None
  try:
    layer = Layer(T, d, n, E, K)
    start = time.perf_counter()
    layer.step()   # a shape's first step compiles and autotunes (cached on disk after)
    torch.cuda.synchronize()
    rec["first_call_s"] = time.perf_counter() - start
    rec["fwd_ms"] = time_ms(layer.forward, iters, reps)
    rec["fwd_bwd_ms"] = time_ms(layer.step, iters, reps)
    rec["bwd_ms"] = rec["fwd_bwd_ms"] - rec["fwd_ms"]
    rec["kernel_fwd_ms"], rec["kernels_fwd"], rec["kernel_launches_fwd"] = kernel_times(
        layer.forward)
    (rec["kernel_fwd_bwd_ms"], rec["kernels_fwd_bwd"],
     rec["kernel_launches_fwd_bwd"]) = kernel_times(layer.step)
    rec["act_bytes"] = layer.act_bytes()
    rec["step_bytes"] = layer.step_bytes()
  except Exception as e:
    rec["status"] = f"{type(e).__name__}: {str(e)[:300]}"
  del layer
  torch.cuda.empty_cache()   # the JAX process beside this one allocates as it goes
  return rec


def main():
  for line in sys.stdin:
    if not line.strip():
      break
    print(json.dumps(measure(json.loads(line))), flush=True)


if __name__ == "__main__":
  main()
