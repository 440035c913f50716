"""Prometheus metrics of the serving front end, under ``runtime:`` names and vLLM's ``vllm:`` names.

``EngineMetrics`` owns a private CollectorRegistry. The AsyncLLM feeds it every request it adds or
ends in the front end and every EngineCoreOutputs it receives; the HTTP layer counts responses by
status. ``render()`` gives the /metrics text.

Each engine metric is written twice. ``runtime:<name>`` is the server's, labelled ``model_name``. vLLM's
name (``vllm:num_requests_running``, ``vllm:gpu_cache_usage_perc`` ...) is labelled ``model_name`` and
``engine`` (the engine core's data-parallel rank), one series per engine core, as vLLM labels it, so
dashboards made for vLLM (its published Grafana dashboard) work unchanged. With one engine core both
have the same values. With several (``--data-parallel-size``) the runtime gauges are the replicas'
scheduler stats combined (``combine_engine_stats``) and the runtime counters and histograms count every
engine's events. The HTTP counters, the prefix cache hit rate gauge and the ``runtime:engine_*`` series
(per engine core, labelled ``engine``) are ``runtime:`` only.

Request timing, as vLLM defines it: TTFT and e2e latency from the request's arrival in the front end;
its phases on the engine core's clock (``runtime.metrics_series.RequestTimes.phases``). An ``n > 1``
request's children are requests of their own; ``request_params_n`` and ``request_max_num_generation_tokens``
(the most tokens of any child) are observed once per request, when its last child ends.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from itertools import zip_longest

from prometheus_client import (
    CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, disable_created_metrics, generate_latest,
)

from runtime.messages import EngineCoreOutput, EngineCoreOutputs, FinishReason
from runtime.metrics_series import (
    ITERATION_TOKEN_BUCKETS, N_BUCKETS, PREFIX, REQUEST_LATENCY_BUCKETS, TOKEN_BUCKETS, TPOT_BUCKETS, TTFT_BUCKETS,
    VLLM_PREFIX, Family, RequestTimes,
)
from runtime.stat_logger import StatLogger

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
_PER_POS = "spec_decode_num_accepted_tokens_per_pos"


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


class EngineMetrics:
    """Counters, gauges and histograms of one served model."""

    def __init__(self, model_name: str):
        disable_created_metrics()  # no "_created" twin of every counter
        self.registry = CollectorRegistry()
        self.model_name = model_name
        self.stat_logger = StatLogger()  # the periodic stats log line, fed the same outputs
        self._times: dict[str, RequestTimes] = {}
        self._parents: dict[str, list[int]] = {}  # n > 1 request id -> [n, children not ended, most tokens of one]
        self._last_counts: dict[int, dict] = {}  # engine index -> its cumulative counts reported so far
        self._engine_stats: dict[int, dict] = {}  # engine index -> its latest scheduler stats
        self._engines: set[str] = set()  # engine labels whose series exist
        self._plain: list[Family] = []  # families with no label but model_name (and engine)
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
        self._see_engine("0")

    def _metric(self, kind, name: str, doc: str, extra_labels=(), vllm_names: tuple[str, ...] | None = None,
                **kwargs) -> Family:
        """``runtime:<name>`` and ``vllm:<n>`` (labelled by engine) for each of ``vllm_names`` (default: ``name``)."""
        names = (name,) if vllm_names is None else vllm_names
        own = kind(PREFIX + name, doc, ["model_name", *extra_labels], registry=self.registry, **kwargs)
        twins = [kind(VLLM_PREFIX + n, doc, ["model_name", "engine", *extra_labels], registry=self.registry, **kwargs)
                 for n in names]
        family = Family(own, twins, self.model_name)
        if not extra_labels:
            self._plain.append(family)
        return family

    def _add_scheduler_metrics(self) -> None:
        m = self._metric
        self.num_running = m(Gauge, "num_requests_running", "Requests running in the engine")
        self.num_waiting = m(Gauge, "num_requests_waiting", "Requests waiting to run")
        self.kv_usage = m(
            Gauge, "kv_cache_usage_perc", "Fraction of KV cache blocks in use (0-1)",
            vllm_names=("kv_cache_usage_perc", "gpu_cache_usage_perc"),
        )
        self.prefix_hit_rate = m(Gauge, "prefix_cache_hit_rate", "Prefix cache hits / queries so far", vllm_names=())
        self.iteration_tokens = m(Histogram, "iteration_tokens_total", "Tokens computed per engine step",
                                  buckets=ITERATION_TOKEN_BUCKETS)
        # Scheduler stats key (a cumulative count) -> its counter. Speculative decoding as vLLM names it:
        # a draft is one request's drafts verified in one step.
        self.stat_counters = {
            "prefix_cache_queries": m(Counter, "prefix_cache_queries", "Prompt tokens looked up in the prefix cache"),
            "prefix_cache_hits": m(Counter, "prefix_cache_hits", "Prompt tokens found in the prefix cache"),
            "num_preemptions": m(Counter, "num_preemptions", "Requests preempted by the scheduler"),
            "spec_decode_num_drafts": m(Counter, "spec_decode_num_drafts", "Speculative drafts verified (requests x steps)"),
            "spec_decode_num_draft_tokens": m(Counter, "spec_decode_num_draft_tokens", "Speculative draft tokens verified"),
            "spec_decode_num_accepted_tokens": m(
                Counter, "spec_decode_num_accepted_tokens", "Speculative draft tokens accepted"
            ),
        }
        # KV offload tiers (runtime-plugin-kv-offload)
        for key, doc in _OFFLOAD_COUNTERS.items():
            self.stat_counters["kv_offload_" + key] = m(Counter, "kv_offload_" + key, doc, vllm_names=())
        self.spec_accepted_per_pos = m(
            Counter, _PER_POS, "Speculative draft tokens accepted, by position in the draft", ("position",),
        )
        self.offload_hits = m(Counter, "kv_offload_hits", "KV blocks loaded from an offload tier, by tier", ("tier",),
                              vllm_names=())
        self._add_engine_metrics()

    def _add_engine_metrics(self) -> None:
        """Per engine core (data-parallel rank), labelled ``engine``, runtime only."""
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
        self.prompt_tokens = m(Counter, "prompt_tokens", "Prompt tokens of requests prefilled")
        self.generation_tokens = m(Counter, "generation_tokens", "Generated tokens")
        self.request_success = m(Counter, "request_success", "Finished requests by finish reason", ("finished_reason",))
        self.ttft = m(Histogram, "time_to_first_token_seconds", "Time to first token", buckets=TTFT_BUCKETS)
        self.tpot = m(
            Histogram, "time_per_output_token_seconds", "Mean time per output token after the first, per request",
            buckets=TPOT_BUCKETS,
        )
        # vLLM's name of the same per-request mean (its time_per_output_token_seconds samples every token gap)
        self.request_tpot = m(
            Histogram, "request_time_per_output_token_seconds", "Mean time per output token after the first, per request",
            buckets=TPOT_BUCKETS,
        )
        self.itl = m(
            Histogram, "inter_token_latency_seconds",
            "Time between consecutive output tokens (a batch of k tokens arriving together counts k gaps)",
            buckets=TPOT_BUCKETS,
        )
        self.e2e = m(Histogram, "e2e_request_latency_seconds", "End-to-end request latency", buckets=REQUEST_LATENCY_BUCKETS)
        # queue, prefill, decode, inference: in the order of RequestTimes.phases
        phases = (("queue", "Time from queued in the engine to first scheduled"),
                  ("prefill", "Time from first scheduled to the first token"),
                  ("decode", "Time from the first token to the last"),
                  ("inference", "Time from first scheduled to the last token"))
        self.phase_histograms = [m(Histogram, f"request_{phase}_time_seconds", doc, buckets=REQUEST_LATENCY_BUCKETS)
                                 for phase, doc in phases]
        hist = [("request_prompt_tokens", "Prompt tokens per request"),
                ("request_generation_tokens", "Generated tokens per finished request"),
                ("request_max_num_generation_tokens", "Most tokens generated by one completion of a request (n > 1: of its n)"),
                ("request_params_max_tokens", "The max_tokens of each request")]
        (self.request_prompt_tokens, self.request_generation_tokens, self.request_max_generation,
         self.request_max_tokens) = (m(Histogram, name, doc, buckets=TOKEN_BUCKETS) for name, doc in hist)
        self.request_n = m(Histogram, "request_params_n", "The n of each request", buckets=N_BUCKETS)

    def _see_engine(self, engine: str) -> None:
        """Engine ``engine``'s series, at 0 until used (every finish reason's too, as vLLM shows them)."""
        self._engines.add(engine)
        for family in self._plain:
            family.on(engine)
        for reason in FinishReason:
            self.request_success.on(engine, reason.value)

    # ------------------------------------------------------------ request life
    def add_request(
        self, request_id: str, num_prompt_tokens: int, arrival: float | None = None, *, max_tokens: int | None = None,
        parent: str | None = None, n: int = 1,
    ) -> None:
        """A request arrived, or one of the ``n`` children of request ``parent`` (those after the first pass 0
        prompt tokens). Its engine core is the one its outputs come from, unless ``set_engine`` says."""
        arrival = time.time() if arrival is None else arrival
        self._times[request_id] = RequestTimes(arrival, num_prompt_tokens, max_tokens=max_tokens, parent=parent)
        if parent is not None:
            self._parents.setdefault(parent, [n, n, 0])
        if num_prompt_tokens:
            self.stat_logger.record_prompt(request_id, num_prompt_tokens)

    def set_engine(self, request_id: str, engine_index: int) -> None:
        """The engine core (data-parallel rank) request ``request_id`` went to, for its ``engine`` label."""
        times = self._times.get(request_id)
        if times is not None:
            times.engine = str(engine_index)

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
        sent = outputs.timestamp or now  # on the engine core's clock
        engine = str(engine_index)
        if engine not in self._engines:
            self._see_engine(engine)
        for output in outputs.outputs:
            self._record_output(output, now, sent, engine)
        if outputs.new_tokens is not None:
            self._record_new_tokens(outputs.new_tokens.request_ids, now, sent, engine)
        combined = None
        if outputs.scheduler_stats:
            combined = self._record_engine_stats(outputs.scheduler_stats, engine_index)
            self._record_stats(combined)
        self.stat_logger.record(outputs, combined)

    def _record_output(self, output: EngineCoreOutput, now: float, sent: float, engine: str) -> None:
        times = self._times.get(output.request_id)
        if times is None:
            return
        if output.scheduled_time:
            times.queued, times.scheduled = output.queued_time, output.scheduled_time
        num_new = len(output.new_token_ids)
        if num_new:
            self._record_tokens(times, num_new, now, sent, engine)
        if output.finish_reason is None:
            return
        del self._times[output.request_id]
        self._observe_end(times, output.finish_reason.value, now)
        self.engine_success.server(engine, output.finish_reason.value).inc()

    def _record_new_tokens(self, request_ids: list[str], now: float, sent: float, engine: str) -> None:
        """One token each, none a first token (the bulk of a decode step: the metric children looked up once)."""
        itl, num_tokens = self.itl.on(engine), 0
        for request_id in request_ids:
            times = self._times.get(request_id)
            if times is None:
                continue
            if times.first_token is None or times.engine != engine:
                self._record_tokens(times, 1, now, sent, engine)  # not seen from this engine before
                continue
            itl.observe(now - times.last_token)
            times.last_token, times.last_token_ts = now, sent
            times.num_generated += 1
            num_tokens += 1
        if num_tokens:
            self.generation_tokens.on(engine).inc(num_tokens)

    def _record_tokens(self, times: RequestTimes, num_new: int, now: float, sent: float, engine: str) -> None:
        if times.engine is None:
            times.engine = engine
        engine = times.engine
        self.generation_tokens.on(engine).inc(num_new)
        if times.first_token is None:
            times.first_token, times.first_token_ts = now, sent
            self.ttft.on(engine).observe(now - times.arrival)
            self.prompt_tokens.on(engine).inc(times.num_prompt_tokens)  # prefilled, as vLLM counts them
            gaps = [0.0] * (num_new - 1)  # tokens that came with the first one
        else:
            gaps = [(now - times.last_token) / num_new] * num_new
        itl = self.itl.on(engine)
        for gap in gaps:
            itl.observe(gap)
        times.last_token, times.last_token_ts = now, sent
        times.num_generated += num_new

    def _observe_end(self, times: RequestTimes, reason: str, now: float) -> None:
        engine = times.engine or "0"
        self.request_success.on(engine, reason).inc()
        self.e2e.on(engine).observe(now - times.arrival)
        if times.num_prompt_tokens:
            self.request_prompt_tokens.on(engine).observe(times.num_prompt_tokens)
        self.request_generation_tokens.on(engine).observe(times.num_generated)
        if times.max_tokens:
            self.request_max_tokens.on(engine).observe(times.max_tokens)
        if times.num_generated > 1 and times.first_token is not None:
            tpot = (times.last_token - times.first_token) / (times.num_generated - 1)
            self.tpot.on(engine).observe(tpot)
            self.request_tpot.on(engine).observe(tpot)
        phases = times.phases()
        if phases is not None:
            for family, seconds in zip(self.phase_histograms, phases):
                family.on(engine).observe(seconds)
        self._observe_request_end(times, engine)

    def _observe_request_end(self, times: RequestTimes, engine: str) -> None:
        """The user's request: n and the most tokens of one completion, once its last child (of n) ended."""
        n, most = 1, times.num_generated
        if times.parent is not None:
            group = self._parents.get(times.parent)
            if group is None:
                return
            group[1] -= 1
            group[2] = max(group[2], times.num_generated)
            if group[1] > 0:
                return
            del self._parents[times.parent]
            n, most = group[0], group[2]
        self.request_n.on(engine).observe(n)
        self.request_max_generation.on(engine).observe(most)

    # --------------------------------------------------------- scheduler stats
    def _record_engine_stats(self, stats: dict, engine_index: int) -> dict:
        """Engine ``engine_index``'s own series; returns the server's stats over every engine heard from."""
        self._engine_stats[engine_index] = stats
        engine = str(engine_index)
        running, waiting, usage = stats.get("num_running", 0), stats.get("num_waiting", 0), stats.get("kv_cache_usage", 0.0)
        self.engine_running.server(engine).set(running)
        self.engine_waiting.server(engine).set(waiting)
        self.engine_kv_usage.server(engine).set(usage)
        self.num_running.engine(engine).set(running)
        self.num_waiting.engine(engine).set(waiting)
        self.kv_usage.engine(engine).set(usage)
        self._record_counts(stats, engine_index)
        if stats.get("num_step_tokens"):
            self.iteration_tokens.on(engine).observe(stats["num_step_tokens"])
        if len(self._engine_stats) == 1:
            return stats
        return combine_engine_stats(self._engine_stats.values())

    def _record_counts(self, stats: dict, engine_index: int) -> None:
        """The engine's cumulative counts (prefix cache, preemptions, drafts, offload), as increments since its last report."""
        last = self._last_counts.setdefault(engine_index, {})
        engine = str(engine_index)

        def delta(key, value) -> float:
            increment = max(value - last.get(key, 0), 0)
            last[key] = value
            return increment

        for key, value in stats.items():
            family = self.stat_counters.get(key)
            if family is not None:
                family.on(engine).inc(delta(key, value))
            elif key.startswith("kv_offload_hits_"):
                self.offload_hits.server(key.removeprefix("kv_offload_hits_")).inc(delta(key, value))
        for position, value in enumerate(stats.get(_PER_POS) or ()):
            self.spec_accepted_per_pos.on(engine, str(position)).inc(delta((_PER_POS, position), value))

    def _record_stats(self, stats: dict) -> None:
        """The server's gauges, from the engines' stats combined."""
        self.num_running.server().set(stats.get("num_running", 0))
        self.num_waiting.server().set(stats.get("num_waiting", 0))
        self.kv_usage.server().set(stats.get("kv_cache_usage", 0.0))
        queries, hits = stats.get("prefix_cache_queries", 0), stats.get("prefix_cache_hits", 0)
        self.prefix_hit_rate.server().set(hits / queries if queries else 0.0)

    def mark_engine_dead(self) -> None:
        """No engine, nothing runs: zero the gauges and fail what was in flight."""
        self.end_requests(list(self._times), "error")
        self.num_running.server().set(0)
        self.num_waiting.server().set(0)
        for engine in self._engines:
            self.num_running.engine(engine).set(0)
            self.num_waiting.engine(engine).set(0)
        for engine_index in self._engine_stats:
            self.engine_running.server(str(engine_index)).set(0)
            self.engine_waiting.server(str(engine_index)).set(0)

    # ------------------------------------------------------------------- HTTP
    def record_http(self, path: str, status: int) -> None:
        self.http_responses.labels(path, str(status)).inc()

    def record_error(self, status: int, error_type: str) -> None:
        self.request_errors.server(str(status), error_type).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)
