"""benchmarks/bench_slo.py --tiny: the acceptance grid's runner on the CPU (one density, one
workload), its rows, SLO attainment and the floors file; replay_steps.py and slo_report.py on
synthetic runs."""

import importlib.util
import json
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "benchmarks"


def test_tiny_grid(tmp_path):
    """Static budgets 16 / 32 / 64 and the latency-target scheduler at a target every gap meets
    (1 s) and one none does (1 ns): each static run is scored at both targets from one trace.
    Catches: a static run scored once, attainment not per target, the latency target not reaching
    the engine (no predictions), a floors file missing the latency-target rows."""
    sys.path.insert(0, str(BENCH))
    spec = importlib.util.spec_from_file_location("bench_slo", BENCH / "bench_slo.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules["bench_slo"] = mod
    try:
        spec.loader.exec_module(mod)
        assert mod.main(["--tiny", "--densities", "1%", "--workloads", "mixed", "--targets", "1000,0.000001",
                         "--out", str(tmp_path)]) == 0
    finally:
        sys.modules.pop("bench_slo", None)
    rows = json.loads((tmp_path / "results.json").read_text())["rows"]
    assert [(r["scheduler"], r["target_ms"]) for r in rows] == [
        (f"static {b}", t) for b in (16, 32, 64) for t in (1000.0, 1e-06)] + [("slo", 1000.0), ("slo", 1e-06)]
    for r in rows:
        assert r["density"] == "1%" and r["requests"] == 6 and r["output_tokens"] == 36
        assert r["slo_attainment_pct"] == (100.0 if r["target_ms"] == 1000.0 else 0.0)
        assert ("prediction_within_10pct" in r) == (r["scheduler"] == "slo")
    for i in range(0, 6, 2):  # one trace per static budget
        assert {k: v for k, v in rows[i].items() if k not in ("target_ms", "slo_attainment_pct")} == \
            {k: v for k, v in rows[i + 1].items() if k not in ("target_ms", "slo_attainment_pct")}
    steps = json.loads((tmp_path / "steps.json").read_text())
    assert steps["columns"][-3:] == ["predicted_ms", "measured_ms", "interval_ms"]
    work = mod.TINY_WORKLOADS[0].requests()
    computed = sum(r.prompt_tokens + r.output_tokens - 1 for r in work)  # the last token is never fed back
    assert len(steps["runs"]) == 5
    for name, run in steps["runs"].items():  # every step of every run, predictions where a target scheduled
        assert sum(r[1] for r in run) == computed, name
        assert all((r[4] is not None) == (name.endswith("ms") and r[0] > 0) for r in run), name
        assert all(0 < r[5] <= r[6] for r in run), name  # the interval holds the step
    floors = (tmp_path / "floors.md").read_text()
    assert "met: ITL p99 <= target: mixed / 1% @ 1000 ms" in floors
    assert "NOT met: ITL p99 <= target: mixed / 1% @ 1e-06 ms" in floors


def test_replay_scores_the_table_and_the_correction_on_recorded_steps():
    """benchmarks/replay_steps.py on steps measured 20% over a synthetic table: none within 10% as
    measured; corrected, a kind's k-th step is predicted at 1 + 0.2 (1 - 0.9^k) times the table,
    within 10% of the measured 1.2 x once 0.2 x 0.9^k <= 0.12 (from k = 5 on).
    Catches: the correction fed the corrected prediction, or kinds mixed up (decode-only vs mixed)."""
    sys.path.insert(0, str(BENCH))
    import replay_steps

    from spear.serve.latency.table import LatencyTable

    f = lambda d, t, L: 5 + d + (t / 100 if t else 0)  # noqa: E731
    table = LatencyTable((1, 8), (0, 64, 128), (256, 1024), [[[f(d, t, L) for L in (256, 1024)] for t in (0, 64, 128)]
                                                             for d in (1, 8)], 0.1)
    rows = []
    for i in range(40):  # alternating kinds: decode-only, then a 128-token mixed step
        rows.append([4, 4, 0, 512.0, None, 1.2 * f(4, 0, 512)])
        rows.append([4, 100, 128, 512.0, None, 1.2 * f(4, 128, 512)])
    plain, fixed, n = replay_steps.replay(rows, table, [])
    # per kind the residual after k steps is 0.2 (1 - 0.9^k): within 10% of 1.2 x from k = 6 on
    within = sum(abs(1.2 - (1 + 0.2 * (1 - 0.9 ** k))) <= 0.12 for k in range(40)) * 2
    assert (plain, n) == (0.0, 80) and fixed == within / 80
    # rows with the interval column (later runs) are scored on it, not on the step's wall time
    timed = [r[:5] + [r[5] / 1.2, r[5]] for r in rows]
    assert replay_steps.replay(timed, table, []) == (plain, fixed, n)


def test_report_scores_parts_together(tmp_path):
    """benchmarks/slo_report.py on two parts (W4 alone, ECs on every linear alone): the floor that
    compares them (static 256 meets 16 ms on W4, 17.6 ms with ECs: shown) and the chunk order appear,
    which neither part's own floors hold; a case in both parts is refused.
    Catches: parts scored one by one, rows with an error scored, a repeated case taking the last."""
    sys.path.insert(0, str(BENCH))
    import slo_report

    def row(density, sched, itl, ttft, chunk, **extra):
        return dict(density=density, ec_pct=0.0, workload="mixed", scheduler=sched, target_ms=16.0,
                    budget=2048 if sched == "slo" else 256, requests=40, output_tokens=5120, slo_attainment_pct=99.0,
                    ttft_p50_ms=ttft, ttft_p99_ms=2 * ttft, itl_p50_ms=10.0, itl_p99_ms=itl, output_tok_s=700.0,
                    chunk_p50=chunk, **extra)

    parts = [[row("none", "static 256", 15.9, 380, 246), row("none", "slo", 15.5, 420, 222)],
             [row("every linear", "static 256", 17.6, 500, 246), row("every linear", "slo", 15.3, 900, 121),
              dict(density="every linear", workload="mixed", scheduler="static 512", target_ms=16.0, budget=512,
                   error="RuntimeError('boom')")]]
    files = []
    for i, rows in enumerate(parts):
        (tmp_path / f"p{i}").mkdir()
        files.append(tmp_path / f"p{i}" / "results.json")
        files[-1].write_text(json.dumps({"header": "grid", "rows": rows}))
    assert slo_report.main(["--out", str(tmp_path / "out")] + [str(f) for f in files]) == 0
    floors = (tmp_path / "out" / "floors.md").read_text().splitlines()
    assert "- met: static 256, tuned on plain W4, misses the target with ECs on every linear: mixed @ 16 ms " \
           "(17.6 ms)" in floors
    assert "- met: denser compensators, no larger chunks under the target: mixed @ 16 ms (none 222, every linear " \
           "121)" in floors
    assert "- met: TTFT p50 <= 1.2 x best static meeting the target: mixed / none @ 16 ms (420 ms vs 380 ms)" in floors
    assert not any("every linear @ 16 ms (900" in f for f in floors)  # no static meets 16 ms with ECs
    assert "error: RuntimeError('boom')" in (tmp_path / "out" / "table.md").read_text()
    with pytest.raises(SystemExit):
        slo_report.main(["--out", str(tmp_path / "dup"), str(files[0]), str(files[0])])
