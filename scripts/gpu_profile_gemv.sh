#!/usr/bin/env bash
# Per-kernel profile of the batch-1 decode step (Llama-2-7B shapes) and the dispatched W4 GEMV
# on the five 7B/8B shapes at M = 1 ... 16.
#   usage: scripts/gpu_profile_gemv.sh OUT_DIR
set -uo pipefail
out=${1:?usage: scripts/gpu_profile_gemv.sh OUT_DIR}
mkdir -p "$out"
export PYTHONUNBUFFERED=1
timeout 200 python benchmarks/bench_decode.py --models Llama-2-7B --batches 1 --profile --out "$out/profile" \
  > "$out/profile.txt" 2>&1
tail -30 "$out/profile.txt"
timeout 150 python benchmarks/bench_gemv.py --out "$out/dispatched" --quick --all-shapes --layouts kmajor \
  --ms 1,2,4,8,16 > "$out/dispatched.txt" 2>&1
grep "M=" "$out/dispatched.txt"
