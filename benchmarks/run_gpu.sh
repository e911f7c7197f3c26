#!/usr/bin/env bash
# On a machine with a Hopper GPU: the GPU tests, the correctness check at the paper's configs,
# and the fair side-by-side benchmark against the PyTorch SonicMoE.
#
#   bash benchmarks/run_gpu.sh [tests] [anchors] [bench]      (no argument: all three, in turn)
#
# Needs JAX for CUDA and the cute extra (pip install -e ".[cuda,test,cute]"); `bench` also needs
# PyTorch with sonic-moe, in this environment or in TORCH_PYTHONPATH.
# Environment:
#   OUT              folder for the logs and results (default runs/gpu)
#   CONFIGS          comma list of benchmarks/configs.py names (default: the paper's five)
#   ROUNDS           side-by-side rounds, ours and theirs in turn (default 3)
#   TORCH_PYTHONPATH PYTHONPATH of the PyTorch SonicMoE's process, where its packages live apart
#                    (sonic-moe pins an older nvidia-cutlass-dsl than the cute extra)
set -uo pipefail
OUT=${OUT:-runs/gpu}
CONFIGS=${CONFIGS:-7B-n256,7B-n1024,30B-n256,120B-n1024,olmoe}
ROUNDS=${ROUNDS:-3}
modes=("$@")
[ ${#modes[@]} -eq 0 ] && modes=(tests anchors bench)
for mode in "${modes[@]}"; do
  case "$mode" in
    tests|anchors|bench) ;;
    *) echo "unknown mode '$mode': tests, anchors or bench" >&2; exit 2 ;;
  esac
done
mkdir -p "$OUT"
status=0
for mode in "${modes[@]}"; do
  case "$mode" in
    tests)
      python3 -m pytest -m gpu -p no:cacheprovider tests > "$OUT/pytest_gpu.log" 2>&1 || status=1
      tail -n 3 "$OUT/pytest_gpu.log"
      echo "wrote $OUT/pytest_gpu.log" ;;
    anchors)
      python3 -m benchmarks.check_anchors --backend auto --configs "$CONFIGS" \
        --out "$OUT" || status=1 ;;
    bench)
      python3 -m benchmarks.bench --impls auto,torch_sonicmoe --configs "$CONFIGS" \
        --rounds "$ROUNDS" --out "$OUT/bench" \
        ${TORCH_PYTHONPATH:+--torch-pythonpath "$TORCH_PYTHONPATH"} || status=1 ;;
  esac
done
exit $status
