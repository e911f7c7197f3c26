"""Side-by-side MoE layer benchmark: our backends and the PyTorch SonicMoE, in one run on one GPU.

  python -m benchmarks.bench --impls auto,torch_sonicmoe --rounds 3   # the fair comparison
  python -m benchmarks.bench --configs olmoe --impls xla,pallas,dense
  python -m benchmarks.bench --custom 32768,4096,1024,256,4 --rounding nearest
  python -m benchmarks.bench --tiny                   # CPU smoke run

Impls: xla, pallas, cute, auto (our layer by backend; a per-op mix such as
"dh=cute+dx_tilde=cute"; "/w<W>" or "/w<F>-<B>" appended picks the column windows),
lax_ragged_dot and tokamax (the same math by plain autodiff over jax.lax.ragged_dot /
tokamax.ragged_dot), torch_sonicmoe (PyPI sonic-moe in a process of its own,
benchmarks/torch_sonicmoe.py), dense (a bf16 matmul chain of equal FLOPs: the ceiling).

What makes the comparison fair (every side, every record):
- the same step: the loss's value sum(out * dout) and the gradients of x, the router and both
  expert weights; the PyTorch step starts from cleared gradients (`.grad = None`), as a
  training loop's `optimizer.zero_grad()` leaves them, so no accumulation kernels run;
- the same timing: `--iters` steps per sample, the median of `--reps` samples, two warm-up
  steps first; the GPU kernels of the step from each side's profiler (JAX's / torch.profiler,
  the same number of profiled steps), so that host overhead shows only in the wall times;
- the same card in one run: with `--rounds R` every impl is measured R times in turn, who goes
  first alternating, and the table gives each impl's medians over its rounds (kernel times
  drift by a few percent between processes and as the card holds its power cap);
- each record names the GPU, the commit, the versions, the command and how gradients were
  handled. JAX allocates device memory as it goes here (XLA_PYTHON_CLIENT_PREALLOCATE=false)
  so that the PyTorch process beside it has room; neither side's timed loop allocates.

Each record: impl, config, T, d, n, E, K, round, fwd_ms, bwd_ms, fwd_bwd_ms, fwd_tflops,
fwd_bwd_tflops, kernel_fwd_ms, kernel_fwd_bwd_ms (and every kernel), act_bytes (what the layer
keeps for the backward beyond its inputs), step_bytes (the memory a forward+backward step needs
beyond its inputs: temporaries at their peak plus gradients), status, gpu, date, commit,
command, versions, grads. Failures are rows, not crashes.
"""
from __future__ import annotations

import argparse
import dataclasses
import datetime
import functools
import importlib
import importlib.metadata
import json
import os
import statistics
import queue
import subprocess
import sys
import threading
import time

import jax
import jax.numpy as jnp

import sonicmoe_jax as sm
from benchmarks import configs as C
from benchmarks import device_kernels



def make_args(T, d, n, E, K, seed=0):
  k = jax.random.split(jax.random.key(seed), 5)
  bf = jnp.bfloat16
  x = (jax.random.normal(k[0], (T, d), jnp.float32) * 0.5).astype(bf)
  wr = (jax.random.normal(k[1], (d, E), jnp.float32) * 0.02).astype(bf)
  w1 = (jax.random.normal(k[2], (E, d, 2 * n), jnp.float32) * 0.02).astype(bf)
  w2 = (jax.random.normal(k[3], (E, n, d), jnp.float32) * 0.02).astype(bf)
  dout = jax.random.normal(k[4], (T, d), jnp.float32).astype(bf)
  return (x, wr, w1, w2), dout


def ours(backend, K, rounding, tile, windows=None, kernel_config=None):
  def fn(x, wr, w1, w2):
    return sm.moe(x, wr, w1, w2, k=K, rounding=rounding, tile=tile, backend=backend,
                  windows=windows, kernel_config=kernel_config).out
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


