"""An experiment for the device machine: rewrites ffi/grouped_gemm.py (in the copy it runs, never
the repository) so that the SwiGLU epilogues (up_proj's A = silu(gate) up, dH's dSwiGLU) take
their sigmoid from the special function unit: ex2.approx of -x log2(e) and rcp.approx of 1 + that
(two MUFU instructions and a multiply per value), where the kernels now compute e^x by a
range-split ex2 (about nine instructions) and divide by IEEE rcp.rn (about eight more, with a
branch). Relative error about 2^-21, far below the bf16 outputs' rounding (2^-9); the bits
change. Session 23's Nsight Compute found the 7B-n256 dH's consumers in their epilogue about
three times as long as in their mainloop (5477 SASS instructions per warp and tile, 40% of warp
samples), so the epilogue's instruction count bounds that kernel.

compile_cache keys kernels on the ffi sources, so the rewritten kernels compile afresh.

  python -m benchmarks.approx_sigmoid [--check]   (--check: only verify that it applies)
"""
from __future__ import annotations

import argparse
import pathlib

TARGET = pathlib.Path(__file__).resolve().parent.parent / "ffi" / "grouped_gemm.py"

# (the source as it is, the source rewritten): each must occur exactly once
REWRITES = [
    ("ROW_MODES = (1, 2, 0)",
     "LOG2E = 1.4426950408889634   # log2(e): e^x = 2^(x log2 e)\nROW_MODES = (1, 2, 0)"),
    ("    return [gate, up, gate / (1.0 + cute.math.exp(-gate)) * up]",
     "    return [gate, up, gate * sigmoid(gate) * up]"),
    ('@cute.jit\ndef dswiglu(gate, up, da, s):',
     'def sigmoid(x):\n'
     '  """1 / (1 + e^-x) of fp32 vectors by ex2.approx and rcp.approx."""\n'
     '  return cute.math.rcp(1.0 + cute.math.exp2(x * -LOG2E, fastmath=True), approx=True,\n'
     '                       ftz=True)\n\n\n'
     '@cute.jit\ndef dswiglu(gate, up, da, s):'),
    ("  sig = 1.0 / (1.0 + cute.math.exp(-gate))", "  sig = sigmoid(gate)"),
]


def rewrite(source: str) -> str:
  """grouped_gemm.py's source with the approximate sigmoid; ValueError if a piece it rewrites
  is not there exactly once (the kernels changed: update REWRITES)."""
  for old, new in REWRITES:
    if source.count(old) != 1:
      raise ValueError(f"approx_sigmoid: {old.splitlines()[0]!r} occurs {source.count(old)} "
                       f"times in {TARGET.name}, not once")
    source = source.replace(old, new)
  return source


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--check", action="store_true", help="only verify that the rewrite applies")
  args = p.parse_args(argv)
  new = rewrite(TARGET.read_text())
  if args.check:
    print(f"approx_sigmoid: applies to {TARGET}")
    return
  TARGET.write_text(new)
  print(f"approx_sigmoid: rewrote {TARGET}")


if __name__ == "__main__":
  main()
