#!/usr/bin/env bash
# One device call (~4 min): Llama-2-7B and Llama-3-8B at batch 1 (W4 and W4+EC, one process per
# run), alternating an older build and this one (old, new, new, old) so that drift between runs
# shows, then the K-major GPU tests of the W4 op (fused EC included) on this build.
#   scripts/gpu_ab_decode.sh OUT_DIR OLD_BUILD [bench_decode.py args...]
# OLD_BUILD: mkdir -p build/ab && git archive REV spear benchmarks tests | tar -x -C build/ab,
# passed to the device with carry build/ab.
set -uo pipefail
out=${1:?usage: scripts/gpu_ab_decode.sh OUT_DIR OLD_BUILD [bench_decode args]}
old=${2:?usage: scripts/gpu_ab_decode.sh OUT_DIR OLD_BUILD [bench_decode args]}
shift 2
extra=("$@")
mkdir -p "$out"
export PYTHONUNBUFFERED=1
b1() {  # name build: batch 1, W4 and W4+EC
  local name=$1 build=$2
  timeout 80 python "$build/benchmarks/bench_decode.py" --models Llama-2-7B,Llama-3-8B --batches 1 --no-fp16 \
    --out "$out/decode-$name" "${extra[@]}" > "$out/decode-$name.txt" 2>&1
  echo "== $name"; grep -E "^\| Llama" "$out/decode-$name.txt"
}
b1 old-1 "$old"; b1 new-1 .; b1 new-2 .; b1 old-2 "$old"
timeout 200 python -m pytest -q -p no:cacheprovider -m gpu tests/kernels/test_kernels.py \
  -k "real_shapes_kmajor or (ptx_decode and 4096-4096)" 2>&1 | tail -3
