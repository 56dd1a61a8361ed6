#!/usr/bin/env bash
# One device call for the changes prepared on the CPU: GPU tests of the SiLU·mul epilogue, the
# word-pair loops and the engine (with and without programmatic dependent launch), then the
# engine's batch-1 decode: the previous build, this build, this build with --pdl; then the
# one-token GEMV sweep over num_stages x register prefetch.
#   usage: scripts/gpu_next.sh OUT_DIR OLD_BUILD
#   OLD_BUILD: the previous commit's spear, benchmarks and tests, e.g.
#     mkdir -p build/ab && git archive 71f36eb spear benchmarks tests | tar -x -C build/ab
set -uo pipefail
out=${1:?usage: scripts/gpu_next.sh OUT_DIR OLD_BUILD}
old=${2:?usage: scripts/gpu_next.sh OUT_DIR OLD_BUILD}
mkdir -p "$out"
export PYTHONUNBUFFERED=1
{ timeout 200 python -m pytest -q -x -p no:cacheprovider -m gpu tests/kernels/test_kernels.py \
    -k "silu_mul or ptx_decode_loop" 2>&1 | tail -2
  timeout 120 python -m pytest -q -p no:cacheprovider -m gpu tests/serve/test_gpu.py 2>&1 | tail -2; } > "$out/tests.txt"
cat "$out/tests.txt"
grep -q failed "$out/tests.txt" && exit 1
run() {  # name root extra-args...
  local name=$1 root=$2; shift 2
  timeout 110 python "$root/benchmarks/bench_decode.py" --batches 1 --no-fp16 --out "$out/decode-$name" "$@" \
    > "$out/decode-$name.txt" 2>&1
  echo "== $name"; grep -E "^\| Llama" "$out/decode-$name.txt"
}
run old "$old"
run new .
run new-pdl . --pdl
timeout 200 python benchmarks/bench_gemv.py --out "$out/gemv" --layouts kmajor --ms 1,2,4 --BN 64 --num-warps 2,4 \
  --programs 264,528 --prefetch 0,1 --num-stages 1,2,3 --budget-s 180 > "$out/gemv.txt" 2>&1
grep -E "M=|launch table" "$out/gemv.txt"
