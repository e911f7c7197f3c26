#!/usr/bin/env bash
# GPU work for one device call, writing logs and JSON under $OUT (see benchmarks/NOTES.md).
# Usage on the device machine, from the repo root:  bash benchmarks/gpu_session.sh MODE...
#   check : GPU-only tests (pallas, sharding mesh-of-one, cute if carried) and the per-op
#           breakdown of the pallas backend at 30B-n256 and 7B-n256          (~4 min)
#   sweep : tile sweep of the varlen-M kernels at 30B-n256 and 7B-n256        (~3 min)
#   rounding: token rounding (nearest) vs plain top-K throughput at T=32768, d=4096, n=1024,
#           E=256, K=4 on the pallas backend                                   (~2 min)
#   anchors: check_anchors (pallas vs float32 references) at the five paper configs  (~6 min)
#   cute_anchors: the same with every CuTe op (after `cute`)                          (~7 min)
#   omnimoe: OmniMoE tests and latency benchmark on the GPU
#   cute  : the cute GPU tests (tests/test_cute_*.py), every CUTE_PARTS-th from CUTE_PART
#           (default 1 of 3), compiling into the disk cache /tmp/cute-cache (carry the cute wheels first,
#           ../shared/tools/device-wheels cute; source their env.sh; exits 3 without them) (5-7 min a part)
#   cute_all: all of the cute GPU tests (tests/test_cute_*.py) in one call, in CUTE_WORKERS
#           (default 6) pytest-xdist processes on the one GPU (its wheels carried in XDIST_WHEELS, default
#           .devwheels/xdist/: `pip download --no-deps pytest-xdist execnet -d .devwheels/xdist`;
#           exits 3 without them),
#           then the failed ones again in one process (one that ran out of memory beside the
#           others passes there) (after cute staging; 190 tests: ~4.5 min at 6 workers)
#   cute_sweep: their tile/epilogue sweep at 30B-n256                                 (~5 min)
#   cute_bench: then (kernels read back from the disk cache) the FFI call cost and the layer
#           at the five anchors, the default ("auto") vs all-pallas                  (~5 min)
#   kernels_auto: the per-op breakdown of the default at 7B-n256 and 30B-n256, then the
#           router logits (bf16 operands vs an fp32 copy of X) at 30B-n256           (~4 min)
#   pallas_layer: the Pallas layer's GPU tests against xla (timed out at 120 s in session 11) (~4 min)
#   per_op_wide: the per-op breakdown of the default at 120B-n1024 and 30B-n256 (after `cute`
#           staging: source /tmp/devsite-cute/env.sh first)                              (~3 min)
#   clocks: SM clock, power and temperature sampled while the default runs at 30B-n256  (~2 min)
#   windows: the layer's column windows: GPU tests, the default with two windows against float32
#           at 30B-n256                                                            (~6 min)
#   windows_bench: the default (two windows where it picks them) and one window at four
#           anchors (time, step MiB; WIN_IMPLS adds e.g. auto/w4)
#                                                                                  (~6 min)
#   persistent: the persistent kernels: bitwise GPU tests (kernels, layer), the weight
#           gradients' sweep rows at 120B-n1024 and 7B-n1024, the wide store GEMMs' at olmoe and
#           120B-n1024 beside grouped_gemm's, the step with either store kernel      (~9 min)
#   ncu_kernel: Nsight Compute on one sweep kernel (NCU_KERNEL; default: 7B-n256's dH), per-SASS
#           stalls                                                                 (~3 min)
#   ab_sweep: one tile_sweep (AB_SWEEP: its arguments) on this tree, then again with the
#           files under .ab/before/ (carried; benchmarks/ab_before.sh writes them from a
#           commit) copied over it: a kernel change before and after in one call   (~2-5 min)
#   ab_bench: bench (AB_BENCH: its arguments) on this tree and with .ab/before/ over it, two
#           interleaved rounds: a change's effect on the step in one call          (~4-9 min)
#   step_memory: the step's peak memory and XLA's report of its largest buffers    (~2 min)
#   ncu_pair: Nsight Compute on one step's GEMMs, ours and the PyTorch SonicMoE's, at
#           NCU_CONFIG (after cute and upstream staging and torch_warm)              (~4 min)
#   ncu_bytes: DRAM and L2 bytes, clock, throughput and warp stalls of our dW1 alone (two
#           launches of NCU_BYTES_KERNEL, a sweep row, default
#           dw1_gather_persistent_sized_dynamic_cluster: olmoe's layer's) and of the PyTorch
#           SonicMoE's step GEMMs at NCU_CONFIG (default olmoe; after cute and upstream staging and
#           torch_warm); NCU_STALLS=1: a second pass each, the warps' stall reasons per issued
#           instruction (smsp__average_warps_issue_stalled_*)                 (~3 min, ~5 with it)
#   pair  : one config side by side in one call, ours then the PyTorch SonicMoE's first run
#           and timed loop (PAIR_CONFIG; after cute and upstream staging)            (~10 min)
#   pair_rounds: after `pair` at those configs: ours and theirs in turn, PAIR_ROUNDS rounds at
#           PAIR_CONFIGS, each GEMM's median over the rounds (kernel_table --by-gemm) (~1.5 min a config a round)
#   setting_rounds: our default under each of SETTINGS (bench.py's --cute-* arguments per
#           variant, '|' between) in turn, SETTING_ROUNDS rounds at SETTING_CONFIGS; each
#           variant's GEMMs and step, medians (kernel_table)  (~40-60 s a config a variant a round)
#   torch_forced: the PyTorch SonicMoE at FORCE_CONFIG (default 30B-n256) with one GEMM
#           (FORCE_GEMM, default dX~) forced to each of FORCE_TILES ('|' between; torch_autotune's
#           names, e.g. "192x128 pp 1x2|128x128 pp 1x2") in turn, one process each, after
#           upstream staging with .devcache carried; each run's GEMMs (kernel_table --by-gemm)
#                                                                   (~1.5 min a tile)
#   torch_cache_save: the PyTorch SonicMoE's autotuning results and compiled kernels into $OUT
#           (kept here in .devcache/; carried, the next machine restores them at the start) (~10 s)
#   torch_warm: the PyTorch SonicMoE's first runs (compiles, autotuning: ~510 s fresh), after
#           staging the upstream wheels; its autotuning results into $OUT          (~9 min)
#   bench : side by side at the five anchors: pallas, tokamax, dense, the default ("auto") when
#           the cute wheels are staged (source /tmp/devsite-cute/env.sh and, for tokamax,
#           /tmp/devsite-tokamax/env.sh first), and the PyTorch SonicMoE when its wheels are
#           staged (it runs with /tmp/devsite-upstream alone on its PYTHONPATH)
set -uo pipefail
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
export SONICMOE_CUTE_CACHE=${SONICMOE_CUTE_CACHE:-/tmp/cute-cache}   # shared by the cute modes
{ nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
  python3 -c "import jax, sys; print(sys.version.split()[0], jax.__version__, jax.devices())"
  python3 -c "from importlib import metadata as m; print('nvidia-cutlass-dsl', m.version('nvidia-cutlass-dsl'))" 2>/dev/null \
    || echo "nvidia-cutlass-dsl: not importable (the cute backend is off: 'auto' runs pallas)"; } | tee "$OUT/gpu.txt"
