"""The PyTorch SonicMoE's autotuning results (quack's ~/.quack cache, as torch_cache_save in
gpu_session.sh returns it: quack_autotune.tgz) as a table: for each anchor config and GEMM,
the tile configs it timed, fastest first (the median of its timings, ms). Its autotuner picks
per machine, so two machines may run different kernels for one GEMM: this shows what it chose
and by how much. --force edits a restored cache so that its next process runs a chosen tile
for one GEMM (their step with another of their kernels: an experiment, said so where used).

  python -m benchmarks.torch_autotune .devcache/quack_autotune.tgz [--top 3]
  python -m benchmarks.torch_autotune ~/.quack --force 30B-n256 'dX~' '192x128 pp 1x2'
"""
from __future__ import annotations

import argparse
import json
import os
import re
import tarfile

from benchmarks import configs
from benchmarks.kernel_table import GEMMS
_SIZE = re.compile(r"torch\.Size\(\[([\d, ]*)\]\)")
_FIELD = re.compile(r"(\w+)=([\w.]+)")


def read_results(path: str) -> list[tuple[str, dict]]:
  """(kind, result) for every *.autotune.json in a .tgz or under a folder; kind is the file's
  stem (gemm_tuned, gemm_gated_tuned: the up-projection, gemm_dgated_tuned: dH)."""
  found = []
  if os.path.isdir(path):
    for file, kind in _result_files(path):
      with open(file) as f:
        found.append((kind, json.load(f)))
  else:
    with tarfile.open(path) as tar:
      for member in tar.getmembers():
        if member.isfile() and member.name.endswith(".autotune.json"):
          kind = os.path.basename(member.name).split(".")[0]
          found.append((kind, json.loads(tar.extractfile(member).read())))
  return found


def _result_files(folder: str):
  """(path, kind) of every *.autotune.json under a folder."""
  for root, _, files in os.walk(folder):
    for name in sorted(files):
      if name.endswith(".autotune.json"):
        yield os.path.join(root, name), name.split(".")[0]


UNFORCED_MS = 1e6   # the timings force() gives a tile it forced before: never picked


def force(folder: str, config: str, gemm: str, tile: str) -> str:
  """Makes quack run `tile` (as describe() writes it, e.g. '192x128 pp 1x2') for one anchor
  config's GEMM: its cached timings in `folder` (~/.quack, after gpu_session.sh restored
  them) become [0, 0, 0], so the next process picks it; a tile an earlier call forced (its
  timings [0, 0, 0]) gets UNFORCED_MS, so that forcing tiles one after another runs each.
  Returns the file it changed; the table then shows it at 0.000 ms."""
  for file, kind in _result_files(folder):
    with open(file) as f:
      result = json.load(f)
    if classify(kind, shapes_of(result["key"])) != (config, gemm):
      continue
    tiles = [describe(cfg) for cfg, _ in result["configs_timings"]]
    if tile not in tiles:
      raise ValueError(f"tile: {config} {gemm} timed no {tile!r}; it timed {sorted(set(tiles))}")
    for entry in result["configs_timings"]:
      if describe(entry[0]) == tile:
        entry[1] = [0.0, 0.0, 0.0]
      elif entry[1] == [0.0, 0.0, 0.0]:
        entry[1] = [UNFORCED_MS] * 3
    with open(file, "w") as f:
      json.dump(result, f)
    return file
  raise ValueError(f"config, gemm: no autotuning result for {config} {gemm} under {folder}")


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
  """(median ms, config) of every config it timed, fastest first: each config's timings are
  quack's do_bench quantiles (0.5, 0.2, 0.8), and it runs the config of the least median."""
  rows = [(times[0], describe(cfg)) for cfg, times in result["configs_timings"]]
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
  parser.add_argument("--force", nargs=3, metavar=("CONFIG", "GEMM", "TILE"),
                      help="in the one folder given: make quack run TILE (e.g. '192x128 pp 1x2') "
                           "for CONFIG's GEMM (one of " + ", ".join(GEMMS) + ")")
  args = parser.parse_args()
  if args.force:
    if len(args.paths) != 1 or not os.path.isdir(args.paths[0]):
      parser.error("--force changes one folder's results (~/.quack): give that folder alone")
    print("forced:", force(args.paths[0], *args.force))
  for path in args.paths:
    print(f"== {path}")
    print(table(read_results(path), args.top))


if __name__ == "__main__":
  main()
