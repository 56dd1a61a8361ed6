"""Every benchmark script imports and answers ``--help``: a script that still imports a module or
option the package removed fails here, on the CPU, before anyone spends a GPU run on it.

Each runs in one fresh interpreter (they put ``benchmarks/`` on ``sys.path`` themselves and some
set environment variables at import), all scripts in the same one to pay torch's import once.
A mutation this catches: ``from spear.kernels.w4a16_prefill import ...`` left in bench_kernels.py
after the module was removed."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SCRIPTS = sorted((ROOT / "benchmarks").glob("*.py"))

_CHECK = r"""
import contextlib, io, runpy, sys
failed = []
for path in sys.argv[1:]:
    sys.argv = [path, "--help"]
    out = io.StringIO()
    try:
        with contextlib.redirect_stdout(out):
            runpy.run_path(path, run_name="__main__")
    except SystemExit as e:
        if e.code not in (0, None):
            failed.append(f"{path}: --help exited {e.code}")
        elif "usage" not in out.getvalue().lower():
            failed.append(f"{path}: --help printed no usage")
    except BaseException as e:
        failed.append(f"{path}: {type(e).__name__}: {e}")
print("\n".join(failed))
sys.exit(1 if failed else 0)
"""


def test_every_benchmark_script_imports_and_answers_help():
    assert len(SCRIPTS) > 10
    mains = [str(p) for p in SCRIPTS if "__main__" in p.read_text()]
    libs = [p.stem for p in SCRIPTS if "__main__" not in p.read_text()]
    # the helper modules (no __main__) import too
    lib_check = "import sys; sys.path.insert(0, 'benchmarks'); " + "; ".join(f"import {m}" for m in libs)
    r = subprocess.run([sys.executable, "-c", lib_check], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    r = subprocess.run([sys.executable, "-c", _CHECK, *mains], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, (r.stdout + r.stderr)[-3000:]