def forward_backward(fn):
  """The timed step, jitted: step(x, router_w, w1, w2, dout) -> (loss, gradients of the four
  weights and inputs), the loss sum(fn(...) * dout) in float32. The value too, as a training
  step (and the PyTorch SonicMoE's step) needs it: with the gradients alone XLA would drop the
  forward's work past the residuals (the down-projection and the aggregation). The backward
  starts from dout only once the forward's output exists (an optimization barrier on the two):
  in a network dO depends on O, and the PyTorch SonicMoE runs its whole forward first; without
  it XLA may run the backward beside the forward's last GEMM, and the peak then holds both."""
  def step(x, router_w, w1, w2, dout):
    out, pullback = jax.vjp(fn, x, router_w, w1, w2)
    out, d_out = jax.lax.optimization_barrier((out, dout.astype(out.dtype)))
    value = jnp.sum(out.astype(jnp.float32) * d_out.astype(jnp.float32))
    return value, pullback(d_out)
  return jax.jit(step)


def kernels_of(fwd, fwd_bwd, args, dout):
  """The GPU kernels of a forward and of a forward+backward step (device_kernels.kernel_times:
  their total, per-kernel times and launch order), as the PyTorch process records them: {}
  off the GPU."""
  if jax.default_backend() != "gpu":
    return {}
  rec = {}
  for key, fn, fn_args in (("fwd", fwd, args), ("fwd_bwd", fwd_bwd, args + (dout,))):
    try:
      times = device_kernels.kernel_times(fn, fn_args)
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


def impl_fn(impl, K, rounding, tile, kernel_config=None):
  """The function an impl name runs; ours with "/w<W>" appended (e.g. "auto/w2", "auto/w1")
  runs the layer with that many column windows (moe's `windows`; without: its default), with
  "/w<F>-<B>" (e.g. "auto/w1-2") F in the forward and B in the backward."""
  impl, _, windows = impl.partition("/w")
  if impl in ("xla", "pallas", "cute", "auto") or "=" in impl:
    counts = tuple(int(w) for w in windows.split("-")) if windows else (None,)
    # (one count, or the pair; moe names any other shape of windows)
    return ours(backend_spec(impl), K, rounding, tile, counts[0] if len(counts) == 1 else counts,
                kernel_config)
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


class OurCase:
  """One impl of ours at one config: its jitted forward and step, compiled at the first
  measure and kept for the later rounds."""

  def __init__(self, impl, name, cfg, rounding, tile, kernel_config=None):
    self.impl, self.name, self.cfg = impl, name, cfg
    self.rounding, self.tile, self.kernel_config = rounding, tile, kernel_config
    self.fn = self.fwd = self.fwd_bwd = None
    self.memory = None

  def measure(self, iters, reps, meta):
    T, d, n, E, K = self.cfg
    rec = dict(impl=self.impl, config=self.name, T=T, d=d, n=n, E=E, K=K, fwd_ms=None,
               bwd_ms=None, fwd_bwd_ms=None, fwd_tflops=None, fwd_bwd_tflops=None,
               act_bytes=None, step_bytes=None, status="ok",
               grads="returned by the step (nothing accumulates)", **meta)
    try:
      args, dout = make_args(T, d, n, E, K)
      if self.fn is None:
        self.fn = impl_fn(self.impl, K, self.rounding, self.tile, self.kernel_config)
        self.fwd, self.fwd_bwd = jax.jit(self.fn), forward_backward(self.fn)
      t_f = time_ms(self.fwd, args, iters, reps)
      t_fb = time_ms(self.fwd_bwd, args + (dout,), iters, reps)
      if self.memory is None:   # the same every round
        self.memory = dict(step_bytes=step_bytes(self.fwd_bwd, args + (dout,)),
                           act_bytes=None if self.impl == "dense" else activation_bytes(self.fn, args))
      rec.update(kernels_of(self.fwd, self.fwd_bwd, args, dout))
      rec.update(self.memory, fwd_ms=t_f, fwd_bwd_ms=t_fb, bwd_ms=t_fb - t_f,
                 fwd_tflops=C.fwd_flops(*self.cfg) / t_f / 1e9,
                 fwd_bwd_tflops=C.fwd_bwd_flops(*self.cfg) / t_fb / 1e9)
    except Exception as e:  # a failure is a row
      msg = str(e).splitlines()[0] if str(e) else ""
      rec["status"] = f"{type(e).__name__}: {msg[:300]}"
    return rec


