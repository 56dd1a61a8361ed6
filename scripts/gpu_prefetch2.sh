#!/usr/bin/env bash
# One device call (~9 min): does a second step of register prefetch in the K-major one-token
# loop (PREFETCH = 2) pay?
#   1. the engine at batch 1 (W4, W4+EC; Llama-2-7B and Llama-3-8B) with the committed launch
#      table, then with the same launches at prefetch depth 2 (benchmarks/data/prefetch2/
#      table-pf2.json), then the committed table again (drift check);
#   2. the GPU tests of the PTX loop (depths 0, 1, 2; plain and fused EC) and of the op;
#   3. bench_gemv.py's sweep of the loop at M = 1, 2 over warps, programs and depth 1 / 2.
#   scripts/gpu_prefetch2.sh OUT_DIR
set -uo pipefail
out=${1:?usage: scripts/gpu_prefetch2.sh OUT_DIR}
mkdir -p "$out"
export PYTHONUNBUFFERED=1
b1() {  # name [table]
  local name=$1; shift
  timeout 90 python benchmarks/bench_decode.py --models Llama-2-7B,Llama-3-8B --batches 1 --no-fp16 \
    --out "$out/decode-$name" "$@" > "$out/decode-$name.txt" 2>&1
  echo "== $name"; grep -E "^\| Llama" "$out/decode-$name.txt"
}
b1 pf1-a; b1 pf2 --table benchmarks/data/prefetch2/table-pf2.json; b1 pf1-b
timeout 150 python -m pytest -q -p no:cacheprovider -p no:logging -m gpu tests/kernels/test_kernels.py \
  tests/kernels/test_ops.py -k "ptx_decode_loop or test_ops" 2>&1 | tail -4 | tee "$out/tests.txt"
timeout 200 python benchmarks/bench_gemv.py --out "$out/gemv" --layouts kmajor --ms 1,2 --BN 64 \
  --num-warps 2,4 --programs 264,528,1056 --prefetch 1,2 --num-stages 1 --budget-s 150 > "$out/gemv.txt" 2>&1
tail -12 "$out/gemv.txt"
tar -C "$out" -czf "$out/prefetch2.tgz" .
