#!/usr/bin/env bash
# GPU check of the K-major layout end to end: kernel tests at real shapes, the op as
# dispatched for both layouts (M = 1 ... 512), and the engine's decode with each layout.
#   usage: scripts/gpu_kmajor.sh OUT_DIR
set -uo pipefail
out=${1:?usage: scripts/gpu_kmajor.sh OUT_DIR}
mkdir -p "$out"
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
timeout 200 python -m pytest -q -p no:cacheprovider -m gpu tests/kernels/test_kernels.py -x 2>&1 | tail -15 > "$out/tests.txt"
tail -5 "$out/tests.txt"
timeout 150 python benchmarks/bench_gemv.py --out "$out/gemv" --quick --all-shapes --ms 1,2,4,8,16,32,64,512 \
  > "$out/gemv.txt" 2>&1; tail -45 "$out/gemv.txt"
for layout in nmajor kmajor; do
  timeout 100 python benchmarks/bench_decode.py --models Llama-2-7B --batches 1,8 --layout $layout \
    --out "$out/decode-$layout" > "$out/decode-$layout.txt" 2>&1; tail -8 "$out/decode-$layout.txt"
done
