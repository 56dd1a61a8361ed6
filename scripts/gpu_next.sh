#!/usr/bin/env bash
# Device calls (each under the 10-minute limit) that check and time a build on the GPU.
#   scripts/gpu_next.sh 1 OUT_DIR: every GPU test (-m gpu) of the kernels but the W8 ones (~360 s on
#     an H200) and the engine's GPU tests (fp32 against HF; W4 and W4+EC with programmatic
#     dependent launch off, "wait", "trigger" and "auto"; the W8 head; ~150 s).
#   scripts/gpu_next.sh 2 OUT_DIR MODEL: the decode benchmark for one model shape (Llama-2-7B or
#     Llama-3-8B): FP16, W4, W4+EC and W4 with a W4 or a W8 output head at 1/8/32/64 sequences, for the
#     README table. One call per model: a full table of both did not fit one call (BENCHMARKS.md,
#     "Eleventh run"). Results tarred to OUT_DIR/decode-MODEL.tgz.
#   scripts/gpu_next.sh 3 OUT_DIR: the W8A16 head kernel's GPU tests, check_pdl.py on graphs and in
#     eager decode, then benchmarks/bench_w8.py --sweep (against cuBLAS fp16 at the Llama-2-7B /
#     Llama-3-8B head shapes; its best launches).
#   scripts/gpu_next.sh 4 OUT_DIR: ec_gate split over K against the single pass (--gate-programs 0):
#     bench_kernels.py at 64 / 512 / 2048 tokens with a per-kernel profile of the EC call, then
#     Llama-3-8B W4 / W4+EC decode at 1 and 64 sequences.
#   scripts/gpu_next.sh 5 OUT_DIR: the fused EC's hang check: Llama-3-8B W4+EC decode at batch 1 in
#     fresh processes (45 s each, 90 s for a tree's first), on this tree and on a copy without the
#     barrier before the last u program re-arms its counters (_ec_programs.py); without it 5 of 8
#     processes stalled on 2026-12-01.
#   scripts/gpu_next.sh 6 OUT_DIR: the prefill EC inside the cuBLAS GEMM (ops.PREFILL_EC "out": A
#     stacked under W_hat; "in": [x, v] against [W_hat, alpha B]) against ec_gate on a side stream
#     ("side"): their GPU tests, then bench_kernels.py at 512 / 2048 tokens, rank 32, with a
#     per-kernel profile of the EC call, once per mode.
#   scripts/gpu_next.sh 7 OUT_DIR: decode A/Bs on Llama-3-8B W4 / W4+EC at 1, 32 and 64 sequences:
#     the defaults against the rotary in its own launch (--no-rope-in-attention) and against the
#     fused EC only up to 16 sequences (--fused-max-m 16), the settings before 2026-12-01.
#   scripts/gpu_next.sh 8 OUT_DIR: parts 1 and 5 in one call: the GPU tests of part 1 in four
#     processes at once (the compiles spread over the CPU cores), then the hang check with 4 runs of
#     this tree and 3 of the copy without the barrier.
#   scripts/gpu_next.sh 9 OUT_DIR: part 6's timings without its tests, then bench_kernels.py --tune
#     --tune-kinds tc_wide (the 17-64-token launch); its launch_table.json is also kept in
#     .triton-cache/tune-wide/ for part 7 of the same session.
#   scripts/gpu_next.sh 10 OUT_DIR: the op's GPU tests, benchmarks/diag_rope_attention.py (where the rotary inside the
#     attention kernel and rope_write_kv disagree, for two head shapes), then a per-kernel profile
#     of Llama-3-8B's W4 and W4+EC (rank 16) layers at 8-64 tokens.
#   scripts/gpu_next.sh 11 OUT_DIR: the engine's GPU tests (now with the rotary inside the attention
#     kernel, the default since 2026-12-01), then Llama-3-8B W4 / W4+EC decode at 1, 4, 8, 16 and 32
#     sequences with a per-kernel profile at 8 and 32 (W4+EC costs +14-16% over W4 at 8-16
#     sequences, +5% at 32), and the same with 16 u programs at 5-16 tokens (a table whose "tc"
#     entry has u_split 16): there the fused launch has 512 W programs + 32 u programs against 528
#     resident slots (4 per SM by registers, benchmarks/kernel_registers.py), so 16 programs run
#     in a second wave; 16 u programs fit one.
#   Part 7 adds an arm with that table (--table) when it is there.
# Triton's compile cache is kept in the working tree (.triton-cache, ignored by git), which the
# device keeps between the calls of a session, so later calls do not compile again.
set -uo pipefail
usage="usage: scripts/gpu_next.sh 1-11 OUT_DIR [MODEL]"
part=${1:?$usage}
out=${2:?$usage}
mkdir -p "$out"
export PYTHONUNBUFFERED=1
export TRITON_CACHE_DIR="$PWD/.triton-cache"
case "$part" in
1)
  # -v names each test as it starts; faulthandler dumps the Python stacks of a test that runs past
  # 120 s (a compile or a synchronize), so a stall shows where it is
  timeout 440 python -m pytest -v -p no:cacheprovider -p no:logging -o faulthandler_timeout=120 -m gpu tests/kernels \
    --ignore=tests/kernels/test_w8a16.py --durations=5 > "$out/tests.txt" 2>&1
  grep -v PASSED "$out/tests.txt" | tail -30
  timeout 150 python -m pytest -v -p no:cacheprovider -p no:logging -o faulthandler_timeout=120 -m gpu \
    tests/serve/test_gpu.py > "$out/tests-engine.txt" 2>&1
  grep -v PASSED "$out/tests-engine.txt" | tail -20 ;;
