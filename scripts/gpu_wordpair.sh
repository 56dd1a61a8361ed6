#!/usr/bin/env bash
# The K-major decode loop with word pairs (one fp32 conversion per two words, 16-byte activation
# loads) against the previous build in build/ab (a `git archive` of the earlier commit's spear,
# benchmarks and tests): GPU tests, the dispatched GEMV at M = 1, 2 on the five 7B/8B shapes,
# and the engine's batch-1 decode, both builds on the same machine.
#   usage: scripts/gpu_wordpair.sh OUT_DIR [tests|bench|all]
set -uo pipefail
out=${1:?usage: scripts/gpu_wordpair.sh OUT_DIR [tests|bench|all]}
what=${2:-all}
mkdir -p "$out"
export PYTHONUNBUFFERED=1
if [ "$what" != bench ]; then
  timeout 240 python -m pytest -q -x -p no:cacheprovider -m gpu tests/kernels/test_kernels.py \
    -k "ptx_decode_loop or real_shapes_kmajor" > "$out/tests.txt" 2>&1
  timeout 60 python -m pytest -q -p no:cacheprovider -m gpu tests/serve/test_gpu.py >> "$out/tests.txt" 2>&1
  grep -E "passed|failed|Error" "$out/tests.txt" | tail -6
fi
[ "$what" = tests ] && exit 0
for build in new old; do
  root=.
  [ $build = old ] && root=build/ab
  timeout 100 python $root/benchmarks/bench_gemv.py --out "$out/gemv-$build" --quick --all-shapes --layouts kmajor \
    --ms 1,2 > "$out/gemv-$build.txt" 2>&1
  echo "== gemv $build"; grep "M=" "$out/gemv-$build.txt"
done
for build in new old; do
  root=.
  [ $build = old ] && root=build/ab
  timeout 150 python $root/benchmarks/bench_decode.py --batches 1 --out "$out/decode-$build" > "$out/decode-$build.txt" 2>&1
  echo "== decode $build"; tail -6 "$out/decode-$build.txt"
done
