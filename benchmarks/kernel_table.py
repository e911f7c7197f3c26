"""Per-kernel side by side from a bench.py JSON: for each config, every impl's GPU kernels of a
forward+backward step (their profilers' per-step times, longest first), in columns; or with
--by-op their sums per op of the layer (op_of); or with --by-gemm each of the six GEMMs,
the median over rounds when given several files of one side-by-side run (by_gemm); or with
--by-layer the whole step's times, TF/s and memory, medians over rounds (layer_table); or with
--roofline each GEMM's FLOPs and least bytes, and the share of the card's bf16 peak and HBM
bandwidth its median time reaches (roofline_table). Those keep one impl's runs under other
kernel configurations (bench.py --cute, --pallas) apart (variant).

  python -m benchmarks.kernel_table benchmarks/results/<run>/bench.json [more.json ...] [--top 12]
      [--fwd] [--order] [--min-ms 0.05] [--by-op | --by-gemm | --by-layer | --roofline]
"""
from __future__ import annotations

import argparse
import json
import re
import statistics

from benchmarks import configs

NAME_WIDTH = 52
MIB = 2 ** 20


def short_name(name: str) -> str:
  """A kernel name without CuTe DSL's generated prefix and its parameter dump (keeping the MMA
  tile, e.g. 'quackgemm_actGemmGatedSm90 [MNK 64,256,16]'); ours by their label alone
  ('sonicmoe_dh_gather': ffi.grouped_gemm.kernel_label)."""
  if name.startswith("sonicmoe_"):
    return name.partition("_kernel_")[0]
  for prefix in ("kernel_cutlass_kernel_", "kernel_cutlass_"):
    if name.startswith(prefix):
      name = name[len(prefix):]
      break
  head, sep, params = name.partition("_object_at_")
  if not sep:
    return name
  mma = re.search(r"ShapeMNK(64)(\d+)(16)", params)   # Hopper wgmma: m64 nN k16 (bf16)
  return head + (f" [MNK {','.join(mma.groups())}]" if mma else "")


def in_launch_order(record, key: str):
  """The record's kernels of `key` as the step launches them, every launch with its time
  (kernel_launches_*); longest first where the record has no launch list."""
  return record.get(key.replace("kernels_", "kernel_launches_")) or record[key]


# the layer's ops: "other GEMMs" are down_proj, dX~, dW1 and dW2
OPS = ("up-projection", "dH", "other GEMMs", "aggregations", "other")


def op_of(name: str, after_store: bool) -> str:
  """The layer's op a kernel belongs to (OPS), by its name: our CuTe kernels by their label
  (grouped_gemm.kernel_label), the PyTorch SonicMoE's quack GEMMs by their epilogue
  (actGemmGated: the up-projection, dactGemm: dH, GemmDefault: down_proj, dX~, dW1, dW2).
  Aggregations: gather-sum kernels, the PyTorch SonicMoE's elementwise kernels, and an XLA
  fusion launched right after one of our store GEMMs (after_store: it sums that GEMM's output
  per token)."""
  if "up_proj" in name or "actGemmGated" in name and "dact" not in name:
    return OPS[0]
  if "_dh" in name or "dactGemm" in name:
    return OPS[1]
  if "matmul" in name or "weight_grad" in name or "GemmDefault" in name:
    return OPS[2]
  if "gather_sum" in name or "elementwise" in name or (after_store and "fusion" in name):
    return OPS[3]
  return OPS[4]


def by_op(record, key: str = "kernels_fwd_bwd") -> dict:
  """{op: ms} of a record's kernels (OPS order), from its launches (in_launch_order)."""
  sums = dict.fromkeys(OPS, 0.0)
  after_store = False
  for name, ms in in_launch_order(record, key):
    sums[op_of(name, after_store)] += ms
    after_store = name.startswith("sonicmoe_") and "matmul" in name
  return sums


# the layer's six GEMMs, as one step launches them
GEMMS = ("up-proj", "down-proj", "dH", "dX~", "dW1", "dW2")


