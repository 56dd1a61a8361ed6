"""benchmarks/bench_tp.py --tiny on the CPU: checkpoints written, an engine per TP size, the table."""

from __future__ import annotations

import importlib.util
import json
import math
from pathlib import Path

BENCH = Path(__file__).resolve().parents[2] / "benchmarks" / "bench_tp.py"


def test_bench_tp_tiny_runs_and_writes_its_table(tmp_path):
    spec = importlib.util.spec_from_file_location("bench_tp", BENCH)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    assert bench.main(["--tiny", "--variants", "w4,w4+ec", "--out", str(tmp_path)]) == 0
    rows = json.loads((tmp_path / "results.json").read_text())
    assert [(r["variant"], r["tp"]) for r in rows] == [("w4", 1), ("w4", 2), ("w4+ec", 1), ("w4+ec", 2)]
    assert all(math.isfinite(r["ms@1"]) and r["ms@1"] > 0 for r in rows)
    assert rows[2]["ec_pct"] > 0 and rows[0]["ec_pct"] == 0
    table = (tmp_path / "table.md").read_text()
    assert "| tiny | w4+ec |" in table and "allreduce" in table
