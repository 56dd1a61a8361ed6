#!/usr/bin/env bash
# Two device calls (each under the 10-minute limit) for what the last CPU work left to time.
#   scripts/gpu_next.sh 1 OUT_DIR: GPU tests of the kernels and the engine, then the full decode
#     benchmark (FP16, W4, W4+EC at 1/8/32/64 sequences) for the README table (~8 min);
#   scripts/gpu_next.sh 2 OUT_DIR: batch 1 with the attention's context splits off at short
#     contexts (the A/B against part 1), bench_kernels.py --quick (the kernel-floor rows), the W4 op as
#     dispatched at M = 1..16, and which pair of decode kernels breaks the engine's output under
#     programmatic dependent launch at the "trigger" level (~9 min).
set -uo pipefail
part=${1:?usage: scripts/gpu_next.sh 1|2 OUT_DIR}
out=${2:?usage: scripts/gpu_next.sh 1|2 OUT_DIR}
mkdir -p "$out"
export PYTHONUNBUFFERED=1
if [ "$part" = 1 ]; then
  { timeout 150 python -m pytest -q -x -p no:cacheprovider -m gpu tests/kernels/test_kernels.py \
      tests/kernels/test_attention.py -k "real_shapes_kmajor or silu_mul or attention" 2>&1 | tail -2
    timeout 90 python -m pytest -q -p no:cacheprovider -m gpu tests/serve/test_gpu.py 2>&1 \
      | grep -E "passed|failed|Error" | tail -8; } > "$out/tests.txt"
  cat "$out/tests.txt"
  grep -q failed "$out/tests.txt" && exit 1
  timeout 330 python benchmarks/bench_decode.py --out "$out/decode" > "$out/decode.txt" 2>&1
  grep -E "^\| Llama" "$out/decode.txt"
  tar -C "$out" -czf "$out/decode.tgz" decode
else
  # attention split by each sequence's own context (default) against no split at short contexts;
  # compare with part 1's batch-1 rows
  timeout 110 python benchmarks/bench_decode.py --batches 1 --no-fp16 --attn-min-split-tiles 1000 \
    --out "$out/decode-nosplit" > "$out/decode-nosplit.txt" 2>&1
  echo "== one split per short context"; grep -E "^\| Llama" "$out/decode-nosplit.txt"
  timeout 200 python benchmarks/bench_kernels.py --quick --budget-s 170 --out "$out/kernels" > "$out/kernels.txt" 2>&1
  tail -30 "$out/kernels.txt"
  timeout 60 python benchmarks/bench_gemv.py --out "$out/gemv" --layouts kmajor --quick --all-shapes \
    --ms 1,2,3,4,8,16 > "$out/gemv.txt" 2>&1
  grep -E "median" "$out/gemv.txt"
  for only in w4a16.py,_launch_norm w4a16.py,rope_write_kv _launch_norm,rope_write_kv; do
    timeout 40 python benchmarks/check_pdl.py trigger --only "$only" 2>&1 | grep -E "^trigger"
  done
  tar -C "$out" -czf "$out/kernels.tgz" kernels gemv decode-nosplit
fi
