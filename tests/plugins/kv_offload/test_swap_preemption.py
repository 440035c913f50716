"""--preemption-mode swap: a preempted request's blocks go to the cpu tier and come back on
resume; outputs equal recompute preemption's and transformers', with fewer tokens computed."""

from __future__ import annotations

import gc

import pytest

from runtime import LLM, SamplingParams
from runtime.testing.reference import check_outputs_equal, make_prompts, reference_outputs

NUM_NEW_TOKENS = 24
# The parity suite's forced-preemption setting (runtime.testing.conformance), prefix caching on.
PREEMPTION = dict(num_gpu_blocks_override=24, block_size=4, max_model_len=96, max_num_batched_tokens=64)
SWAP = dict(preemption_mode="swap", kv_offload="cpu", kv_offload_size="1MiB")


def run(model_path: str, inspect=None, **kwargs) -> tuple[list[list[int]], int, dict]:
    """(tokens per prompt, tokens the device computed, scheduler stats); ``inspect(llm)`` runs before shutdown."""
    llm = LLM(model_path, dtype="float32", skip_tokenizer_init=True, **{**PREEMPTION, **kwargs})
    core = llm.llm_engine.engine_core
    computed = []
    for name in ("execute_model", "execute_model_async"):
        launch = getattr(core.executor, name)

        def counting(so, launch=launch):
            computed.append(so.total_num_scheduled_tokens)
            return launch(so)

        setattr(core.executor, name, counting)
    params = SamplingParams(temperature=0.0, max_tokens=NUM_NEW_TOKENS, ignore_eos=True)
    outputs = llm.generate([{"prompt_token_ids": p} for p in make_prompts()], params, use_tqdm=False)
    stats = dict(core.scheduler.stats())
    if inspect is not None:
        inspect(llm)
    core.shutdown()
    del llm
    gc.collect()
    return [list(o.outputs[0].token_ids) for o in outputs], sum(computed), stats


@pytest.fixture(scope="module")
def recompute(model_path):
    tokens, computed, stats = run(model_path)
    assert stats["num_preemptions"] > 0
    return tokens, computed, [t for t, _ in reference_outputs(model_path, make_prompts(), NUM_NEW_TOKENS)]


@pytest.mark.parametrize("extra", [{}, dict(async_scheduling=True, max_num_batched_tokens=16)], ids=["sync", "async_chunked"])
def test_swap_equals_recompute_and_transformers_with_fewer_tokens_computed(model_path, recompute, extra):
    expected, computed_by_recompute, reference = recompute
    base_tokens, computed_base, _ = run(model_path, **extra) if extra else (expected, computed_by_recompute, None)
    tokens, computed, stats = run(model_path, **SWAP, **extra)
    check_outputs_equal(reference, expected, "recompute preemption vs transformers")
    check_outputs_equal(base_tokens, tokens, "swap vs recompute preemption")
    check_outputs_equal(reference, tokens, "swap vs transformers")
    assert stats["num_preemptions"] > 0
    assert stats["kv_offload_hits_cpu"] > 0 and stats["kv_offload_hit_tokens"] > 0
    assert computed < computed_base, (computed, computed_base)


@pytest.mark.parametrize("tiers", [dict(kv_offload="cpu", kv_offload_size="1MiB"),
                                   dict(kv_offload="cpu,disk", kv_offload_size="16KiB,4MiB")], ids=["cpu", "cpu_disk"])
def test_swap_and_tiers_with_an_fp8_kv_cache_equal_recompute(model_path, tiers, tmp_path):
    """``--kv-cache-dtype fp8`` (1-byte blocks) with the tiers: blocks go out and come back byte for
    byte (torch has no index_copy_ for the float8 types on the CPU: the copies run on uint8 views)."""
    if "disk" in tiers["kv_offload"]:
        tiers = dict(tiers, kv_offload_dir=str(tmp_path))
    expected, _, _ = run(model_path, kv_cache_dtype="fp8")
    tokens, _, stats = run(model_path, kv_cache_dtype="fp8", preemption_mode="swap", **tiers)
    check_outputs_equal(expected, tokens, "fp8 KV: swap vs recompute preemption")
    assert stats["num_preemptions"] > 0
    assert stats["kv_offload_blocks_loaded"] > 0


def test_a_drafters_kv_comes_back_with_the_swapped_blocks(model_path, recompute):
    """Speculative decoding with the target as its own draft model: every greedy draft is kept, also for requests
    whose blocks were swapped out and loaded back, because the drafter's layers travel with the target's. Before,
    only the target's KV came back and the drafter read stale entries: most of its drafts were rejected. And the
    drafter forgets finished requests also when their last step schedules no token (the offload tier's save-only
    steps): it kept them before."""
    _, _, reference = recompute
    spec = {"method": "draft_model", "model": model_path, "num_speculative_tokens": 3}
    kept = []

    def inspect(llm):
        runner = llm.llm_engine.engine_core.executor.worker.model_runner.spec_runner
        kept.extend([*runner.valid, *runner.pending, *runner.written_end])

    tokens, _, stats = run(model_path, inspect, **SWAP, speculative_config=spec)
    assert kept == [], kept
    check_outputs_equal(reference, tokens, "swap with a draft model vs transformers")
    assert stats["num_preemptions"] > 0 and stats["kv_offload_hits_cpu"] > 0, stats
    drafted, accepted = stats["spec_decode_num_draft_tokens"], stats["spec_decode_num_accepted_tokens"]
    assert drafted > 0 and accepted == drafted, (accepted, drafted)