class TorchWorker:
  """The PyTorch SonicMoE in its own process (benchmarks/torch_sonicmoe.py), kept up across
  rounds so that each shape compiles once. `command` replaces the process's command line
  (tests); `pythonpath`, its PYTHONPATH (sonic-moe pins an older nvidia-cutlass-dsl than the
  cute extra: each process imports its own)."""

  def __init__(self, timeout_s, pythonpath=None, command=None):
    self.timeout_s = timeout_s
    self.command = command or [sys.executable, os.path.join(os.path.dirname(__file__),
                                                             "torch_sonicmoe.py")]
    self.env = dict(os.environ) if pythonpath is None else dict(os.environ, PYTHONPATH=pythonpath)
    self.proc = None

  def _start(self):
    self.proc = subprocess.Popen(self.command, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                 text=True, env=self.env)
    self.lines = queue.Queue()   # its stdout's lines, then None at its end

    def read(stdout, lines):
      for line in stdout:
        lines.put(line)
      lines.put(None)
    threading.Thread(target=read, args=(self.proc.stdout, self.lines), daemon=True).start()

  def measure(self, name, cfg, iters, reps, meta):
    """Its record for one config (a row saying why where it gave none in time)."""
    if self.proc is None or self.proc.poll() is not None:
      self._start()
    request = dict(config=name, shape=list(cfg), iters=iters, reps=reps)
    rec = None
    try:
      self.proc.stdin.write(json.dumps(request) + "\n")
      self.proc.stdin.flush()
      deadline = time.monotonic() + self.timeout_s
      while rec is None:
        try:
          line = self.lines.get(timeout=max(0.0, deadline - time.monotonic()))
        except queue.Empty:
          self.close()
          rec = dict(status=f"timeout: no answer within {self.timeout_s} s (a shape's first "
                            "step compiles and autotunes)")
          break
        if line is None:
          rec = dict(status=f"error: the PyTorch process ended (exit code {self.proc.wait()})")
          self.proc = None
        elif line.startswith("{"):
          rec = json.loads(line)
    except (BrokenPipeError, OSError) as e:
      rec = dict(status=f"error: {type(e).__name__}: {e}")
      self.proc = None
    T, d, n, E, K = cfg
    rec = dict(rec, impl="torch_sonicmoe", config=name, T=T, d=d, n=n, E=E, K=K)
    rec.update({k: v for k, v in meta.items() if k != "versions" or "versions" not in rec})
    for key in ("fwd_ms", "bwd_ms", "fwd_bwd_ms", "act_bytes", "step_bytes"):
      rec.setdefault(key, None)
    if rec.get("fwd_ms"):
      rec["fwd_tflops"] = C.fwd_flops(*cfg) / rec["fwd_ms"] / 1e9
      rec["fwd_bwd_tflops"] = C.fwd_bwd_flops(*cfg) / rec["fwd_bwd_ms"] / 1e9
    else:
      rec.update(fwd_tflops=None, fwd_bwd_tflops=None)
    return rec

  def close(self):
    if self.proc is not None:
      if self.proc.poll() is None:
        self.proc.kill()
      self.proc.wait()
      self.proc = None


def _field_value(field: dataclasses.Field, text: str):
  """A config field's value from its command-line text, by the field's default's type."""
  default = field.default
  if isinstance(default, bool):
    if text.lower() not in ("true", "false"):
      raise ValueError(f"{field.name} takes true or false; got {text!r}")
    return text.lower() == "true"
  if isinstance(default, tuple) or ("tuple" in str(field.type) and text != "auto"):
    return tuple(filter(None, text.split(",")))
  try:
    return int(text)
  except ValueError:
    return text


