"""The acceptance grid of latency-target scheduling, as data, and the serving metrics of one run.

Grid: inter-token latency targets x compensator densities x workloads x schedulers. The
schedulers are the static token budgets and the latency-target scheduler (``itl_slo_ms`` = the
case's target; its ceiling, ``max_num_batched_tokens``, is the largest static budget). A density
is what ``decode_cases.attach_ecs(modules, rank, hidden, budget, model)`` places: gated ECs
spread evenly over the linears up to ``budget`` x the W4 model's bytes, or on every linear.

Metrics, from each request's arrival and the times its output tokens were delivered:

  SLO attainment  % of inter-token gaps (every output token after a request's first) <= the target
  TTFT            first token - arrival, p50 and p99
  ITL             gaps between consecutive tokens of a request, p50 and p99
  output tok/s    output tokens / (last token delivered - first arrival)

Percentiles interpolate linearly between order statistics (numpy's default). ``floors`` checks
the acceptance floors on a list of rows, ``prediction_accuracy`` the latency table's predictions.
"""

from __future__ import annotations

import itertools
import random
from dataclasses import dataclass

import numpy as np

TARGETS_MS = (16.0, 22.0)
STATIC_BUDGETS = (256, 512, 2048)
TTFT_FACTOR = 1.2        # TTFT p50 of the latency-target scheduler <= this x the best static one meeting the target
PREDICTION_TOL = 0.10    # predicted step time within 10% of measured ...
PREDICTION_SHARE = 0.90  # ... for 90% of steps


@dataclass(frozen=True)
class Density:
    name: str
    rank: int                # 0: no compensators
    hidden: int
    budget: float | None     # EC bytes / W4 bytes the spread stops at; None: every linear


DENSITIES = (Density("none", 0, 0, 0.0), Density("1%", 16, 16, 0.01), Density("every linear", 16, 16, None))


@dataclass(frozen=True)
class Scheduler:
    name: str
    max_num_batched_tokens: int
    slo: bool                # the latency-target scheduler, at the case's target


SCHEDULERS = tuple(Scheduler(f"static {b}", b, False) for b in STATIC_BUDGETS) + (
    Scheduler("slo", max(STATIC_BUDGETS), True),)


@dataclass(frozen=True)
class Request:
    arrival_s: float
    prompt_tokens: int
    output_tokens: int


@dataclass(frozen=True)
class Workload:
    name: str
    num_requests: int
    rate: float              # Poisson arrivals per second
    prompt_min: int          # prompt lengths uniform in [prompt_min, prompt_max]
    prompt_max: int
    output_tokens: int       # every request generates exactly this many (EOS ignored)
    seed: int

    def requests(self) -> list[Request]:
        """Seeded: exponential gaps of mean 1 / rate from t = 0, prompt lengths uniform."""
        rng = random.Random(self.seed)
        t, out = 0.0, []
        for _ in range(self.num_requests):
            t += rng.expovariate(self.rate)
            out.append(Request(t, rng.randint(self.prompt_min, self.prompt_max), self.output_tokens))
        return out


WORKLOADS = (
    Workload("mixed", 40, 8.0, 256, 3072, 128, 0),     # the mixed-steps workload
    # heavier: half again the rate, twice the prompts' mean length, twice the output (contexts to ~6.4k)
    Workload("heavy", 80, 12.0, 1024, 6144, 256, 1),
)


@dataclass(frozen=True)
class Case:
    target_ms: float
    density: Density
    workload: Workload
    scheduler: Scheduler

    @property
    def name(self) -> str:
        return f"{self.workload.name} / {self.density.name} / {self.scheduler.name} @ {self.target_ms:g} ms"


def cases() -> list[Case]:
    return [Case(t, d, w, s) for t, d, w, s in itertools.product(TARGETS_MS, DENSITIES, WORKLOADS, SCHEDULERS)]


# ---------------------------------------------------------------------------- metrics
@dataclass(frozen=True)
class RequestTiming:
    arrival_s: float
    token_times_s: tuple[float, ...]   # when each output token was delivered


def _pct(values, q: float) -> float:
    return float(np.percentile(values, q)) if len(values) else float("nan")


