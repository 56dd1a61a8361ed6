#!/usr/bin/env bash
# Serving GPU tests, engine decode, the op as dispatched (both layouts), then the kernel GPU tests.
#   usage: scripts/gpu_final.sh OUT_DIR
set -uo pipefail
out=${1:?usage: scripts/gpu_final.sh OUT_DIR}
mkdir -p "$out"
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
timeout 100 python -m pytest -q -p no:cacheprovider -m gpu tests/serve/test_gpu.py 2>&1 | tail -8 > "$out/tests.txt"
tail -2 "$out/tests.txt"
timeout 130 python benchmarks/bench_decode.py --batches 1,8 --out "$out/decode" > "$out/decode.txt" 2>&1
tail -12 "$out/decode.txt"
timeout 60 python benchmarks/bench_gemv.py --out "$out/gemv" --quick --all-shapes --ms 1,16 > "$out/gemv.txt" 2>&1
grep "M=" "$out/gemv.txt"
timeout 140 python -m pytest -q -p no:cacheprovider -m gpu tests/kernels/test_kernels.py 2>&1 | tail -8 > "$out/ktests.txt"
tail -4 "$out/ktests.txt"
