"""Metrics under runtime's and vLLM's names, inter-token latency, and the periodic stats log line."""

from __future__ import annotations

import logging

import pytest
from prometheus_client.parser import text_string_to_metric_families

from runtime.messages import EngineCoreOutput, EngineCoreOutputs, FinishReason
from runtime.metrics import EngineMetrics
from runtime.stat_logger import StatLogger, log_stats_interval

# What vLLM's published Grafana dashboard and its docs query, by sample name.
VLLM_SAMPLES = (
    "vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:gpu_cache_usage_perc", "vllm:kv_cache_usage_perc",
    "vllm:prompt_tokens_total", "vllm:generation_tokens_total", "vllm:request_success_total",
    "vllm:num_preemptions_total", "vllm:prefix_cache_queries_total", "vllm:prefix_cache_hits_total",
    "vllm:time_to_first_token_seconds_bucket", "vllm:time_per_output_token_seconds_bucket",
    "vllm:inter_token_latency_seconds_bucket", "vllm:e2e_request_latency_seconds_bucket",
    "vllm:request_prompt_tokens_bucket", "vllm:request_generation_tokens_bucket",
)


def samples(metrics: EngineMetrics) -> dict[tuple[str, tuple], float]:
    out = {}
    for family in text_string_to_metric_families(metrics.render().decode()):
        for sample in family.samples:
            out[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return out


def run_two_requests(metrics: EngineMetrics) -> None:
    stats = {"num_running": 2, "num_waiting": 1, "kv_cache_usage": 0.25, "prefix_cache_queries": 8, "prefix_cache_hits": 2}
    metrics.add_request("a", num_prompt_tokens=5, arrival=100.0)
    metrics.add_request("b", num_prompt_tokens=3, arrival=100.0)
    # a: 2 tokens at 100.5, then 1 at 101.0, then 2 at 102.0 (finished); b: 1 token, then aborted
    metrics.record(EngineCoreOutputs(outputs=[EngineCoreOutput("a", [1, 2]), EngineCoreOutput("b", [1])], scheduler_stats=stats), now=100.5)
    metrics.record(EngineCoreOutputs(outputs=[EngineCoreOutput("a", [3])]), now=101.0)
    metrics.record(EngineCoreOutputs(outputs=[EngineCoreOutput("a", [4, 5], finish_reason=FinishReason.LENGTH)]), now=102.0)
    metrics.end_requests(["b"], "abort", now=103.0)


def test_every_engine_metric_has_its_vllm_twin_with_the_same_value():
    metrics = EngineMetrics("m")
    run_two_requests(metrics)
    values = samples(metrics)
    names = {name for name, _ in values}
    assert set(VLLM_SAMPLES) <= names, set(VLLM_SAMPLES) - names
    for (name, labels), value in values.items():
        if name.startswith("vllm:"):
            twin = "runtime:" + name.removeprefix("vllm:").replace("gpu_cache_usage_perc", "kv_cache_usage_perc")
            assert dict(labels)["engine"] == "0", name  # vLLM labels its series by engine core; here there is one
            assert values[(twin, tuple(label for label in labels if label[0] != "engine"))] == value, name
    assert all(dict(labels)["model_name"] == "m" for name, labels in values if name.startswith("vllm:"))
    # runtime's own: no vLLM twin
    assert not any(n.startswith(("vllm:http", "vllm:request_errors", "vllm:prefix_cache_hit_rate")) for n in names)


def test_inter_token_latency_counts_every_gap_after_the_first_token():
    metrics = EngineMetrics("m")
    run_two_requests(metrics)
    values = samples(metrics)
    model = (("model_name", "m"),)
    engine = (("engine", "0"), *model)  # vLLM's names are labelled by engine core too
    # a: 5 tokens -> 4 gaps: 0 (came with the first), 0.5, 0.5 + 0.5 (two tokens over 1 s); b: 1 token, no gap
    assert values[("vllm:inter_token_latency_seconds_count", engine)] == 4
    assert values[("vllm:inter_token_latency_seconds_sum", engine)] == pytest.approx(1.5)
    assert values[("runtime:time_per_output_token_seconds_sum", model)] == pytest.approx(1.5 / 4)
    assert values[("vllm:request_prompt_tokens_sum", engine)] == 8
    assert values[("vllm:request_generation_tokens_sum", engine)] == 5 + 1
    assert values[("vllm:request_success_total", (("engine", "0"), ("finished_reason", "length"), *model))] == 1


def test_stat_logger_line_covers_the_interval_and_stays_quiet_when_idle(caplog):
    caplog.set_level(logging.INFO, logger="runtime.stats")
    logger = StatLogger(interval_s=10.0, last_log_time=0.0)
    logger.record_prompt("a", 40)
    logger.record_prompt("c", 7)  # prefilled later: not in this line
    stats = {"num_running": 3, "num_waiting": 1, "kv_cache_usage": 0.5, "prefix_cache_queries": 10, "prefix_cache_hits": 4}
    logger.record(EngineCoreOutputs(outputs=[EngineCoreOutput("a", [1, 2]), EngineCoreOutput("b", [3])], scheduler_stats=stats))
    logger.maybe_log(now=5.0)  # not yet
    assert caplog.messages == []
    logger.maybe_log(now=10.0)
    assert caplog.messages == [
        "Avg prompt throughput: 4.0 tokens/s, Avg generation throughput: 0.3 tokens/s, Running: 3 reqs, "
        "Waiting: 1 reqs, KV cache usage: 50.0%, Prefix cache hit rate: 40.0%"
    ]
    idle = {"num_running": 0, "num_waiting": 0, "kv_cache_usage": 0.0, "prefix_cache_queries": 10, "prefix_cache_hits": 4}
    logger.record(EngineCoreOutputs(scheduler_stats=idle))
    assert logger.log(now=20.0) is not None  # the first idle line says the engine went idle
    assert logger.log(now=30.0) is None and len(caplog.messages) == 2


def test_stat_logger_counts_a_prompt_when_its_first_output_arrives(caplog):
    caplog.set_level(logging.INFO, logger="runtime.stats")
    logger = StatLogger(interval_s=10.0, last_log_time=0.0)
    for request_id in "abc":  # an offline batch: every prompt added at once
        logger.record_prompt(request_id, 100)
    logger.forget(["c"])  # aborted before its prefill
    stats = {"num_running": 1, "num_waiting": 1}
    logger.record(EngineCoreOutputs(outputs=[EngineCoreOutput("a", [1])], scheduler_stats=stats))
    logger.log(now=10.0)
    logger.record(EngineCoreOutputs(outputs=[EngineCoreOutput("a", [2]), EngineCoreOutput("b", [3])], scheduler_stats=stats))
    logger.log(now=20.0)
    logger.record(EngineCoreOutputs(outputs=[EngineCoreOutput("b", [4])], scheduler_stats=stats))
    logger.log(now=30.0)
    assert [m.split(", Running")[0] for m in caplog.messages] == [
        "Avg prompt throughput: 10.0 tokens/s, Avg generation throughput: 0.1 tokens/s",
        "Avg prompt throughput: 10.0 tokens/s, Avg generation throughput: 0.2 tokens/s",
        "Avg prompt throughput: 0.0 tokens/s, Avg generation throughput: 0.1 tokens/s",
    ]


def test_log_stats_interval_from_the_environment(monkeypatch):
    monkeypatch.setenv("RUNTIME_LOG_STATS_INTERVAL", "0.5")
    assert log_stats_interval() == 0.5
    monkeypatch.setenv("RUNTIME_LOG_STATS_INTERVAL", "soon")
    with pytest.raises(ValueError, match="RUNTIME_LOG_STATS_INTERVAL must be a number of seconds > 0, got 'soon'"):
        log_stats_interval()
