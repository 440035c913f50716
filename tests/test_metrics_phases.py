"""vLLM's request metrics on a fake clock: the phases (queue, prefill, decode, inference), the request
parameter histograms (n, max_tokens, most tokens of one completion), tokens per engine step, and the
``engine`` label of vLLM's names with several engine cores, in one process and in several."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
from prometheus_client.parser import text_string_to_metric_families

from runtime.messages import EngineCoreOutput, EngineCoreOutputs, FinishReason, NewTokens
from runtime.metrics import EngineMetrics

PHASES = ("queue", "prefill", "decode", "inference")


def samples(text: str) -> dict[tuple[str, tuple], float]:
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def value(values: dict, name: str, engine: str | None = "0", **labels) -> float:
    """A sample of a vllm: name (of ``engine``) or of a runtime: name (``engine=None``)."""
    labels = {"model_name": "m", **labels, **({} if engine is None else {"engine": engine})}
    return values[(name, tuple(sorted(labels.items())))]


def first_output(request_id, tokens, queued, scheduled, **kwargs) -> EngineCoreOutput:
    return EngineCoreOutput(request_id, tokens, queued_time=queued, scheduled_time=scheduled, **kwargs)


def test_phases_follow_vllms_definitions_on_the_engine_clock():
    metrics = EngineMetrics("m")
    metrics.add_request("a", 4, arrival=100.0, max_tokens=9)
    # queued 100.2, first scheduled 101.0; tokens sent at 101.5 (the first two), 102.0 and 103.5 (the last).
    metrics.record(EngineCoreOutputs([first_output("a", [1, 2], 100.2, 101.0)], timestamp=101.5), now=101.6)
    metrics.record(EngineCoreOutputs(timestamp=102.0, new_tokens=NewTokens(["a"], [3])), now=102.1)
    metrics.record(EngineCoreOutputs([EngineCoreOutput("a", [4], finish_reason=FinishReason.LENGTH)], timestamp=103.5),
                   now=103.7)
    values = samples(metrics.render().decode())
    expected = {"queue": 0.8, "prefill": 0.5, "decode": 2.0, "inference": 2.5}
    for phase, seconds in expected.items():
        for prefix, engine in (("vllm:", "0"), ("runtime:", None)):
            name = f"{prefix}request_{phase}_time_seconds"
            assert value(values, name + "_count", engine) == 1, name
            assert value(values, name + "_sum", engine) == pytest.approx(seconds), name
    # The front end's view stays as it was: TTFT and e2e from the arrival, as received.
    assert value(values, "vllm:time_to_first_token_seconds_sum") == pytest.approx(1.6)
    assert value(values, "vllm:e2e_request_latency_seconds_sum") == pytest.approx(3.7)
    assert value(values, "vllm:request_params_max_tokens_sum") == 9
    assert value(values, "vllm:prompt_tokens_total") == 4


def test_a_request_without_a_token_has_no_phases_and_a_stop_string_end_has_them():
    metrics = EngineMetrics("m")
    metrics.add_request("waiting", 3, arrival=0.0)
    metrics.add_request("stopped", 3, arrival=0.0)
    metrics.record(EngineCoreOutputs([first_output("stopped", [5], 1.0, 2.0)], timestamp=3.0), now=3.0)
    metrics.record(EngineCoreOutputs(timestamp=4.0, new_tokens=NewTokens(["stopped"], [6])), now=4.0)
    metrics.end_requests(["stopped"], "stop", now=4.5)  # a stop string, found in the front end
    metrics.end_requests(["waiting"], "abort", now=5.0)  # never scheduled
    values = samples(metrics.render().decode())
    assert value(values, "vllm:request_success_total", finished_reason="abort") == 1
    assert value(values, "vllm:request_success_total", finished_reason="stop") == 1
    assert [value(values, f"vllm:request_{p}_time_seconds_sum") for p in PHASES] == pytest.approx([1.0, 1.0, 1.0, 2.0])
    assert all(value(values, f"vllm:request_{p}_time_seconds_count") == 1 for p in PHASES)


def test_n_and_the_most_tokens_of_one_completion_once_per_request():
    metrics = EngineMetrics("m")
    for index, num_tokens in enumerate((2, 5, 3)):  # one request with n=3, children ending with 2, 5 and 3 tokens
        metrics.add_request(f"{index}_r", 6 if index == 0 else 0, arrival=0.0, max_tokens=8, parent="r", n=3)
    metrics.add_request("single", 2, arrival=0.0, max_tokens=4)
    for index, num_tokens in enumerate((2, 5, 3)):
        done = EngineCoreOutput(f"{index}_r", list(range(num_tokens)), finish_reason=FinishReason.STOP)
        metrics.record(EngineCoreOutputs([done]), now=1.0)
        if index == 0:  # the request has not ended yet: nothing observed
            assert value(samples(metrics.render().decode()), "vllm:request_params_n_count") == 0
    metrics.record(EngineCoreOutputs([EngineCoreOutput("single", [1], finish_reason=FinishReason.LENGTH)]), now=1.0)
    values = samples(metrics.render().decode())
    assert value(values, "vllm:request_params_n_count") == 2
    assert value(values, "vllm:request_params_n_sum") == 3 + 1
    assert value(values, "vllm:request_params_n_bucket", le="2.0") == 1  # the single one
    assert value(values, "vllm:request_max_num_generation_tokens_count") == 2
    assert value(values, "vllm:request_max_num_generation_tokens_sum") == 5 + 1
    assert value(values, "vllm:request_params_max_tokens_count") == 4  # each engine request
    assert value(values, "vllm:request_params_max_tokens_sum") == 3 * 8 + 4
    assert value(values, "vllm:request_generation_tokens_sum") == 2 + 5 + 3 + 1
    assert value(values, "vllm:request_prompt_tokens_count") == 2  # the prompt once per request
    assert value(values, "vllm:prompt_tokens_total") == 6 + 2


def test_iteration_tokens_and_preemptions_come_from_the_engine_steps():
    metrics = EngineMetrics("m")
    for num_step_tokens, preemptions in ((96, 0), (4, 1), (0, 1)):  # the last: idle stats, no step
        metrics.record(EngineCoreOutputs(scheduler_stats={"num_step_tokens": num_step_tokens, "num_preemptions": preemptions}))
    values = samples(metrics.render().decode())
    for prefix, engine in (("vllm:", "0"), ("runtime:", None)):
        assert value(values, prefix + "iteration_tokens_total_count", engine) == 2
        assert value(values, prefix + "iteration_tokens_total_sum", engine) == 100
        assert value(values, prefix + "iteration_tokens_total_bucket", engine, le="8.0") == 1
        assert value(values, prefix + "num_preemptions_total", engine) == 1


def test_each_engine_core_has_its_own_vllm_series_and_the_server_their_total():
    metrics = EngineMetrics("m")
    metrics.add_request("x", 3, arrival=0.0)
    metrics.set_engine("x", 1)
    metrics.end_requests(["x"], "abort", now=2.0)  # no output yet: still engine 1's
    for engine_index, running, hits in ((0, 2, 3), (1, 1, 5), (0, 1, 4), (1, 0, 7)):
        stats = {"num_running": running, "prefix_cache_hits": hits, "prefix_cache_queries": 2 * hits, "kv_cache_usage": 0.5}
        metrics.record(EngineCoreOutputs(scheduler_stats=stats), engine_index=engine_index)
    values = samples(metrics.render().decode())
    assert value(values, "vllm:request_success_total", "1", finished_reason="abort") == 1
    assert value(values, "vllm:request_success_total", "0", finished_reason="abort") == 0
    assert value(values, "vllm:e2e_request_latency_seconds_sum", "1") == 2.0
    assert (value(values, "vllm:prefix_cache_hits_total", "0"), value(values, "vllm:prefix_cache_hits_total", "1")) == (4, 7)
    assert value(values, "runtime:prefix_cache_hits_total", None) == 11
    assert (value(values, "vllm:num_requests_running", "0"), value(values, "vllm:num_requests_running", "1")) == (1, 0)
    assert value(values, "runtime:num_requests_running", None) == 1


SCRIPT = textwrap.dedent("""
    import sys
    from runtime.entrypoints.openai.mp_metrics import MultiProcessMetrics
    from runtime.messages import EngineCoreOutput, EngineCoreOutputs, FinishReason
    metrics = MultiProcessMetrics("m", sys.argv[1])
    if sys.argv[2] == "render":
        sys.stdout.write(metrics.render().decode())
        sys.exit()
    queued = float(sys.argv[2])  # each process serves one request: queued at q, scheduled at q + 1, done at q + 3
    metrics.add_request("a", 2, arrival=0.0, max_tokens=5)
    first = EngineCoreOutput("a", [1], queued_time=queued, scheduled_time=queued + 1)
    metrics.record(EngineCoreOutputs([first], timestamp=queued + 2), now=queued + 2)
    metrics.record(EngineCoreOutputs([EngineCoreOutput("a", [2], finish_reason=FinishReason.STOP)], timestamp=queued + 3,
                                     scheduler_stats={"num_running": 1, "num_step_tokens": 8}), now=queued + 3)
""")


def test_several_api_processes_sum_the_new_metrics(tmp_path):
    def run(*args: str) -> str:
        env = {**os.environ, "PROMETHEUS_MULTIPROC_DIR": str(tmp_path)}
        done = subprocess.run([sys.executable, "-c", SCRIPT, str(tmp_path), *args], env=env, capture_output=True,
                              text=True, timeout=60)
        assert done.returncode == 0, done.stderr
        return done.stdout

    run("10")
    run("20")
    values = samples(run("render"))
    for prefix, engine in (("vllm:", "0"), ("runtime:", None)):
        for phase, seconds in zip(PHASES, (1.0, 1.0, 1.0, 2.0)):
            assert value(values, f"{prefix}request_{phase}_time_seconds_count", engine) == 2
            assert value(values, f"{prefix}request_{phase}_time_seconds_sum", engine) == pytest.approx(2 * seconds)
        assert value(values, prefix + "iteration_tokens_total_sum", engine) == 16
        assert value(values, prefix + "request_params_n_count", engine) == 2
        assert value(values, prefix + "num_requests_running", engine) == 1  # the live maximum, not a sum
