#!/usr/bin/env bash
# Device calls (each under the 10-minute limit) for what the last CPU work left to check and time.
#   scripts/gpu_next.sh 1 OUT_DIR: every GPU test (-m gpu) of the kernels and the engine on this
#     build (the fused EC now runs on each tile's last split: determinism at real shapes, the
#     engine against fp32 HF), then whether the engine's tokens are right with programmatic
#     dependent launch at "wait" and "trigger" in eager decode as well as with CUDA graphs (~7 min);
#   scripts/gpu_next.sh 2 OUT_DIR: the full decode benchmark (FP16, W4, W4+EC at 1/8/32/64
#     sequences) for the README table, then W4 / W4+EC at batch 1 with PDL "wait", then with the
#     fused EC in programs of its own (LAUNCH["ec_tiles"] 1, 2, 4; 0, the default, runs it on
#     each tile's last split) (~8 min).
set -uo pipefail
part=${1:?usage: scripts/gpu_next.sh 1|2 OUT_DIR}
out=${2:?usage: scripts/gpu_next.sh 1|2 OUT_DIR}
mkdir -p "$out"
export PYTHONUNBUFFERED=1
case "$part" in
1)
  { timeout 330 python -m pytest -q -p no:cacheprovider -m gpu tests/kernels 2>&1 | tail -3
    timeout 100 python -m pytest -q -p no:cacheprovider -m gpu tests/serve/test_gpu.py 2>&1 \
      | grep -E "passed|failed|Error" | tail -8; } > "$out/tests.txt"
  cat "$out/tests.txt"
  timeout 50 python benchmarks/check_pdl.py wait trigger 2>&1 | grep -E "^(trigger|wait)"
  timeout 50 python benchmarks/check_pdl.py wait trigger --no-graphs 2>&1 | grep -E "^(trigger|wait)" ;;
2)
  timeout 330 python benchmarks/bench_decode.py --out "$out/decode" > "$out/decode.txt" 2>&1
  grep -E "^\| Llama" "$out/decode.txt"
  timeout 100 python benchmarks/bench_decode.py --models Llama-2-7B,Llama-3-8B --batches 1 --no-fp16 --pdl wait \
    --out "$out/decode-wait" > "$out/decode-wait.txt" 2>&1
  grep -E "^\| Llama" "$out/decode-wait.txt"
  for t in 1 2 4 0; do
    echo "{\"ec_tiles\": $t}" > "$out/ec$t.json"
    timeout 100 python benchmarks/bench_decode.py --models Llama-2-7B,Llama-3-8B --batches 1 --no-fp16 \
      --table "$out/ec$t.json" --out "$out/decode-ec$t" > "$out/decode-ec$t.txt" 2>&1
    echo "== ec_tiles $t"; grep -E "^\| Llama" "$out/decode-ec$t.txt"
  done
  tar -C "$out" -czf "$out/decode.tgz" decode decode-wait decode-ec1 decode-ec2 decode-ec4 decode-ec0 ;;
*) echo "part must be 1 or 2" >&2; exit 2 ;;
esac
