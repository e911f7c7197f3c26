"""Side-by-side MoE layer benchmark: our backends against the anchors, in one run on one GPU.

  python -m benchmarks.bench                          # all anchor configs, every available impl
  python -m benchmarks.bench --configs olmoe --impls xla,pallas,dense
  python -m benchmarks.bench --custom 32768,4096,1024,256,4 --rounding nearest
  python -m benchmarks.bench --tiny                   # CPU smoke run

Impls: xla, pallas, cute (our layer, by backend), lax_ragged_dot and tokamax (the same math
by plain autodiff over jax.lax.ragged_dot / tokamax.ragged_dot), torch_sonicmoe (PyPI sonic-moe,
run in a subprocess when importable), dense (a bf16 matmul chain of equal FLOPs: the ceiling).
Each record: impl, config, T, d, n, E, K, fwd_ms, bwd_ms, fwd_bwd_ms, fwd_tflops,
fwd_bwd_tflops, act_bytes (what the layer keeps for the backward beyond its inputs, as the
torch subprocess measures it: X is kept too but exists anyway), step_bytes (the memory a
forward+backward step needs beyond its inputs: temporaries at their peak plus gradients), status,
gpu, date, versions. Failures are rows, not crashes.
"""
from __future__ import annotations

import argparse
import datetime
import functools
import importlib
import importlib.metadata
import json
import os
import statistics
import subprocess
import sys
import time

import jax
import jax.numpy as jnp

import sonicmoe_jax as sm
from benchmarks import configs as C
from benchmarks import device_kernels
from pallas_kernels import config as pallas_config



def make_args(T, d, n, E, K, seed=0):
  k = jax.random.split(jax.random.key(seed), 5)
  bf = jnp.bfloat16
  x = (jax.random.normal(k[0], (T, d), jnp.float32) * 0.5).astype(bf)
  wr = (jax.random.normal(k[1], (d, E), jnp.float32) * 0.02).astype(bf)
  w1 = (jax.random.normal(k[2], (E, d, 2 * n), jnp.float32) * 0.02).astype(bf)
  w2 = (jax.random.normal(k[3], (E, n, d), jnp.float32) * 0.02).astype(bf)
  dout = jax.random.normal(k[4], (T, d), jnp.float32).astype(bf)
  return (x, wr, w1, w2), dout


def ours(backend, K, rounding, tile, windows=None):
  def fn(x, wr, w1, w2):
    return sm.moe(x, wr, w1, w2, k=K, rounding=rounding, tile=tile, backend=backend,
                  windows=windows).out
  return fn


def plain_autodiff(rdot, K):
  """argsort + gather + ragged_dot + SwiGLU + ragged_dot + scatter-add, differentiated by JAX."""
  def fn(x, wr, w1, w2):
    T, d = x.shape
    n = w2.shape[1]
    logits = jnp.dot(x, wr, preferred_element_type=jnp.float32)
    top_v, top_i = jax.lax.top_k(logits, K)
    s = jax.nn.softmax(top_v, axis=-1)
    flat = top_i.reshape(-1)
    order = jnp.argsort(flat, stable=True)
    tok = order // K
    sizes = jnp.bincount(flat, length=w1.shape[0]).astype(jnp.int32)
    h = rdot(x[tok], w1, sizes)
    a = (jax.nn.silu(h[:, :n].astype(jnp.float32)) * h[:, n:].astype(jnp.float32)).astype(x.dtype)
    y = rdot(a, w2, sizes)
    y = (y.astype(jnp.float32) * s.reshape(-1)[order][:, None]).astype(x.dtype)
    return jnp.zeros((T, d), x.dtype).at[tok].add(y)
  return fn


def dense(K):
  """T*K rows through one expert-sized MLP: the FLOPs of the MoE with no routing or gathers."""
  def fn(x, wr, w1, w2):
    T, d = x.shape
    n = w2.shape[1]
    h = jnp.tile(x, (K, 1)) @ w1[0]
    a = (jax.nn.silu(h[:, :n].astype(jnp.float32)) * h[:, n:].astype(jnp.float32)).astype(x.dtype)
    return (a @ w2[0]).reshape(K, T, d).sum(0)
  return fn


