#!/usr/bin/env bash
# One device call's worth of GPU work for the next session (see benchmarks/NOTES.md), writing
# logs and JSON under $OUT. Usage on the device machine, from the repo root:
#   bash benchmarks/gpu_session.sh [quick|full]
# quick (~6 min): GPU-only tests (pallas, sharding mesh-of-one, cute if carried), and the per-op
#                 breakdown of the pallas backend at 30B-n256 and 7B-n256.
# full: also the side-by-side bench of every available impl at the five anchor configs.
set -uo pipefail
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
mode=${1:-quick}
nvidia-smi --query-gpu=name,driver_version --format=csv | tee "$OUT/gpu.txt"
python3 -c "import jax, sys; print(sys.version.split()[0], jax.__version__, jax.devices())" | tee -a "$OUT/gpu.txt"
XLA_FLAGS=--xla_gpu_autotune_level=0 timeout 300 python3 -m pytest -q -m gpu -p no:cacheprovider \
  tests/test_pallas.py tests/test_sharding.py tests/test_cute.py 2>&1 | tail -30 | tee "$OUT/pytest_gpu.log"
for backend in pallas; do
  timeout 200 python3 -m benchmarks.kernels --backend "$backend" --configs 30B-n256,7B-n256 \
    --out "$OUT/kernels_$backend.json" 2>&1 | grep -v '^{' | tee "$OUT/kernels_$backend.log"
done
if [ "$mode" = full ]; then
  timeout 420 python3 -m benchmarks.bench --iters 5 --reps 3 --out "$OUT/bench" 2>&1 | tail -25 | tee "$OUT/bench.log"
fi
