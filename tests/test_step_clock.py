"""`spear run`'s step timing (spear.pipeline.StepClock) on a clock the test moves by hand."""

import pytest

from spear import pipeline


class _Time:
    """perf_counter / process_time that advance only when told."""

    def __init__(self):
        self.wall = self.cpu = 100.0

    def perf_counter(self):
        return self.wall

    def process_time(self):
        return self.cpu

    def advance(self, wall, cpu):
        self.wall += wall
        self.cpu += cpu


def test_steps_sum_their_passes_and_the_total_counts_the_time_between(monkeypatch):
    """A step entered twice sums both passes, a step left by an exception still counts, and the
    total covers the time outside every step; the line rounds to whole seconds, steps in the order
    first entered.

    Catches: a step's second pass replacing its first, the time of a failing step dropped (no
    ``finally``), or the total taken as the sum of the steps."""
    t = _Time()
    monkeypatch.setattr(pipeline, "time", t)
    clock = pipeline.StepClock()
    with clock("load"):
        t.advance(2.0, 3.0)
    with clock("perplexity"):
        t.advance(1.0, 1.5)
    t.advance(0.25, 0.25)  # outside every step
    with pytest.raises(RuntimeError):
        with clock("perplexity"):
            t.advance(1.25, 0.75)
            raise RuntimeError("stop")
    table, line = clock.summary()
    assert list(table) == ["total", "load", "perplexity"]
    assert table["total"] == pytest.approx({"wall": 4.5, "cpu": 5.5})
    assert table["load"] == pytest.approx({"wall": 2.0, "cpu": 3.0})
    assert table["perplexity"] == pytest.approx({"wall": 2.25, "cpu": 2.25})
    assert line == "4 s (6 s CPU): load 2 s, perplexity 2 s"
