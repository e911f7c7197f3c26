"""Times the PyTorch SonicMoE (PyPI sonic-moe) for benchmarks/bench.py; run as a subprocess.

argv[1]: JSON {config name: [T, d, n, E, K]}. Prints one JSON record per config: wall times,
memory, and the GPU time of each kernel in one forward+backward step (torch.profiler; the
kernels' own time, without the host overhead that the wall time includes), for a per-kernel
comparison with benchmarks/kernels.py.
argv[2] == "--profile-one-step": instead, after two warm-up steps, one forward+backward step
between cudaProfilerStart and cudaProfilerStop, for `ncu --profile-from-start off`
(benchmarks/ncu_step.py does the same for ours).
"""
import importlib.metadata
import json
import statistics
import sys
import time

import torch


def time_ms(fn, iters=20, reps=5):
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


def kernel_times(fn, iters=3):
  """(ms per step summed over every CUDA kernel, [(kernel name, ms per step)] longest first,
  [(kernel name, ms)] of one step's launches in launch order)."""
  from torch.profiler import ProfilerActivity, profile
  fn()
  torch.cuda.synchronize()
  with profile(activities=[ProfilerActivity.CUDA]) as prof:
    for _ in range(iters):
      fn()
    torch.cuda.synchronize()
  per_name, launches = {}, []
  for i, event in enumerate(prof.events()):
    if event.device_type == torch.autograd.DeviceType.CUDA:
      us = getattr(event, "device_time", None)
      us = event.cuda_time if us is None else us
      name = event.name[:160]
      per_name[name] = per_name.get(name, 0.0) + us / 1e3 / iters
      # (FunctionEvent.time_range: its start in us; else the events' own order)
      start = getattr(getattr(event, "time_range", None), "start", i)
      launches.append((start, name, round(us / 1e3, 4)))
  ranked = sorted(per_name.items(), key=lambda item: -item[1])
  launches.sort(key=lambda launch: launch[0])
  return (sum(per_name.values()), [(name, round(ms, 4)) for name, ms in ranked],
          [(name, ms) for _, name, ms in launches[:len(launches) // iters]])


def profile_one_step(step):
  """Two warm-up steps (compiles, autotuning), then one between cudaProfilerStart and Stop."""
  step()
  step()
  torch.cuda.synchronize()
  torch.cuda.cudart().cudaProfilerStart()
  step()
  torch.cuda.synchronize()
  torch.cuda.cudart().cudaProfilerStop()


def versions():
  """This process's torch, sonic-moe and CuTe DSL versions (not the JAX process's)."""
  v = {"python": sys.version.split()[0]}
  for package in ("torch", "sonic-moe", "quack-kernels", "nvidia-cutlass-dsl"):
    try:
      v[package] = importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
      v[package] = None
  return v


def main():
  from sonicmoe import KernelBackendMoE, MoE
  from sonicmoe.enums import ActivationType
  for name, (T, d, n, E, K) in json.loads(sys.argv[1]).items():
    rec = dict(impl="torch_sonicmoe", config=name, status="ok", versions=versions())
    try:
      torch.manual_seed(0)
      layer = MoE(num_experts=E, num_experts_per_tok=K, hidden_size=d, intermediate_size=n,
                  activation_function=ActivationType.SWIGLU, add_bias=False, std=0.02)
      layer = layer.to("cuda", torch.bfloat16)
      x = (torch.randn(T, d, device="cuda") * 0.5).to(torch.bfloat16).requires_grad_()
      dout = torch.randn(T, d, device="cuda", dtype=torch.bfloat16)
      backend = KernelBackendMoE.sonicmoe

      def fwd():
        with torch.no_grad():
          return layer(x, kernel_backend_moe=backend)[0]

      def fwd_bwd():
        layer(x, kernel_backend_moe=backend)[0].backward(dout)

      if sys.argv[2:] == ["--profile-one-step"]:
        profile_one_step(fwd_bwd)
        continue
      start = time.perf_counter()
      fwd_bwd()  # first calls compile and autotune the CuTe / Triton kernels (cached on disk)
      torch.cuda.synchronize()
      rec["first_call_s"] = time.perf_counter() - start
      print(f"{name}: first forward+backward took {rec['first_call_s']:.1f} s", file=sys.stderr, flush=True)
      rec["fwd_ms"] = time_ms(fwd)
      rec["fwd_bwd_ms"] = time_ms(fwd_bwd)
      rec["bwd_ms"] = rec["fwd_bwd_ms"] - rec["fwd_ms"]
      rec["kernel_fwd_ms"], rec["kernels_fwd"], rec["kernel_launches_fwd"] = kernel_times(fwd)
      (rec["kernel_fwd_bwd_ms"], rec["kernels_fwd_bwd"],
       rec["kernel_launches_fwd_bwd"]) = kernel_times(fwd_bwd)
      x.grad = None
      for prm in layer.parameters():
        prm.grad = None
      torch.cuda.synchronize()
      base = torch.cuda.memory_allocated()
      out = layer(x, kernel_backend_moe=backend)[0]
      torch.cuda.synchronize()
      rec["act_bytes"] = torch.cuda.memory_allocated() - base - out.numel() * out.element_size()
      del out
      # step_bytes: the peak one forward+backward allocates beyond its inputs (gradients included)
      x.grad = None
      for prm in layer.parameters():
        prm.grad = None
      torch.cuda.synchronize()
      torch.cuda.reset_peak_memory_stats()
      base = torch.cuda.memory_allocated()
      fwd_bwd()
      torch.cuda.synchronize()
      rec["step_bytes"] = torch.cuda.max_memory_allocated() - base
    except Exception as e:
      rec["status"] = f"{type(e).__name__}: {str(e)[:300]}"
    print(json.dumps(rec), flush=True)


if __name__ == "__main__":
  main()
