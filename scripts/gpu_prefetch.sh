#!/usr/bin/env bash
# The K-major decode loop with and without the register prefetch: GPU tests, a launch sweep at
# M = 1, 2 (writes a launch table), then the engine's batch-1 decode with that table.
#   usage: scripts/gpu_prefetch.sh OUT_DIR [sweep|decode]
# Needs a CUDA GPU with torch, triton and transformers installed; run from the repo root.
set -uo pipefail
out=${1:?usage: scripts/gpu_prefetch.sh OUT_DIR [sweep|decode]}
mkdir -p "$out"
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
if [ "${2:-sweep}" = sweep ]; then
  { timeout 70 python -m pytest -q -p no:cacheprovider -m gpu tests/serve/test_gpu.py 2>&1 | tail -4
    timeout 100 python -m pytest -q -p no:cacheprovider -m gpu tests/kernels/test_kernels.py \
      -k "ptx_decode_loop or real_shapes_kmajor" 2>&1 | tail -6; } > "$out/tests.txt"
  tail -3 "$out/tests.txt"
  timeout 210 python benchmarks/bench_gemv.py --out "$out/gemv" --layouts kmajor --ms 1,2 --BN 64,128 \
    --num-warps 2,4,8 --programs 264,528,1056 --prefetch 0,1 --budget-s 180 > "$out/gemv.txt" 2>&1
  grep -E "M=|launch table" "$out/gemv.txt"
  table="$out/gemv/launch_table.json"
  [ -f "$table" ] || table=""
  timeout 170 python benchmarks/bench_decode.py --batches 1 ${table:+--table "$table"} --out "$out/decode" \
    > "$out/decode.txt" 2>&1
  tail -8 "$out/decode.txt"
else
  table=${3:?decode mode needs the launch table}
  timeout 170 python benchmarks/bench_decode.py --batches 1,8 --table "$table" --fused-max-rank 16 \
    --out "$out/decode-r16" > "$out/decode-r16.txt" 2>&1
  tail -8 "$out/decode-r16.txt"
  timeout 120 python benchmarks/bench_gemv.py --out "$out/dispatched" --quick --all-shapes --layouts kmajor \
    --ms 1,2,4,8,16 > "$out/dispatched.txt" 2>&1
  grep "M=" "$out/dispatched.txt"
fi
