#!/usr/bin/env bash
# Serving GPU tests (fused projections with merged ECs), the M = 4 dispatch, engine decode.
#   usage: scripts/gpu_final.sh OUT_DIR
set -uo pipefail
out=${1:?usage: scripts/gpu_final.sh OUT_DIR}
mkdir -p "$out"
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
timeout 150 python -m pytest -q -p no:cacheprovider -m gpu tests/serve/test_gpu.py 2>&1 | tail -8 > "$out/tests.txt"
tail -4 "$out/tests.txt"
timeout 70 python benchmarks/bench_gemv.py --out "$out/gemv4" --quick --all-shapes --ms 4 > "$out/gemv4.txt" 2>&1
grep "M=" "$out/gemv4.txt"
timeout 200 python benchmarks/bench_decode.py --batches 1,8,64 --out "$out/decode" > "$out/decode.txt" 2>&1
tail -12 "$out/decode.txt"