def by_gemm(record, key: str = "kernels_fwd_bwd") -> dict:
  """{gemm: ms} of a record's six GEMMs (GEMMS; a GEMM made in column windows: their sum),
  from its launches. Ours by label: a store GEMM ('matmul') before dH is the down-projection,
  after it dX~; of the two weight gradients dW1 is the longer (twice dW2's FLOPs). The PyTorch
  SonicMoE's by epilogue: its plain GEMM before dH is the down-projection, after it dW2, dX~,
  dW1 in that order. GEMMs the record lacks are absent."""
  sums: dict = {}
  after_dh, plain_after_dh, weight_grads = False, [], []
  for name, ms in in_launch_order(record, key):
    op = op_of(name, after_store=False)
    if op == OPS[0]:
      gemm = "up-proj"
    elif op == OPS[1]:
      gemm, after_dh = "dH", True
    elif "weight_grad" in name:
      weight_grads.append(ms)
      continue
    elif "matmul" in name:
      gemm = "dX~" if after_dh else "down-proj"
    elif "GemmDefault" in name:
      if not after_dh:
        gemm = "down-proj"
      else:
        plain_after_dh.append(ms)
        continue
    else:
      continue
    sums[gemm] = sums.get(gemm, 0.0) + ms
  if len(weight_grads) == 2:
    sums["dW2"], sums["dW1"] = sorted(weight_grads)
  if len(plain_after_dh) == 3:
    sums["dW2"], sums["dX~"], sums["dW1"] = plain_after_dh
  return {gemm: sums[gemm] for gemm in GEMMS if gemm in sums}


# dense bf16 tensor-core peak (TFLOP/s) and HBM bandwidth (TB/s) of the SXM cards, by the
# device_kind's words
CARDS = {"H100": (989.0, 3.35), "H200": (989.0, 4.8)}


def gemm_work(gemm: str, T: int, d: int, n: int, E: int, K: int, itemsize: int = 2):
  """(FLOPs, least bytes) of one of the six GEMMs of a step: every operand read once and
  every output written once (the gathered rows as T*K rows; weights whole; the weight
  gradients written in the input dtype)."""
  rows = T * K
  flops = {"up-proj": 2 * rows * d * 2 * n, "down-proj": 2 * rows * n * d,
           "dH": 2 * rows * d * n, "dX~": 2 * rows * 2 * n * d,
           "dW1": 2 * rows * d * 2 * n, "dW2": 2 * rows * n * d}[gemm]
  w1, w2 = E * d * 2 * n, E * n * d
  elems = {"up-proj": rows * d + w1 + rows * 2 * n + rows * n,     # X rows, W1 -> H, A
           "down-proj": rows * n + w2 + rows * d,                   # A, W2 -> Y
           "dH": rows * d + w2 + rows * 2 * n + rows * 2 * n + rows * n,   # dO rows, W2, H -> dH, A'
           "dX~": rows * 2 * n + w1 + rows * d,                     # dH, W1 -> dX~
           "dW1": rows * d + rows * 2 * n + w1,                     # X rows, dH -> dW1
           "dW2": rows * n + rows * d + w2}[gemm]                   # A', dO rows -> dW2
  return flops, elems * itemsize


def card_of(record):
  """(peak TFLOP/s, HBM TB/s) of the record's GPU, or None for a card not in CARDS."""
  kind = record.get("gpu") or ""
  return next((peaks for name, peaks in CARDS.items() if name in kind), None)


def roofline_table(records, key: str = "kernels_fwd_bwd") -> str:
  """Text table: per config and impl, each GEMM's median ms (gemm_table's), its TFLOP/s and
  share of the card's bf16 peak, its least bytes' GB/s and share of HBM bandwidth."""
  groups = rounds_by_config_impl(records, lambda r: r.get(key))
  w = _impl_width(groups)
  lines = [_lead("config", "impl", "rounds", w)
           + f"{'gemm':>9s} {'ms':>8s} {'GFLOP':>8s} {'MB':>8s} {'TF/s':>7s} {'%peak':>6s} "
           f"{'GB/s':>7s} {'%HBM':>5s}"]
  for (config, impl), records_of in groups.items():
    r0 = records_of[0]
    shape = tuple(r0[k] for k in ("T", "d", "n", "E", "K"))
    peaks = card_of(r0)
    rounds = [by_gemm(r, key) for r in records_of]
    for g in GEMMS:
      if not all(g in r for r in rounds):
        continue
      ms = statistics.median(r[g] for r in rounds)
      flops, nbytes = gemm_work(g, *shape)
      tflops, gbs = flops / ms / 1e9, nbytes / ms / 1e6
      share = (f"{100 * tflops / peaks[0]:6.1f} {gbs:7.0f} {100 * gbs / 1e3 / peaks[1]:5.1f}"
               if peaks else f"{'-':>6s} {gbs:7.0f} {'-':>5s}")
      lines.append(_lead(config, impl, len(rounds), w)
                   + f"{g:>9s} {ms:8.3f} {flops / 1e9:8.1f} {nbytes / 1e6:8.1f} {tflops:7.1f} "
                   + share)
  return "\n".join(lines)


