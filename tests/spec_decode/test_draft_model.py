"""The draft_model proposer through the engine: drafts change nothing but speed.

The target and its baseline (no speculation) come from the tiny random checkpoints; a copy
of the target as its own draft must have every draft accepted (its KV over the shared block
ids is right through chunked prefill, prefix hits and preemption), also under random
sampling (q = p: only a rejection sampler given the draft's q accepts them all); a draft of
other weights must still give the target's greedy tokens.
"""

from __future__ import annotations

import gc

import pytest

from runtime import LLM, SamplingParams
from runtime.testing.conformance import SETTINGS
from runtime.testing.models import UNTOKENIZED_VOCAB_SIZE, build_untokenized_model
from runtime.testing.reference import check_outputs_equal

from spec_decode.engine_runs import generate, repetitive_prompts, spec_counts

NUM_NEW_TOKENS = 12


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    """(target path, another draft of the same shape, prompts, greedy tokens without speculation)."""
    root = tmp_path_factory.mktemp("draft_llama")
    target = build_untokenized_model("llama", root / "target")
    other = build_untokenized_model("llama", root / "other", seed=1)
    prompts = repetitive_prompts(UNTOKENIZED_VOCAB_SIZE)
    llm = LLM(target, dtype="float32", skip_tokenizer_init=True)
    params = SamplingParams(temperature=0.0, max_tokens=NUM_NEW_TOKENS, ignore_eos=True)
    expected = [o.outputs[0].token_ids for o in generate(llm, prompts, params)]
    del llm
    gc.collect()
    return target, other, prompts, expected


def draft_config(path, k=3):
    return {"method": "draft_model", "model": str(path), "num_speculative_tokens": k}


@pytest.mark.parametrize("setting", ["async_chunked_prefix", "preemption"])
def test_self_draft_greedy_identical_and_all_accepted(llama, setting):
    target, _, prompts, expected = llama
    llm = LLM(target, dtype="float32", skip_tokenizer_init=True, speculative_config=draft_config(target), **SETTINGS[setting])
    params = SamplingParams(temperature=0.0, max_tokens=NUM_NEW_TOKENS, ignore_eos=True)
    for _ in range(2 if "prefix" in setting else 1):
        outputs = [o.outputs[0].token_ids for o in generate(llm, prompts, params)]
        check_outputs_equal(expected, outputs, f"draft_model/{setting}")
    drafted, accepted = spec_counts(llm)
    assert drafted > 0 and accepted == drafted, (drafted, accepted)
    scheduler = llm.llm_engine.engine_core.scheduler
    assert scheduler.kv_cache_manager.stats.hits > 0 if "prefix" in setting else scheduler.num_preemptions > 0
    del llm
    gc.collect()


@pytest.mark.parametrize("arch,setting", [("qwen2", "preemption"), ("qwen3", "async_chunked_prefix"),
                                          ("gemma3", "prefix_caching")])
def test_other_draft_on_every_architecture(arch, setting, tmp_path):
    """A draft of the same shape with other weights (drafts often rejected): the target's greedy tokens."""
    target = build_untokenized_model(arch, tmp_path / "target")
    other = build_untokenized_model(arch, tmp_path / "other", seed=1)
    prompts = repetitive_prompts(UNTOKENIZED_VOCAB_SIZE)
    params = SamplingParams(temperature=0.0, max_tokens=NUM_NEW_TOKENS, ignore_eos=True)
    plain = LLM(target, dtype="float32", skip_tokenizer_init=True)
    expected = [o.outputs[0].token_ids for o in generate(plain, prompts, params)]
    del plain
    llm = LLM(target, dtype="float32", skip_tokenizer_init=True, speculative_config=draft_config(other), **SETTINGS[setting])
    for _ in range(2 if "prefix" in setting else 1):
        check_outputs_equal(expected, [o.outputs[0].token_ids for o in generate(llm, prompts, params)], f"{arch}/{setting}")
    assert spec_counts(llm)[0] > 0
    scheduler = llm.llm_engine.engine_core.scheduler
    assert scheduler.kv_cache_manager.stats.hits > 0 if "prefix" in setting else scheduler.num_preemptions > 0
    del llm
    gc.collect()


def test_other_draft_greedy_identical_n2_and_random_uses_q(llama):
    target, other, prompts, expected = llama
    llm = LLM(target, dtype="float32", skip_tokenizer_init=True, speculative_config=draft_config(other, k=2),
              max_num_batched_tokens=16, block_size=4, enable_prefix_caching=True)
    greedy = SamplingParams(temperature=0.0, max_tokens=NUM_NEW_TOKENS, ignore_eos=True, n=2)
    for out, tokens in zip(generate(llm, prompts[:2], greedy), expected):
        assert [c.token_ids for c in out.outputs] == [tokens, tokens]
    assert spec_counts(llm)[0] > 0
    seeded = SamplingParams(temperature=0.9, max_tokens=NUM_NEW_TOKENS, ignore_eos=True, seed=3, n=2)
    first = [[c.token_ids for c in o.outputs] for o in generate(llm, prompts[:2], seeded)]
    assert [[c.token_ids for c in o.outputs] for o in generate(llm, prompts[1:2], seeded)] == first[1:2]
    del llm
    gc.collect()
    # The target as its own draft: q = p, so every sampled draft is accepted (with q = 1 some would not be).
    llm = LLM(target, dtype="float32", skip_tokenizer_init=True, speculative_config=draft_config(target))
    generate(llm, prompts, SamplingParams(temperature=1.0, max_tokens=NUM_NEW_TOKENS, ignore_eos=True))
    drafted, accepted = spec_counts(llm)
    assert drafted > 20 and accepted >= drafted - 1, (drafted, accepted)
    del llm
    gc.collect()


def test_draft_with_another_vocabulary_is_refused(llama, tmp_path):
    target = llama[0]
    small = build_untokenized_model("llama", tmp_path / "small_vocab", vocab_size=256)
    with pytest.raises(ValueError, match="vocab_size 256.*512.*share the target's tokenizer"):
        LLM(target, dtype="float32", skip_tokenizer_init=True, speculative_config=draft_config(small))


def test_model_without_method_is_a_draft_model_and_needs_a_model(llama):
    from runtime.engine_args import EngineArgs
    from runtime.speculative_config import resolve_speculative_config

    target = llama[0]
    resolved = resolve_speculative_config(EngineArgs(model=target, speculative_config={"model": target, "num_speculative_tokens": 2}))
    assert resolved["method"] == "draft_model"
    with pytest.raises(ValueError, match="needs speculative_config's 'model'"):
        LLM(target, dtype="float32", skip_tokenizer_init=True, speculative_config={"method": "draft_model", "num_speculative_tokens": 2})
