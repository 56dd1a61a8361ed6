#!/usr/bin/env bash
# The serving benchmark as the README table quotes it (FP16, W4, W4+EC at batch 1, 8, 32, 64 on
# the Llama-2-7B and Llama-3-8B shapes), then batch 1 with the previous cap of 8 u programs.
#   usage: scripts/gpu_full_decode.sh OUT_DIR
set -uo pipefail
out=${1:?usage: scripts/gpu_full_decode.sh OUT_DIR}
mkdir -p "$out"
export PYTHONUNBUFFERED=1
timeout 330 python benchmarks/bench_decode.py --out "$out/decode" > "$out/decode.txt" 2>&1
grep -E "^\| Llama|floor|ceiling" "$out/decode.txt"
timeout 120 python benchmarks/bench_decode.py --batches 1 --no-fp16 --u-split-max 8 --out "$out/decode-u8" \
  > "$out/decode-u8.txt" 2>&1
echo "== u programs <= 8"; grep -E "^\| Llama" "$out/decode-u8.txt"
