#!/usr/bin/env bash
# One device call (~6 min): the fused EC at 1-16 tokens with the u programs' tiles of this build
# (1024 elements at 2-4 tokens) against a copy with the earlier 2048 at every token count
# (BENCHMARKS.md, "Tenth run", item 5): bench_kernels.py on the Llama-2-7B / Llama-3-8B shapes,
# ranks 16 and 32, both runs in one call so that the ratios share the GPU's state.
#   scripts/gpu_ectile.sh OUT_DIR
set -uo pipefail
out=${1:?usage: scripts/gpu_ectile.sh OUT_DIR}
mkdir -p "$out"
export PYTHONUNBUFFERED=1
rm -rf /tmp/tile2048 && mkdir -p /tmp/tile2048 && cp -r spear /tmp/tile2048/
python - <<'PY'
from pathlib import Path
f = Path("/tmp/tile2048/spear/kernels/_ec_programs.py")
t = f.read_text()
old = "UK: tl.constexpr = min(BK, (2048 if MV == 1 else 1024) // R)"
assert old in t
f.write_text(t.replace(old, "UK: tl.constexpr = min(BK, 2048 // R)"))
PY
for run in new old; do
  pp=$([ "$run" = old ] && echo /tmp/tile2048 || echo "$PWD")
  PYTHONPATH="$pp" timeout 170 python benchmarks/bench_kernels.py --models Llama-2-7B,Llama-3-8B --ms 1,2,4,8,16 \
    --ranks 16,32 --budget-s 140 --out "$out/$run" > "$out/$run.txt" 2>&1
  echo "== $run"; grep -E "kernels from|M= " "$out/$run.txt" | head -40
done