def variant(record) -> str:
  """The record's impl, with the kernel configuration fields its run changed (bench.py --cute,
  --pallas) in brackets: 'auto[cute.store_wide_min_k=4096]'; runs of one impl under other
  configurations are other variants (a bench.py --cute-variant record's impl, 'auto
  [FIELDS]', is named by its impl and all its changed fields the same way)."""
  impl = record["impl"].split(" [")[0]
  changed = [(f"{backend}.{name}", value)
             for backend, fields in sorted((record.get("kernel_config") or {}).items())
             for name, value in sorted(fields.items())]
  if not changed:
    return impl
  return impl + "[" + ",".join(f"{k}={v}" for k, v in changed) + "]"


def rounds_by_config_impl(records, keep) -> dict:
  """{(config, variant): its records that keep(record) holds for, in order} (one per round)."""
  groups: dict = {}
  for r in records:
    if keep(r):
      groups.setdefault((r["config"], variant(r)), []).append(r)
  return groups


def _impl_width(groups) -> int:
  """The impl column's width: 15, or the longest variant's."""
  return max([15] + [len(impl) for _, impl in groups])


def _lead(config, impl, rounds, width: int) -> str:
  """A round table's first three columns: config, impl (variant) and rounds."""
  return f"{config:12s} {impl:{width}s} {rounds:>6} "


def gemm_table(records, key: str = "kernels_fwd_bwd") -> str:
  """Text table: per config and impl (variant: with the settings a run changed), each GEMM's
  ms (by_gemm), the median over the records of that config and variant (rounds of one
  side-by-side run); under each after a config's first, its medians divided by the first's."""
  groups = rounds_by_config_impl(records, lambda r: r.get(key))
  w = _impl_width(groups)
  lines = [_lead("config", "impl", "rounds", w) + " ".join(f"{g:>9s}" for g in GEMMS)]
  first: dict = {}
  for (config, impl), records_of in groups.items():
    rounds = [by_gemm(r, key) for r in records_of]
    medians = {g: statistics.median(r[g] for r in rounds) for g in GEMMS
               if all(g in r for r in rounds)}
    lines.append(_lead(config, impl, len(rounds), w)
                 + " ".join(f"{medians[g]:9.3f}" if g in medians else f"{'-':>9s}" for g in GEMMS))
    base = first.setdefault(config, medians)
    if base is not medians:
      lines.append(_lead("", "/ the first", "", w) + " ".join(
          f"{medians[g] / base[g]:9.3f}" if g in medians and g in base else f"{'-':>9s}"
          for g in GEMMS))
  return "\n".join(lines)


def layer_table(records) -> str:
  """Text table: per config and impl, the medians over its records (rounds) of the step's GPU
  kernels (forward, forward+backward; their profilers' sums), its wall times (the timed loop),
  the TF/s of the wall forward+backward (configs.fwd_bwd_flops of the anchor), what the layer
  keeps for the backward and the step's peak (MiB). A config that is not an anchor gets no TF/s."""
  columns = [("kernels fwd", "kernel_fwd_ms", 1), ("kernels f+b", "kernel_fwd_bwd_ms", 1),
             ("wall fwd", "fwd_ms", 1), ("wall f+b", "fwd_bwd_ms", 1),
             ("kept MiB", "act_bytes", MIB), ("step MiB", "step_bytes", MIB)]
  groups = rounds_by_config_impl(records, lambda r: r.get("status", "ok") == "ok")
  w = _impl_width(groups)
  lines = [_lead("config", "impl", "rounds", w)
           + " ".join(f"{title:>11s}" for title, _, _ in columns) + f" {'TF/s':>6s}"]
  for (config, impl), rounds in groups.items():
    medians = {key: statistics.median(r[key] / unit for r in rounds)
               for _, key, unit in columns if all(r.get(key) is not None for r in rounds)}
    cells = [f"{medians[key]:11.3f}" if key in medians else f"{'-':>11s}" for _, key, _ in columns]
    tflops = "-"
    if config in configs.NAMED and "fwd_bwd_ms" in medians:
      tflops = f"{configs.fwd_bwd_flops(*configs.NAMED[config]) / medians['fwd_bwd_ms'] / 1e9:.0f}"
    lines.append(_lead(config, impl, len(rounds), w) + " ".join(cells) + f" {tflops:>6s}")
  return "\n".join(lines)


