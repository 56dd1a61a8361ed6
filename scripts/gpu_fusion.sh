#!/usr/bin/env bash
# GPU check of the fused q/k/v and gate/up projections and the K-major engine default:
# serving GPU tests, the M = 4 dispatch (CUDA-core loop vs tensor-core tiles), engine decode.
#   usage: scripts/gpu_fusion.sh OUT_DIR
set -uo pipefail
out=${1:?usage: scripts/gpu_fusion.sh OUT_DIR}
mkdir -p "$out"
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
timeout 200 python -m pytest -q -p no:cacheprovider -m gpu tests/serve/test_gpu.py 2>&1 | tail -15 > "$out/tests.txt"
timeout 100 python -m pytest -q -p no:cacheprovider tests/kernels/test_fused.py tests/serve/test_fusion.py \
  2>&1 | tail -6 >> "$out/tests.txt"
tail -6 "$out/tests.txt"
timeout 90 python benchmarks/bench_gemv.py --out "$out/gemv4" --ms 4 --budget-s 1 > "$out/gemv4.txt" 2>&1
grep "M=" "$out/gemv4.txt"
timeout 220 python benchmarks/bench_decode.py --batches 1,8,32,64 --out "$out/decode" > "$out/decode.txt" 2>&1
tail -16 "$out/decode.txt"
timeout 60 python benchmarks/bench_decode.py --models Llama-2-7B --batches 1 --no-fuse --out "$out/decode-nofuse" \
  > "$out/decode-nofuse.txt" 2>&1; tail -7 "$out/decode-nofuse.txt"