def summarize(timings: list[RequestTiming], target_ms: float) -> dict:
    """The metrics of one run (module docstring); times in ms except tok/s."""
    ttft = [1e3 * (t.token_times_s[0] - t.arrival_s) for t in timings if t.token_times_s]
    itl = [1e3 * (b - a) for t in timings for a, b in zip(t.token_times_s, t.token_times_s[1:])]
    tokens = sum(len(t.token_times_s) for t in timings)
    last = max((t.token_times_s[-1] for t in timings if t.token_times_s), default=float("nan"))
    span = last - min(t.arrival_s for t in timings)
    return {"requests": len(timings), "output_tokens": tokens,
            "slo_attainment_pct": 100 * sum(g <= target_ms for g in itl) / len(itl) if itl else float("nan"),
            "ttft_p50_ms": _pct(ttft, 50), "ttft_p99_ms": _pct(ttft, 99),
            "itl_p50_ms": _pct(itl, 50), "itl_p99_ms": _pct(itl, 99),
            "output_tok_s": tokens / span if span > 0 else float("nan")}


def prediction_accuracy(steps, tol: float = PREDICTION_TOL) -> float:
    """Share of the steps with a prediction (engine StepRecords) whose prediction is within ``tol``
    of the step's measured interval (from the previous step's end: what its decodes waited for),
    relative to the measured one."""
    pred = [s for s in steps if s.predicted_ms is not None]
    return sum(abs(s.predicted_ms - s.interval_ms) <= tol * s.interval_ms for s in pred) / len(pred) if pred \
        else float("nan")


def floors_markdown(checks: list[tuple[str, bool, str]]) -> str:
    """``floors``' checks as the lines of floors.md."""
    return "\n".join(f"- {'met' if ok else 'NOT met'}: {name} ({detail})" for name, ok, detail in checks) + "\n"


def floors(rows: list[tuple[Case, dict]]) -> list[tuple[str, bool, str]]:
    """The acceptance floors on (case, summarize(...)) rows: (floor, met, detail). A floor is
    checked where its rows are present (a part of the grid checks its part); the static
    schedulers are those of the rows."""
    by = {(c.target_ms, c.density.name, c.workload.name, c.scheduler.name): m for c, m in rows}
    statics = {c.scheduler.name: c.scheduler for c, _ in rows if not c.scheduler.slo}
    out = []
    for (t, dens, work, sched), m in sorted(by.items()):
        if sched != "slo":
            continue
        out.append((f"ITL p99 <= target: {work} / {dens} @ {t:g} ms", m["itl_p99_ms"] <= t,
                    f"{m['itl_p99_ms']:.1f} ms"))
        meeting = [by[k]["ttft_p50_ms"] for k in ((t, dens, work, s) for s in statics)
                   if k in by and by[k]["itl_p99_ms"] <= t]
        if meeting:
            out.append((f"TTFT p50 <= {TTFT_FACTOR} x best static meeting the target: {work} / {dens} @ {t:g} ms",
                        m["ttft_p50_ms"] <= TTFT_FACTOR * min(meeting),
                        f"{m['ttft_p50_ms']:.0f} ms vs {min(meeting):.0f} ms"))
    dense = DENSITIES[-1].name
    for t, work in sorted({(k[0], k[2]) for k in by}):
        plain = [s for name, s in statics.items() if (t, "none", work, name) in by
                 and by[(t, "none", work, name)]["itl_p99_ms"] <= t and (t, dense, work, name) in by]
        if plain:  # the largest static budget that meets the target on plain W4
            s = max(plain, key=lambda s: s.max_num_batched_tokens)
            itl = by[(t, dense, work, s.name)]["itl_p99_ms"]
            out.append((f"{s.name}, tuned on plain W4, misses the target with ECs on {dense}: "
                        f"{work} @ {t:g} ms", itl > t, f"{itl:.1f} ms"))
        # compensator-aware: under one target, a denser placement gets no larger chunks
        chunks = [(d.name, by[(t, d.name, work, "slo")]["chunk_p50"]) for d in DENSITIES
                  if "chunk_p50" in by.get((t, d.name, work, "slo"), {})]
        if len(chunks) >= 2:
            out.append((f"denser compensators, no larger chunks under the target: {work} @ {t:g} ms",
                        all(a >= b for (_, a), (_, b) in zip(chunks, chunks[1:])),
                        ", ".join(f"{name} {c:.0f}" for name, c in chunks)))
    return out
