"""benchmarks/slo_cases.py: the acceptance grid as data, and its metrics on synthetic timestamps
(exact numbers: times on a 1/1024 s grid, so every gap is exact in binary)."""

import importlib.util
import sys
from pathlib import Path

import pytest

from spear.serve.core.messages import StepRecord

spec = importlib.util.spec_from_file_location("slo_cases", Path(__file__).resolve().parents[2] / "benchmarks"
                                              / "slo_cases.py")
cases = sys.modules["slo_cases"] = importlib.util.module_from_spec(spec)  # dataclasses look their module up
spec.loader.exec_module(cases)

U = 1 / 1024          # s
MS = 1e3 * U          # 0.9765625 ms


def test_metrics_on_synthetic_timestamps():
    timings = [cases.RequestTiming(0 * U, (100 * U, 110 * U, 126 * U, 131 * U)),   # gaps 10, 16, 5
               cases.RequestTiming(50 * U, (250 * U, 266 * U, 300 * U)),           # gaps 16, 34
               cases.RequestTiming(200 * U, (300 * U,))]                           # first token only
    m = cases.summarize(timings, target_ms=16 * MS)
    assert m["requests"] == 3 and m["output_tokens"] == 8
    assert m["slo_attainment_pct"] == 80.0                 # 4 of the 5 gaps are <= 16 units
    assert m["ttft_p50_ms"] == 100 * MS                    # of 100, 200, 100
    assert m["ttft_p99_ms"] == pytest.approx((100 + 0.98 * 100) * MS)
    assert m["itl_p50_ms"] == 16 * MS                      # of 5, 10, 16, 16, 34
    assert m["itl_p99_ms"] == pytest.approx((16 + 0.96 * 18) * MS)
    assert m["output_tok_s"] == pytest.approx(8 / (300 * U))  # from the first arrival to the last token
    assert cases.summarize(timings, target_ms=15 * MS)["slo_attainment_pct"] == 40.0


def test_the_grid():
    grid = cases.cases()
    assert len(grid) == 2 * 3 * 2 * 4 and len({c.name for c in grid}) == len(grid)
    assert {c.target_ms for c in grid} == {16.0, 22.0}
    assert [s.name for s in cases.SCHEDULERS] == ["static 256", "static 512", "static 2048", "slo"]
    assert cases.SCHEDULERS[-1].max_num_batched_tokens == 2048
    mixed = cases.WORKLOADS[0]
    assert (mixed.num_requests, mixed.rate, mixed.prompt_min, mixed.prompt_max, mixed.output_tokens) == (
        40, 8.0, 256, 3072, 128)
    for w in cases.WORKLOADS:
        reqs = w.requests()
        assert reqs == w.requests() and len(reqs) == w.num_requests  # seeded
        assert all(a.arrival_s < b.arrival_s for a, b in zip(reqs, reqs[1:]))
        assert all(w.prompt_min <= r.prompt_tokens <= w.prompt_max for r in reqs)


def test_prediction_accuracy():
    rec = lambda p, m: StepRecord(num_tokens=2, num_seqs=2, decode_only=False, seconds=m / 1e3, predicted_ms=p)  # noqa: E731
    steps = [rec(10.0, 10.5), rec(10.0, 11.2), rec(None, 50.0), rec(9.0, 10.0), rec(10.0, 9.0)]
    # |p - m| <= 0.1 m: 0.5 <= 1.05 yes, 1.2 <= 1.12 no, 1.0 <= 1.0 yes, 1.0 <= 0.9 no
    assert cases.prediction_accuracy(steps) == 0.5


def test_floors():
    C = cases
    values = {  # density -> scheduler -> (ITL p99, TTFT p50), target 16 ms
        "none": {"static 256": (12, 900), "static 512": (15, 600), "static 2048": (30, 300), "slo": (15.5, 650)},
        "1%": {"static 256": (13, 950), "static 512": (17, 620), "static 2048": (33, 310), "slo": (15.8, 1200)},
        "every linear": {"static 256": (15, 1000), "static 512": (19, 640), "static 2048": (40, 320),
                         "slo": (16.5, 900)}}
    dens = {d.name: d for d in C.DENSITIES}
    chunk = {"none": 640, "1%": 512, "every linear": 384}  # the latency-target runs' chunk p50
    rows = [(C.Case(16.0, dens[d], C.WORKLOADS[0], s), {"itl_p99_ms": values[d][s.name][0],
                                                        "ttft_p50_ms": values[d][s.name][1],
                                                        **({"chunk_p50": chunk[d]} if s.slo else {})})
            for d in values for s in C.SCHEDULERS]
    got = {name: met for name, met, _ in C.floors(rows)}
    assert got == {
        "ITL p99 <= target: mixed / 1% @ 16 ms": True, "ITL p99 <= target: mixed / every linear @ 16 ms": False,
        "ITL p99 <= target: mixed / none @ 16 ms": True,
        # best static meeting 16 ms: 256 (950) at 1%, 256 (1000) on every linear, 512 (600) on none
        "TTFT p50 <= 1.2 x best static meeting the target: mixed / 1% @ 16 ms": False,
        "TTFT p50 <= 1.2 x best static meeting the target: mixed / every linear @ 16 ms": True,
        "TTFT p50 <= 1.2 x best static meeting the target: mixed / none @ 16 ms": True,
        # static 512 meets 16 ms on plain W4 and misses it (19 ms) with ECs on every linear
        "static 512, tuned on plain W4, misses the target with ECs on every linear: mixed @ 16 ms": True,
        "denser compensators, no larger chunks under the target: mixed @ 16 ms": True}
    # a part of the grid (no "every linear" rows, no static 512): each floor whose rows are there
    # Catches: a partial grid raising on a missing row, or a floor checked against absent rows
    part = [(c, m) for c, m in rows if c.density.name != "every linear" and c.scheduler.name != "static 512"]
    got = {name: met for name, met, _ in C.floors(part)}
    assert got == {
        "ITL p99 <= target: mixed / 1% @ 16 ms": True, "ITL p99 <= target: mixed / none @ 16 ms": True,
        "TTFT p50 <= 1.2 x best static meeting the target: mixed / 1% @ 16 ms": False,
        # without static 512, the best static meeting 16 ms on none is 256 (900 ms): 650 <= 1080
        "TTFT p50 <= 1.2 x best static meeting the target: mixed / none @ 16 ms": True,
        "denser compensators, no larger chunks under the target: mixed @ 16 ms": True}
    # a denser placement with larger chunks than a sparser one fails it
    # Catches: the densities compared out of order, or the check always met
    chunk["1%"] = 700
    for c, m in rows:
        if c.scheduler.slo:
            m["chunk_p50"] = chunk[c.density.name]
    assert {name: met for name, met, _ in C.floors(rows)}[
        "denser compensators, no larger chunks under the target: mixed @ 16 ms"] is False