def changed_fields(kernel_config) -> dict:
  """{backend: {field: value}} of the fields that differ from the config type's defaults (what a
  record says a run changed)."""
  return {backend: {f.name: getattr(config, f.name) for f in dataclasses.fields(config)
                    if getattr(config, f.name) != f.default}
          for backend, config in (kernel_config or {}).items()}


def kernel_config_from(pallas_fields, cute_fields):
  """{backend: config} from FIELD=VALUE texts for PallasConfig and CuteConfig (ValueError naming
  an unknown field), or None where neither is given."""
  configs = {}
  for backend, texts, module in (("pallas", pallas_fields, "pallas_kernels.config"),
                                 ("cute", cute_fields, "ffi.config")):
    if not texts:
      continue
    config_type = {"pallas": "PallasConfig", "cute": "CuteConfig"}[backend]
    config_type = getattr(importlib.import_module(module), config_type)
    fields = {f.name: f for f in dataclasses.fields(config_type)}
    values = {}
    for text in texts:
      name, sep, value = text.partition("=")
      if not sep or name not in fields:
        raise ValueError(f"--{backend} takes FIELD=VALUE with FIELD one of {sorted(fields)}; "
                         f"got {text!r}")
      values[name] = _field_value(fields[name], value)
    configs[backend] = config_type(**values)
  return configs or None


def available_impls():
  """The impls this machine runs: our GPU backends (and "auto" over them) on a GPU only (off it
  the Pallas kernels would run interpreted and the CuTe ones not at all), then the others whose
  packages import."""
  impls = ["xla"]
  if jax.default_backend() == "gpu":
    for backend in ("pallas", "cute"):
      try:
        sm.resolve_backend(backend)
        impls.append(backend)
      except Exception:
        pass
    impls.append("auto")
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


SUMMARY_COLUMNS = (("kern fwd", "kernel_fwd_ms", 1), ("kern f+b", "kernel_fwd_bwd_ms", 1),
                   ("wall fwd", "fwd_ms", 1), ("wall f+b", "fwd_bwd_ms", 1),
                   ("f+b TF/s", "fwd_bwd_tflops", 1), ("kept MiB", "act_bytes", 2**20),
                   ("step MiB", "step_bytes", 2**20))


def medians(records):
  """{(config, impl): (rounds that ran, {key: median over them}, status of the last round)}
  in the order the records first name each pair. A key some round lacks is left out."""
  groups = {}
  for r in records:
    groups.setdefault((r["config"], r["impl"]), []).append(r)
  out = {}
  for pair, recs in groups.items():
    ok = [r for r in recs if r["status"] == "ok"]
    med = {key: statistics.median(r[key] for r in ok) for _, key, _ in SUMMARY_COLUMNS
           if ok and all(r.get(key) is not None for r in ok)}
    out[pair] = (len(ok), med, recs[-1]["status"])
  return out


def table(records, baseline="torch_sonicmoe"):
  """Text table: per config and impl the medians over its rounds (GPU kernel times of one
  step from a profiler, wall times, TF/s of the wall forward+backward, what the forward keeps
  for the backward, the step's peak); under each impl of a config that has `baseline` rows,
  its medians over the baseline's."""
  med = medians(records)
  head = f"{'config':12s} {'impl':15s} {'rounds':>6s} " + " ".join(
      f"{title:>9s}" for title, _, _ in SUMMARY_COLUMNS) + "  status"
  lines = [head]
  for (config, impl), (rounds, m, status) in med.items():
    cells = [fmt(m[key] / unit if key in m else None, "9.3f" if unit == 1 and "tflops" not in key
                 else "9.0f") for _, key, unit in SUMMARY_COLUMNS]
    lines.append(f"{config:12s} {impl:15s} {rounds:6d} " + " ".join(cells) + f"  {status[:60]}")
    base = med.get((config, baseline))
    if impl != baseline and base and base[1] and m:
      ratios = [fmt(m[key] / base[1][key] if key in m and base[1].get(key) else None, "9.3f")
                for _, key, _ in SUMMARY_COLUMNS]
      lines.append(f"{'':12s} {'  / ' + baseline:22s} " + " ".join(ratios))
  return "\n".join(lines)