2)
  model=${3:?part 2 needs a model shape: Llama-2-7B or Llama-3-8B}
  timeout 560 python benchmarks/bench_decode.py --models "$model" --w4-head --w8-head --out "$out/decode-$model" \
    > "$out/decode-$model.txt" 2>&1
  grep -E "^\| Llama|^Llama|batch +1:| in [0-9.]+ s" "$out/decode-$model.txt"
  tar -C "$out" -czf "$out/decode-$model.tgz" "decode-$model" "decode-$model.txt" ;;
3)
  timeout 200 python -m pytest -v -p no:cacheprovider -p no:logging -o faulthandler_timeout=120 -m gpu \
    tests/kernels/test_w8a16.py > "$out/tests-w8.txt" 2>&1
  grep -v PASSED "$out/tests-w8.txt" | tail -20
  timeout 30 python benchmarks/check_pdl.py wait trigger 2>&1 | grep -E "^(trigger|wait)"
  timeout 30 python benchmarks/check_pdl.py wait trigger --no-graphs 2>&1 | grep -E "^(trigger|wait)"
  timeout 330 python benchmarks/bench_w8.py --out "$out/w8" --sweep --budget-s 240 > "$out/w8.txt" 2>&1
  grep -v -i warn "$out/w8.txt" | tail -40 ;;
4)
  for gp in 0 264; do
    timeout 170 python benchmarks/bench_kernels.py --out "$out/kernels-gp$gp" --models Llama-2-7B,Llama-3-8B \
      --ms 64,512,2048 --ranks 32 --gate-programs $gp --profile "ec r32" --budget-s 130 > "$out/kernels-gp$gp.txt" 2>&1
    echo "== ec_gate programs $gp"; grep -E "^Llama|ec r32 at" "$out/kernels-gp$gp.txt"
  done
  for gp in 0 264; do
    timeout 110 python benchmarks/bench_decode.py --models Llama-3-8B --batches 1,64 --no-fp16 --gate-programs $gp \
      --out "$out/decode-gp$gp" > "$out/decode-gp$gp.txt" 2>&1
    echo "== decode, ec_gate programs $gp"; grep -E "^\| Llama|batch +(1|64):| in [0-9.]+ s" "$out/decode-gp$gp.txt"
  done ;;
5|8)
  if [ "$part" = 8 ]; then
    gpu_tests() { timeout 300 python -m pytest -v -p no:cacheprovider -p no:logging -o faulthandler_timeout=150 -m gpu "$@"; }
    gpu_tests tests/kernels/test_kernels.py > "$out/tests-kernels.txt" 2>&1 &
    gpu_tests tests/kernels/test_attention.py > "$out/tests-attention.txt" 2>&1 &
    gpu_tests tests/kernels/test_ops.py tests/kernels/test_prefill_ec.py tests/kernels/test_tune.py \
      > "$out/tests-ops.txt" 2>&1 &
    gpu_tests tests/serve/test_gpu.py > "$out/tests-engine.txt" 2>&1 &
    wait
    for f in "$out"/tests-*.txt; do echo "== $f"; grep -v PASSED "$f" | tail -12; done
    runs_current=4; runs_nobarrier=3
  else
    runs_current=6; runs_nobarrier=4
  fi
  rm -rf /tmp/nobarrier && mkdir -p /tmp/nobarrier && cp -r spear benchmarks /tmp/nobarrier/
  python - <<'PY'
from pathlib import Path
f = Path("/tmp/nobarrier/spear/kernels/_ec_programs.py")
t = f.read_text()
old = "            tl.debug_barrier()\n            tl.store(u_lock, 0)"
assert t.count(old) == 1, "the re-arm's barrier moved: update gpu_next.sh part 5"
f.write_text(t.replace(old, "            tl.store(u_lock, 0)"))
PY
  for tree in . /tmp/nobarrier; do
    n=$([ "$tree" = . ] && echo $runs_current || echo $runs_nobarrier); name=$([ "$tree" = . ] && echo current || echo nobarrier)
    for i in $(seq "$n"); do
      # the first run of a tree may compile its kernels: a longer limit
      timeout -s KILL $([ "$i" = 1 ] && echo 90 || echo 45) python "$tree/benchmarks/bench_decode.py" --models Llama-3-8B --batches 1 --no-fp16 \
        --out "$out/hang" > "$out/hang-$name-$i.txt" 2>&1
      if grep -q "w4+ec  *batch   1:" "$out/hang-$name-$i.txt"; then r=completed; else r=STALLED; fi
      echo "$name run $i: W4+EC batch 1 $r"
    done
  done ;;
