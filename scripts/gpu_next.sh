#!/usr/bin/env bash
# Device calls (each under the 10-minute limit) that check and time a build on the GPU.
#   scripts/gpu_next.sh 1 OUT_DIR: every GPU test (-m gpu) of the kernels (~330 s on an H200).
#   scripts/gpu_next.sh 2 OUT_DIR: the engine's GPU tests (fp32 against HF; W4 and W4+EC with
#     programmatic dependent launch off, "wait" and "trigger"), check_pdl.py on graphs and in
#     eager decode, then the full decode benchmark (FP16, W4, W4+EC, W4 with a W4 output head at
#     1/8/32/64 sequences) for
#     the README table (~7 min). Results tarred to OUT_DIR/decode.tgz (a call returns 8 files).
set -uo pipefail
part=${1:?usage: scripts/gpu_next.sh 1|2 OUT_DIR}
out=${2:?usage: scripts/gpu_next.sh 1|2 OUT_DIR}
mkdir -p "$out"
export PYTHONUNBUFFERED=1
case "$part" in
1)
  # -v names each test as it starts; faulthandler dumps the Python stacks of a test that runs past
  # 120 s (a compile or a synchronize), so a stall shows where it is
  timeout 500 python -m pytest -v -p no:cacheprovider -p no:logging -o faulthandler_timeout=120 -m gpu tests/kernels \
    --durations=5 > "$out/tests.txt" 2>&1
  grep -v PASSED "$out/tests.txt" | tail -60 ;;
2)
  timeout 170 python -m pytest -v -p no:cacheprovider -p no:logging -o faulthandler_timeout=120 -m gpu \
    tests/serve/test_gpu.py > "$out/tests.txt" 2>&1
  grep -v PASSED "$out/tests.txt" | tail -40
  timeout 50 python benchmarks/check_pdl.py wait trigger 2>&1 | grep -E "^(trigger|wait)"
  timeout 50 python benchmarks/check_pdl.py wait trigger --no-graphs 2>&1 | grep -E "^(trigger|wait)"
  timeout 330 python benchmarks/bench_decode.py --w4-head --out "$out/decode" > "$out/decode.txt" 2>&1
  grep -E "^\| Llama|^Llama|batch +1:" "$out/decode.txt"
  tar -C "$out" -czf "$out/decode.tgz" decode decode.txt tests.txt ;;
*) echo "part must be 1 or 2" >&2; exit 2 ;;
esac
