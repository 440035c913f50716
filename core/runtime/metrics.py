"""Prometheus metrics of the serving front end, under ``runtime:`` names and vLLM's ``vllm:`` names.

``EngineMetrics`` owns a private CollectorRegistry. The AsyncLLM feeds it every
EngineCoreOutputs it receives (per-request timings are measured from the
arrival of the request to each batch of new tokens) and every abort; the HTTP
layer counts responses by status. ``render()`` gives the /metrics text.

Each engine metric is written twice, as ``runtime:<name>`` and as vLLM's name
(``vllm:num_requests_running``, ``vllm:gpu_cache_usage_perc`` ...), so dashboards made
for vLLM (its published Grafana dashboard) work unchanged. The HTTP counters and the
prefix cache hit rate gauge, which vLLM does not have, are ``runtime:`` only.

With several engine cores (``--data-parallel-size``) the engine metrics above are the
server's: the replicas' scheduler stats combined (``combine_engine_stats``). Each replica's
own running, waiting, KV usage and finished requests are the ``runtime:engine_*`` series,
labelled ``engine="<rank>"`` as vLLM labels its per-engine series (present with one engine too).
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from dataclasses import dataclass
from itertools import zip_longest

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    disable_created_metrics,
    generate_latest,
)

from runtime.messages import EngineCoreOutput, EngineCoreOutputs, FinishReason
from runtime.stat_logger import StatLogger

PREFIX = "runtime:"
VLLM_PREFIX = "vllm:"
# vLLM's bucket bounds (every one of them, so a dashboard's ``le="..."`` query finds its bucket), reaching
# minutes for the first token and hours for a request: a long queue must not fall into +Inf.
_TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0,
                 80.0, 160.0, 640.0, 2560.0)
_TPOT_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                 20.0, 40.0, 80.0)
_E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0, 480.0,
                960.0, 1920.0, 7680.0)
_TOKEN_BUCKETS = tuple(m * 10**e for e in range(7) for m in (1, 2, 5) if m * 10**e <= 1_000_000)  # 1, 2, 5, 10 ...

CONTENT_TYPE = CONTENT_TYPE_LATEST
_OFFLOAD_COUNTERS = {
    "hit_tokens": "Prompt tokens loaded from a KV offload tier instead of computed",
    "blocks_stored": "KV blocks saved to the offload tiers",
    "bytes_stored": "Bytes of KV blocks saved to the offload tiers",
    "blocks_loaded": "KV blocks loaded from the offload tiers into the device cache",
    "bytes_loaded": "Bytes of KV blocks loaded from the offload tiers",
    "load_seconds": "Time spent loading KV blocks from the offload tiers",
    "checksum_failures": "Offloaded KV blocks that failed their checksum (recomputed)",
}


def combine_engine_stats(stats_by_engine: Iterable[dict]) -> dict:
    """The scheduler stats of several engine cores as one: counts and cumulative counters summed
    (lists element-wise), the KV cache usage averaged (every replica has the same cache)."""
    all_stats = list(stats_by_engine)
    combined: dict = {}
    for stats in all_stats:
        for key, value in stats.items():
            if isinstance(value, list):
                combined[key] = [a + b for a, b in zip_longest(combined.get(key, []), value, fillvalue=0)]
            elif isinstance(value, (int, float)):
                combined[key] = combined.get(key, 0) + value
    if all_stats:
        combined["kv_cache_usage"] = sum(s.get("kv_cache_usage", 0.0) for s in all_stats) / len(all_stats)
    return combined


class _Twins:
    """One metric (or one labelled child) under several names, updated together."""

    __slots__ = ("_metrics",)

    def __init__(self, metrics):
        self._metrics = tuple(metrics)

    def labels(self, *values: str) -> "_Twins":
        return _Twins(m.labels(*values) for m in self._metrics)

    def inc(self, amount: float = 1.0) -> None:
        for m in self._metrics:
            m.inc(amount)

    def set(self, value: float) -> None:
        for m in self._metrics:
            m.set(value)

    def observe(self, value: float) -> None:
        for m in self._metrics:
            m.observe(value)


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
        self.model_name = model_name
        self.stat_logger = StatLogger()  # the periodic stats log line, fed the same outputs
        self._times: dict[str, _RequestTimes] = {}
        self._last_prefix = (0, 0, 0)  # queries, hits, preemptions reported so far (cumulative)
        self._last_spec: dict[str, object] = {}  # speculative-decoding counts reported so far (cumulative)
        self._last_offload: dict[str, float] = {}  # KV offload counts reported so far (cumulative)
        self._engine_stats: dict[int, dict] = {}  # engine index -> its latest scheduler stats
        self._add_scheduler_metrics()
        self._add_request_metrics()
        self.http_responses = Counter(
            PREFIX + "http_responses", "HTTP responses of the API by path and status", ["path", "status"],
            registry=self.registry,
        )
        self.request_errors = self._metric(
            Counter, "request_errors", "Requests answered with an error, by OpenAI error type",
            ("status", "type"), vllm_names=(),
        )

    def _metric(self, kind, name: str, doc: str, extra_labels=(), vllm_names: tuple[str, ...] | None = None, **kwargs):
        """``runtime:<name>`` and ``vllm:<n>`` for each of ``vllm_names`` (default: ``name``);
        bound to this model when there are no other labels."""
        names = [PREFIX + name] + [VLLM_PREFIX + n for n in ((name,) if vllm_names is None else vllm_names)]
        labels = ["model_name", *extra_labels]
        twins = _Twins(kind(n, doc, labels, registry=self.registry, **kwargs) for n in names)
        return twins if extra_labels else twins.labels(self.model_name)

    def _add_scheduler_metrics(self) -> None:
        m = self._metric
        self.num_running = m(Gauge, "num_requests_running", "Requests running in the engine")
        self.num_waiting = m(Gauge, "num_requests_waiting", "Requests waiting to run")
        self.kv_usage = m(
            Gauge, "kv_cache_usage_perc", "Fraction of KV cache blocks in use (0-1)",
            vllm_names=("kv_cache_usage_perc", "gpu_cache_usage_perc"),
        )
        self.prefix_queries = m(Counter, "prefix_cache_queries", "Prompt tokens looked up in the prefix cache")
        self.prefix_hits = m(Counter, "prefix_cache_hits", "Prompt tokens found in the prefix cache")
        self.prefix_hit_rate = m(Gauge, "prefix_cache_hit_rate", "Prefix cache hits / queries so far", vllm_names=())
        self.preemptions = m(Counter, "num_preemptions", "Requests preempted by the scheduler")
        # Speculative decoding (vLLM's names): a draft is one request's drafts verified in one step.
        self.spec_counters = {
            "spec_decode_num_drafts": m(Counter, "spec_decode_num_drafts", "Speculative drafts verified (requests x steps)"),
            "spec_decode_num_draft_tokens": m(Counter, "spec_decode_num_draft_tokens", "Speculative draft tokens verified"),
            "spec_decode_num_accepted_tokens": m(
                Counter, "spec_decode_num_accepted_tokens", "Speculative draft tokens accepted"
            ),
        }
        self.spec_accepted_per_pos = m(
            Counter, "spec_decode_num_accepted_tokens_per_pos", "Speculative draft tokens accepted, by position in the draft",
            ("position",),
        )
        # KV offload tiers (runtime-plugin-kv-offload): scheduler stats key -> counter.
        self.offload_counters = {
            "kv_offload_" + key: m(Counter, "kv_offload_" + key, doc, vllm_names=()) for key, doc in _OFFLOAD_COUNTERS.items()
        }
        self.offload_hits = m(Counter, "kv_offload_hits", "KV blocks loaded from an offload tier, by tier", ("tier",),
                              vllm_names=())
        self._add_engine_metrics()

    def _add_engine_metrics(self) -> None:
        """Per engine core (data-parallel rank), labelled ``engine``."""
        m = self._metric
        self.engine_running = m(Gauge, "engine_num_requests_running", "Requests running in each engine core",
                                ("engine",), vllm_names=())
        self.engine_waiting = m(Gauge, "engine_num_requests_waiting", "Requests waiting in each engine core",
                                ("engine",), vllm_names=())
        self.engine_kv_usage = m(Gauge, "engine_kv_cache_usage_perc", "Fraction of each engine core's KV cache in use",
                                 ("engine",), vllm_names=())
        self.engine_success = m(Counter, "engine_request_success", "Requests each engine core finished, by finish reason",
                                ("engine", "finished_reason"), vllm_names=())

    def _add_request_metrics(self) -> None:
        m = self._metric
        self.prompt_tokens = m(Counter, "prompt_tokens", "Prompt tokens of requests added")
        self.generation_tokens = m(Counter, "generation_tokens", "Generated tokens")
        self.request_success = m(Counter, "request_success", "Finished requests by finish reason", ("finished_reason",))
        for reason in FinishReason:  # every reason's series from the start (at 0), as vLLM shows them
            self.request_success.labels(self.model_name, reason.value)
        self.ttft = m(Histogram, "time_to_first_token_seconds", "Time to first token", buckets=_TTFT_BUCKETS)
        self.tpot = m(
            Histogram, "time_per_output_token_seconds", "Mean time per output token after the first, per request",
            buckets=_TPOT_BUCKETS,
        )
        # vLLM's name of the same per-request mean (its time_per_output_token_seconds samples every token gap)
        self.request_tpot = m(
            Histogram, "request_time_per_output_token_seconds", "Mean time per output token after the first, per request",
            buckets=_TPOT_BUCKETS,
        )
        self.itl = m(
            Histogram, "inter_token_latency_seconds",
            "Time between consecutive output tokens (a batch of k tokens arriving together counts k gaps)",
            buckets=_TPOT_BUCKETS,
        )
        self.e2e = m(Histogram, "e2e_request_latency_seconds", "End-to-end request latency", buckets=_E2E_BUCKETS)
        self.request_prompt_tokens = m(
            Histogram, "request_prompt_tokens", "Prompt tokens per request", buckets=_TOKEN_BUCKETS
        )
        self.request_generation_tokens = m(
            Histogram, "request_generation_tokens", "Generated tokens per finished request", buckets=_TOKEN_BUCKETS
        )

    # ------------------------------------------------------------ request life
    def add_request(self, request_id: str, num_prompt_tokens: int, arrival: float | None = None) -> None:
        """A request (or one of its ``n`` children: those after the first pass 0 prompt tokens) arrived."""
        self._times[request_id] = _RequestTimes(arrival=time.time() if arrival is None else arrival)
        self.prompt_tokens.inc(num_prompt_tokens)
        if num_prompt_tokens:
            self.request_prompt_tokens.observe(num_prompt_tokens)
            self.stat_logger.record_prompt(request_id, num_prompt_tokens)

    def end_requests(self, request_ids, reason: str, now: float | None = None) -> None:
        """Requests that ended in the front end: "abort", "error", or "stop" (a stop string)."""
        now = time.time() if now is None else now
        self.stat_logger.forget(request_ids)
        for request_id in request_ids:
            times = self._times.pop(request_id, None)
            if times is not None:
                self._observe_end(times, reason, now)

    def record(self, outputs: EngineCoreOutputs, now: float | None = None, engine_index: int = 0) -> None:
        """One message of engine core ``engine_index`` (its data-parallel rank)."""
        now = time.time() if now is None else now
        engine = str(engine_index)
        for output in outputs.outputs:
            self._record_output(output, now, engine)
        if outputs.new_tokens is not None:
            for request_id in outputs.new_tokens.request_ids:
                times = self._times.get(request_id)
                if times is not None:
                    self._record_tokens(times, 1, now)
        combined = None
        if outputs.scheduler_stats:
            combined = self._record_engine_stats(outputs.scheduler_stats, engine_index)
            self._record_stats(combined)
        self.stat_logger.record(outputs, combined)

    def _record_engine_stats(self, stats: dict, engine_index: int) -> dict:
        """Set engine ``engine_index``'s own gauges; the server's stats over every engine heard from."""
        self._engine_stats[engine_index] = stats
        engine = str(engine_index)
        self.engine_running.labels(self.model_name, engine).set(stats.get("num_running", 0))
        self.engine_waiting.labels(self.model_name, engine).set(stats.get("num_waiting", 0))
        self.engine_kv_usage.labels(self.model_name, engine).set(stats.get("kv_cache_usage", 0.0))
        if len(self._engine_stats) == 1:
            return stats
        return combine_engine_stats(self._engine_stats.values())

    def _record_output(self, output: EngineCoreOutput, now: float, engine: str = "0") -> None:
        times = self._times.get(output.request_id)
        if times is None:
            return
        num_new = len(output.new_token_ids)
        if num_new:
            self._record_tokens(times, num_new, now)
        if output.finish_reason is None:
            return
        del self._times[output.request_id]
        self._observe_end(times, output.finish_reason.value, now)
        self.engine_success.labels(self.model_name, engine, output.finish_reason.value).inc()

    def _record_tokens(self, times: _RequestTimes, num_new: int, now: float) -> None:
        self.generation_tokens.inc(num_new)
        if times.first_token is None:
            times.first_token = now
            self.ttft.observe(now - times.arrival)
            gaps = [0.0] * (num_new - 1)  # tokens that came with the first one
        else:
            gaps = [(now - times.last_token) / num_new] * num_new
        for gap in gaps:
            self.itl.observe(gap)
        times.last_token = now
        times.num_generated += num_new

    def _observe_end(self, times: _RequestTimes, reason: str, now: float) -> None:
        self.request_success.labels(self.model_name, reason).inc()
        self.e2e.observe(now - times.arrival)
        self.request_generation_tokens.observe(times.num_generated)
        if times.num_generated > 1 and times.first_token is not None:
            tpot = (times.last_token - times.first_token) / (times.num_generated - 1)
            self.tpot.observe(tpot)
            self.request_tpot.observe(tpot)

    def _record_stats(self, stats: dict) -> None:
        self.num_running.set(stats.get("num_running", 0))
        self.num_waiting.set(stats.get("num_waiting", 0))
        self.kv_usage.set(stats.get("kv_cache_usage", 0.0))
        queries, hits = stats.get("prefix_cache_queries", 0), stats.get("prefix_cache_hits", 0)
        preemptions = stats.get("num_preemptions", 0)
        last_queries, last_hits, last_preemptions = self._last_prefix
        self.prefix_queries.inc(max(queries - last_queries, 0))
        self.prefix_hits.inc(max(hits - last_hits, 0))
        self.preemptions.inc(max(preemptions - last_preemptions, 0))
        self._last_prefix = (queries, hits, preemptions)
        self.prefix_hit_rate.set(hits / queries if queries else 0.0)
        if "spec_decode_num_drafts" in stats:
            self._record_spec_stats(stats)
        if "kv_offload_hit_tokens" in stats:
            self._record_offload_stats(stats)

    def _record_offload_stats(self, stats: dict) -> None:
        """The KV offload tiers' cumulative counts, as increments since the last report."""
        last = self._last_offload
        for key, value in stats.items():
            if not key.startswith("kv_offload_"):
                continue
            delta = max(value - last.get(key, 0), 0)
            last[key] = value
            if key in self.offload_counters:
                self.offload_counters[key].inc(delta)
            elif key.startswith("kv_offload_hits_"):
                self.offload_hits.labels(self.model_name, key.removeprefix("kv_offload_hits_")).inc(delta)

    def _record_spec_stats(self, stats: dict) -> None:
        """The scheduler's cumulative speculative-decoding counts, as increments since the last report."""
        last = self._last_spec
        for key, counter in self.spec_counters.items():
            value = stats.get(key, 0)
            counter.inc(max(value - last.get(key, 0), 0))
            last[key] = value
        per_pos = stats.get("spec_decode_num_accepted_tokens_per_pos") or []
        last_per_pos = last.get("per_pos") or []
        for position, value in enumerate(per_pos):
            previous = last_per_pos[position] if position < len(last_per_pos) else 0
            self.spec_accepted_per_pos.labels(self.model_name, str(position)).inc(max(value - previous, 0))
        last["per_pos"] = list(per_pos)

    def mark_engine_dead(self) -> None:
        """No engine, nothing runs: zero the gauges and fail what was in flight."""
        self.end_requests(list(self._times), "error")
        self.num_running.set(0)
        self.num_waiting.set(0)
        for engine_index in self._engine_stats:
            self.engine_running.labels(self.model_name, str(engine_index)).set(0)
            self.engine_waiting.labels(self.model_name, str(engine_index)).set(0)

    # ------------------------------------------------------------------- HTTP
    def record_http(self, path: str, status: int) -> None:
        self.http_responses.labels(path, str(status)).inc()

    def record_error(self, status: int, error_type: str) -> None:
        self.request_errors.labels(self.model_name, str(status), error_type).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)
