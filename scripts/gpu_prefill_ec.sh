#!/usr/bin/env bash
# One device call (~5 min): the semi-fused EC at prefill sizes with ops.PREFILL_EC "ec_up" (the EC
# added after the GEMM by a kernel of its own) against "addmm" (alpha · v Bᵀ computed beside the
# dequantize pass, added by cuBLAS in the GEMM's epilogue; BENCHMARKS.md, "Tenth run", item 7):
# the op's GPU tests of both, then bench_kernels.py on the Llama-2-7B / Llama-3-8B shapes.
#   scripts/gpu_prefill_ec.sh OUT_DIR
set -uo pipefail
out=${1:?usage: scripts/gpu_prefill_ec.sh OUT_DIR}
mkdir -p "$out"
export PYTHONUNBUFFERED=1
timeout 120 python -m pytest -v -p no:cacheprovider -p no:logging -o faulthandler_timeout=60 -m gpu \
  tests/kernels/test_ops.py -k "dispatch or graph_replay" > "$out/tests.txt" 2>&1
grep -v PASSED "$out/tests.txt" | tail -20
for mode in ec_up addmm; do
  timeout 150 python benchmarks/bench_kernels.py --models Llama-2-7B,Llama-3-8B --ms 512,2048,4096 --ranks 16,32 \
    --prefill-ec "$mode" --budget-s 120 --out "$out/$mode" > "$out/$mode.txt" 2>&1
  echo "== $mode"; grep -E "M= " "$out/$mode.txt" | head -30
done
