#!/usr/bin/env bash
# A copy of the kernels in /tmp/old/spear whose fused EC re-arms its counters the old way (every W
# tile counts with an atomic_add and the last one zeroes the counters: the interpreter's form), for
# an A/B against the current form: scripts/probe_fused.py --root /tmp/old (BENCHMARKS.md, tenth run).
set -euo pipefail
rm -rf /tmp/old && mkdir -p /tmp/old && cp -r spear /tmp/old/
python - <<'PY'
from pathlib import Path
f = Path("/tmp/old/spear/kernels/_ec_programs.py")
t = f.read_text()
assert t.count("if not DOT_F32:") == 2 and t.count("    if DOT_F32:\n") == 1
t = t.replace("if not DOT_F32:", "if False:").replace("    if DOT_F32:\n", "    if True:\n")
f.write_text(t)
PY
