"""Multi-turn conversations over a tiny device pool: with the cpu tier, later turns load
their evicted history instead of recomputing it, and every token stays the same as without
offload and as transformers' greedy tokens (float32)."""

from __future__ import annotations

import pytest

from runtime.messages import EngineCoreOutputs
from runtime.metrics import EngineMetrics
from runtime.testing.reference import check_outputs_equal

from offload_conversations import close, make_llm, run_turns

SETTINGS = {
    "cpu_lru": dict(kv_offload="cpu", kv_offload_size="1MiB"),
    "cpu_arc_async_chunked": dict(kv_offload="cpu", kv_offload_size="1MiB", kv_offload_policy="arc",
                                  async_scheduling=True, max_num_batched_tokens=16),
}


def tokens_of(turns):
    return [output for turn in turns for _, output, _ in turn]


@pytest.mark.parametrize("setting", list(SETTINGS))
def test_later_turns_hit_the_cpu_tier_with_identical_tokens(model_path, baseline, setting):
    base_turns, base_stats, reference = baseline
    llm = make_llm(model_path, **SETTINGS[setting])
    if "async" in setting:
        assert llm.llm_engine.engine_core.async_scheduling
    turns, stats = run_turns(llm)
    close(llm)
    check_outputs_equal(tokens_of(base_turns), tokens_of(turns), f"{setting} vs no offload")
    check_outputs_equal(reference, tokens_of(turns), f"{setting} vs transformers")
    assert stats[-1]["kv_offload_blocks_stored"] > 0
    later_hits = stats[-1].get("kv_offload_hits_cpu", 0) - stats[0].get("kv_offload_hits_cpu", 0)
    assert later_hits > 0, stats
    assert stats[-1]["kv_offload_blocks_loaded"] == stats[-1]["kv_offload_hits_cpu"]
    assert stats[-1]["kv_offload_hit_tokens"] == 4 * stats[-1]["kv_offload_blocks_loaded"]
    # Later turns compute fewer prefill tokens: more of their prompts came cached.
    cached = sum(c for turn in turns[1:] for _, _, c in turn)
    base_cached = sum(c for turn in base_turns[1:] for _, _, c in turn)
    assert cached > base_cached, (cached, base_cached)


def test_offload_counters_on_metrics(model_path):
    llm = make_llm(model_path, kv_offload="cpu", kv_offload_size="1MiB")
    _, stats = run_turns(llm, num_turns=2)
    close(llm)
    metrics = EngineMetrics("tiny")
    metrics.record(EngineCoreOutputs(scheduler_stats=stats[-1]))
    text = metrics.render().decode()

    def value(name: str) -> float:
        line = next(line for line in text.splitlines() if line.startswith(name))
        return float(line.rsplit(" ", 1)[1])

    assert value('runtime:kv_offload_hits_total{model_name="tiny",tier="cpu"}') == stats[-1]["kv_offload_hits_cpu"] > 0
    assert value("runtime:kv_offload_blocks_stored_total") == stats[-1]["kv_offload_blocks_stored"]
    assert value("runtime:kv_offload_bytes_loaded_total") == stats[-1]["kv_offload_bytes_loaded"] > 0
    assert value("runtime:kv_offload_load_seconds_total") > 0


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_generate_returns_with_the_last_blocks_saved_and_freed(model_path, async_scheduling):
    from runtime import SamplingParams

    llm = make_llm(model_path, kv_offload="cpu", kv_offload_size="1MiB", async_scheduling=async_scheduling)
    engine = llm.llm_engine
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    llm.generate([{"prompt_token_ids": list(range(3, 40))}], params, use_tqdm=False)
    scheduler = engine.engine_core.scheduler
    pool = scheduler.kv_cache_manager.pool
    # Its blocks were held for their saves until a step carried them: that step ran before generate returned.
    assert pool.num_free_blocks == pool.num_blocks and engine.last_stats["kv_cache_usage"] == 0.0
    assert not engine.has_unfinished_requests() and engine.last_stats["kv_offload_blocks_stored"] == 10
    assert engine.engine_core.reset_prefix_cache()
    close(llm)
