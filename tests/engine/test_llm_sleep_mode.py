"""The offline LLM's sleep mode (vLLM's enable_sleep_mode, sleep(level), wake_up(tags)): the weights' and the KV
cache's memory is really freed, and after wake_up greedy generation gives the tokens it gave before."""

from __future__ import annotations

import pytest
import torch

from runtime import LLM, SamplingParams
from runtime.engine.control import EngineControlError

GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
PROMPT = {"prompt_token_ids": list(range(100, 121))}


@pytest.fixture(scope="module")
def model_path(tmp_path_factory) -> str:
    from runtime.testing.models import build_tiny_model

    return build_tiny_model("llama", tmp_path_factory.mktemp("llama"))


@pytest.fixture(scope="module")
def llm(model_path):
    return LLM(model_path, dtype="float32", max_model_len=128, block_size=4, num_gpu_blocks_override=64,
               enable_prefix_caching=True, enable_sleep_mode=True)


@pytest.fixture(scope="module")
def reference(llm) -> list[int]:
    return tokens(llm)


def tokens(llm) -> list[int]:
    return list(llm.generate(PROMPT, GREEDY, use_tqdm=False)[0].outputs[0].token_ids)


def runner(llm):
    return llm.llm_engine.engine_core.executor.worker.model_runner


def held_bytes(tensors) -> int:
    return sum(t.untyped_storage().nbytes() for t in tensors)


def prefix_hits(llm) -> int:
    return llm.llm_engine.engine_core.scheduler.kv_cache_manager.stats.hits


@pytest.mark.parametrize("level", [1, 2])
def test_sleep_frees_weights_and_kv_cache_and_wake_up_gives_the_same_tokens(llm, reference, level):
    model_runner = runner(llm)
    weights = [*model_runner.model.parameters()]
    num_weight_bytes = held_bytes(weights)
    assert tokens(llm) == reference  # the prompt's blocks are in the prefix cache now
    llm.sleep(level=level)
    assert llm.is_sleeping()
    assert held_bytes(weights) == 0 and held_bytes(model_runner.kv_caches) == 0
    host = llm.llm_engine.engine_core.executor.worker.sleep_state.host_copies
    assert sum(copy.numel() for _, copy in host) == (num_weight_bytes if level == 1 else 0)
    with pytest.raises(ValueError, match=r"the engine is asleep \(sleep level \d.*call wake_up\(\) before adding requests"):
        llm.generate(PROMPT, GREEDY, use_tqdm=False)
    llm.wake_up()
    assert not llm.is_sleeping()
    assert held_bytes(weights) == num_weight_bytes
    hits = prefix_hits(llm)
    assert tokens(llm) == reference
    assert prefix_hits(llm) == hits  # sleep reset the prefix cache: nothing was left to hit
    assert tokens(llm) == reference and prefix_hits(llm) > hits  # and caching works again


def test_level_2_reloads_the_checkpoint_and_level_1_keeps_the_weights_as_they_are(llm, reference):
    embed = runner(llm).model.model.embed_tokens.weight
    original = embed.detach().clone()
    with torch.no_grad():
        embed.add_(1.0)  # weights changed in place (as an RL trainer would)
    llm.sleep(level=1)
    llm.wake_up()
    assert torch.equal(embed, original + 1.0)
    llm.sleep(level=2)
    llm.wake_up()
    assert torch.equal(embed, original)
    assert tokens(llm) == reference


def test_wake_up_by_tags(llm, reference):
    model_runner = runner(llm)
    llm.sleep(level=1)
    with pytest.raises(ValueError, match="wake_up tag 'kv' is not valid; valid: weights, kv_cache"):
        llm.wake_up(tags=["kv"])
    llm.wake_up(tags=["weights"])
    assert llm.is_sleeping()
    assert held_bytes(model_runner.model.parameters()) > 0 and held_bytes(model_runner.kv_caches) == 0
    with pytest.raises(ValueError, match=r"asleep: kv_cache\)"):
        llm.generate(PROMPT, GREEDY, use_tqdm=False)
    llm.wake_up(tags=["kv_cache"])
    assert not llm.is_sleeping()
    assert held_bytes(model_runner.kv_caches) > 0
    assert tokens(llm) == reference
    llm.wake_up()  # awake already: nothing to do, as vLLM


def test_sleep_is_refused_with_unfinished_requests_and_bad_levels(llm, reference):
    engine = llm.llm_engine
    engine.add_request("running", PROMPT, GREEDY)
    with pytest.raises(EngineControlError, match=r"cannot sleep with 1 unfinished request\(s\) in the engine"):
        llm.sleep()
    assert not llm.is_sleeping()
    engine.abort_request(["running"])
    for level in (0, 3, "1", True):
        with pytest.raises(ValueError, match=rf"sleep level {level!r} is not valid; valid: 1 \(weights kept in host"):
            llm.sleep(level=level)
    llm.sleep()
    with pytest.raises(EngineControlError, match=r"already asleep \(level 1; asleep: kv_cache, weights\); call wake_up"):
        llm.sleep(level=2)
    llm.wake_up()
    assert tokens(llm) == reference


def test_sleep_mode_needs_enable_sleep_mode(model_path):
    llm = LLM(model_path, dtype="float32", max_model_len=64, num_gpu_blocks_override=16)
    try:
        for call in (llm.sleep, llm.wake_up):
            with pytest.raises(EngineControlError, match=r"needs sleep mode: start the engine with enable_sleep_mode=True"):
                call()
        assert not llm.is_sleeping()
    finally:
        llm.llm_engine.engine_core.shutdown()


def test_sleep_and_wake_up_reach_every_worker_process(model_path):
    """Two tensor-parallel workers in their own processes: each frees and restores its shard."""
    tp = LLM(model_path, dtype="float32", max_model_len=64, num_gpu_blocks_override=16, tensor_parallel_size=2,
             enable_sleep_mode=True)
    try:
        before = tokens(tp)
        tp.sleep(level=2)
        freed = tp.llm_engine.engine_core.control.freed_bytes
        assert len(freed) == 2 and all(f["weights"] > 0 and f["kv_cache"] > 0 for f in freed)
        tp.wake_up()
        assert tokens(tp) == before
    finally:
        tp.llm_engine.engine_core.shutdown()
