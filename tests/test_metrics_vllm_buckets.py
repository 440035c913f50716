"""The histograms' buckets are vLLM's (long waits land in a finite bucket), and every finish reason's
request_success series is there from the start, as vLLM shows them."""

from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families

from runtime.messages import EngineCoreOutput, EngineCoreOutputs, FinishReason
from runtime.metrics import EngineMetrics

# vLLM's bucket bounds (vllm/v1/metrics/loggers.py)
VLLM_BOUNDS = {
    "vllm:time_to_first_token_seconds": (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                                         7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0),
    "vllm:time_per_output_token_seconds": (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0,
                                           7.5, 10.0, 20.0, 40.0, 80.0),
    "vllm:inter_token_latency_seconds": (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0,
                                         7.5, 10.0, 20.0, 40.0, 80.0),
    "vllm:e2e_request_latency_seconds": (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0,
                                         60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0),
}


def buckets(metrics: EngineMetrics) -> dict[str, dict[float, float]]:
    """histogram name -> {upper bound: cumulative count}."""
    out: dict[str, dict[float, float]] = {}
    for family in text_string_to_metric_families(metrics.render().decode()):
        for sample in family.samples:
            if sample.name.endswith("_bucket"):
                out.setdefault(sample.name.removesuffix("_bucket"), {})[float(sample.labels["le"])] = sample.value
    return out


def test_histograms_have_every_vllm_bucket_bound():
    found = buckets(EngineMetrics("m"))
    for name, bounds in VLLM_BOUNDS.items():
        assert set(bounds) <= set(found[name]), (name, sorted(set(bounds) - set(found[name])))
        assert set(bounds) <= set(found["runtime:" + name.removeprefix("vllm:")]), name


def test_a_long_wait_lands_in_a_finite_bucket():
    """A first token after 100 s (a long queue) and a 10-minute request are told apart from forever (+Inf)."""
    metrics = EngineMetrics("m")
    metrics.add_request("a", num_prompt_tokens=4, arrival=0.0)
    metrics.record(EngineCoreOutputs(outputs=[EngineCoreOutput("a", [1])]), now=100.0)
    metrics.record(EngineCoreOutputs(outputs=[EngineCoreOutput("a", [2], finish_reason=FinishReason.STOP)]), now=600.0)
    found = buckets(metrics)
    assert found["vllm:time_to_first_token_seconds"][160.0] == 1
    assert found["vllm:time_to_first_token_seconds"][40.0] == 0
    assert found["vllm:e2e_request_latency_seconds"][960.0] == 1
    assert found["vllm:e2e_request_latency_seconds"][480.0] == 0
    assert found["vllm:time_per_output_token_seconds"][80.0] == 0  # 500 s for one token: past every bound
    assert found["vllm:time_per_output_token_seconds"][float("inf")] == 1


def test_every_finish_reason_series_is_there_before_any_request():
    """So rate() over finished_reason="abort" is 0, not empty, until the first abort (as vLLM)."""
    values = {}
    for family in text_string_to_metric_families(EngineMetrics("m").render().decode()):
        for sample in family.samples:
            if sample.name == "vllm:request_success_total":
                values[sample.labels["finished_reason"]] = (sample.labels["model_name"], sample.value)
    assert {"stop", "length", "abort"} <= set(values)
    assert all(value == ("m", 0.0) for value in values.values())


def test_per_request_time_per_output_token_under_vllms_name():
    """vLLM's dashboards and tools read the per-request mean as vllm:request_time_per_output_token_seconds."""
    metrics = EngineMetrics("m")
    metrics.add_request("a", num_prompt_tokens=4, arrival=0.0)
    metrics.record(EngineCoreOutputs(outputs=[EngineCoreOutput("a", [1])]), now=1.0)
    metrics.record(EngineCoreOutputs(outputs=[EngineCoreOutput("a", [2, 3], finish_reason=FinishReason.STOP)]), now=2.0)
    values = {(s.name, s.labels.get("le")): s.value for f in text_string_to_metric_families(metrics.render().decode())
              for s in f.samples}
    for prefix in ("vllm:", "runtime:"):
        assert values[(prefix + "request_time_per_output_token_seconds_count", None)] == 1
        assert values[(prefix + "request_time_per_output_token_seconds_sum", None)] == 0.5  # 1 s over 2 tokens
        assert values[(prefix + "request_time_per_output_token_seconds_bucket", "80.0")] == 1
