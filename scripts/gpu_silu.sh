#!/usr/bin/env bash
# SiLU·mul in the gate/up GEMM's epilogue (interleaved W4 gate/up) against a previous build:
# GPU tests of the act path and the serving engine, then the engine's batch-1 decode of both
# builds on one machine.
#   usage: scripts/gpu_silu.sh OUT_DIR OLD_BUILD
#   OLD_BUILD: a tree with the previous commit's spear, benchmarks and tests, e.g.
#     mkdir -p build/ab && git archive COMMIT spear benchmarks tests | tar -x -C build/ab
set -uo pipefail
out=${1:?usage: scripts/gpu_silu.sh OUT_DIR OLD_BUILD}
old=${2:?usage: scripts/gpu_silu.sh OUT_DIR OLD_BUILD}
mkdir -p "$out"
export PYTHONUNBUFFERED=1
{ timeout 150 python -m pytest -q -x -p no:cacheprovider -m gpu tests/kernels/test_kernels.py -k "silu_mul" 2>&1 | tail -2
  timeout 60 python -m pytest -q -p no:cacheprovider -m gpu tests/serve/test_gpu.py 2>&1 | tail -1; } > "$out/tests.txt"
cat "$out/tests.txt"
grep -q failed "$out/tests.txt" && exit 1
for build in new old; do
  root=.
  [ $build = old ] && root=$old
  timeout 110 python $root/benchmarks/bench_decode.py --batches 1 --no-fp16 --out "$out/decode-$build" \
    > "$out/decode-$build.txt" 2>&1
  echo "== $build"; grep -E "^\| Llama" "$out/decode-$build.txt"
done
