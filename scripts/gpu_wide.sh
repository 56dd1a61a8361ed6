#!/usr/bin/env bash
# One device call (~8 min): the one-token launch for wide layers (LAUNCH["fma_kmajor_wide"]) in the
# engine at batch 1 (W4, W4+EC; Llama-2-7B, Llama-3-8B), without it / with it / without it
# (drift check), then the GPU tests of the op and of the engine.
#   scripts/gpu_wide.sh OUT_DIR
set -uo pipefail
out=${1:?usage: scripts/gpu_wide.sh OUT_DIR}
mkdir -p "$out"
export PYTHONUNBUFFERED=1
b1() {  # name [bench_decode args]
  local name=$1; shift
  timeout 90 python benchmarks/bench_decode.py --models Llama-2-7B,Llama-3-8B --batches 1 --no-fp16 \
    --out "$out/decode-$name" "$@" > "$out/decode-$name.txt" 2>&1
  echo "== $name"; grep -E "^\| Llama" "$out/decode-$name.txt"
}
b1 nowide-a --table benchmarks/data/wide-2026-11-30/table-nowide.json; b1 wide; \
  b1 nowide-b --table benchmarks/data/wide-2026-11-30/table-nowide.json
timeout 100 python -m pytest -q -p no:cacheprovider -p no:logging -m gpu tests/kernels/test_ops.py \
  tests/kernels/test_kernels.py -k "test_ops or wide_layer" 2>&1 | tail -3 | tee "$out/tests-ops.txt"
timeout 170 python -m pytest -q -p no:cacheprovider -p no:logging -m gpu tests/serve/test_gpu.py 2>&1 \
  | tail -3 | tee "$out/tests-serve.txt"
tar -C "$out" -czf "$out/wide.tgz" --exclude wide.tgz .
