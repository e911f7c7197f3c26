"""Times the PyTorch SonicMoE (PyPI sonic-moe) for benchmarks/bench.py; run as a subprocess.

argv[1]: JSON {config name: [T, d, n, E, K]}. Prints one JSON record per config.
"""
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


def main():
  from sonicmoe import KernelBackendMoE, MoE
  from sonicmoe.enums import ActivationType
  for name, (T, d, n, E, K) in json.loads(sys.argv[1]).items():
    rec = dict(impl="torch_sonicmoe", config=name, status="ok")
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

      start = time.perf_counter()
      fwd_bwd()  # first calls compile and autotune the CuTe / Triton kernels (cached on disk)
      torch.cuda.synchronize()
      rec["first_call_s"] = time.perf_counter() - start
      print(f"{name}: first forward+backward took {rec['first_call_s']:.1f} s", file=sys.stderr, flush=True)
      rec["fwd_ms"] = time_ms(fwd)
      rec["fwd_bwd_ms"] = time_ms(fwd_bwd)
      rec["bwd_ms"] = rec["fwd_bwd_ms"] - rec["fwd_ms"]
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
