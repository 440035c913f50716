"""The offline LLM's start_profile() / stop_profile() (torch.profiler traces into RUNTIME_TORCH_PROFILER_DIR) and
get_metrics() (vLLM's snapshot of the Prometheus metrics as Counter / Gauge / Histogram / Vector objects)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry
from prometheus_client import Counter as PromCounter

from runtime import LLM, SamplingParams
from runtime.engine.control import EngineControlError
from runtime.engine.metrics_reader import Counter, Gauge, Histogram, Vector, get_metrics_snapshot

GREEDY = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True)
PROMPT = {"prompt_token_ids": list(range(100, 112))}


@pytest.fixture(scope="module")
def llm(tmp_path_factory):
    from runtime.testing.models import build_tiny_model

    path = build_tiny_model("llama", tmp_path_factory.mktemp("llama"))
    return LLM(path, dtype="float32", max_model_len=64, num_gpu_blocks_override=32, disable_log_stats=False)


def test_start_and_stop_profile_write_a_trace_per_worker(llm, tmp_path, monkeypatch):
    monkeypatch.setenv("RUNTIME_TORCH_PROFILER_DIR", str(tmp_path))
    llm.start_profile()
    with pytest.raises(EngineControlError, match=r"a profile is already recording; call stop_profile\(\) first"):
        llm.start_profile()
    llm.generate(PROMPT, GREEDY, use_tqdm=False)
    traces = llm.stop_profile()
    assert len(traces) == 1 and Path(traces[0]).parent == tmp_path
    events = json.loads(Path(traces[0]).read_text())["traceEvents"]
    assert any(event.get("name", "").startswith("aten::") for event in events)
    assert "aten::" in Path(traces[0].removesuffix(".trace.json") + ".txt").read_text()
    with pytest.raises(EngineControlError, match=r"no profile is recording; call start_profile\(\) first"):
        llm.stop_profile()


def test_start_profile_needs_the_profiler_dir(llm, monkeypatch):
    monkeypatch.delenv("RUNTIME_TORCH_PROFILER_DIR", raising=False)
    with pytest.raises(EngineControlError, match=r"start_profile\(\) needs RUNTIME_TORCH_PROFILER_DIR \(vLLM's VLLM_TORCH"):
        llm.start_profile()


def find(metrics, name: str, kind: type, **labels):
    found = [m for m in metrics if m.name == name and isinstance(m, kind) and labels.items() <= m.labels.items()]
    assert len(found) == 1, (name, labels, found)
    return found[0]


def test_get_metrics_counts_the_requests(llm):
    before = llm.get_metrics()
    prompts_before = find(before, "vllm:prompt_tokens", Counter).value
    finished_before = find(before, "vllm:request_success", Counter, finished_reason="length").value
    e2e_before = find(before, "vllm:e2e_request_latency_seconds", Histogram).count
    llm.generate([PROMPT, PROMPT], GREEDY, use_tqdm=False)
    metrics = llm.get_metrics()
    assert find(metrics, "vllm:prompt_tokens", Counter, model_name=llm.llm_engine.config.model_config.served_model_name,
                engine="0").value == prompts_before + 24
    assert find(metrics, "vllm:request_success", Counter, finished_reason="length").value == finished_before + 2
    assert find(metrics, "vllm:num_requests_running", Gauge).value == 0.0
    e2e = find(metrics, "vllm:e2e_request_latency_seconds", Histogram)
    assert e2e.count == e2e_before + 2 and e2e.sum > 0
    bounds = list(e2e.buckets)
    assert bounds[-1] == "+Inf" and e2e.buckets["+Inf"] == e2e.count
    counts = list(e2e.buckets.values())
    assert counts == sorted(counts)  # cumulative, as Prometheus counts buckets
    assert find(metrics, "runtime:generation_tokens", Counter).value >= 10


def test_get_metrics_needs_stats(tmp_path):
    from runtime.testing.models import build_tiny_model

    quiet = LLM(build_tiny_model("llama", tmp_path), dtype="float32", max_model_len=64, num_gpu_blocks_override=16)
    try:
        with pytest.raises(RuntimeError, match=r"get_metrics\(\) needs the engine's stats: .*disable_log_stats=False"):
            quiet.get_metrics()
    finally:
        quiet.llm_engine.engine_core.shutdown()


def test_a_counter_by_position_is_a_vector():
    registry = CollectorRegistry()
    counter = PromCounter("vllm:spec_decode_num_accepted_tokens_per_pos", "doc", ["model_name", "position"],
                          registry=registry)
    counter.labels("m", "0").inc(3)
    counter.labels("m", "2").inc(1.5)
    (vector,) = get_metrics_snapshot(registry)
    assert vector == Vector("vllm:spec_decode_num_accepted_tokens_per_pos", {"model_name": "m"}, [3, 0, 1.5])


def test_start_profile_ends_a_recording_step_window_and_a_window_waits_for_none(tmp_path):
    import torch

    from runtime.worker.profiling import OnDemandProfiler, StepProfiler

    window = StepProfiler(tmp_path, 0, first=0, count=100)
    window.before_step()  # the window records from step 0
    torch.ones(4).add_(1)
    window.after_step()
    on_demand = OnDemandProfiler(tmp_path, 0, window)
    on_demand.start()  # one torch profiler at a time: the window is written early
    assert window.profile is None and (tmp_path / "rank0.txt").read_text().startswith("steps 0..0\n")
    late = StepProfiler(tmp_path / "late", 0, first=0, count=1)
    late.on_demand = True
    late.before_step()  # its first step comes while start_profile() records: skipped
    assert late.profile is None
    assert on_demand.stop().exists() and not window.on_demand
