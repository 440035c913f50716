"""EAGLE-1, EAGLE-3 and Medusa heads (random, in their published layouts) through the engine.

Their drafts come from the target's hidden states; whatever they draft, greedy tokens must
equal the target's without speculation, with chunked prefill, prefix caching and preemption.
"""

from __future__ import annotations

import gc

import pytest

from runtime import LLM, SamplingParams
from runtime.testing.conformance import SETTINGS
from runtime.testing.models import UNTOKENIZED_VOCAB_SIZE, build_untokenized_model
from runtime.testing.reference import check_outputs_equal

from spec_decode.heads import build_eagle1_head, build_eagle3_head, build_medusa_head
from spec_decode.engine_runs import generate, repetitive_prompts, spec_counts

NUM_NEW_TOKENS = 10
GREEDY = SamplingParams(temperature=0.0, max_tokens=NUM_NEW_TOKENS, ignore_eos=True)
_baselines: dict = {}


def baseline(arch, root):
    """(target path, prompts, greedy tokens without speculation), built once per architecture."""
    if arch not in _baselines:
        path = build_untokenized_model(arch, root / f"target_{arch}")
        prompts = repetitive_prompts(UNTOKENIZED_VOCAB_SIZE)
        llm = LLM(path, dtype="float32", skip_tokenizer_init=True)
        _baselines[arch] = (path, prompts, [o.outputs[0].token_ids for o in generate(llm, prompts, GREEDY)])
        del llm
        gc.collect()
    return _baselines[arch]


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return tmp_path_factory.mktemp("heads")


def build_head(method, arch, root):
    num_target_layers = 4 if arch == "gemma3" else 2
    if method == "eagle":
        return build_eagle1_head(root / f"eagle1_{arch}", UNTOKENIZED_VOCAB_SIZE)
    if method == "eagle3":
        layers = [0, num_target_layers // 2, num_target_layers - 1]
        return build_eagle3_head(root / f"eagle3_{arch}", UNTOKENIZED_VOCAB_SIZE, layers, UNTOKENIZED_VOCAB_SIZE // 2)
    return build_medusa_head(root / f"medusa_{arch}", UNTOKENIZED_VOCAB_SIZE)


@pytest.mark.parametrize("method,arch,setting", [  # every head on every architecture, the settings rotating
    ("eagle", "llama", "async_chunked_prefix"),
    ("eagle", "qwen2", "prefix_caching"),
    ("eagle", "qwen3", "preemption"),
    ("eagle", "gemma3", "async_chunked_prefix"),
    ("eagle3", "llama", "preemption"),
    ("eagle3", "qwen2", "async_chunked_prefix"),
    ("eagle3", "qwen3", "prefix_caching"),
    ("eagle3", "gemma3", "preemption"),
    ("medusa", "llama", "prefix_caching"),
    ("medusa", "qwen2", "preemption"),
    ("medusa", "qwen3", "async_chunked_prefix"),
    ("medusa", "gemma3", "preemption"),
])
def test_greedy_identical_with_heads(method, arch, setting, root):
    target, prompts, expected = baseline(arch, root)
    config = {"method": method, "model": build_head(method, arch, root), "num_speculative_tokens": 3}
    llm = LLM(target, dtype="float32", skip_tokenizer_init=True, speculative_config=config, **SETTINGS[setting])
    for _ in range(2 if "prefix" in setting else 1):
        check_outputs_equal(expected, [o.outputs[0].token_ids for o in generate(llm, prompts, GREEDY)], f"{method}/{arch}/{setting}")
    assert spec_counts(llm)[0] > 0, "nothing was drafted"
    scheduler = llm.llm_engine.engine_core.scheduler
    assert scheduler.kv_cache_manager.stats.hits > 0 if "prefix" in setting else scheduler.num_preemptions > 0
    del llm
    gc.collect()


def test_eagle_n2_and_seeded_random_sampling(root):
    target, prompts, expected = baseline("llama", root)
    config = {"method": "eagle", "model": build_head("eagle", "llama", root), "num_speculative_tokens": 2}
    llm = LLM(target, dtype="float32", skip_tokenizer_init=True, speculative_config=config)
    params = SamplingParams(temperature=0.0, max_tokens=NUM_NEW_TOKENS, ignore_eos=True, n=2)
    assert [[c.token_ids for c in o.outputs] for o in generate(llm, prompts[:2], params)] == [[e, e] for e in expected[:2]]
    seeded = SamplingParams(temperature=0.8, max_tokens=NUM_NEW_TOKENS, ignore_eos=True, seed=5)
    first = [o.outputs[0].token_ids for o in generate(llm, prompts[:2], seeded)]
    assert [o.outputs[0].token_ids for o in generate(llm, prompts[1:2], seeded)] == first[1:2]


def test_head_layouts_are_checked(root, tmp_path):
    target = baseline("llama", root)[0]
    eagle1 = build_head("eagle", "llama", root)
    with pytest.raises(ValueError, match="has no 'midlayer"):
        LLM(target, dtype="float32", skip_tokenizer_init=True,
            speculative_config={"method": "eagle3", "model": eagle1, "num_speculative_tokens": 2})
    other_vocab = build_medusa_head(tmp_path / "medusa_256", 256)
    with pytest.raises(ValueError, match="predicts 256 tokens, the target model has 512"):
        LLM(target, dtype="float32", skip_tokenizer_init=True,
            speculative_config={"method": "medusa", "model": other_vocab, "num_speculative_tokens": 2})