def time_ms(f, args, iters, reps):
  jax.block_until_ready(f(*args))  # compile + warm up
  jax.block_until_ready(f(*args))
  samples = []
  for _ in range(reps):
    t0 = time.perf_counter()
    for _ in range(iters):
      out = f(*args)
    jax.block_until_ready(out)
    samples.append((time.perf_counter() - t0) / iters * 1e3)
  return statistics.median(samples)


def activation_bytes(fn, args):
  """Bytes the layer keeps for its backward beyond its inputs (x and the weights): the
  allocation the forward leaves behind, what torch.cuda.memory_allocated sees for the PyTorch
  SonicMoE."""
  res = sm.saved_residuals(fn, *args)
  return sum(r.nbytes for r in res if not r.source.startswith("argument"))


def forward_backward(fn, dout):
  """The timed step: loss = sum(fn(x, router_w, w1, w2) * dout), its value and gradients.
  The value too, as a training step (and the PyTorch SonicMoE's out.backward) needs it: with
  the gradients alone XLA drops the forward's work past the residuals (the down-projection and
  the aggregation), as the fwd+bwd rows measured before 2026-11-30 (session 11) did.
  The backward starts from dout only once the forward's output exists (an optimization
  barrier on the two): in a network dO depends on O, and the PyTorch SonicMoE runs its whole
  forward first. Without it this loss's dO (dout itself) lets XLA run the backward beside the
  forward's down-projection and aggregation, and its peak memory then holds both (measured
  before 2026-12-01, session 17)."""
  def step(*args):
    out, pullback = jax.vjp(fn, *args)
    out, d_out = jax.lax.optimization_barrier((out, dout.astype(out.dtype)))
    value = jnp.sum(out.astype(jnp.float32) * d_out.astype(jnp.float32))
    return value, pullback(d_out)
  return jax.jit(step)


def measure(fn, args, dout, iters, reps):
  fwd = jax.jit(fn)
  fwd_bwd = forward_backward(fn, dout)
  t_f = time_ms(fwd, args, iters, reps)
  t_fb = time_ms(fwd_bwd, args, iters, reps)
  return t_f, t_fb, step_bytes(fwd_bwd, args), kernels_of(fwd, fwd_bwd, args)


def kernels_of(fwd, fwd_bwd, args):
  """The GPU kernels of a forward and of a forward+backward step (device_kernels.kernel_times:
  their total, per-kernel times and launch order), as the torch subprocess records them: {}
  off the GPU."""
  if jax.default_backend() != "gpu":
    return {}
  rec = {}
  for key, fn in (("fwd", fwd), ("fwd_bwd", fwd_bwd)):
    try:
      times = device_kernels.kernel_times(fn, args)
    except Exception as e:   # the profiler is a nicety: the row keeps its timings
      rec["kernels_status"] = f"{type(e).__name__}: {str(e)[:200]}"
      break
    if times is not None:
      rec[f"kernel_{key}_ms"], rec[f"kernels_{key}"], rec[f"kernel_launches_{key}"] = times
  return rec


def step_bytes(jitted, args):
  """Device memory one forward+backward step needs beyond its inputs: XLA's temporaries at
  their peak plus the gradients it returns (compiled memory analysis), or None where the
  backend gives none. Unlike act_bytes this sees what XLA itself keeps from the forward to
  the backward (for example a gather it shares between them)."""
  stats = jitted.lower(*args).compile().memory_analysis()
  if stats is None:
    return None
  return stats.temp_size_in_bytes + stats.output_size_in_bytes


def backend_spec(impl):
  """Our layer's backend for an impl name: "xla", "pallas", "cute", "auto" (the library's
  default per op and layer shape), or a per-op mix written op=backend+op=backend (e.g.
  "dh=cute+dx_tilde=cute") as a dict."""
  return impl if "+" not in impl and "=" not in impl else dict(p.split("=") for p in impl.split("+"))