def chart(records, path):
  """Bars of each impl's median model TF/s (forward; forward+backward) per config."""
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  med = medians(records)
  ok = {pair: m for pair, (_, m, _) in med.items() if m.get("fwd_bwd_tflops")}
  if not ok:
    return
  cfgs = list(dict.fromkeys(c for c, _ in ok))
  impls = list(dict.fromkeys(i for _, i in ok))
  gpu = records[0].get("gpu", "")
  fig, axes = plt.subplots(1, 2, figsize=(13, 4.5))
  width = 0.8 / len(impls)
  for ax, kind, title in ((axes[0], "fwd", "forward"), (axes[1], "fwd_bwd", "forward+backward")):
    for i, impl in enumerate(impls):
      vals = []
      for c in cfgs:
        m = ok.get((c, impl), {})
        ms = m.get(f"{kind}_ms")
        flops = (C.fwd_flops if kind == "fwd" else C.fwd_bwd_flops)(*next(
            (r["T"], r["d"], r["n"], r["E"], r["K"]) for r in records if r["config"] == c))
        vals.append(flops / ms / 1e9 if ms else 0)
      ax.bar([j + i * width for j in range(len(cfgs))], vals, width, label=impl)
    ax.set_xticks([j + 0.4 - width / 2 for j in range(len(cfgs))], cfgs, rotation=20)
    ax.set_ylabel("model TF/s (wall)")
    ax.set_title(f"{title} ({gpu})")
  axes[0].legend(fontsize=8)
  fig.tight_layout()
  fig.savefig(path, dpi=110)
  plt.close(fig)


def save(records, out):
  with open(os.path.join(out, "bench.json"), "w") as f:
    json.dump(records, f, indent=1)


def commit():
  """The checkout's commit (with "-dirty" for uncommitted changes), or None outside git."""
  try:
    return subprocess.run(["git", "describe", "--always", "--dirty", "--abbrev=12"],
                          capture_output=True, text=True, check=True,
                          cwd=os.path.dirname(os.path.abspath(__file__))).stdout.strip() or None
  except (OSError, subprocess.CalledProcessError):
    return None


def build_parser() -> argparse.ArgumentParser:
  """The benchmark's command line (every flag with its help)."""
  p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--configs", default=",".join(C.ANCHORS),
                 help="comma list of benchmarks/configs.py names (default: the paper's five; "
                      "PRODUCTION names released models' layers)")
  p.add_argument("--custom", action="append", default=[], help="T,d,n,E,K (repeatable)")
  p.add_argument("--impls", default=None, help="comma list; default: every available one")
  p.add_argument("--rounding", default=None, help="token rounding for our impls (default: none)")
  p.add_argument("--tile", type=int, default=128, help="token-rounding tile")
  p.add_argument("--iters", type=int, default=10,
                 help="steps per timed sample, for every impl (the PyTorch SonicMoE's too)")
  p.add_argument("--reps", type=int, default=5, help="timed samples; their median is the time")
  p.add_argument("--rounds", type=int, default=1,
                 help="measure every impl at every config this many times, in turn (who goes "
                      "first alternates each round); the table gives the medians over rounds")
  p.add_argument("--tiny", action="store_true", help="one tiny config (CPU smoke run)")
  p.add_argument("--out", default="runs/bench", help="folder for bench.json and bench.png")
  p.add_argument("--commit", default=None,
                 help="the code's commit, for the records (default: git describe of this checkout)")
  p.add_argument("--torch-timeout", type=int, default=1800,
                 help="seconds the PyTorch process may take for one config (its first step at a "
                      "new shape compiles and autotunes)")
  p.add_argument("--torch-pythonpath", default=None,
                 help="PYTHONPATH of the PyTorch process (default: this process's)")
  p.add_argument("--pallas", action="append", default=[], metavar="FIELD=VALUE",
                 help="a pallas_kernels.config.PallasConfig field for our impls, e.g. "
                      "up_proj_gather_in_kernel=false (repeatable)")
  p.add_argument("--cute", action="append", default=[], metavar="FIELD=VALUE",
                 help="an ffi.config.CuteConfig field for our impls, e.g. store_cluster_n=2 or "
                      "tma_gather=dw1 (repeatable; a tuple field takes a comma list, '' for none)")
  p.add_argument("--cute-variant", action="append", default=[], metavar="FIELD=VALUE[+...]",
                 help="also measure the impls that run the cute backend (auto, cute) with these "
                      "CuteConfig fields on top of --cute's, in the same rounds and process, "
                      "e.g. store_wide_cluster_m=2+store_wide_cluster_n=1 (repeatable: one "
                      "variant each; its records' impl is 'auto [FIELDS]')")
  return p


