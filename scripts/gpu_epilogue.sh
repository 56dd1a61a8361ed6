#!/usr/bin/env bash
# The fused EC's epilogue at decode (B v by FMAs, relaxed done counter) against the previous
# build in build/ab (`git archive` of the earlier commit): GPU tests, then the engine's batch-1
# decode (W4, W4+EC; no FP16) of both builds on one machine.
#   usage: scripts/gpu_epilogue.sh OUT_DIR
set -uo pipefail
out=${1:?usage: scripts/gpu_epilogue.sh OUT_DIR}
mkdir -p "$out"
export PYTHONUNBUFFERED=1
{ timeout 150 python -m pytest -q -x -p no:cacheprovider -m gpu tests/kernels/test_kernels.py \
    -k "ptx_decode_loop and True" 2>&1 | tail -2
  timeout 60 python -m pytest -q -p no:cacheprovider -m gpu tests/serve/test_gpu.py 2>&1 | tail -1; } > "$out/tests.txt"
cat "$out/tests.txt"
grep -q failed "$out/tests.txt" && exit 1
for build in new old; do
  root=.
  [ $build = old ] && root=build/ab
  timeout 110 python $root/benchmarks/bench_decode.py --batches 1 --no-fp16 --out "$out/decode-$build" \
    > "$out/decode-$build.txt" 2>&1
  echo "== $build"; grep -E "^\| Llama" "$out/decode-$build.txt"
done