def impl_fn(impl, K, rounding, tile):
  """The function an impl name runs; ours with "/w<W>" appended (e.g. "auto/w2", "auto/w1")
  runs the layer with that many column windows (moe's `windows`; without: its default), with
  "/w<F>-<B>" (e.g. "auto/w1-2") F in the forward and B in the backward."""
  impl, _, windows = impl.partition("/w")
  if impl in ("xla", "pallas", "cute", "auto") or "=" in impl:
    counts = tuple(int(w) for w in windows.split("-")) if windows else (None,)
    # (one count, or the pair; moe names any other shape of windows)
    return ours(backend_spec(impl), K, rounding, tile, counts[0] if len(counts) == 1 else counts)
  if impl == "lax_ragged_dot":
    return plain_autodiff(functools.partial(jax.lax.ragged_dot, preferred_element_type=None), K)
  if impl == "tokamax":
    import tokamax
    return plain_autodiff(functools.partial(tokamax.ragged_dot, implementation="mosaic"), K)
  if impl == "dense":
    return dense(K)
  raise ValueError(f"unknown impl {impl!r}")


def versions():
  v = {"jax": jax.__version__, "jaxlib": getattr(jax.lib, "__version__", None) or jax.__version__,
       "sonicmoe_jax": sm.__version__, "python": sys.version.split()[0]}
  try:
    import tokamax
    v["tokamax"] = tokamax.__version__
  except Exception:
    pass
  try:   # without it "auto" runs pallas: the rows say which they measured
    v["nvidia_cutlass_dsl"] = importlib.metadata.version("nvidia-cutlass-dsl")
  except importlib.metadata.PackageNotFoundError:
    v["nvidia_cutlass_dsl"] = None
  return v


def run_case(impl, name, cfg, args_ns, meta):
  T, d, n, E, K = cfg
  rec = dict(impl=impl, config=name, T=T, d=d, n=n, E=E, K=K, fwd_ms=None, bwd_ms=None,
             fwd_bwd_ms=None, fwd_tflops=None, fwd_bwd_tflops=None, act_bytes=None,
             step_bytes=None, status="ok", rounding=args_ns.rounding, **meta)
  try:
    fn = impl_fn(impl, K, args_ns.rounding, args_ns.tile)
    args, dout = make_args(T, d, n, E, K)
    t_f, t_fb, step, kernels = measure(fn, args, dout, args_ns.iters, args_ns.reps)
    rec.update(kernels)
    rec.update(fwd_ms=t_f, fwd_bwd_ms=t_fb, bwd_ms=t_fb - t_f, step_bytes=step,
               fwd_tflops=C.fwd_flops(*cfg) / t_f / 1e9,
               fwd_bwd_tflops=C.fwd_bwd_flops(*cfg) / t_fb / 1e9)
    if impl != "dense":
      rec["act_bytes"] = activation_bytes(fn, args)
  except Exception as e:  # a failure is a row
    msg = str(e).splitlines()[0] if str(e) else ""
    rec["status"] = f"{type(e).__name__}: {msg[:300]}"
  return rec


def run_torch(names, cfgs, meta, timeout_s, pythonpath=None):
  """PyPI sonic-moe in a subprocess (PyTorch and JAX share one GPU badly in one process).
  Configs it did not reach within timeout_s are rows with that status. pythonpath: the
  subprocess's PYTHONPATH instead of this process's (sonic-moe pins an older
  nvidia-cutlass-dsl than the cute backend's: each process imports its own)."""
  script = os.path.join(os.path.dirname(__file__), "torch_sonicmoe.py")
  env = dict(os.environ) if pythonpath is None else dict(os.environ, PYTHONPATH=pythonpath)
  status = None
  try:
    out = subprocess.run([sys.executable, script, json.dumps(dict(zip(names, cfgs)))],
                         capture_output=True, text=True, timeout=timeout_s, env=env)
    stdout = out.stdout
    if not any(l.startswith("{") for l in stdout.splitlines()):
      status = "error: " + ((out.stderr or out.stdout).strip().splitlines() or ["no output"])[-1][:300]
  except subprocess.TimeoutExpired as e:
    stdout = e.stdout.decode() if isinstance(e.stdout, bytes) else (e.stdout or "")
    status = f"timeout: not reached within {timeout_s} s (first runs compile CuTe kernels)"
  done = {r["config"]: r for r in (json.loads(l) for l in stdout.splitlines() if l.startswith("{"))}
  recs = [done.get(nm, dict(impl="torch_sonicmoe", config=nm, status=status or "missing"))
          for nm in names]
  for r, (nm, cfg) in zip(recs, zip(names, cfgs)):
    T, d, n, E, K = cfg
    r.update({k: v for k, v in meta.items() if k != "versions" or "versions" not in r},
             config=nm, T=T, d=d, n=n, E=E, K=K)   # (its own process's versions kept)
    for key in ("fwd_ms", "bwd_ms", "fwd_bwd_ms", "fwd_tflops", "fwd_bwd_tflops", "act_bytes",
                "step_bytes"):
      r.setdefault(key, None)
    if r.get("fwd_ms"):
      r["fwd_tflops"] = C.fwd_flops(*cfg) / r["fwd_ms"] / 1e9
      r["fwd_bwd_tflops"] = C.fwd_bwd_flops(*cfg) / r["fwd_bwd_ms"] / 1e9
  return recs


