#!/usr/bin/env bash
# The fused EC's u programs (register prefetch of the A tiles) at several caps on their number:
# GPU tests of the fused K-major decode loop, then the engine's batch-1 decode (W4 and W4+EC,
# no FP16 run) per cap.
#   usage: scripts/gpu_usplit.sh OUT_DIR [CAPS, default "8 16 32"]
set -uo pipefail
out=${1:?usage: scripts/gpu_usplit.sh OUT_DIR [CAPS]}
caps=${2:-8 16 32}
mkdir -p "$out"
export PYTHONUNBUFFERED=1
{ timeout 150 python -m pytest -q -x -p no:cacheprovider -m gpu tests/kernels/test_kernels.py \
    -k "ptx_decode_loop and True" 2>&1 | tail -3
  timeout 60 python -m pytest -q -p no:cacheprovider -m gpu tests/serve/test_gpu.py 2>&1 | tail -2; } > "$out/tests.txt"
cat "$out/tests.txt"
for u in $caps; do
  timeout 150 python benchmarks/bench_decode.py --batches 1 --no-fp16 --u-split-max "$u" --out "$out/decode-u$u" \
    > "$out/decode-u$u.txt" 2>&1
  echo "== u programs <= $u"; grep -E "^\| Llama" "$out/decode-u$u.txt"
done
