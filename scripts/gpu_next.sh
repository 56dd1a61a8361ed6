#!/usr/bin/env bash
# Device calls (each under the 10-minute limit) that check and time a build on the GPU.
#   scripts/gpu_next.sh 1 OUT_DIR: every GPU test (-m gpu) of the kernels (~350 s on an H200), the
#     engine's GPU tests (fp32 against HF; W4 and W4+EC with programmatic dependent launch off,
#     "wait", "trigger" and "auto"; ~125 s) and check_pdl.py on graphs and in eager decode.
#   scripts/gpu_next.sh 2 OUT_DIR MODEL: the decode benchmark for one model shape (Llama-2-7B or
#     Llama-3-8B): FP16, W4, W4+EC and W4 with a W4 or a W8 output head at 1/8/32/64 sequences, for the
#     README table. One call per model: a full table of both did not fit one call (BENCHMARKS.md,
#     "Eleventh run"). Results tarred to OUT_DIR/decode-MODEL.tgz.
# Triton's compile cache is kept in the working tree (.triton-cache, ignored by git), which the
# device keeps between the calls of a session, so later calls do not compile again.
set -uo pipefail
part=${1:?usage: scripts/gpu_next.sh 1|2 OUT_DIR [MODEL]}
out=${2:?usage: scripts/gpu_next.sh 1|2 OUT_DIR [MODEL]}
mkdir -p "$out"
export PYTHONUNBUFFERED=1
export TRITON_CACHE_DIR="$PWD/.triton-cache"
case "$part" in
1)
  # -v names each test as it starts; faulthandler dumps the Python stacks of a test that runs past
  # 120 s (a compile or a synchronize), so a stall shows where it is
  timeout 400 python -m pytest -v -p no:cacheprovider -p no:logging -o faulthandler_timeout=120 -m gpu tests/kernels \
    --durations=5 > "$out/tests.txt" 2>&1
  grep -v PASSED "$out/tests.txt" | tail -30
  timeout 150 python -m pytest -v -p no:cacheprovider -p no:logging -o faulthandler_timeout=120 -m gpu \
    tests/serve/test_gpu.py > "$out/tests-engine.txt" 2>&1
  grep -v PASSED "$out/tests-engine.txt" | tail -20
  timeout 30 python benchmarks/check_pdl.py wait trigger 2>&1 | grep -E "^(trigger|wait)"
  timeout 30 python benchmarks/check_pdl.py wait trigger --no-graphs 2>&1 | grep -E "^(trigger|wait)" ;;
2)
  model=${3:?part 2 needs a model shape: Llama-2-7B or Llama-3-8B}
  timeout 560 python benchmarks/bench_decode.py --models "$model" --w4-head --w8-head --out "$out/decode-$model" \
    > "$out/decode-$model.txt" 2>&1
  grep -E "^\| Llama|^Llama|batch +1:| in [0-9.]+ s" "$out/decode-$model.txt"
  tar -C "$out" -czf "$out/decode-$model.tgz" "decode-$model" "decode-$model.txt" ;;
*) echo "part must be 1 or 2" >&2; exit 2 ;;
esac