def available_impls():
  impls = ["xla"]
  for backend in ("pallas", "cute"):
    try:
      sm.resolve_backend(backend)
      impls.append(backend)
    except Exception:
      pass
  impls.append("lax_ragged_dot")
  try:
    import tokamax  # noqa: F401
    impls.append("tokamax")
  except Exception:
    pass
  try:
    import sonicmoe  # noqa: F401
    impls.append("torch_sonicmoe")
  except Exception:
    pass
  return impls + ["dense"]


def fmt(v, spec):
  return format(v, spec) if isinstance(v, (int, float)) else "-"


def table(records):
  lines = [f"{'config':12s} {'impl':15s} {'fwd ms':>9s} {'fwd TF/s':>9s} {'f+b ms':>9s} "
           f"{'f+b TF/s':>9s} {'act MiB':>9s} {'step MiB':>9s}  status"]
  mib = lambda v: v / 2**20 if v else None
  for r in records:
    lines.append(f"{r['config']:12s} {r['impl']:15s} {fmt(r.get('fwd_ms'), '9.3f')} "
                 f"{fmt(r.get('fwd_tflops'), '9.0f')} {fmt(r.get('fwd_bwd_ms'), '9.3f')} "
                 f"{fmt(r.get('fwd_bwd_tflops'), '9.0f')} {fmt(mib(r.get('act_bytes')), '9.1f')} "
                 f"{fmt(mib(r.get('step_bytes')), '9.1f')}  {r['status'][:60]}")
    if "kernel_fwd_bwd_ms" in r:   # its GPU kernels alone (no host overhead), from a profiler
      lines.append(f"{'':12s} {'  its kernels':15s} {fmt(r.get('kernel_fwd_ms'), '9.3f')} "
                   f"{'':9s} {fmt(r.get('kernel_fwd_bwd_ms'), '9.3f')}")
  return "\n".join(lines)


def chart(records, path):
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  ok = [r for r in records if r.get("fwd_bwd_tflops")]
  if not ok:
    return
  cfgs = list(dict.fromkeys(r["config"] for r in ok))
  impls = list(dict.fromkeys(r["impl"] for r in ok))
  fig, axes = plt.subplots(1, 2, figsize=(13, 4.5))
  width = 0.8 / len(impls)
  for ax, key, title in ((axes[0], "fwd_tflops", "forward"), (axes[1], "fwd_bwd_tflops", "forward+backward")):
    for i, impl in enumerate(impls):
      vals = [next((r[key] for r in ok if r["config"] == c and r["impl"] == impl), 0) or 0 for c in cfgs]
      ax.bar([j + i * width for j in range(len(cfgs))], vals, width, label=impl)
    ax.set_xticks([j + 0.4 - width / 2 for j in range(len(cfgs))], cfgs, rotation=20)
    ax.set_ylabel("model TF/s")
    ax.set_title(f"{title} ({ok[0].get('gpu', '')})")
  axes[0].legend(fontsize=8)
  fig.tight_layout()
  fig.savefig(path, dpi=110)
  plt.close(fig)