# whether the cute backend's packages import here (the cute wheels staged and their env.sh sourced)
cute_staged() { python3 -c "import cutlass, jax_tvm_ffi" 2>/dev/null; }
# the PyTorch SonicMoE's PYTHONPATH: its staged wheels alone (it pins an older
# nvidia-cutlass-dsl than the cute backend's, which this process's PYTHONPATH may carry)
torch_pythonpath() { [ -f /tmp/devsite-upstream/env.sh ] && (unset PYTHONPATH; . /tmp/devsite-upstream/env.sh; echo "$PYTHONPATH"); }
# the PyTorch SonicMoE's argument: {name: [T, d, n, E, K]} of the anchors named in a comma list
# (empty: all five)
anchors_json() { python3 -c 'from benchmarks import configs as C; import json, sys
names = sys.argv[1].split(",") if sys.argv[1] else list(C.ANCHORS)
print(json.dumps({k: C.ANCHORS[k] for k in names}))' "${1:-}"; }
# join_records OUT OURS THEIRS [ROUND]: ours (bench.py's JSON list) then theirs
# (torch_sonicmoe.py's JSON lines) into the list OUT; with ROUND, each record tagged with it and
# appended to OUT's (rounds of one run). A file that is missing (or "") adds nothing.
join_records() { python3 -c "
import json, os, sys
out, ours, theirs, r = (sys.argv[1:] + [''])[:4]
rows = json.load(open(out)) if r and os.path.exists(out) else []
new = (json.load(open(ours)) if os.path.exists(ours) else []) + (
    [json.loads(l) for l in open(theirs) if l.strip()] if os.path.exists(theirs) else [])
json.dump(rows + [dict(x, round=int(r)) if r else x for x in new], open(out, 'w'))" "$@"; }
# round_bench LOG ARGS...: one round of ours for the *_rounds modes, bench ARGS at their
# iterations into /tmp/round_ours.json (its log appended to LOG)
round_bench() { local log=$1; shift
  rm -f /tmp/round_ours.json /tmp/round_ours.png
  timeout 400 python3 -m benchmarks.bench --iters 5 --reps 3 "$@" --out /tmp/round_ours >> "$log" 2>&1; }
# save_autotune: quack's autotuning results (~/.quack, a few KB: which tile each GEMM runs
# on this machine) into $OUT/quack_autotune.tgz (benchmarks.torch_autotune reads it)
save_autotune() {
  if [ -d "$HOME/.quack" ]; then
    tar czf "$OUT/quack_autotune.tgz" -C "$HOME" .quack && echo "quack_autotune.tgz saved"
  else echo "autotuning results not saved: no $HOME/.quack"; fi; }
# the PyTorch SonicMoE's caches from an earlier machine (torch_cache_save's files, carried in
# .devcache/): quack's autotuning results (~/.quack: the config each GEMM shape runs; with
# them it tunes nothing) and its compiled kernels (quack_cache under the temp folder; with
# them it compiles nothing). Without them its first run took 447-472 s at 30B-n256 and
# 120B-n1024 on a fresh machine. Restored once per machine, before any mode runs, from
# DEVCACHE (default .devcache; quack keys its picks on the shapes, not the card, so each card's
# picks need a folder of their own, e.g. DEVCACHE=.devcache-h100 for the H100's).
quack_kernels_dir() { python3 -c 'import getpass, os, tempfile; print(os.path.join(tempfile.gettempdir(), getpass.getuser(), "quack_cache"))'; }
devcache=${DEVCACHE:-.devcache}
if [ -d "$devcache" ] && [ ! -e "${TMPDIR:-/tmp}/.quack-restored" ]; then
  [ -f "$devcache/quack_autotune.tgz" ] && tar xzf "$devcache/quack_autotune.tgz" -C "$HOME"
  if ls "$devcache"/quack_kernels.tgz.part* > /dev/null 2>&1; then
    mkdir -p "$(dirname "$(quack_kernels_dir)")"
    cat "$devcache"/quack_kernels.tgz.part* | tar xzf - -C "$(dirname "$(quack_kernels_dir)")"
  fi
  touch "${TMPDIR:-/tmp}/.quack-restored"
  echo "restored the PyTorch SonicMoE's caches: $(find "$HOME/.quack" -name '*.autotune.json' 2>/dev/null | wc -l) autotuning results, $(find "$(quack_kernels_dir)" -type f 2>/dev/null | wc -l) kernel files"
fi
for mode in "$@"; do
  case "$mode" in
    check)
      # -m gpu, plus the varlen-K test with olmoe-length pipelines (it runs on any platform)
      XLA_FLAGS=--xla_gpu_autotune_level=0 timeout 300 python3 -m pytest \
        -k "gpu or long_pipelines" -p no:cacheprovider \
        tests/test_pallas.py tests/test_sharding.py tests/test_cute_*.py > "$OUT/pytest_gpu.log" 2>&1
      grep -E "^(FAILED|ERROR)|passed|failed" "$OUT/pytest_gpu.log" | tail -12
      timeout 200 python3 -m benchmarks.kernels --backend pallas --configs 30B-n256,7B-n256 \
        --out "$OUT/kernels_pallas.json" 2>&1 | grep -v '^{' | tail -22 ;;
    sweep)
      timeout 150 python3 -m benchmarks.tile_sweep --configs 30B-n256,7B-n256 --kernels up_proj,dh \
        --block-n 64,128 --stages 2,4 --out "$OUT/sweep_up_dh.json" 2>&1 | grep -v '^{' | tail -13
      timeout 200 python3 -m benchmarks.tile_sweep --configs 30B-n256,7B-n256 --kernels down_proj,dx_tilde \
        --block-n 128,256 --stages 2,4 --out "$OUT/sweep_matmul.json" 2>&1 | grep -v '^{' | tail -25 ;;
    kernels_auto)  # the per-op breakdown of the default ("auto": cute ops where it picks them,
                   # source /tmp/devsite-cute/env.sh first) at 7B-n256 and 30B-n256   (~3 min)
      timeout 280 python3 -m benchmarks.kernels --backend auto --configs 7B-n256,30B-n256 \
        --out "$OUT/kernels_auto.json" 2>&1 | grep -v '^{' | tail -40
      timeout 90 python3 -m benchmarks.router_logits ;;   # router logits: bf16 vs fp32 copy
    pallas_layer)
      XLA_FLAGS=--xla_gpu_autotune_level=0 timeout 280 python3 -m pytest -p no:cacheprovider -rA \
        -m gpu tests/test_pallas.py -k "matches_xla or gather_in_kernel" > "$OUT/pytest_pallas_layer.log" 2>&1
      echo "pallas layer tests: rc $?"; grep -E "^(PASSED|FAILED|ERROR)" "$OUT/pytest_pallas_layer.log" ;;
    per_op_wide)
      timeout 280 python3 -m benchmarks.kernels --backend auto --configs 120B-n1024,30B-n256 \
        --out "$OUT/kernels_auto_wide.json" 2>&1 | grep -v '^{' | tail -40 ;;
    clocks)  # after `cute` staging: SM clock, power and temperature every 20 ms (nvidia-smi)
             # while the default runs at CLOCK_CONFIG (default 30B-n256): does the step run
             # below the clock its kernels get alone?                                (~2 min)
      nvidia-smi --query-gpu=timestamp,clocks.sm,power.draw,temperature.gpu --format=csv,noheader \
        -lms 20 > "$OUT/clocks.csv" 2>&1 & smi=$!
      timeout 200 python3 -m benchmarks.bench --configs "${CLOCK_CONFIG:-30B-n256}" --impls auto \
        --iters 20 --reps 3 --out "$OUT/bench_clocks" 2>&1 | tail -3
      kill $smi; python3 - "$OUT/clocks.csv" <<'PY'