6|9)
  if [ "$part" = 6 ]; then
    timeout 150 python -m pytest -v -p no:cacheprovider -p no:logging -o faulthandler_timeout=60 -m gpu \
      tests/kernels/test_prefill_ec.py > "$out/tests-prefill-ec.txt" 2>&1
    grep -v PASSED "$out/tests-prefill-ec.txt" | tail -15
  fi
  for mode in side out in; do
    timeout 120 python benchmarks/bench_kernels.py --out "$out/kernels-$mode" --models Llama-2-7B,Llama-3-8B \
      --ms 512,2048 --ranks 32 --prefill-ec $mode --profile "ec r32" --budget-s 90 > "$out/kernels-$mode.txt" 2>&1
    echo "== prefill EC $mode"; grep -E "^Llama|ec r32 at" "$out/kernels-$mode.txt"
  done
  if [ "$part" = 9 ]; then
    timeout 250 python benchmarks/bench_kernels.py --out "$out/tune-wide" --tune --tune-kinds tc_wide \
      > "$out/tune-wide.txt" 2>&1
    grep -E "^tune|^launch table" "$out/tune-wide.txt"
    [ -f "$out/tune-wide/launch_table.json" ] && mkdir -p .triton-cache/tune-wide \
      && cp "$out/tune-wide/launch_table.json" .triton-cache/tune-wide/
  fi ;;
7)
  variants=(default --no-rope-in-attention "--fused-max-m 16")
  table=.triton-cache/tune-wide/launch_table.json
  [ -f "$table" ] && variants+=("--table $table")
  for variant in "${variants[@]}"; do
    case "$variant" in --table*) name=tablewide ;; *) name=$(echo "$variant" | tr -d ' -') ;; esac
    timeout 140 python benchmarks/bench_decode.py --models Llama-3-8B --batches 1,32,64 --no-fp16 \
      $([ "$variant" = default ] || echo "$variant") --out "$out/decode-$name" > "$out/decode-$name.txt" 2>&1
    echo "== decode, $variant"; grep -E "batch +(1|32|64):| in [0-9.]+ s" "$out/decode-$name.txt"
  done ;;
10)
  # the op's GPU tests first: its M = 64 cases take the fused kernel since FUSED_MAX_M = 64
  timeout 120 python -m pytest -q -p no:cacheprovider -p no:logging -m gpu tests/kernels/test_ops.py \
    > "$out/tests-ops.txt" 2>&1; tail -3 "$out/tests-ops.txt"
  for shape in "16 4 64" "32 8 128"; do
    set -- $shape
    timeout 90 python benchmarks/diag_rope_attention.py --heads "$1/$2" --head-dim "$3" > "$out/diag-$1-$2-$3.txt" 2>&1
    echo "== diag H=$1/$2 d=$3"; head -60 "$out/diag-$1-$2-$3.txt"
  done
  timeout 200 python benchmarks/bench_kernels.py --out "$out/kernels-decode" --models Llama-3-8B --ms 8,16,32,64 \
    --ranks 16 --profile "ec r16,w4" --budget-s 150 > "$out/kernels-decode.txt" 2>&1
  grep -E "^Llama| at M=" "$out/kernels-decode.txt"
  tar -C "$out" -czf "$out/part10.tgz" --exclude=part10.tgz . ;;
11)
  timeout 200 python -m pytest -v -p no:cacheprovider -p no:logging -o faulthandler_timeout=120 -m gpu \
    tests/serve/test_gpu.py > "$out/tests-engine.txt" 2>&1
  grep -v PASSED "$out/tests-engine.txt" | tail -20
  python -c "import json; from spear.kernels import launch
json.dump({'tc': dict(launch.LAUNCH['tc'], u_split=16)}, open('$out/tc-u16.json', 'w'))"
  for arm in default "--table $out/tc-u16.json"; do
    name=$([ "$arm" = default ] && echo default || echo tcu16)
    timeout 150 python benchmarks/bench_decode.py --models Llama-3-8B --batches 1,4,8,16,32 --no-fp16 \
      $([ "$arm" = default ] && echo "--profile 8,32" || echo "$arm") --out "$out/decode-$name" > "$out/decode-$name.txt" 2>&1
    echo "== decode, $arm"; grep -E "batch +[0-9]+:|GPU kernel time|^ +[0-9.]+ us " "$out/decode-$name.txt" | head -60
  done
  tar -C "$out" -czf "$out/part11.tgz" decode-* tests-engine.txt ;;
*) echo "part must be 1 to 11" >&2; exit 2 ;;
esac
