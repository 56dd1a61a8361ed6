"""The serving benchmarks' workloads and metrics (bench_serving.py, bench_slo.py): seeded
Poisson arrivals, and TTFT / ITL / tokens/s / step statistics of a trace of token times."""

from __future__ import annotations

import math
import random
import statistics
from dataclasses import dataclass, field


@dataclass
class Request:
    arrival: float              # seconds after the start
    prompt: list[int]
    output: int


SATURATING = dict(requests=240, rate=48.0, prompt_min=128, prompt_max=2048, output=32, output_max=512,
                  max_num_seqs=128)


def workload(n: int, rate: float, prompt_min: int, prompt_max: int, output: int, vocab: int,
             seed: int = 0, output_max: int | None = None) -> list[Request]:
    """Poisson arrivals (exponential gaps at ``rate`` per second), uniform prompt lengths; output
    lengths ``output`` or, with ``output_max``, uniform in output..output_max."""
    rng = random.Random(seed)
    t, out = 0.0, []
    for _ in range(n):
        t += rng.expovariate(rate)
        prompt = [rng.randrange(vocab) for _ in range(rng.randint(prompt_min, prompt_max))]
        out.append(Request(t, prompt, output if output_max is None else rng.randint(output, output_max)))
    return out


def percentile(values: list[float], q: float) -> float:
    """The q-quantile (0..1) by linear interpolation between order statistics; NaN when empty."""
    v = sorted(values)
    if not v:
        return float("nan")
    pos = q * (len(v) - 1)
    lo = math.floor(pos)
    hi = min(lo + 1, len(v) - 1)
    return v[lo] + (v[hi] - v[lo]) * (pos - lo)


@dataclass
class Trace:
    """Per request: arrival and token times (seconds from the start); per step: (tokens, decode only, seconds)."""
    arrivals: list[float] = field(default_factory=list)
    tokens: list[list[float]] = field(default_factory=list)
    steps: list[tuple[int, bool, float]] = field(default_factory=list)
    records: list = field(default_factory=list)   # the engine's StepRecords (in process)
    hops: list = field(default_factory=list)      # HTTP: per request (sent, headers, Server-Timing s), or None
    server: dict = field(default_factory=dict)    # HTTP: the server's hop metrics (serving_http.server_hops)


def summarize(trace: Trace, target_ms: float | None = None) -> dict:
    ttft = [t[0] - a for a, t in zip(trace.arrivals, trace.tokens) if t]
    itl = [b - a for t in trace.tokens for a, b in zip(t, t[1:])]
    n_tokens = sum(len(t) for t in trace.tokens)
    end = max((t[-1] for t in trace.tokens if t), default=0.0)
    span = end - min(trace.arrivals, default=0.0)
    out = dict(requests=len(trace.arrivals), output_tokens=n_tokens,
               ttft_p50_s=percentile(ttft, 0.5), ttft_p99_s=percentile(ttft, 0.99),
               itl_p50_ms=1e3 * percentile(itl, 0.5), itl_p99_ms=1e3 * percentile(itl, 0.99),
               itl_max_ms=1e3 * max(itl, default=float("nan")),
               output_tok_s=n_tokens / span if span > 0 else float("nan"))
    hops = [(a, h, t[0]) for a, h, t in zip(trace.arrivals, trace.hops, trace.tokens) if h is not None and t]
    if hops:  # where the HTTP path's TTFT goes: the client sending late, until the core took it (of
        # which the server's own parse, prepare and admit, from its Server-Timing; the rest is the
        # client's and the socket's), then until the first token reached the client
        timed = [h for _, h, _ in hops if len(h) > 2 and h[2]]
        parts = [("client_late", [h[0] - a for a, h, _ in hops]), ("until_taken", [h[1] - h[0] for _, h, _ in hops]),
                 ("taken_to_first", [f - h[1] for _, h, f in hops])]
        if timed:
            parts += [(f"server_{k}", [h[2].get(k, 0.0) for h in timed]) for k in ("parse", "prepare", "admit")]
            parts += [("outside_server", [h[1] - h[0] - sum(h[2].values()) for h in timed])]
        for key, vals in parts:
            out[f"{key}_p50_ms"], out[f"{key}_p99_ms"] = 1e3 * percentile(vals, 0.5), 1e3 * percentile(vals, 0.99)
    out.update(trace.server)
    if target_ms is not None:  # SLO attainment: % of inter-token gaps within the target
        out["slo_attainment_pct"] = 100 * sum(g <= target_ms / 1e3 for g in itl) / len(itl) if itl else float("nan")
    if any(r.predicted_ms is not None for r in trace.records):
        from slo_cases import prediction_accuracy

        out["prediction_within_10pct"] = prediction_accuracy(trace.records)
        chunks = [r.prefill_tokens for r in trace.records if r.prefill_tokens and r.num_decodes]
        out["chunk_p50"] = percentile(chunks, 0.5)
    if trace.steps:
        dec = [s for n, d, s in trace.steps if d]
        mixed = [s for n, d, s in trace.steps if not d]
        by_count: dict[int, list[float]] = {}
        for n, _, s in trace.steps:
            by_count.setdefault(n, []).append(s)
        stalls = sum(s > 2 * statistics.median(by_count[n]) for n, _, s in trace.steps if len(by_count[n]) >= 3)
        out.update(decode_step_p50_ms=1e3 * percentile(dec, 0.5), mixed_step_p50_ms=1e3 * percentile(mixed, 0.5),
                   mixed_step_p99_ms=1e3 * percentile(mixed, 0.99), steps=len(trace.steps), mixed_steps=len(mixed),
                   stalls=int(stalls))
    return out
