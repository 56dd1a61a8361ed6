"""Prometheus metrics of the server, in a registry of their own (``/metrics``)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from spear.serve.core.messages import EngineStats, StepRecord
from spear.serve.frontend.output import RequestOutput

_LATENCY_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0,
                    30.0, 60.0)
_E2E_BUCKETS = (0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 60.0, 120.0, 300.0)
# a step is milliseconds: fine buckets around the usual inter-token targets (16-25 ms)
_STEP_BUCKETS = (0.002, 0.004, 0.006, 0.008, 0.01, 0.012, 0.014, 0.016, 0.018, 0.02, 0.022, 0.025, 0.03, 0.04,
                 0.05, 0.075, 0.1, 0.15, 0.25, 0.5, 1.0, 2.5, 5.0)
_HOP_BUCKETS = (0.0005, 0.001, 0.002, 0.004, 0.008, 0.016, 0.032, 0.064, 0.128, 0.256, 1.0)
_CHUNK_BUCKETS = (0, 16, 32, 64, 128, 256, 384, 512, 768, 1024, 1536, 2048, 4096, 8192)


class ServingMetrics:
    def __init__(self):
        r = self.registry = CollectorRegistry()
        self.requests = Counter("spear_requests", "Finished requests, by finish reason (stop, length, abort)",
                                ["finish_reason"], registry=r)
        self.rejected = Counter("spear_requests_rejected", "Requests refused before running, by reason",
                                ["reason"], registry=r)
        self.connections_closed = Counter(
            "spear_http_connections_closed", "HTTP connections the server closed, or clients left, before a request "
            "was in, by reason (api/transport.py; client_left: the client left mid-upload)", ["reason"], registry=r)
        # where a token's time goes between the engine core and its client, in the server's process
        self.output_delay = Histogram("spear_core_output_delay_seconds", "From the engine core sending a step's "
                                      "message to the server handling it", buckets=_HOP_BUCKETS, registry=r)
        self.loop_lag = Histogram("spear_event_loop_lag_seconds", "How late the server's event loop woke a task "
                                  "that slept 20 ms", buckets=_HOP_BUCKETS, registry=r)
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
        # read at scrape time (AsyncLLM sets its function): a hung step shows as a growing value
        self.step_running = Gauge("spear_engine_step_running_seconds",
                                  "How long the engine step now running has run (0 between steps)", registry=r)
        self.itl_slo = Gauge("spear_itl_slo_seconds", "The inter-token latency target (0: none)", registry=r)
        self.prefill_tokens = Histogram("spear_step_prefill_tokens", "Prefill tokens the scheduler put in each step",
                                        buckets=_CHUNK_BUCKETS, registry=r)
        self.chunk_budget = Gauge("spear_step_chunk_budget_tokens",
                                  "Prefill tokens the latency target allowed in the last step", registry=r)
        self.step_seconds = Histogram("spear_step_seconds", "Measured wall time of each engine step",
                                      buckets=_STEP_BUCKETS, registry=r)
        self.step_predicted = Histogram("spear_step_predicted_seconds",
                                        "The latency table's prediction of each step with decodes",
                                        buckets=_STEP_BUCKETS, registry=r)
        self.step_residual = Gauge("spear_step_prediction_error_ratio",
                                   "(interval - predicted) / predicted of the last predicted step (interval: from "
                                   "the previous step's end)", registry=r)
        self.steps_over_slo = Counter("spear_steps_over_slo", "Steps with decodes whose interval (from the previous "
                                      "step's end) exceeded the target", registry=r)
        self.correction = Gauge("spear_latency_correction_ratio",
                                "Running (interval - table) / table of the steps of a kind, which corrects the "
                                "latency table's predictions (step_tokens: 0 decode-only, N mixed steps of N padded "
                                "tokens, 1 every mixed step without CUDA graphs)", ["step_tokens"], registry=r)
        self.frames_dropped = Counter("spear_core_frames_dropped", "Frames of the link between the server and the "
                                      "engine core that their receiver (side: server, core) dropped, by reason "
                                      "(malformed: not signed or not the protocol's; replayed)",
                                      ["side", "reason"], registry=r)
        self._preempted_seen = 0
        self._dropped_seen: dict[tuple[str, str], int] = {}

    def observe(self, out: RequestOutput, now: float, last_token_time: float | None) -> None:
        """One step's output of one request; ``last_token_time`` is when its previous token came. The
        step's tokens are counted for all its requests at once (``generation_tokens.inc``)."""
        n = len(out.new_token_ids)
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
        self.itl_slo.set(0.0 if stats.itl_slo_ms is None else stats.itl_slo_ms / 1e3)
        for kind, ratio in stats.latency_correction.items():
            self.correction.labels(str(kind)).set(ratio)

    def count_dropped_frames(self, totals: dict[tuple[str, str], int]) -> None:
        """The link's dropped frames so far, by (side, reason) (CoreClient.frames_dropped)."""
        for key, total in totals.items():
            seen = self._dropped_seen.get(key, 0)
            if total > seen:
                self.frames_dropped.labels(*key).inc(total - seen)
                self._dropped_seen[key] = total

    def observe_step(self, step: StepRecord, itl_slo_ms: float | None) -> None:
        """Every engine step, as it comes."""
        measured = step.measured_ms / 1e3
        self.step_seconds.observe(measured)
        self.prefill_tokens.observe(step.prefill_tokens)
        if step.chunk_budget is not None:
            self.chunk_budget.set(step.chunk_budget)
        if step.predicted_ms is not None:
            self.step_predicted.observe(step.predicted_ms / 1e3)
            self.step_residual.set((step.interval_ms - step.predicted_ms) / step.predicted_ms)
        if itl_slo_ms is not None and step.num_decodes and step.interval_ms > itl_slo_ms:
            self.steps_over_slo.inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)