CUTE_IMPLS = ("auto", "cute")   # the impls a --cute-variant applies to


def measured_entries(impls, pallas_fields, cute_fields, cute_variants):
  """(impl, record label, kernel config) of each thing a round measures: every impl with the
  --pallas/--cute config, then each --cute-variant of the cute-backend impls."""
  base = kernel_config_from(pallas_fields, cute_fields)
  entries = [(impl, impl, base) for impl in impls]
  for variant in cute_variants:
    config = kernel_config_from(pallas_fields, list(cute_fields) + variant.split("+"))
    entries += [(impl, f"{impl} [{variant}]", config) for impl in impls if impl in CUTE_IMPLS]
  return entries


def main(argv=None):
  p = build_parser()
  a = p.parse_args(argv)
  sm.memory.take_gpu_memory_as_needed()   # (before JAX takes the GPU)
  cases = dict(C.TINY) if a.tiny else dict(C.lookup(c) for c in a.configs.split(",") if c)
  cases.update(C.parse_config(c) for c in a.custom)
  impls = a.impls.split(",") if a.impls else available_impls()
  dev = jax.devices()[0]
  meta = dict(gpu=dev.device_kind, date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
              commit=a.commit or commit(), command=" ".join(["python -m benchmarks.bench"] + (argv or sys.argv[1:])),
              versions=versions(), iters=a.iters, reps=a.reps)
  print(f"devices {jax.devices()} | commit {meta['commit']} | {meta['versions']} | impls {impls}",
        flush=True)
  os.makedirs(a.out, exist_ok=True)
  worker = (TorchWorker(a.torch_timeout, a.torch_pythonpath) if "torch_sonicmoe" in impls
            else None)
  entries = measured_entries(impls, a.pallas, a.cute, a.cute_variant)
  ours_cases, records = {}, []
  try:
    for rnd in range(a.rounds):
      for name, cfg in cases.items():
        for impl, label, kernel_config in entries if rnd % 2 == 0 else entries[::-1]:
          # (who goes first alternates)
          if impl == "torch_sonicmoe":
            rec = worker.measure(name, cfg, a.iters, a.reps, meta)
          else:
            case = ours_cases.setdefault((label, name), OurCase(impl, name, cfg, a.rounding,
                                                                a.tile, kernel_config))
            # (the configuration is ours: the PyTorch records carry none)
            rec = dict(case.measure(a.iters, a.reps, meta), impl=label,
                       kernel_config=changed_fields(kernel_config))
          rec["round"] = rnd
          records.append(rec)
          print(f"[round {rnd}] {name} {label}: fwd {fmt(rec['fwd_ms'], '.3f')} ms, fwd+bwd "
                f"{fmt(rec['fwd_bwd_ms'], '.3f')} ms, kernels fwd+bwd "
                f"{fmt(rec.get('kernel_fwd_bwd_ms'), '.3f')} ms, {rec['status'][:300]}", flush=True)
          save(records, a.out)  # after every case: a run cut short keeps what it measured
  finally:
    if worker is not None:
      worker.close()
  chart(records, os.path.join(a.out, "bench.png"))
  print(table(sorted(records, key=lambda r: list(cases).index(r["config"]))))
  print(f"wrote {os.path.join(a.out, 'bench.json')} and bench.png ({len(records)} records)")
  return records


if __name__ == "__main__":
  main()