import sys
rows = [r.split(", ") for r in open(sys.argv[1]) if r.count(",") == 3]
busy = [r for r in rows if float(r[2].split()[0]) > 300]   # drawing > 300 W: in the loop
for name, i in (("SM MHz", 1), ("W", 2), ("C", 3)):
  v = [float(r[i].split()[0]) for r in busy]
  print(f"{name}: {len(v)} samples under load, min {min(v):.0f} mean {sum(v)/len(v):.0f} max {max(v):.0f}" if v else f"{name}: no samples under load")
PY
      ;;
    windows)  # after `cute` staging: the layer's column windows (moe's `windows`): GPU tests (the
              # windowed store GEMMs bitwise, the layer, its peak memory),
              # then the default with two windows against float32 at 30B-n256   (~6 min)
      timeout 240 python3 -m pytest -p no:cacheprovider -rA -m gpu tests/test_cute_*.py \
        tests/test_windows.py -k "window" > "$OUT/pytest_windows.log" 2>&1
      rc=$?; grep -E "^(FAILED|ERROR)|passed|failed" "$OUT/pytest_windows.log" | tail -6
      [ $rc -ne 0 ] && { echo "windows tests: rc $rc"; continue; }
      timeout 200 python3 -m benchmarks.check_anchors --backend auto --configs 30B-n256 \
        --windows 2 --out "$OUT/check_windows.json" 2>&1 | tail -2 ;;
    windows_bench)  # after `windows`: the default (two windows where it picks them) and one
                    # window (WIN_IMPLS) at WIN_CONFIGS (default 7B-n256, 30B-n256, 120B-n1024,
                    # olmoe): time, step MiB (~6 min)
      timeout 560 python3 -m benchmarks.bench --configs "${WIN_CONFIGS:-7B-n256,30B-n256,120B-n1024,olmoe}" \
        --impls "${WIN_IMPLS:-auto,auto/w1}" --iters 5 --reps 3 --out "$OUT/bench_windows" 2>&1 | tail -14 ;;
    persistent)  # after `cute` staging: the persistent kernels (ffi/persistent.py): bitwise GPU
                 # tests against grouped_gemm's and in the layer, the weight gradients' sweep rows
                 # at 120B-n1024 and 7B-n1024 and the wide store GEMMs' at olmoe and 120B-n1024
                 # beside grouped_gemm's, then the step with either store kernel (~9 min)
      timeout 240 python3 -m pytest -p no:cacheprovider -rA -m gpu tests/test_cute_*.py \
        -k "persistent" > "$OUT/pytest_persistent.log" 2>&1
      rc=$?; grep -E "^(PASSED|FAILED|ERROR)|passed|failed" "$OUT/pytest_persistent.log" | tail -14
      [ $rc -ne 0 ] && { echo "persistent tests: rc $rc"; continue; }
      timeout 150 python3 -m benchmarks.tile_sweep --impl cute --configs 120B-n1024,7B-n1024 \
        --stages 0 --block-n 256 --out "$OUT/sweep_wgrad_persistent.json" --kernels \
        dw1_gather,dw1_gather_persistent,dw2_gather,dw2_gather_persistent 2>&1 | grep -v '^{' \
        | grep -v "^config"
      timeout 150 python3 -m benchmarks.tile_sweep --impl cute --configs olmoe,120B-n1024 \
        --stages 0 --block-n 256 --out "$OUT/sweep_store_persistent.json" --kernels \
        down_proj,down_proj_ws,down_proj_persistent,dx_tilde,dx_tilde_ws,dx_tilde_persistent 2>&1 | grep -v '^{' \
        | grep -v "^config"
      for store in grouped persistent; do
        timeout 150 python3 -m benchmarks.bench --configs olmoe,120B-n1024 --impls auto \
          --cute-store-wide $store --iters 5 --reps 3 --out "$OUT/bench_store_wide_$store" 2>&1 | tail -5
      done ;;
    ncu_kernel)  # after `cute` staging: Nsight Compute on one tile_sweep kernel alone,
                 # NCU_KERNEL="<config> <sweep kernel> <block_n> <kernel-name regex>" (default:
                 # the default dH at 7B-n256, the ping-pong kernel gathering dO; e.g. "olmoe
                 # dw1_gather_persistent 256 sonicmoe_persistent_weight_grad"): sections,
                 # stall ratios and shared-memory bank conflicts, then the warp-state samples
                 # per SASS instruction (its report's source page)                      (~3 min)
      read -r cfg kernel block_n regex <<< "${NCU_KERNEL:-7B-n256 dh_pingpong_gather_tma 128 pingpong_dh}"
      sweep=(python3 -m benchmarks.tile_sweep --impl cute --configs "$cfg" --stages 0
             --block-n "$block_n" --kernels "$kernel" --iters 1 --reps 1)
      name="ncu_${kernel}_$cfg"
      # the kernel compiled into the disk cache first: compiling under ncu segfaulted at once
      # (session 35, rc 139 on a fresh cache; the same command ran once the cache held it)
      timeout 200 "${sweep[@]}" > "$OUT/${name}_warm.log" 2>&1; echo "compile (no ncu): rc $?"
      # (-k names the kernel: a sweep's first launch may be another, e.g. dH's up-projection)
      XLA_PYTHON_CLIENT_PREALLOCATE=false timeout 200 ncu --clock-control none -k "regex:$regex" \
        --launch-count 1 --section SpeedOfLight --section MemoryWorkloadAnalysis \
        --section MemoryWorkloadAnalysis_Tables --section SchedulerStats --section WarpStateStats \
        --metrics regex:smsp__average_warps_issue_stalled_.*_per_issue_active.ratio \
        "${sweep[@]}" > "$OUT/$name.txt" 2>&1; echo "ncu sections: rc $?"
      grep -E "Duration|DRAM Throughput|Compute \(SM\)|L2 Cache Throughput|Bank Conflicts|bank conflicts|stalled_.*(long_sc|wait|barrier|dispatch|short|mio|lg_throttle)" \
        "$OUT/$name.txt" | cut -c1-110
      XLA_PYTHON_CLIENT_PREALLOCATE=false timeout 200 ncu --clock-control none -k "regex:$regex" \
        --launch-count 1 --section SourceCounters -f -o "$OUT/${name}_source" "${sweep[@]}" \
        > "$OUT/${name}_source.log" 2>&1; echo "ncu source counters: rc $?"
      # (the source-counters pass segfaulted in sessions 35 and 42: then no source page)
      if ncu --import "$OUT/${name}_source.ncu-rep" --page source --print-source sass --csv \
        > "$OUT/${name}_sass.csv" 2> "$OUT/${name}_sass.err"; then
        python3 -m benchmarks.ncu_sass_top "$OUT/${name}_sass.csv" --top 8 --context 3
      else echo "source page: rc $?"; fi ;;
    ab_sweep)  # after `cute` staging: AB_SWEEP="<tile_sweep arguments>" after (this tree),
               # then before (.ab/before/ copied over the tree: carry [".ab"]; the next call
               # gets a fresh copy of the tree)
      [ -d .ab/before ] || { echo "ab_sweep: no .ab/before (benchmarks/ab_before.sh)"; continue; }
      read -r -a ab_args <<< "${AB_SWEEP:?AB_SWEEP: the tile_sweep arguments}"
      for side in after before; do
        [ "$side" = before ] && cp -r .ab/before/. .
        echo "== $side"
        timeout 280 python3 -m benchmarks.tile_sweep "${ab_args[@]}" --out "$OUT/sweep_$side.json" \
          2>&1 | grep -v '^{'
      done ;;
    ab_bench)  # after `cute` staging: AB_BENCH="<bench arguments>" on this tree (after) and
               # with .ab/before/ copied over it (before), in two rounds: after, before, after,
               # before (carry [".ab"]; benchmarks/ab_before.sh)
      [ -d .ab/before ] || { echo "ab_bench: no .ab/before (benchmarks/ab_before.sh)"; continue; }
      read -r -a ab_args <<< "${AB_BENCH:?AB_BENCH: the bench arguments}"
      rm -rf /tmp/ab_after; mkdir -p /tmp/ab_after
      (cd .ab/before && find . -type f) | while read -r f; do
        mkdir -p "/tmp/ab_after/$(dirname "$f")"; cp "$f" "/tmp/ab_after/$f"; done
      for round in 1 2; do
        for side in after before; do
          if [ "$side" = before ]; then cp -r .ab/before/. .; else cp -r /tmp/ab_after/. .; fi
          echo "== $side $round"
          timeout 200 python3 -m benchmarks.bench "${ab_args[@]}" \
            --out "$OUT/bench_${side}_$round" 2>&1 | grep -E " ok$|its kernels|rror"
        done
      done
      cp -r /tmp/ab_after/. . ;;
    step_memory)  # after `cute` staging: the step's peak memory and XLA's memory-usage report
                  # (its largest buffers) at MEM_CONFIGS (default 30B-n256 7B-n256)   (~2 min)
      for cfg in ${MEM_CONFIGS:-30B-n256 7B-n256}; do
        rm -rf /tmp/xladump
        XLA_FLAGS="--xla_dump_to=/tmp/xladump --xla_dump_hlo_module_re=jit_step" timeout 200 \
          python3 -m benchmarks.ncu_step --no-profiler --config "$cfg" --impl auto 2>&1 | tail -1
        report=$(ls /tmp/xladump/*jit_step*memory-usage-report.txt 2>/dev/null | head -1)
        [ -n "$report" ] && { cp "$report" "$OUT/memory_report_$cfg.txt"; head -16 "$report" | cut -c1-160; }
      done ;;
    ncu_pair)  # after `cute` and upstream staging and `torch_warm` of NCU_CONFIG (default
               # 30B-n256): Nsight Compute on one step's GEMMs, ours and the PyTorch SonicMoE's
      cfg=${NCU_CONFIG:-30B-n256}; tp=$(torch_pythonpath)
      sections=(--section SpeedOfLight --section MemoryWorkloadAnalysis --section WarpStateStats
                --section Occupancy --section LaunchStats --section SchedulerStats)
      # (ours from the start, its first step's launches: around cudaProfilerStart it segfaulted
      # in session 18, as it did from the start at 7B-n256; its kernels compiled into the disk
      # cache first, as ncu_kernel's)
      timeout 200 python3 -m benchmarks.ncu_step --no-profiler --config "$cfg" --impl auto \
        > "$OUT/ncu_ours_warm_$cfg.log" 2>&1; echo "compile (no ncu): rc $?"
      XLA_PYTHON_CLIENT_PREALLOCATE=false timeout 250 ncu --clock-control none -k regex:sonicmoe \
        --launch-count 10 "${sections[@]}" python3 -m benchmarks.ncu_step --no-profiler \
        --config "$cfg" --impl auto > "$OUT/ncu_ours_$cfg.txt" 2>&1; echo "ncu ours: rc $?"
      PYTHONPATH=$tp timeout 250 ncu --profile-from-start off --clock-control none \
        -k regex:quackgemm "${sections[@]}" python3 benchmarks/torch_sonicmoe.py "$(anchors_json "$cfg")" \
        --profile-one-step > "$OUT/ncu_torch_$cfg.txt" 2>&1; echo "ncu torch: rc $?"
      for side in ours torch; do
        grep -E "^  [a-zA-Z_]+.*\(|Duration|DRAM Throughput|Compute \(SM\) Throughput|L2 Cache Throughput|Registers Per|Achieved Occupancy|Grid Size|Block Size|Issue Slots Busy|No Eligible" \
          "$OUT/ncu_${side}_$cfg.txt" | cut -c1-110 | head -70
      done ;;
    ncu_bytes)  # (see above; our step under ncu segfaulted at olmoe in session 42: ours from
                # tile_sweep, compiled into the disk cache first; L2 flushed before each kernel)
      cfg=${NCU_CONFIG:-olmoe}; tp=$(torch_pythonpath)
      metrics=gpu__time_duration.sum,dram__bytes_read.sum,dram__bytes_write.sum
      metrics=$metrics,lts__t_sectors_srcunit_tex_op_read.sum,lts__t_sectors_srcunit_tex_op_write.sum
      metrics=$metrics,lts__t_sectors_srcunit_tex_op_read_lookup_miss.sum
      # (and each kernel's clock, SM and tensor throughput and warp stalls: SpeedOfLight,
      # WarpStateStats)
      sections=(--section SpeedOfLight --section WarpStateStats)
      sweep=(python3 -m benchmarks.tile_sweep --impl cute --configs "$cfg" --stages 0 --block-n 256
             --kernels "${NCU_BYTES_KERNEL:-dw1_gather_persistent_sized_dynamic_cluster}" --iters 1 --reps 1)
      timeout 200 "${sweep[@]}" > "$OUT/ncu_bytes_warm.log" 2>&1; echo "compile (no ncu): rc $?"
      XLA_PYTHON_CLIENT_PREALLOCATE=false timeout 200 ncu --clock-control none \
        -k regex:sonicmoe_persistent_weight_grad --launch-count 2 --metrics "$metrics" \
        "${sections[@]}" "${sweep[@]}" > "$OUT/ncu_bytes_ours_$cfg.txt" 2>&1; echo "ncu ours: rc $?"
      PYTHONPATH=$tp timeout 200 ncu --profile-from-start off --clock-control none \
        -k regex:quackgemm --metrics "$metrics" "${sections[@]}" python3 benchmarks/torch_sonicmoe.py \
        "$(anchors_json "$cfg")" --profile-one-step > "$OUT/ncu_bytes_torch_$cfg.txt" 2>&1
      echo "ncu torch: rc $?"
      grep -hE "^  [a-zA-Z_]+|gpu__time|dram__|lts__|SM Frequency|Compute \(SM\)|Warp Cycles Per Issued" \
        "$OUT/ncu_bytes_ours_$cfg.txt" "$OUT/ncu_bytes_torch_$cfg.txt" | cut -c1-120
      if [ -n "${NCU_STALLS:-}" ]; then   # (a pass of its own: one --metrics list a pass)
        # (as session 45's working calls; its first, the regex without the section, segfaulted)
        stalls=(--section WarpStateStats
                --metrics regex:smsp__average_warps_issue_stalled_.*_per_issue_active.ratio)
        XLA_PYTHON_CLIENT_PREALLOCATE=false timeout 200 ncu --clock-control none \
          -k regex:sonicmoe_persistent_weight_grad --launch-count 1 "${stalls[@]}" "${sweep[@]}" \
          > "$OUT/ncu_stalls_ours_$cfg.txt" 2>&1; echo "ncu stalls ours: rc $?"
        PYTHONPATH=$tp timeout 200 ncu --profile-from-start off --clock-control none \
          -k regex:quackgemm "${stalls[@]}" python3 benchmarks/torch_sonicmoe.py \
          "$(anchors_json "$cfg")" --profile-one-step > "$OUT/ncu_stalls_torch_$cfg.txt" 2>&1
        echo "ncu stalls torch: rc $?"
        grep -hE "^  [a-zA-Z_]+|stalled_.*(long_sc|wait|barrier|gmma|math|mio|lg_thr|short|sleep|membar|dispatch)" \
          "$OUT/ncu_stalls_ours_$cfg.txt" "$OUT/ncu_stalls_torch_$cfg.txt" | cut -c1-120
      fi ;;
    pair)  # after cute and upstream staging: one config (PAIR_CONFIG, default olmoe) side by
           # side in one call on a fresh PyTorch cache: ours first (bench, auto), then the
           # PyTorch SonicMoE's first run, timed loop and profiled step in what is left of the
           # call's 600 s (its first run took 462 s at olmoe in session 26); then both steps'
           # kernels per op (kernel_table)                                            (~10 min)
      cfg=${PAIR_CONFIG:-olmoe}; tp=$(torch_pythonpath); start=$SECONDS
      timeout 150 python3 -m benchmarks.bench --impls auto --configs "$cfg" --iters 5 --reps 3 \
        --out "$OUT/pair_ours" 2>&1 | tail -4
      left=$((590 - (SECONDS - start) - ${PAIR_MARGIN_S:-25}))
      echo "the PyTorch SonicMoE: ${left} s"
      PYTHONPATH=$tp timeout "$left" python3 benchmarks/torch_sonicmoe.py "$(anchors_json "$cfg")" \
        > "$OUT/pair_torch.jsonl" 2> "$OUT/pair_torch.log"; echo "torch: rc $?"
      join_records "$OUT/pair.json" "$OUT/pair_ours.json" "$OUT/pair_torch.jsonl" \
        && python3 -m benchmarks.kernel_table "$OUT/pair.json" --by-op ;;
    pair_rounds)  # after `pair` (or torch_warm) at the same configs on this machine: ours and
                  # the PyTorch SonicMoE in turn, PAIR_ROUNDS rounds (default 3) at each of
                  # PAIR_CONFIGS (default PAIR_CONFIG), ours as PAIR_IMPLS (default auto; e.g.
                  # auto,auto/w1: one window too), each in its own process; each GEMM's
                  # median over the rounds (kernel_table --by-gemm): the processes' clock
                  # drift shared out between both sides (~1.5 min a config a round; all in
                  # $OUT/rounds.json, several calls' files merge: kernel_table --by-gemm FILES...)
      tp=$(torch_pythonpath); configs=${PAIR_CONFIGS:-${PAIR_CONFIG:-olmoe}}
      for r in $(seq "${PAIR_ROUNDS:-3}"); do
        round_bench "$OUT/rounds_ours.log" --impls "${PAIR_IMPLS:-auto}" --configs "$configs" \
          || echo "ours, round $r: rc $?"
        PYTHONPATH=$tp timeout 240 python3 benchmarks/torch_sonicmoe.py "$(anchors_json "$configs")" \
          > /tmp/rounds_torch.jsonl 2>> "$OUT/rounds_torch.log" || echo "torch, round $r: rc $?"
        # every round's records appended to one list ($OUT returns at most 8 files)
        join_records "$OUT/rounds.json" /tmp/round_ours.json /tmp/rounds_torch.jsonl "$r"
        rm -f /tmp/rounds_torch.jsonl
      done
      python3 -m benchmarks.kernel_table --by-gemm "$OUT/rounds.json" ;;
    setting_rounds)  # after `cute` staging: our default under each of SETTINGS (bench arguments
                     # per variant, '|' between, e.g. "--cute-store-wide-min-k 2048|
                     # --cute-store-wide-min-k 4096") in turn, SETTING_ROUNDS rounds (default 3)
                     # at SETTING_CONFIGS (default olmoe), each in its own process; all in
                     # $OUT/setting_rounds.json, then each variant's GEMMs and step, medians
                     # (kernel_table keeps the variants apart by the settings they changed)
      IFS='|' read -r -a variants <<< "${SETTINGS:?SETTINGS: bench arguments per variant, '|' between}"
      for r in $(seq "${SETTING_ROUNDS:-3}"); do
        for v in "${variants[@]}"; do
          read -r -a v_args <<< "$v"
          round_bench "$OUT/setting_rounds.log" --impls auto --configs "${SETTING_CONFIGS:-olmoe}" \
            "${v_args[@]}" || echo "round $r, $v: rc $?"
          join_records "$OUT/setting_rounds.json" /tmp/round_ours.json "" "$r"
        done
      done
      python3 -m benchmarks.kernel_table --by-gemm "$OUT/setting_rounds.json"
      python3 -m benchmarks.kernel_table --by-layer "$OUT/setting_rounds.json" ;;
    torch_forced)  # after upstream staging, .devcache carried (its autotuning results)
      tp=$(torch_pythonpath); cfg=${FORCE_CONFIG:-30B-n256}; i=0
      IFS='|' read -r -a tiles <<< "${FORCE_TILES:?FORCE_TILES: torch_autotune tiles, '|' between}"
      for tile in "${tiles[@]}"; do
        i=$((i + 1))
        python3 -m benchmarks.torch_autotune "$HOME/.quack" --force "$cfg" "${FORCE_GEMM:-dX~}" \
          "$tile" | grep forced || { echo "torch_forced: $tile not forced"; continue; }
        PYTHONPATH=$tp timeout 240 python3 benchmarks/torch_sonicmoe.py "$(anchors_json "$cfg")" \
          > "$OUT/forced_$i.jsonl" 2>> "$OUT/forced.log" || echo "torch, $tile: rc $?"
        echo "== ${FORCE_GEMM:-dX~} forced to $tile"
        join_records "$OUT/forced_$i.json" "" "$OUT/forced_$i.jsonl" \
          && python3 -m benchmarks.kernel_table --by-gemm "$OUT/forced_$i.json"
      done ;;
    torch_cache_save)  # after the PyTorch SonicMoE ran on this machine: its autotuning results
                       # and compiled kernels into $OUT (the kernels in 15 MiB parts, at most
                       # 4), for .devcache/ here and a carry on the next machine   (~10 s)
      save_autotune
      kernels=$(quack_kernels_dir); packed=${TMPDIR:-/tmp}/quack_kernels.tgz
      if [ -d "$kernels" ]; then
        tar czf "$packed" -C "$(dirname "$kernels")" "$(basename "$kernels")"
        size=$(stat -c %s "$packed")
        if [ "$size" -le $((60 * 1024 * 1024)) ]; then
          split -b 15m -d "$packed" "$OUT/quack_kernels.tgz.part" && echo "quack_kernels.tgz saved: $size bytes"
        else
          echo "compiled kernels not saved: $size bytes compressed, more than 4 parts of 15 MiB"
        fi
        rm -f "$packed"
      else echo "compiled kernels not saved: no $kernels"; fi ;;
    torch_warm)  # the PyTorch SonicMoE's first runs at the anchors (TORCH_CONFIGS, default all
                 # five; its CuTe compiles and autotuning, cached on its disk for `bench`: > 570 s
                 # for all five on a fresh machine in session 10, 7B-n256 then took 44 s); its
                 # autotuner's picks saved (save_autotune: they differ between machines, and
                 # session 40's were lost with its machine); TORCH_WARM_S: its time limit
                 # (default 570 s; less where the call stages wheels first)
      tp=$(torch_pythonpath)
      PYTHONPATH=$tp timeout "${TORCH_WARM_S:-570}" python3 benchmarks/torch_sonicmoe.py "$(anchors_json "${TORCH_CONFIGS:-}")" \
        > "$OUT/torch_warm.jsonl" 2> "$OUT/torch_warm.log"; echo "torch_warm: rc $?"
      grep "first forward" "$OUT/torch_warm.log"
      save_autotune ;;
    bench)  # BENCH_CONFIGS / BENCH_IMPLS (comma lists) narrow it: all five anchors with every
            # impl do not fit one call with the PyTorch SonicMoE in it
      impls=pallas,dense; torch=()
      python3 -c "import tokamax" 2>/dev/null && impls=$impls,tokamax   # staged
      # cute staged too: the default, and the default with the cute up-projection (its sweep
      # rows: 3.88 ms at 30B-n256 in session 9, 4.22 in session 8; Pallas 4.17)
      cute_staged && impls=auto,up_proj=cute,$impls
      tp=$(torch_pythonpath)
      if PYTHONPATH=$tp python3 -c "import sonicmoe" 2>/dev/null; then
        impls=$impls,torch_sonicmoe; torch=(--torch-pythonpath "$tp")
      fi
      [ -n "${BENCH_IMPLS:-}" ] && impls=$BENCH_IMPLS
      configs=(); [ -n "${BENCH_CONFIGS:-}" ] && configs=(--configs "$BENCH_CONFIGS")
      timeout 580 python3 -m benchmarks.bench --impls "$impls" "${configs[@]}" --iters 5 --reps 3 \
        --torch-timeout 300 "${torch[@]}" --out "$OUT/bench" 2>&1 | tail -40 ;;
    cute)  # the cute GPU tests (tests/test_cute_*.py), part CUTE_PART of CUTE_PARTS (default 1
           # of 3: the whole set, ~200 tests, runs past one call's 9 minutes; their order by
           # collection)
      cute_staged || { echo "cute: the cute wheels are not staged here"; exit 3; }
      python3 -m pytest -p no:cacheprovider -m gpu tests/test_cute_*.py --co 2>/dev/null \
        | grep '::' > "$OUT/cute_test_ids.txt"   # (pyproject's -q: one node id a line)
      part=${CUTE_PART:-1} parts=${CUTE_PARTS:-3}
      awk -v p="$part" -v n="$parts" '(NR - 1) % n == p - 1' "$OUT/cute_test_ids.txt" > "$OUT/cute_part$part.txt"
      [ -s "$OUT/cute_part$part.txt" ] || { echo "cute: no tests collected"; exit 3; }
      echo "cute: part $part of $parts, $(wc -l < "$OUT/cute_part$part.txt") of $(wc -l < "$OUT/cute_test_ids.txt") tests"
      timeout 520 python3 -m pytest -p no:cacheprovider -rfEs -m gpu $(cat "$OUT/cute_part$part.txt") \
        > "$OUT/pytest_cute_part$part.log" 2>&1
      grep -E "^(FAILED|ERROR)|passed|failed" "$OUT/pytest_cute_part$part.log" | tail -12
      echo "disk cache entries: $(ls "$SONICMOE_CUTE_CACHE" 2>/dev/null | grep -c '\.o$')" ;;
    cute_all)  # (see above)
      cute_staged || { echo "cute_all: the cute wheels are not staged here"; exit 3; }
      wheels=${XDIST_WHEELS:-.devwheels/xdist}
      ls "$wheels"/*.whl > /dev/null 2>&1 || { echo "cute_all: no $wheels/*.whl"; exit 3; }
      site=${TMPDIR:-/tmp}/xdist-site; mkdir -p "$site"
      for w in "$wheels"/*.whl; do python3 -m zipfile -e "$w" "$site"; done
      cache=${TMPDIR:-/tmp}/cute-all-pytest-cache
      PYTHONPATH=$site${PYTHONPATH:+:$PYTHONPATH} XLA_PYTHON_CLIENT_PREALLOCATE=false \
        timeout 400 python3 -m pytest -m gpu tests/test_cute_*.py -n "${CUTE_WORKERS:-6}" -rfE \
        -o cache_dir="$cache" > "$OUT/pytest_cute_all.log" 2>&1
      rc=$?; echo "cute_all: rc $rc"; grep -E "^(FAILED|ERROR)|passed|failed|skipped" "$OUT/pytest_cute_all.log" | tail -12
      if [ "$rc" = 1 ]; then   # some failed: those again, alone
        timeout 150 python3 -m pytest -m gpu tests/test_cute_*.py --lf -rfE -o cache_dir="$cache" \
          > "$OUT/pytest_cute_rerun.log" 2>&1
        echo "cute_all, the failed ones alone: rc $?"
        grep -E "^(FAILED|ERROR)|passed|failed" "$OUT/pytest_cute_rerun.log" | tail -12
      fi ;;
    cute_sweep)
      sweep() { timeout "$1" python3 -m benchmarks.tile_sweep --impl cute --configs 30B-n256 \
        --stages 3,0 "${@:3}" --out "$OUT/sweep_cute_$2.json" 2>&1 | grep -v '^{' | grep -v "^config"; }
      sweep 60 up --kernels up_proj,up_proj_gather --block-n 64,128
      sweep 60 mm --kernels down_proj,dx_tilde --block-n 128,256
      sweep 100 dh --kernels dh,dh_tma,dh_gather --block-n 64,128
      sweep 120 bw --kernels dw1,dw2,dw1_gather,dw2_gather --block-n 128,256
      timeout 40 python3 -m benchmarks.tile_sweep --configs 30B-n256 --kernels dw1 --block-n 128 \
        --stages 4 --out "$OUT/sweep_pallas_dw1.json" 2>&1 | grep -v '^{' | tail -1 ;;   # Pallas's, same rows
    cute_bench)  # after `cute`, on the same machine: FFI call cost, and the layer's default
                 # ("auto": dh, dx_tilde, dw1 on cute where backends.py says) vs all-pallas
      timeout 60 python3 -m benchmarks.ffi_overhead --calls 20 --out "$OUT/ffi_overhead.json" \
        2>&1 | grep -v '^{' | tail -5
      timeout 300 python3 -m benchmarks.bench --impls pallas,auto \
        --iters 5 --reps 3 --out "$OUT/bench_cute" 2>&1 | tail -11 ;;
    rounding)  # token rounding vs plain top-K at a sparse config (issue #4), pallas backend
      for r in none nearest; do
        flag=(); [ "$r" = nearest ] && flag=(--rounding nearest)
        timeout 200 python3 -m benchmarks.bench --configs "" --custom 32768,4096,1024,256,4 \
          --impls pallas "${flag[@]}" --iters 5 --reps 3 --out "$OUT/bench_rounding_$r" 2>&1 | tail -3
      done ;;
    omnimoe)  # OmniMoE tests on the GPU and the latency benchmark (issue #8)      (~6 min)
      XLA_FLAGS=--xla_gpu_autotune_level=0 timeout 240 python3 -m pytest -p no:cacheprovider \
        tests/test_omnimoe.py > "$OUT/pytest_omnimoe_gpu.log" 2>&1; tail -3 "$OUT/pytest_omnimoe_gpu.log"
      timeout 200 python3 -m benchmarks.omnimoe_bench --active 7e6,28e6 --tokens 1024,4096 \
        --out "$OUT/omnimoe.json" 2>&1 | grep -c '^{' ;;
    cute_anchors)  # the same check with every CuTe op (after `cute`, on the same machine)
      timeout 500 python3 -m benchmarks.check_anchors \
        --backend up_proj=cute+down_proj=cute+dh=cute+dx_tilde=cute+dw1=cute+dw2=cute+aggregate=cute \
        --out "$OUT/check_anchors_cute.json" 2>&1 | grep '^{' | cut -c1-200 ;;
    anchors)  # correctness at the five paper configs vs float32 references
      timeout 420 python3 -m benchmarks.check_anchors --backend pallas \
        --out "$OUT/check_anchors.json" 2>&1 | grep '^{' | cut -c1-200 ;;
    *) echo "unknown mode $mode" >&2; exit 2 ;;
  esac
done
# The device tool brings back 8 files of $OUT: past that, the plots go first (their numbers
# are in the JSON beside them), so that logs and JSON come back.
if [ "$(find "$OUT" -type f | wc -l)" -gt 8 ]; then rm -f "$OUT"/*.png; fi
