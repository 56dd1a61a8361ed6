#!/usr/bin/env bash
# Device call (under the 10-minute limit) for what the last CPU work left to time.
#   scripts/gpu_next.sh ec OUT_DIR OLD_BUILD: GPU tests of the W4 kernels (fused EC at real shapes,
#     the PTX decode loop, SiLU·mul) and of the engine, then Llama-2-7B and Llama-3-8B batch 1
#     (W4, W4+EC) alternating the build before the shorter EC chain (OLD_BUILD: mkdir -p build/ab &&
#     git archive bfe811c spear benchmarks tests | tar -x -C build/ab, run with carry build/ab) and
#     this one, with programmatic dependent launch off and at "wait" (~8 min).
set -uo pipefail
part=${1:?usage: scripts/gpu_next.sh ec OUT_DIR OLD_BUILD}
out=${2:?usage: scripts/gpu_next.sh ec OUT_DIR OLD_BUILD}
mkdir -p "$out"
export PYTHONUNBUFFERED=1
b1() {  # name build extra-args...: Llama-2-7B and Llama-3-8B, batch 1, W4 and W4+EC in one process
  local name=$1 build=$2; shift 2
  timeout 110 python "$build/benchmarks/bench_decode.py" --models Llama-2-7B,Llama-3-8B --batches 1 --no-fp16 \
    --out "$out/decode-$name" "$@" > "$out/decode-$name.txt" 2>&1
  echo "== $name"; grep -E "^\| Llama" "$out/decode-$name.txt"
}
case "$part" in
ec)
  old=${3:?OLD_BUILD}
  { timeout 240 python -m pytest -q -p no:cacheprovider -m gpu tests/kernels/test_kernels.py \
      -k "real_shapes or ptx_decode or silu_mul" 2>&1 | tail -3
    timeout 100 python -m pytest -q -p no:cacheprovider -m gpu tests/serve/test_gpu.py 2>&1 \
      | grep -E "passed|failed|Error" | tail -8; } > "$out/tests.txt"
  cat "$out/tests.txt"
  grep -q failed "$out/tests.txt" && exit 1
  b1 old-off-1 "$old"; b1 new-off-1 .; b1 old-wait-1 "$old" --pdl wait; b1 new-wait-1 . --pdl wait
  b1 new-off-2 .; b1 old-off-2 "$old"; b1 new-wait-2 . --pdl wait ;;
*) echo "part must be ec" >&2; exit 2 ;;
esac
