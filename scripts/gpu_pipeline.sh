#!/usr/bin/env bash
# Device calls (each under the 10-minute limit) for the K-major one-token loop with its weight loads
# pipelined through shared memory (Config.pipeline; BENCHMARKS.md, "Tenth run", item 4).
#   scripts/gpu_pipeline.sh sweep OUT_DIR: does this GPU's Triton pipeline the loop (the sm_90
#     compile check asserts cp.async), the loop's tests at real shapes, then bench_gemv.py over
#     pipeline 1-4 against the register prefetch at M = 1, 2, 4 (~5 min); writes
#     OUT_DIR/gemv/launch_table.json (the best launch per token class).
#   scripts/gpu_pipeline.sh engine OUT_DIR TABLE: the engine A/B at batch 1 (Llama-2-7B and
#     Llama-3-8B, W4 and W4+EC): built-in launches, TABLE, built-in again, so that drift shows
#     (~5 min). TABLE: the sweep's launch_table.json, or benchmarks/data/pipeline/table-pl3.json
#     (the built-in launches with a 3-stage pipeline instead of the register prefetch). Then
#     Llama-3-8B at 1 and 64 sequences with EngineConfig.pdl "off" and "auto" (~7 min in all).
set -uo pipefail
what=${1:?usage: scripts/gpu_pipeline.sh sweep|engine OUT_DIR [TABLE]}
out=${2:?usage: scripts/gpu_pipeline.sh sweep|engine OUT_DIR [TABLE]}
mkdir -p "$out"
export PYTHONUNBUFFERED=1
export TRITON_CACHE_DIR="$PWD/.triton-cache"  # kept between the calls of a session
case "$what" in
sweep)
  python -m tests.kernels._compile_check fp16 2>&1 | tail -3
  timeout 150 python -m pytest -v -p no:cacheprovider -p no:logging -o faulthandler_timeout=60 -m gpu \
    tests/kernels/test_kernels.py -k "ptx_decode_loop and True" > "$out/tests.txt" 2>&1
  grep -v PASSED "$out/tests.txt" | tail -20
  timeout 330 python benchmarks/bench_gemv.py --out "$out/gemv" --layouts kmajor --ms 1,2,4 --BN 64 \
    --num-warps 2,4 --programs 264,528,1056 --prefetch 0,1 --pipeline 1,2,3,4 --budget-s 270 2>&1 \
    | grep -v -i warn | tee "$out/gemv.txt" | grep "^M=" ;;
engine)
  table=${3:?engine needs a launch table (JSON)}
  for run in base table base2; do
    extra=()
    [ "$run" = table ] && extra=(--table "$table")
    timeout 120 python benchmarks/bench_decode.py --models Llama-2-7B,Llama-3-8B --batches 1 --no-fp16 \
      "${extra[@]}" --out "$out/$run" > "$out/$run.txt" 2>&1
    echo "== $run"; grep -E "^\| Llama|batch +1:" "$out/$run.txt"
  done
  # EngineConfig.pdl "auto" against "off" at 1 and 64 sequences (BENCHMARKS.md, "Tenth run", item 6)
  for pdl in off auto; do
    timeout 100 python benchmarks/bench_decode.py --models Llama-3-8B --batches 1,64 --no-fp16 --pdl "$pdl" \
      --out "$out/pdl-$pdl" > "$out/pdl-$pdl.txt" 2>&1
    echo "== pdl $pdl"; grep -E "^\| Llama|batch +(1|64):" "$out/pdl-$pdl.txt"
  done ;;
*) echo "first argument: sweep or engine" >&2; exit 2 ;;
esac
