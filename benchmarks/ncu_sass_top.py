"""The SASS instructions where a kernel's warps were sampled most, from Nsight Compute's source
page (`ncu --import <report> --page source --print-source sass --csv > sass.csv`; the csv may
be gzipped): each with its samples (all, long scoreboard, wait), its execution count and the
instructions before it (a stall is charged to the instruction that waits, often a branch
after an mbarrier try-wait, so the context says what it waits for).

  python -m benchmarks.ncu_sass_top sass.csv[.gz] [--top 12] [--context 4]
"""
from __future__ import annotations

import argparse
import csv
import gzip

ALL_SAMPLES = "Warp Stall Sampling (All Samples)"
COLUMNS = (ALL_SAMPLES, "stall_long_sb", "stall_wait")


def _number(text: str) -> float:
  try:
    return float(text.replace(",", ""))
  except ValueError:
    return 0.0


def read_rows(path: str) -> tuple[dict, list[list[str]]]:
  """(column name -> index, the instruction rows) of a source-page csv: its first line names
  the kernel, its second the columns."""
  opener = gzip.open if path.endswith(".gz") else open
  with opener(path, "rt", newline="") as f:
    rows = list(csv.reader(f))
  if len(rows) < 3 or ALL_SAMPLES not in rows[1]:
    raise ValueError(f"{path}: not an ncu source page in csv (no {ALL_SAMPLES!r} column)")
  return {name: i for i, name in enumerate(rows[1])}, rows[2:]


def top_lines(path: str, top: int = 12, context: int = 4) -> list[str]:
  """The report's lines: a header with the total samples, then per instruction among the `top`
  most sampled, `context` instructions before it and itself."""
  index, rows = read_rows(path)
  samples = [_number(r[index[ALL_SAMPLES]]) for r in rows]
  total = sum(samples)
  lines = [f"# {int(total)} samples; per instruction: all, long scoreboard, wait, executed"]
  for i in sorted(range(len(rows)), key=lambda i: -samples[i])[:top]:
    lines.append(f"--- {100 * samples[i] / max(total, 1):.1f}% of samples")
    for r in rows[max(0, i - context):i + 1]:
      counts = " ".join(f"{int(_number(r[index[c]])):7d}" for c in COLUMNS)
      lines.append(f"{counts} {r[index['Instructions Executed']]:>9}  {r[index['Source']].strip()}")
  return lines


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("csv")
  p.add_argument("--top", type=int, default=12)
  p.add_argument("--context", type=int, default=4)
  args = p.parse_args(argv)
  print("\n".join(top_lines(args.csv, args.top, args.context)))


if __name__ == "__main__":
  main()
