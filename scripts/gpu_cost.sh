#!/usr/bin/env bash
# One device call (~2-4 min): benchmarks/ec_cost.py (W4 and W4 + fused EC at one token, the engine's
# launches) on this build and on copies of spear/kernels with parts left out, cumulatively (the
# copies' results are wrong; they are timed only, to place the time by difference).
#   scripts/gpu_cost.sh ec OUT_DIR: the fused EC's parts
#     nowait  the W tiles do not wait for v        nou   ... and the u programs do nothing
#     nodone  ... and no tile signals it is done   nob   ... and no alpha·B v
#   scripts/gpu_cost.sh w4 OUT_DIR: the W4 kernel's split-K tail and fixed cost
#     noreduce  no split-K sum or epilogue         noarrive  ... and no arrival count
#     nostore   ... and no partial stored          onestep   ... and one K step per program
set -uo pipefail
set_=${1:?usage: scripts/gpu_cost.sh ec|w4 OUT_DIR}
out=${2:?usage: scripts/gpu_cost.sh ec|w4 OUT_DIR}
case "$set_" in
  ec) variants="nowait nou nodone nob" ;;
  w4) variants="noreduce noarrive nostore onestep" ;;
  *) echo "first argument: ec or w4" >&2; exit 2 ;;
esac
mkdir -p "$out"
export PYTHONUNBUFFERED=1
export TRITON_CACHE_DIR="$PWD/.triton-cache"  # kept between the calls of a session
echo "== full"; timeout 100 python benchmarks/ec_cost.py 2>&1 | grep -v -i warn | tee "$out/full.txt"
for v in $variants; do
  rm -rf "/tmp/$v" && mkdir -p "/tmp/$v" && cp -r spear "/tmp/$v/"
  python - "$v" "$variants" <<'PY'
import sys
from pathlib import Path
v, order = sys.argv[1], sys.argv[2].split()
root = Path(f"/tmp/{v}/spear/kernels")
# cumulative substitutions: (file, old, new); each old text must be present
SUBS = {
    "nowait": [("_ec_programs.py", "    _wait_above(u_lock, U_SPLIT, DOT_F32)\n", "")],
    "nou": [("w4a16.py", "            _u_program(x_ptr,", "            if U_SPLIT < 0:\n                _u_program(x_ptr,")],
    "nodone": [("_ec_programs.py", "        _signal(done_lock)\n", "")],
    "nob": [("_ec_programs.py", "    accT += alpha * _b_times_v(bt, v_ptr, offs_m, m_mask, offs_r, accT, R, MV, DOT_F32, \".cg\")\n",
             "    accT += 0.0 * alpha\n"),
            ("_ec_programs.py", "    bt = tl.load(b_ptr + n_ld[:, None] * R + offs_r[None, :])",
             "    bt = tl.zeros((n_ld.shape[0], R), b_ptr.dtype.element_ty)")],
    "noreduce": [("w4a16.py", "        if arrived == SPLIT_K - 1:", "        if arrived < 0:")],
    "noarrive": [("w4a16.py", "        tl.debug_barrier()\n        arrived = tl.atomic_add(locks_ptr + lock_base + wt, 1, sem=\"acq_rel\")",
                  "        arrived = split + SPLIT_K")],
    "nostore": [("w4a16.py", "        tl.store(part_ptr + split * M * N + mn_offs, accT, mask=out_mask)",
                 "        tl.store(part_ptr + split * M * N + mn_offs, accT, mask=out_mask & (K < 0))")],
    "onestep": [("w4a16.py", "    k_hi = tl.minimum(k_lo + iters * BK, K)\n    offs_n", "    k_hi = tl.minimum(k_lo + BK, K)\n    offs_n")],
}
for step in order[:order.index(v) + 1]:
    for name, old, new in SUBS[step]:
        f = root / name
        text = f.read_text()
        assert old in text, (step, old)
        f.write_text(text.replace(old, new))
PY
  echo "== $v"; PYTHONPATH="/tmp/$v" timeout 100 python benchmarks/ec_cost.py 2>&1 | grep -v -i warn | tee "$out/$v.txt"
done