def save(records, out):
  with open(out + ".json", "w") as f:
    json.dump(records, f, indent=1)


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--configs", default=",".join(C.ANCHORS))
  p.add_argument("--custom", action="append", default=[], help="T,d,n,E,K (repeatable)")
  p.add_argument("--impls", default=None, help="comma list; default: every available one")
  p.add_argument("--rounding", default=None, help="token rounding for our impls (default: none)")
  p.add_argument("--tile", type=int, default=128)
  p.add_argument("--iters", type=int, default=10)
  p.add_argument("--reps", type=int, default=5)
  p.add_argument("--tiny", action="store_true", help="one tiny config (CPU smoke run)")
  p.add_argument("--out", default="benchmarks/results/latest")
  p.add_argument("--torch-timeout", type=int, default=3000, help="seconds for the torch subprocess")
  p.add_argument("--torch-pythonpath", default=None,
                 help="PYTHONPATH for the torch subprocess (default: this process's)")
  p.add_argument("--pallas-gather", choices=("kernel", "xla"), default="kernel",
                 help="pallas up-projection: gather X's rows inside the kernel (default) or by XLA")
  p.add_argument("--pallas-dw1-gather", choices=("xla", "kernel"), default="xla",
                 help="pallas dW1: gather X's rows by XLA (default) or inside the kernel (slower, less memory)")
  p.add_argument("--cute-dout-gather", choices=("xla", "kernel"),
                 help="cute dh and dw2: gather dO's rows by XLA or inside both kernels (default: "
                      "ffi/ops.py's rule, DOUT_GATHER_MAX_COLUMN_TILES)")
  p.add_argument("--cute-dh", choices=("auto", "registers", "tma_store", "pingpong", "pingpong_tma"),
                 help="cute dh's kernel variant (default: ffi/ops.py DH_KERNEL)")
  p.add_argument("--cute-dh-block-n", type=int, choices=(64, 128, 256),
                 help="cute dh's widest column tile (default: ffi/ops.py DH_BLOCK_N)")
  p.add_argument("--cute-dh-h-smem", choices=("on", "off"),
                 help="cute dh's epilogue reads H from SMEM, TMA-loaded after the mainloop "
                      "(default: ffi/ops.py DH_H_SMEM)")
  p.add_argument("--cute-up-proj", choices=("grouped", "pingpong"),
                 help="cute up_proj's kernel variant (default: ffi/ops.py UP_PROJ_KERNEL)")
  p.add_argument("--cute-store", choices=("grouped", "pingpong", "pingpong_tma"),
                 help="cute down_proj's and dx_tilde's kernel (default: ffi/ops.py STORE_KERNEL)")
  p.add_argument("--cute-store-block-n", type=int, choices=(128, 192),
                 help="the ping-pong store kernels' column tile where 192 divides the columns "
                      "(default: ffi/ops.py STORE_BLOCK_N)")
  p.add_argument("--cute-store-tile-m", type=int, choices=(128, 192),
                 help="the ping-pong store kernels' rows a tile (default: ffi/ops.py STORE_TILE_M)")
  p.add_argument("--cute-store-cluster-n", type=int, choices=(1, 2),
                 help="the ping-pong store kernels' CTAs per cluster (default: ffi/ops.py "
                      "STORE_CLUSTER_N)")
  p.add_argument("--cute-store-wide-min-k", type=int,
                 help="the contraction from which down_proj and dx_tilde take the wide grouped "
                      "kernel instead (default: ffi/ops.py STORE_WIDE_MIN_K)")
  p.add_argument("--cute-store-wide-ws-min-n", type=int,
                 help="the output width from which the wide store kernel has a producer warp "
                      "issue its TMA loads (default: ffi/ops.py STORE_WIDE_WS_MIN_N)")
  p.add_argument("--cute-store-wide", choices=("grouped", "persistent"),
                 help="the wide store GEMMs' kernel (default: ffi/ops.py STORE_WIDE_KERNEL)")
  p.add_argument("--cute-wgrad", choices=("grouped", "persistent"),
                 help="cute dw1's and dw2's kernel where they gather rows (default: ffi/ops.py "
                      "WGRAD_KERNEL)")
  p.add_argument("--cute-wgrad-dynamic", default=None,
                 help="comma list of dw1, dw2: those persistent weight gradients in the dynamic "
                      "tile order; 'auto' for the rule (default: ffi/ops.py WGRAD_DYNAMIC_ORDER, "
                      "'auto'); '' for none")
  p.add_argument("--cute-wgrad-cluster-m", type=int, choices=(1, 2),
                 help="CTAs per cluster of the persistent gathering weight gradients (default: "
                      "ffi/ops.py WGRAD_CLUSTER_M)")
  p.add_argument("--cute-tma-gather", default=None,
                 help="comma list of dw1, dw2: those weight gradients loading their gathered "
                      "rows by TMA (default: ffi/ops.py TMA_GATHER, dw1 and dw2); '' for none")
  a = p.parse_args(argv)
  pallas_config.UP_PROJ_GATHER_IN_KERNEL = a.pallas_gather == "kernel"
  pallas_config.DW1_GATHER_IN_KERNEL = a.pallas_dw1_gather == "kernel"
  cute_settings = dict(DH_KERNEL=a.cute_dh, DH_BLOCK_N=a.cute_dh_block_n,
                       UP_PROJ_KERNEL=a.cute_up_proj, STORE_KERNEL=a.cute_store,
                       STORE_BLOCK_N=a.cute_store_block_n, STORE_TILE_M=a.cute_store_tile_m,
                       STORE_CLUSTER_N=a.cute_store_cluster_n,
                       STORE_WIDE_MIN_K=a.cute_store_wide_min_k,
                       STORE_WIDE_WS_MIN_N=a.cute_store_wide_ws_min_n, WGRAD_KERNEL=a.cute_wgrad,
                       STORE_WIDE_KERNEL=a.cute_store_wide, WGRAD_CLUSTER_M=a.cute_wgrad_cluster_m)
  op_names = lambda csv: tuple(filter(None, csv.split(",")))   # ('' for none)
  if a.cute_wgrad_dynamic is not None:
    cute_settings["WGRAD_DYNAMIC_ORDER"] = ("auto" if a.cute_wgrad_dynamic == "auto" else
                                           op_names(a.cute_wgrad_dynamic))
  if a.cute_tma_gather is not None:
    cute_settings["TMA_GATHER"] = op_names(a.cute_tma_gather)
  if a.cute_dh_h_smem:
    cute_settings["DH_H_SMEM"] = a.cute_dh_h_smem == "on"
  if a.cute_dout_gather:
    cute_settings["DOUT_GATHER_MAX_COLUMN_TILES"] = 0 if a.cute_dout_gather == "xla" else 1 << 30
  cute_settings = {k: v for k, v in cute_settings.items() if v is not None}
  if cute_settings:
    cute_ops = importlib.import_module("ffi.ops")   # (the cute extra: only when asked)
    for name, value in cute_settings.items():
      setattr(cute_ops, name, value)

  cases = dict(C.TINY) if a.tiny else {c: C.ANCHORS[c] for c in a.configs.split(",") if c}
  cases.update(C.parse_config(c) for c in a.custom)
  impls = a.impls.split(",") if a.impls else available_impls()
  dev = jax.devices()[0]
  meta = dict(gpu=dev.device_kind, date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
              versions=versions(), pallas_gather=a.pallas_gather,
              pallas_dw1_gather=a.pallas_dw1_gather, cute_settings=cute_settings)
  print(f"devices {jax.devices()} | {meta['versions']} | impls {impls}", flush=True)
  os.makedirs(os.path.dirname(a.out) or ".", exist_ok=True)
  records = []
  if "torch_sonicmoe" in impls:   # first: the comparison a run cut short must not lose
    records += run_torch(list(cases), list(cases.values()), meta, a.torch_timeout,
                         a.torch_pythonpath)
    save(records, a.out)
  for name, cfg in cases.items():
    for impl in impls:
      if impl == "torch_sonicmoe":
        continue
      rec = run_case(impl, name, cfg, a, meta)
      records.append(rec)
      print(f"[{len(records)}] {name} {impl}: fwd {fmt(rec['fwd_ms'], '.3f')} ms, fwd+bwd "
            f"{fmt(rec['fwd_bwd_ms'], '.3f')} ms, {rec['status'][:80]}", flush=True)
      save(records, a.out)  # after every case: a run cut short keeps what it measured
  chart(records, a.out + ".png")
  print(table(sorted(records, key=lambda r: list(cases).index(r["config"]))))
  return records


if __name__ == "__main__":
  main()
