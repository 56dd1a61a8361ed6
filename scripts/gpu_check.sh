#!/usr/bin/env bash
# One GPU session's checks and timings, in the order that keeps the most useful results if
# the time runs out: GPU tests, the decode-loop sweep (writes a launch table), the engine's
# decode benchmark (default, and with ECs above rank 16 outside the fused kernel), then the
# kernel benchmark's quick sweep.
#   usage: scripts/gpu_check.sh OUT_DIR [SECONDS_FOR_KERNELS]
# Needs a CUDA GPU with torch, triton and transformers installed; run from the repo root.
set -uo pipefail
out=${1:?usage: scripts/gpu_check.sh OUT_DIR [SECONDS_FOR_KERNELS]}
mkdir -p "$out"
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
{
  timeout 300 python -m pytest -q -p no:cacheprovider -m gpu tests/serve/test_gpu.py tests/kernels 2>&1 | tail -25
  timeout 120 python -m pytest -q -p no:cacheprovider tests/kernels/test_attention.py \
    tests/kernels/test_fused.py 2>&1 | tail -6
} > "$out/tests.txt"
tail -8 "$out/tests.txt"
timeout 150 python benchmarks/bench_gemv.py --out "$out/gemv" --budget-s 120 > "$out/gemv.txt" 2>&1; tail -8 "$out/gemv.txt"
timeout 300 python benchmarks/bench_decode.py --batches 1,8 --out "$out/decode" > "$out/decode.txt" 2>&1; tail -12 "$out/decode.txt"
# the fused EC against ec_gate + v-epilogue for ranks above 16 (ops.FUSED_MAX_RANK)
timeout 200 python benchmarks/bench_decode.py --batches 1 --fused-max-rank 16 --out "$out/decode-r16" \
  > "$out/decode-r16.txt" 2>&1; tail -8 "$out/decode-r16.txt"
timeout "${2:-240}" python benchmarks/bench_kernels.py --out "$out/kernels" --quick > "$out/kernels.txt" 2>&1
tail -12 "$out/kernels.txt"
