#!/usr/bin/env bash
# Two device calls (each under the 10-minute limit) for what the last CPU work left to time.
#   scripts/gpu_next.sh 1 OUT_DIR: GPU tests of the kernels and the engine, then the full decode
#     benchmark (FP16, W4, W4+EC at 1/8/32/64 sequences) for the README table (~7 min);
#   scripts/gpu_next.sh 2 OUT_DIR: bench_kernels.py --quick (the kernel-floor rows), the W4 op as
#     dispatched at M = 1..16, and which pair of decode kernels breaks the engine's output under
#     programmatic dependent launch at the "trigger" level (~6 min).
set -uo pipefail
part=${1:?usage: scripts/gpu_next.sh 1|2 OUT_DIR}
out=${2:?usage: scripts/gpu_next.sh 1|2 OUT_DIR}
mkdir -p "$out"
export PYTHONUNBUFFERED=1
if [ "$part" = 1 ]; then
  { timeout 150 python -m pytest -q -x -p no:cacheprovider -m gpu tests/kernels/test_kernels.py \
      -k "real_shapes_kmajor or silu_mul" 2>&1 | tail -2
    timeout 90 python -m pytest -q -p no:cacheprovider -m gpu tests/serve/test_gpu.py 2>&1 \
      | grep -E "passed|failed|Error" | tail -8; } > "$out/tests.txt"
  cat "$out/tests.txt"
  grep -q failed "$out/tests.txt" && exit 1
  timeout 330 python benchmarks/bench_decode.py --out "$out/decode" > "$out/decode.txt" 2>&1
  grep -E "^\| Llama" "$out/decode.txt"
  tar -C "$out" -czf "$out/decode.tgz" decode
else
  timeout 250 python benchmarks/bench_kernels.py --quick --budget-s 220 --out "$out/kernels" > "$out/kernels.txt" 2>&1
  tail -30 "$out/kernels.txt"
  timeout 60 python benchmarks/bench_gemv.py --out "$out/gemv" --layouts kmajor --quick --all-shapes \
    --ms 1,2,3,4,8,16 > "$out/gemv.txt" 2>&1
  grep -E "median" "$out/gemv.txt"
  for only in w4a16.py,_launch_norm w4a16.py,rope_write_kv _launch_norm,rope_write_kv; do
    timeout 40 python benchmarks/check_pdl.py trigger --only "$only" 2>&1 | grep -E "^trigger"
  done
  tar -C "$out" -czf "$out/kernels.tgz" kernels gemv
fi
