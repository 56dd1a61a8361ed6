"""benchmarks/bench_serving.py: its metrics on synthetic traces (exact numbers), and the --tiny run
on the CPU, in process and through ``spear serve`` in a process of its own (the client here)."""

import importlib.util
import json
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "benchmarks" / "bench_serving.py"


@pytest.fixture(scope="module")
def bench():
    import sys

    spec = importlib.util.spec_from_file_location("bench_serving", BENCH)
    mod = importlib.util.module_from_spec(spec)
    sys.modules["bench_serving"] = mod  # its dataclasses look their module up
    spec.loader.exec_module(mod)
    yield mod
    sys.modules.pop("bench_serving", None)


def test_metrics_of_a_synthetic_trace(bench):
    """Two requests: arrivals 0 and 1 s; tokens at 0.5, 0.6, 0.8 and 1.25, 1.5 s. Catches: TTFT from
    the wrong origin, ITL across requests, tok/s over the wrong span, a stall counted early."""
    t = bench.Trace(arrivals=[0.0, 1.0], tokens=[[0.5, 0.6, 0.8], [1.25, 1.5]],
                    steps=[(4, True, 0.01), (4, True, 0.011), (4, True, 0.03), (100, False, 0.2)])
    s = bench.summarize(t)
    # TTFT [0.5, 0.25]; ITL [0.1, 0.2] and [0.25]; p-quantiles interpolate between order statistics
    assert s["ttft_p50_s"] == pytest.approx(0.375) and s["ttft_p99_s"] == pytest.approx(0.4975)
    assert s["itl_p50_ms"] == pytest.approx(200.0) and s["itl_p99_ms"] == pytest.approx(249.0)
    assert s["itl_max_ms"] == pytest.approx(250.0)
    assert s["output_tok_s"] == pytest.approx(5 / 1.5)
    assert s["decode_step_p50_ms"] == pytest.approx(11.0) and s["mixed_step_p50_ms"] == pytest.approx(200.0)
    assert s["stalls"] == 1  # 0.03 s > 2 x median(0.01, 0.011, 0.03); the 100-token step has no peers
    assert bench.percentile([], 0.5) != bench.percentile([], 0.5)  # NaN


def test_http_ttft_by_hop(bench):
    """Arrivals 0 and 1 s; sent 0.01 and 1.03 s; headers (the core took them) 0.05 and 1.13 s; first
    tokens 0.5 and 1.25 s. A request without hops (None) is left out. Catches: a hop measured from
    the wrong end, seconds reported as milliseconds."""
    t = bench.Trace(arrivals=[0.0, 1.0, 2.0], tokens=[[0.5, 0.6], [1.25], [2.5]],
                    hops=[(0.01, 0.05), (1.03, 1.13), None])
    s = bench.summarize(t)
    assert s["client_late_p50_ms"] == pytest.approx(20.0) and s["client_late_p99_ms"] == pytest.approx(29.8)
    assert s["until_taken_p50_ms"] == pytest.approx(70.0) and s["until_taken_p99_ms"] == pytest.approx(99.4)
    assert s["taken_to_first_p50_ms"] == pytest.approx(285.0) and s["taken_to_first_p99_ms"] == pytest.approx(446.7)
    assert "until_taken_p50_ms" not in bench.summarize(bench.Trace(arrivals=[0.0], tokens=[[0.5]]))


def test_workload_is_seeded(bench):
    a = bench.workload(5, 8.0, 10, 20, 4, 100, seed=3)
    b = bench.workload(5, 8.0, 10, 20, 4, 100, seed=3)
    assert [(r.arrival, r.prompt) for r in a] == [(r.arrival, r.prompt) for r in b]
    assert all(10 <= len(r.prompt) <= 20 for r in a) and a[0].arrival < a[-1].arrival


@pytest.mark.parametrize("http", [False, True])
def test_tiny_run(bench, tmp_path, http):
    argv = ["--tiny", "--variants", "w4,w4+ec", "--budgets", "32", "--out", str(tmp_path),
            "--paths", "http" if http else "in-process"]
    assert bench.main(argv) == 0
    rows = json.loads((tmp_path / "results.json").read_text())["rows"]
    assert [r["variant"].split(" ")[0] for r in rows] == ["w4", "w4+ec"]
    assert {r["path"] for r in rows} == {"HTTP" if http else "in process"}
    for r in rows:
        assert r["requests"] == 6 and r["output_tokens"] == 6 * 6
        assert r["ttft_p50_s"] > 0 and r["itl_p50_ms"] > 0 and r["output_tok_s"] > 0
        assert r["itl_max_ms"] >= r["itl_p99_ms"] >= r["itl_p50_ms"] and r["ttft_p99_s"] >= r["ttft_p50_s"]
        assert ("mixed_step_p50_ms" in r) != http
        if http:  # the TTFT's hops add up to it
            assert 0 <= r["until_taken_p50_ms"] and 0 <= r["taken_to_first_p50_ms"]
            assert r["until_taken_p50_ms"] + r["taken_to_first_p50_ms"] <= 1e3 * r["ttft_p99_s"]
            # the clients' own event-loop lag, sampled through the run
            assert 0 <= r["client_loop_lag_p50_ms"] <= r["client_loop_lag_p99_ms"] <= r["client_loop_lag_max_ms"]


def test_tiny_run_under_a_latency_target(bench, tmp_path):
    """--itl-slo-ms adds a run under the latency-target scheduler per variant: its table's
    predictions are counted and its steps stay within the ceiling; the SLO attainment is the share
    of inter-token gaps within the target (checked against the static row's own trace at a target
    no gap meets: 0%).
    Catches: the target not reaching the engine (no predictions), attainment counted in seconds
    against milliseconds."""
    argv = ["--tiny", "--variants", "w4", "--budgets", "32", "--itl-slo-ms", "1000,0.000001", "--out", str(tmp_path)]
    assert bench.main(argv) == 0
    rows = json.loads((tmp_path / "results.json").read_text())["rows"]
    assert [r["budget"] for r in rows] == [32, "SLO 1000 ms (<= 64)", "SLO 1e-06 ms (<= 64)"]
    assert "slo_attainment_pct" not in rows[0]
    assert rows[1]["slo_attainment_pct"] == 100.0 and rows[2]["slo_attainment_pct"] == 0.0
    for r in rows[1:]:
        assert 0.0 <= r["prediction_within_10pct"] <= 1.0 and r["output_tokens"] == 36
