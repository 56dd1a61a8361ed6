"""Prometheus metrics of the server, in a registry of their own (``/metrics``)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from spear.serve.engine import EngineStats, RequestOutput

_LATENCY_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0,
                    30.0, 60.0)
_E2E_BUCKETS = (0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 60.0, 120.0, 300.0)


class ServingMetrics:
    def __init__(self):
        r = self.registry = CollectorRegistry()
        self.requests = Counter("spear_requests", "Finished requests, by finish reason (stop, length, abort)",
                                ["finish_reason"], registry=r)
        self.rejected = Counter("spear_requests_rejected", "Requests refused before running, by reason",
                                ["reason"], registry=r)
        self.prompt_tokens = Counter("spear_prompt_tokens", "Prompt tokens of admitted requests", registry=r)
        self.generation_tokens = Counter("spear_generation_tokens", "Generated tokens", registry=r)
        self.ttft = Histogram("spear_time_to_first_token_seconds", "Arrival to first output token",
                              buckets=_LATENCY_BUCKETS, registry=r)
        self.itl = Histogram("spear_inter_token_latency_seconds", "Time between consecutive output tokens",
                             buckets=_LATENCY_BUCKETS, registry=r)
        self.e2e = Histogram("spear_request_latency_seconds", "Arrival to last token of finished requests",
                             buckets=_E2E_BUCKETS, registry=r)
        self.kv_usage = Gauge("spear_kv_cache_usage_ratio", "Fraction of KV cache blocks in use", registry=r)
        self.waiting = Gauge("spear_num_requests_waiting", "Requests in the waiting queue", registry=r)
        self.running = Gauge("spear_num_requests_running", "Requests being decoded or prefilled", registry=r)
        self.preemptions = Counter("spear_preemptions", "Sequences preempted for lack of KV blocks", registry=r)
        # read at scrape time (AsyncEngine sets its function): a hung step shows as a growing value
        self.step_running = Gauge("spear_engine_step_running_seconds",
                                  "How long the engine step now running has run (0 between steps)", registry=r)
        self._preempted_seen = 0

    def observe(self, out: RequestOutput, now: float, last_token_time: float | None) -> None:
        """One step's output of one request; ``last_token_time`` is when its previous token came."""
        n = len(out.new_token_ids)
        self.generation_tokens.inc(n)
        if last_token_time is None:
            self.prompt_tokens.inc(out.num_prompt_tokens)
            self.ttft.observe(now - out.arrival_time)
        elif n:
            self.itl.observe((now - last_token_time) / n)
        if out.finished:
            self.requests.labels(out.finish_reason).inc()
            self.e2e.observe(now - out.arrival_time)

    def set_stats(self, stats: EngineStats) -> None:
        self.kv_usage.set(stats.kv_usage)
        self.waiting.set(stats.num_waiting)
        self.running.set(stats.num_running)
        if stats.num_preemptions > self._preempted_seen:
            self.preemptions.inc(stats.num_preemptions - self._preempted_seen)
            self._preempted_seen = stats.num_preemptions

    def render(self) -> bytes:
        return generate_latest(self.registry)
