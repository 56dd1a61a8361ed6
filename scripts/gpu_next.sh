#!/usr/bin/env bash
# Device calls (each under the 10-minute limit) for what the last CPU work left to time.
#   scripts/gpu_next.sh 1 OUT_DIR: GPU tests of the kernels and the engine, then the full decode
#     benchmark (FP16, W4, W4+EC at 1/8/32/64 sequences) for the README table (~8 min);
#   scripts/gpu_next.sh 2 OUT_DIR: Llama-2-7B batch 1 with the attention's context splits off at
#     short contexts, and without the narrow-layer one-token launch (A/Bs against part 1), then
#     programmatic dependent launch off / "wait" alternated twice, then bench_kernels.py --quick
#     (the kernel-floor rows) (~9 min);
#   scripts/gpu_next.sh 3 OUT_DIR [OLD_BUILD]: the W4 op as dispatched at M = 1..16; whether the
#     engine's output is right under PDL at the "trigger" level now that the W4 loop loads
#     activations coherently there; Llama-2-7B batch 1 with PDL off / trigger / wait; with
#     OLD_BUILD (mkdir -p build/ab && git archive c536587 spear benchmarks tests | tar -x -C build/ab,
#     run with carry build/ab), batch 1 before / after the gate-weight prefetch (~9 min).
set -uo pipefail
part=${1:?usage: scripts/gpu_next.sh 1|2|3 OUT_DIR [OLD_BUILD]}
out=${2:?usage: scripts/gpu_next.sh 1|2|3 OUT_DIR}
mkdir -p "$out"
export PYTHONUNBUFFERED=1
b1() {  # name extra-args...: Llama-2-7B, batch 1, W4 and W4+EC in one process
  local name=$1; shift
  timeout 100 python benchmarks/bench_decode.py --models Llama-2-7B --batches 1 --no-fp16 \
    --out "$out/decode-$name" "$@" > "$out/decode-$name.txt" 2>&1
  echo "== $name"; grep -E "^\| Llama" "$out/decode-$name.txt"
}
case "$part" in
1)
  { timeout 150 python -m pytest -q -x -p no:cacheprovider -m gpu tests/kernels/test_kernels.py \
      tests/kernels/test_attention.py -k "real_shapes_kmajor or silu_mul or attention" 2>&1 | tail -2
    timeout 90 python -m pytest -q -p no:cacheprovider -m gpu tests/serve/test_gpu.py 2>&1 \
      | grep -E "passed|failed|Error" | tail -8; } > "$out/tests.txt"
  cat "$out/tests.txt"
  grep -q failed "$out/tests.txt" && exit 1
  timeout 330 python benchmarks/bench_decode.py --out "$out/decode" > "$out/decode.txt" 2>&1
  grep -E "^\| Llama" "$out/decode.txt"
  tar -C "$out" -czf "$out/decode.tgz" decode ;;
2)
  b1 nosplit --attn-min-split-tiles 1000
  echo '{"fma_kmajor_narrow": null}' > "$out/narrow-off.json"
  b1 narrow-off --table "$out/narrow-off.json"
  b1 pdl-off-1; b1 pdl-wait-1 --pdl wait; b1 pdl-off-2; b1 pdl-wait-2 --pdl wait
  timeout 200 python benchmarks/bench_kernels.py --quick --budget-s 170 --out "$out/kernels" > "$out/kernels.txt" 2>&1
  tail -30 "$out/kernels.txt"
  tar -C "$out" -czf "$out/part2.tgz" kernels decode-* ;;
3)
  timeout 60 python benchmarks/bench_gemv.py --out "$out/gemv" --layouts kmajor --quick --all-shapes \
    --ms 1,2,3,4,8,16 > "$out/gemv.txt" 2>&1
  grep -E "median" "$out/gemv.txt"
  # "trigger" with coherent activation loads in the W4 loop (was ld.global.nc): every token
  # within 0.05 of the reference now? Then time it against off and wait
  timeout 60 python benchmarks/check_pdl.py trigger wait 2>&1 | grep -E "^(trigger|wait)"
  b1 pdl-off-3; b1 pdl-trigger --pdl trigger; b1 pdl-wait-3 --pdl wait
  # the gate's weights loaded before the u programs' arrival: A/B against the build before it
  if [ -n "${3:-}" ]; then
    timeout 100 python "$3/benchmarks/bench_decode.py" --models Llama-2-7B,Llama-3-8B --batches 1 --no-fp16 \
      --out "$out/decode-gate-before" > "$out/decode-gate-before.txt" 2>&1
    timeout 100 python benchmarks/bench_decode.py --models Llama-2-7B,Llama-3-8B --batches 1 --no-fp16 \
      --out "$out/decode-gate-after" > "$out/decode-gate-after.txt" 2>&1
    for v in before after; do echo "== gate weights $v"; grep -E "^\| Llama" "$out/decode-gate-$v.txt"; done
  fi
  tar -C "$out" -czf "$out/part3.tgz" gemv decode-* ;;
*) echo "part must be 1, 2 or 3" >&2; exit 2 ;;
esac
