#!/usr/bin/env bash
# One device call (~4 min): benchmarks/ec_cost.py on this build and on copies of spear/kernels
# with parts of the fused EC left out (results not checked; for timing only):
#   nowait  the W tiles do not wait for v (they read it whenever they get there)
#   nou     ... and the u programs do nothing
#   nodone  ... and no tile counts itself done / re-arms the counters
#   nob     ... and no alpha·B v (what is left: the EC build's registers and its grid's u slots)
#   scripts/gpu_ec_cost.sh OUT_DIR
set -uo pipefail
out=${1:?usage: scripts/gpu_ec_cost.sh OUT_DIR}
mkdir -p "$out"
export PYTHONUNBUFFERED=1
echo "== full"; timeout 100 python benchmarks/ec_cost.py 2>&1 | grep -v -i warn | tee "$out/full.txt"
for v in nowait nou nodone nob; do
  rm -rf "/tmp/$v" && mkdir -p "/tmp/$v" && cp -r spear "/tmp/$v/"
  python - "$v" <<'PY'
import sys
from pathlib import Path
v = sys.argv[1]
order = ["nowait", "nou", "nodone", "nob"]
steps = order[:order.index(v) + 1]
ecp = Path(f"/tmp/{v}/spear/kernels/_ec_programs.py")
w4 = Path(f"/tmp/{v}/spear/kernels/w4a16.py")
s, t = ecp.read_text(), w4.read_text()
def sub(text, old, new):
    assert old in text, old
    return text.replace(old, new)
if "nowait" in steps:
    s = sub(s, "    _wait_above(u_lock, U_SPLIT, DOT_F32)\n", "")
if "nou" in steps:
    t = sub(t, "            _u_program(x_ptr,", "            if U_SPLIT < 0:\n                _u_program(x_ptr,")
if "nodone" in steps:
    s = sub(s, "    done = tl.atomic_add(locks_ptr + lock_base + n_wt + 1, 1, sem=\"relaxed\")\n    if done == n_wt - 1:",
            "    if n_wt < 0:")
if "nob" in steps:
    line = next(ln for ln in s.splitlines(True) if ln.startswith("    accT += alpha * _b_times_v("))
    s = sub(s, line, "    accT += 0.0 * alpha\n")
    s = sub(s, "    bt = tl.load(b_ptr + n_ld[:, None] * R + offs_r[None, :])", "    bt = tl.zeros((n_ld.shape[0], R), b_ptr.dtype.element_ty)")
ecp.write_text(s); w4.write_text(t)
PY
  echo "== $v"; PYTHONPATH="/tmp/$v" timeout 100 python benchmarks/ec_cost.py 2>&1 | grep -v -i warn | tee "$out/$v.txt"
done