def op_table(records, key: str = "kernels_fwd_bwd") -> str:
  """Text table: per config and impl, its kernels' ms per op (by_op) and their total."""
  lines = [f"{'config':12s} {'impl':15s} " + " ".join(f"{op:>13s}" for op in OPS)
           + f" {'total':>8s}"]
  for r in records:
    if r.get(key):
      sums = by_op(r, key)
      lines.append(f"{r['config']:12s} {r['impl']:15s} "
                   + " ".join(f"{sums[op]:13.3f}" for op in OPS) + f" {sum(sums.values()):8.3f}")
  return "\n".join(lines)


def table(records, top: int = 12, key: str = "kernels_fwd_bwd", launch_order: bool = False,
          min_ms: float = 0.0) -> str:
  """Text table: per config, one column pair (kernel, ms) per impl that has `key` (longest
  first, or with launch_order in the order the step launches them)."""
  lines = []
  for config in dict.fromkeys(r["config"] for r in records):
    rows = [r for r in records if r["config"] == config and r.get(key)]
    if not rows:
      continue
    total_key = key.replace("kernels_", "kernel_") + "_ms"
    lines.append(f"{config}: " + "   ".join(f"{r['impl']} {r[total_key]:.3f} ms" for r in rows))
    kernels = [[(name, ms) for name, ms in (in_launch_order(r, key) if launch_order else r[key])
                if ms >= min_ms] for r in rows]
    for i in range(min(top, max(len(k) for k in kernels))):
      cells = []
      for k in kernels:
        name, ms = k[i] if i < len(k) else ("", None)
        cells.append(f"{short_name(name)[:NAME_WIDTH]:{NAME_WIDTH}s} "
                     f"{'' if ms is None else f'{ms:7.3f}':>7s}")
      lines.append("  " + " | ".join(cells))
  return "\n".join(lines)


def main(argv=None):
  p = argparse.ArgumentParser()
  p.add_argument("bench_json", nargs="+", help="one or more (rounds of one run: --by-gemm)")
  p.add_argument("--top", type=int, default=12)
  p.add_argument("--fwd", action="store_true", help="the forward's kernels instead")
  p.add_argument("--order", action="store_true",
                 help="in the order one step launches them")
  p.add_argument("--min-ms", type=float, default=0.0, help="leave out kernels shorter than this")
  p.add_argument("--by-op", action="store_true", help="each impl's kernels summed per op (op_of)")
  p.add_argument("--by-gemm", action="store_true",
                 help="each impl's six GEMMs (by_gemm), medians over the files' records")
  p.add_argument("--by-layer", action="store_true",
                 help="each impl's step: kernels, wall, TF/s, memory (layer_table), medians")
  p.add_argument("--roofline", action="store_true",
                 help="each GEMM's FLOPs, least bytes and shares of the card's peaks "
                      "(roofline_table), medians")
  a = p.parse_args(argv)
  records = []
  for path in a.bench_json:
    with open(path) as f:
      records += json.load(f)
  key = "kernels_fwd" if a.fwd else "kernels_fwd_bwd"
  if a.roofline:
    text = roofline_table(records, key)
  elif a.by_layer:
    text = layer_table(records)
  elif a.by_gemm:
    text = gemm_table(records, key)
  elif a.by_op:
    text = op_table(records, key)
  else:
    text = table(records, a.top, key, a.order, a.min_ms)
  print(text)
  return text


if __name__ == "__main__":
  main()
