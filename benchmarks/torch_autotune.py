"""The PyTorch SonicMoE's autotuning results (quack's ~/.quack cache, as torch_cache_save in
gpu_session.sh returns it: quack_autotune.tgz) as a table: for each anchor config and GEMM,
the tile configs it timed, fastest first (the median of its timings, ms). Its autotuner picks
per machine, so two machines may run different kernels for one GEMM: this shows what it chose
and by how much.

  python -m benchmarks.torch_autotune .devcache/quack_autotune.tgz [--top 3]
"""
from __future__ import annotations

import argparse
import io
import json
import os
import re
import statistics
import tarfile

from benchmarks import configs

GEMMS = ("up-proj", "down-proj", "dH", "dX~", "dW1", "dW2")
_SIZE = re.compile(r"torch\.Size\(\[([\d, ]*)\]\)")
_FIELD = re.compile(r"(\w+)=([\w.]+)")


def read_results(path: str) -> list[tuple[str, dict]]:
  """(kind, result) for every *.autotune.json in a .tgz or under a folder; kind is the file's
  stem (gemm_tuned, gemm_gated_tuned: the up-projection, gemm_dgated_tuned: dH)."""
  found = []
  if os.path.isdir(path):
    for root, _, files in os.walk(path):
      for name in files:
        if name.endswith(".autotune.json"):
          with open(os.path.join(root, name)) as f:
            found.append((name.split(".")[0], json.load(f)))
  else:
    with tarfile.open(path) as tar:
      for member in tar.getmembers():
        if member.isfile() and member.name.endswith(".autotune.json"):
          text = tar.extractfile(member).read().decode()
          found.append((os.path.basename(member.name).split(".")[0], json.load(io.StringIO(text))))
  return found


def shapes_of(key: list[str]) -> list[tuple[int, ...]]:
  """The tensor shapes in an autotuning key, in order."""
  shapes = []
  for item in key:
    m = _SIZE.fullmatch(item)
    if m:
      shapes.append(tuple(int(v) for v in m.group(1).split(",") if v.strip()))
  return shapes


def classify(kind: str, shapes) -> tuple[str, str] | None:
  """(config, GEMM) of one autotuned GEMM, from its expert weights' shape (E, d, n or 2n) and
  where that shape sits (the output: a weight gradient; the second operand: a store GEMM);
  None when it matches no anchor."""
  weights = [(i, s) for i, s in enumerate(shapes) if len(s) == 3]
  if not weights:
    return None
  index, (e, a, b) = weights[0]
  for name, (_, d, n, experts, _) in configs.ANCHORS.items():
    if e != experts or d not in (a, b):
      continue
    other = b if a == d else a
    if other not in (n, 2 * n):
      continue
    if kind.startswith("gemm_gated"):
      return name, "up-proj"
    if kind.startswith("gemm_dgated"):
      return name, "dH"
    if index == 2:
      return name, "dW1" if other == 2 * n else "dW2"
    return name, "dX~" if a == 2 * n else "down-proj"
  return None


def describe(config_text: str) -> str:
  """'256x128 coop 2x1' from quack's GemmConfig(...) text (ping-pong: 'pp')."""
  f = dict(_FIELD.findall(config_text))
  schedule = "pp" if f.get("pingpong") == "True" else "coop"
  text = f"{f.get('tile_m')}x{f.get('tile_n')} {schedule} {f.get('cluster_m')}x{f.get('cluster_n')}"
  if f.get("swap_ab") == "True":
    text += " swap"
  if f.get("is_dynamic_persistent") == "True":
    text += " dyn"
  return text


def ranked(result: dict) -> list[tuple[float, str]]:
  """(median ms, config) of every config it timed, fastest first."""
  rows = [(statistics.median(times), describe(cfg)) for cfg, times in result["configs_timings"]]
  return sorted(rows)


def table(results, top: int = 3) -> str:
  """One line per (config, GEMM): its fastest `top` configs and their median ms."""
  rows = {}
  for kind, result in results:
    where = classify(kind, shapes_of(result["key"]))
    if where:
      rows[where] = ranked(result)
  order = list(configs.ANCHORS)
  lines = [f"{'config':<12} {'GEMM':<10} fastest configs timed (median ms)"]
  for (config, gemm), timed in sorted(rows.items(), key=lambda r: (order.index(r[0][0]), GEMMS.index(r[0][1]))):
    picks = "  ".join(f"{desc} {ms:.3f}" for ms, desc in timed[:top])
    lines.append(f"{config:<12} {gemm:<10} {picks}")
  return "\n".join(lines)


def main():
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("paths", nargs="+", help="quack_autotune.tgz files or ~/.quack folders")
  parser.add_argument("--top", type=int, default=3, help="configs shown per GEMM")
  args = parser.parse_args()
  for path in args.paths:
    print(f"== {path}")
    print(table(read_results(path), args.top))


if __name__ == "__main__":
  main()
