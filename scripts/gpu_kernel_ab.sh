#!/usr/bin/env bash
# One device call (~8 min): the two kernel-level A/Bs of BENCHMARKS.md "Tenth run", items 5 and 7,
# each run against the other form in the same call:
#   1. the op's GPU tests of both prefill EC forms (dispatch at M up to 2048, graph replay);
#   2. the fused EC at 1-4 tokens with this build's u tiles against a copy with the earlier
#      2048-element tile (bench_kernels.py, rank 32);
#   3. the semi-fused EC at 512 and 2048 tokens with ops.PREFILL_EC "ec_up" against "addmm".
#   scripts/gpu_kernel_ab.sh OUT_DIR
set -uo pipefail
out=${1:?usage: scripts/gpu_kernel_ab.sh OUT_DIR}
mkdir -p "$out"
export PYTHONUNBUFFERED=1
export TRITON_CACHE_DIR="$PWD/.triton-cache"  # kept between the calls of a session
timeout 100 python -m pytest -v -p no:cacheprovider -p no:logging -o faulthandler_timeout=60 -m gpu \
  tests/kernels/test_ops.py -k "dispatch or graph_replay" > "$out/tests.txt" 2>&1
grep -v PASSED "$out/tests.txt" | tail -20
rm -rf /tmp/tile2048 && mkdir -p /tmp/tile2048 && cp -r spear /tmp/tile2048/
python - <<'PY'
from pathlib import Path
f = Path("/tmp/tile2048/spear/kernels/_ec_programs.py")
t = f.read_text()
old = "UK: tl.constexpr = min(BK, (2048 if MV == 1 else 1024) // R)"
assert old in t
f.write_text(t.replace(old, "UK: tl.constexpr = min(BK, 2048 // R)"))
PY
bk() {  # name pythonpath args...
  local name=$1 pp=$2; shift 2
  PYTHONPATH="$pp" timeout 110 python benchmarks/bench_kernels.py --models Llama-2-7B,Llama-3-8B --ranks 32 \
    --budget-s 80 --out "$out/$name" "$@" > "$out/$name.txt" 2>&1
  echo "== $name"; grep -E "kernels from|M= " "$out/$name.txt" | head -24
}
bk tile1024 "$PWD" --ms 1,2,4
bk tile2048 /tmp/tile2048 --ms 1,2,4
bk ec_up "$PWD" --ms 512,2048 --prefill-ec ec_up
bk addmm "$PWD" --ms 512,2048 --prefill-ec addmm
