"""Prometheus metrics of the serving front end (names as vLLM's, prefixed ``runtime:``).

``EngineMetrics`` owns a private CollectorRegistry. The AsyncLLM feeds it every
EngineCoreOutputs it receives (per-request timings are measured from the
arrival of the request to each batch of new tokens) and every abort; the HTTP
layer counts responses by status. ``render()`` gives the /metrics text.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    disable_created_metrics,
    generate_latest,
)

from runtime.engine.messages import EngineCoreOutput, EngineCoreOutputs

PREFIX = "runtime:"
_TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0)
_TPOT_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0)
_E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0)

CONTENT_TYPE = CONTENT_TYPE_LATEST


@dataclass(slots=True)
class _RequestTimes:
    arrival: float
    first_token: float | None = None
    last_token: float | None = None
    num_generated: int = 0


class EngineMetrics:
    """Counters, gauges and histograms of one served model."""

    def __init__(self, model_name: str):
        disable_created_metrics()  # no "_created" twin of every counter
        self.registry = CollectorRegistry()
        self._times: dict[str, _RequestTimes] = {}
        labels = ["model_name"]
        r = self.registry
        self.num_running = Gauge(PREFIX + "num_requests_running", "Requests running in the engine", labels, registry=r)
        self.num_waiting = Gauge(PREFIX + "num_requests_waiting", "Requests waiting to run", labels, registry=r)
        self.kv_usage = Gauge(PREFIX + "kv_cache_usage_perc", "Fraction of KV cache blocks in use (0-1)", labels, registry=r)
        self.prefix_queries = Counter(PREFIX + "prefix_cache_queries", "Prompt tokens looked up in the prefix cache", labels, registry=r)
        self.prefix_hits = Counter(PREFIX + "prefix_cache_hits", "Prompt tokens found in the prefix cache", labels, registry=r)
        self.prefix_hit_rate = Gauge(PREFIX + "prefix_cache_hit_rate", "Prefix cache hits / queries so far", labels, registry=r)
        self.preemptions = Counter(PREFIX + "num_preemptions", "Requests preempted by the scheduler", labels, registry=r)
        self.prompt_tokens = Counter(PREFIX + "prompt_tokens", "Prompt tokens of requests added", labels, registry=r)
        self.generation_tokens = Counter(PREFIX + "generation_tokens", "Generated tokens", labels, registry=r)
        self.request_success = Counter(
            PREFIX + "request_success", "Finished requests by finish reason", labels + ["finished_reason"], registry=r
        )
        self.ttft = Histogram(
            PREFIX + "time_to_first_token_seconds", "Time to first token", labels, buckets=_TTFT_BUCKETS, registry=r
        )
        self.tpot = Histogram(
            PREFIX + "time_per_output_token_seconds", "Mean time per output token after the first",
            labels, buckets=_TPOT_BUCKETS, registry=r,
        )
        self.e2e = Histogram(
            PREFIX + "e2e_request_latency_seconds", "End-to-end request latency", labels, buckets=_E2E_BUCKETS, registry=r
        )
        self.http_responses = Counter(
            PREFIX + "http_responses", "HTTP responses of the API by path and status", ["path", "status"], registry=r
        )
        self.request_errors = Counter(
            PREFIX + "request_errors", "Requests answered with an error, by OpenAI error type",
            labels + ["status", "type"], registry=r,
        )
        self.model_name = model_name
        self._last_prefix = (0, 0, 0)  # queries, hits, preemptions reported so far (cumulative)

    # ------------------------------------------------------------ request life
    def add_request(self, request_id: str, num_prompt_tokens: int, arrival: float | None = None) -> None:
        self._times[request_id] = _RequestTimes(arrival=time.time() if arrival is None else arrival)
        self.prompt_tokens.labels(self.model_name).inc(num_prompt_tokens)

    def end_requests(self, request_ids, reason: str, now: float | None = None) -> None:
        """Requests that ended in the front end: "abort", "error", or "stop" (a stop string)."""
        now = time.time() if now is None else now
        for request_id in request_ids:
            times = self._times.pop(request_id, None)
            if times is not None:
                self._observe_end(times, reason, now)

    def record(self, outputs: EngineCoreOutputs, now: float | None = None) -> None:
        now = time.time() if now is None else now
        for output in outputs.outputs:
            self._record_output(output, now)
        if outputs.scheduler_stats:
            self._record_stats(outputs.scheduler_stats)

    def _record_output(self, output: EngineCoreOutput, now: float) -> None:
        times = self._times.get(output.request_id)
        if times is None:
            return
        num_new = len(output.new_token_ids)
        if num_new:
            self.generation_tokens.labels(self.model_name).inc(num_new)
            if times.first_token is None:
                times.first_token = now
                self.ttft.labels(self.model_name).observe(now - times.arrival)
            times.last_token = now
            times.num_generated += num_new
        if output.finish_reason is None:
            return
        del self._times[output.request_id]
        self._observe_end(times, output.finish_reason.value, now)

    def _observe_end(self, times: _RequestTimes, reason: str, now: float) -> None:
        self.request_success.labels(self.model_name, reason).inc()
        self.e2e.labels(self.model_name).observe(now - times.arrival)
        if times.num_generated > 1 and times.first_token is not None:
            self.tpot.labels(self.model_name).observe((times.last_token - times.first_token) / (times.num_generated - 1))

    def _record_stats(self, stats: dict) -> None:
        name = self.model_name
        self.num_running.labels(name).set(stats.get("num_running", 0))
        self.num_waiting.labels(name).set(stats.get("num_waiting", 0))
        self.kv_usage.labels(name).set(stats.get("kv_cache_usage", 0.0))
        queries, hits = stats.get("prefix_cache_queries", 0), stats.get("prefix_cache_hits", 0)
        preemptions = stats.get("num_preemptions", 0)
        last_queries, last_hits, last_preemptions = self._last_prefix
        self.prefix_queries.labels(name).inc(max(queries - last_queries, 0))
        self.prefix_hits.labels(name).inc(max(hits - last_hits, 0))
        self.preemptions.labels(name).inc(max(preemptions - last_preemptions, 0))
        self._last_prefix = (queries, hits, preemptions)
        self.prefix_hit_rate.labels(name).set(hits / queries if queries else 0.0)

    def mark_engine_dead(self) -> None:
        """No engine, nothing runs: zero the gauges and fail what was in flight."""
        self.end_requests(list(self._times), "error")
        self.num_running.labels(self.model_name).set(0)
        self.num_waiting.labels(self.model_name).set(0)

    # ------------------------------------------------------------------- HTTP
    def record_http(self, path: str, status: int) -> None:
        self.http_responses.labels(path, str(status)).inc()

    def record_error(self, status: int, error_type: str) -> None:
        self.request_errors.labels(self.model_name, str(status), error_type).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)
