"""Speculative decoding (ngram) through the engine: the drafts change nothing but speed.

Greedy tokens must equal those without speculation (and transformers') on every tiny
architecture, in the parity suite's paged-KV settings; stops, lengths, min_tokens,
logprobs, penalties, n > 1 and seeds must behave as without it; prompts repeat
subsequences so that ngram proposes and the target accepts some drafts.
"""

from __future__ import annotations

import gc
import logging
import os
import random

import pytest

from runtime import LLM, SamplingParams, StructuredOutputsParams
from runtime.testing.conformance import SETTINGS
from runtime.testing.models import TINY_ARCHS, UNTOKENIZED_VOCAB_SIZE, build_untokenized_model
from runtime.testing.reference import check_outputs_equal, reference_outputs

NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4, "prompt_lookup_min": 2}
NUM_NEW_TOKENS = 16
# The parity suite's settings, two per architecture: chunked prefill with prefix caching (and
# async scheduling, which falls back to synchronous steps), and forced preemption.
SPEC_SETTINGS = ("async_chunked_prefix", "preemption")


def repetitive_prompts(vocab_size: int, seed: int = 0) -> list[list[int]]:
    """Prompts that repeat subsequences (ngram finds earlier occurrences of their suffixes)."""
    rng = random.Random(seed)

    def seq(n):
        return [rng.randrange(3, vocab_size) for _ in range(n)]

    a, b, c, d = seq(8), seq(5), seq(4), seq(11)
    return [
        a + seq(3) + a + a[:4],
        b * 3 + b[:2],
        d + seq(2) + d + seq(9) + d[:5],  # 38 tokens: several chunks under the tiny budget
        c + c + seq(3) + c[:3],
    ]


def generate(llm: LLM, prompts, params):
    return llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)


def accepted_tokens(llm: LLM) -> int:
    """Accepted draft tokens so far, from the scheduler stats that feed /metrics."""
    stats = getattr(llm.llm_engine, "last_stats", None) or {}
    return stats.get("spec_decode_num_accepted_tokens", 0)


def assert_logprobs_close(expected, actual, label, atol=1e-3):
    for pos, (e, a) in enumerate(zip(expected, actual)):
        assert list(e) == list(a), f"{label}: position {pos} top tokens differ"
        for token in e:
            assert abs(e[token].logprob - a[token].logprob) <= atol, f"{label}: position {pos} token {token}"


@pytest.fixture(scope="module", params=TINY_ARCHS)
def arch_baseline(request, tmp_path_factory):
    """(arch, checkpoint, prompts, greedy outputs without speculation)."""
    arch = request.param
    path = build_untokenized_model(arch, tmp_path_factory.mktemp(f"spec_{arch}"))
    prompts = repetitive_prompts(UNTOKENIZED_VOCAB_SIZE)
    llm = LLM(path, dtype="float32", skip_tokenizer_init=True)
    params = SamplingParams(temperature=0.0, max_tokens=NUM_NEW_TOKENS, ignore_eos=True, logprobs=2)
    outputs = [o.outputs[0] for o in generate(llm, prompts, params)]
    del llm
    gc.collect()
    return arch, path, prompts, outputs


@pytest.mark.parametrize("setting", SPEC_SETTINGS)
def test_greedy_tokens_identical_with_ngram(arch_baseline, setting, caplog):
    arch, path, prompts, expected = arch_baseline
    with caplog.at_level(logging.WARNING, logger="runtime.engine.core"):
        llm = LLM(path, dtype="float32", skip_tokenizer_init=True, speculative_config=NGRAM, **SETTINGS[setting])
    if "async" in setting:
        assert "async scheduling is not supported with speculative decoding" in caplog.text
        assert llm.llm_engine.engine_core.async_scheduling is False
    params = SamplingParams(temperature=0.0, max_tokens=NUM_NEW_TOKENS, ignore_eos=True, logprobs=2)
    label = f"{arch}/{setting}"
    for _ in range(2 if "prefix" in setting else 1):
        outputs = [o.outputs[0] for o in generate(llm, prompts, params)]
        check_outputs_equal([e.token_ids for e in expected], [o.token_ids for o in outputs], label)
        for e, o in zip(expected, outputs):
            assert_logprobs_close(e.logprobs, o.logprobs, label)
    assert accepted_tokens(llm) > 0, f"{label}: no draft was accepted"
    scheduler = llm.llm_engine.engine_core.scheduler
    if "prefix" in setting:
        assert scheduler.kv_cache_manager.stats.hits > 0
    if "preemption" in setting:
        assert scheduler.num_preemptions > 0
    del llm
    gc.collect()


def test_the_baseline_is_transformers_greedy(arch_baseline):
    """With the test above: speculative greedy tokens = transformers' greedy tokens."""
    arch, path, prompts, expected = arch_baseline
    reference = reference_outputs(path, prompts, NUM_NEW_TOKENS)
    check_outputs_equal([tokens for tokens, _ in reference], [e.token_ids for e in expected], f"{arch} vs hf")


# ------------------------------------------------------------ sampling features
PAIR_KWARGS = dict(dtype="float32", skip_tokenizer_init=True, max_model_len=128, block_size=4)
PAIR_SPEC = dict(method="ngram", num_speculative_tokens=3, prompt_lookup_min=1, prompt_lookup_max=3)


@pytest.fixture(scope="module")
def pair_path(tmp_path_factory):
    return build_untokenized_model("llama", tmp_path_factory.mktemp("spec_llama_pair"))


@pytest.fixture(scope="module")
def pair(pair_path):
    """(LLM without speculation, LLM with ngram k=3, prompts) on a tiny llama."""
    prompts = repetitive_prompts(UNTOKENIZED_VOCAB_SIZE, seed=2)
    return LLM(pair_path, **PAIR_KWARGS), LLM(pair_path, speculative_config=PAIR_SPEC, **PAIR_KWARGS), prompts


def completions(llm, prompts, params):
    return [[(c.token_ids, c.finish_reason, c.stop_reason) for c in o.outputs] for o in generate(llm, prompts, params)]


def test_stop_ids_lengths_and_min_tokens_as_without_speculation(pair):
    base, spec, prompts = pair
    free = generate(base, prompts, SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True))
    stop_id = free[0].outputs[0].token_ids[6]
    cases = [
        SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True, stop_token_ids=[stop_id]),
        SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True, stop_token_ids=[stop_id], min_tokens=9),
        SamplingParams(temperature=0.0, max_tokens=16),  # EOS may end it
    ] + [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in (1, 2, 3, 5)]
    before = accepted_tokens(spec)
    for params in cases:
        assert completions(spec, prompts, params) == completions(base, prompts, params), params
    assert accepted_tokens(spec) > before


def test_logprobs_penalties_and_greedy_n_as_without_speculation(pair):
    base, spec, prompts = pair
    cases = [
        SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=3, prompt_logprobs=2),
        SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, repetition_penalty=1.3),
        SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, frequency_penalty=0.4, presence_penalty=0.3),
        SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, n=2),
    ]
    for params in cases:
        expected, actual = generate(base, prompts, params), generate(spec, prompts, params)
        for e, a in zip(expected, actual):
            assert [c.token_ids for c in e.outputs] == [c.token_ids for c in a.outputs], params
            if params.logprobs:
                assert_logprobs_close(e.outputs[0].logprobs, a.outputs[0].logprobs, "logprobs")
                assert_logprobs_close(e.prompt_logprobs[1:], a.prompt_logprobs[1:], "prompt logprobs")


def test_seeded_random_sampling_is_reproducible(pair):
    _, spec, prompts = pair
    params = SamplingParams(temperature=0.8, top_p=0.95, max_tokens=12, ignore_eos=True, seed=7, n=2)
    first = completions(spec, prompts, params)
    assert completions(spec, prompts, params) == first
    assert completions(spec, prompts[1:2], params) == first[1:2]  # alone in its batch


def test_seeded_sampling_equals_no_speculation_whatever_the_drafts_verified(pair, pair_path):
    """A seeded request samples each position as it would without drafts (ngram's one-hot drafts are kept while the
    position's own sample equals them), so its tokens equal the run without speculation, also under a token budget
    that cuts the drafts a step verifies and with preemption. Before, the uniforms drawn per draft moved the noise
    of the step's last token, so the tokens depended on how many drafts the batch left room for."""
    base, spec, prompts = pair
    params = SamplingParams(temperature=0.1, max_tokens=16, ignore_eos=True, seed=5, n=2)
    expected = completions(base, prompts, params)
    assert completions(spec, prompts, params) == expected
    tight = LLM(pair_path, speculative_config=PAIR_SPEC, max_num_batched_tokens=16, num_gpu_blocks_override=32,
                **PAIR_KWARGS)
    try:
        assert completions(tight, prompts, params) == expected
        assert completions(tight, prompts[2:3], params) == expected[2:3]
        stats = tight.llm_engine.engine_core.scheduler.stats()
        assert stats["spec_decode_num_accepted_tokens"] > 0 and stats["num_preemptions"] > 0, stats
    finally:
        del tight
        gc.collect()


@pytest.mark.parametrize("draft", ["self", "other"])
def test_seeded_sampling_with_a_draft_model_equals_no_speculation(pair, pair_path, tmp_path, draft):
    """A draft model's q does not move a seeded request's tokens: each position keeps its own sample, and a seeded
    draft is sampled with that position's noise, so a draft equal to the target has every draft kept (another one,
    fewer). Before, the p / q test with the drafts' own generators gave other tokens than the run without drafts."""
    base, _, prompts = pair
    params = SamplingParams(temperature=0.8, max_tokens=16, ignore_eos=True, seed=11, n=2)
    expected = completions(base, prompts, params)
    model = pair_path if draft == "self" else build_untokenized_model("llama", tmp_path / "draft", seed=3)
    llm = LLM(pair_path, speculative_config={"method": "draft_model", "model": model, "num_speculative_tokens": 3},
              **PAIR_KWARGS)
    try:
        assert completions(llm, prompts, params) == expected
        stats = llm.llm_engine.engine_core.scheduler.stats()
        drafted, accepted = stats["spec_decode_num_draft_tokens"], stats["spec_decode_num_accepted_tokens"]
        assert drafted > 0 and (accepted == drafted if draft == "self" else accepted < drafted), stats
    finally:
        del llm
        gc.collect()


# ------------------------------------------------------------ a real model
@pytest.fixture(scope="module")
def smollm2():
    """SmolLM2 (GGUF) with ngram speculation and the tests' token-trie guided backend."""
    from runtime import plugins
    from runtime.testing.models import smollm2_gguf_path
    from support.token_trie_grammar import BACKEND_NAME, TrieBackendPlugin

    saved = plugins._manager
    manager = plugins.PluginManager(plugins.parse_allow_list(os.environ.get(plugins.ALLOW_LIST_ENV)))
    plugins.reset_plugin_manager(manager)
    manager.register(TrieBackendPlugin, "token_trie_test")
    try:
        yield LLM(smollm2_gguf_path(), dtype="float32", max_model_len=256, speculative_config=NGRAM,
                  guided_decoding_backend=BACKEND_NAME)
    finally:
        plugins.reset_plugin_manager(saved)


def without_speculation(llm: LLM, run):
    """``run()`` on the same engine with its proposer switched off."""
    core = llm.llm_engine.engine_core
    proposer, core.proposer = core.proposer, None
    try:
        return run()
    finally:
        core.proposer = proposer


COPY_CHAT = [{"role": "user", "content": "Copy this text exactly, word for word: The quick brown fox jumps over the "
              "lazy dog. The early bird catches the worm. A stitch in time saves nine."}]


def test_smollm2_copies_from_the_prompt_with_accepted_drafts(smollm2):
    params = SamplingParams(temperature=0.0, max_tokens=24)
    expected = without_speculation(smollm2, lambda: smollm2.chat(COPY_CHAT, params, use_tqdm=False)[0].outputs[0])
    before = dict(smollm2.llm_engine.last_stats)
    actual = smollm2.chat(COPY_CHAT, params, use_tqdm=False)[0].outputs[0]
    assert actual.token_ids == expected.token_ids and actual.text == expected.text
    assert "quick brown fox" in actual.text
    stats = smollm2.llm_engine.last_stats
    drafts = stats["spec_decode_num_drafts"] - before.get("spec_decode_num_drafts", 0)
    accepted = stats["spec_decode_num_accepted_tokens"] - before.get("spec_decode_num_accepted_tokens", 0)
    assert accepted > 0
    assert 1 + accepted / drafts > 2  # a copy: well over one token per verification step


def test_smollm2_stop_strings_and_constrained_requests(smollm2):
    """Stop strings inside accepted runs, and constrained requests (no drafts) beside free ones."""
    from support.token_trie_grammar import choice_spec

    prompt = smollm2.get_tokenizer().apply_chat_template(COPY_CHAT, tokenize=False, add_generation_prompt=True)
    sequences = [[100, 200, 300, 301, 302], [7, 8, 9, 10, 11, 12]]
    constrained = SamplingParams(temperature=0.0, max_tokens=12, structured_outputs=StructuredOutputsParams(choice=choice_spec(sequences)))
    prompts = [prompt, prompt + "The", prompt, prompt]
    params = [
        SamplingParams(temperature=0.0, max_tokens=20, stop=["lazy"]),
        constrained,
        constrained,
        SamplingParams(temperature=0.0, max_tokens=20, stop=[" over"], include_stop_str_in_output=True),
    ]
    expected = without_speculation(smollm2, lambda: smollm2.generate(prompts, params, use_tqdm=False))
    before = accepted_tokens(smollm2)
    actual = smollm2.generate(prompts, params, use_tqdm=False)
    summary = [[(o.outputs[0].token_ids, o.outputs[0].text, o.outputs[0].finish_reason)] for o in actual]
    assert summary == [[(o.outputs[0].token_ids, o.outputs[0].text, o.outputs[0].finish_reason)] for o in expected]
    assert "lazy" not in actual[0].outputs[0].text and actual[0].outputs[0].finish_reason == "stop"
    assert actual[3].outputs[0].text.endswith(" over") and actual[3].outputs[0].finish_reason == "stop"
    for out in actual[1:3]:
        tokens = out.outputs[0].token_ids
        assert (tokens[:-1] if tokens[-1] == 2 else tokens) in sequences, tokens  # 2: SmolLM2's EOS
    assert accepted_tokens(smollm2) > before  # the free requests beside them speculated


def test_allowed_token_ids_with_and_without_speculation_equal_transformers(pair, pair_path):
    """vLLM's allowed_token_ids, greedy: the engine's tokens are transformers' greedy tokens over the allowed ids
    alone (the other logits at -inf), with and without ngram drafts (the mask applies at every verified position)."""
    import torch
    from transformers import AutoModelForCausalLM

    base, spec, prompts = pair
    expected_free = [o.outputs[0].token_ids for o in generate(base, prompts, SamplingParams(temperature=0.0, max_tokens=12,
                                                                                              ignore_eos=True))]
    allowed = sorted({t for tokens in expected_free for t in tokens[::2]})  # the model's likely tokens, half of them
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, allowed_token_ids=allowed)
    model = AutoModelForCausalLM.from_pretrained(pair_path, dtype=torch.float32).eval()
    banned = torch.ones(model.config.vocab_size, dtype=torch.bool)
    banned[allowed] = False
    expected = []
    with torch.no_grad():
        for prompt in prompts:
            ids = list(prompt)
            for _ in range(12):
                logits = model(torch.tensor([ids])).logits[0, -1].masked_fill(banned, float("-inf"))
                ids.append(int(logits.argmax()))
            expected.append(ids[len(prompt):])
    assert [o.outputs[0].token_ids for o in generate(base, prompts, params)] == expected
    assert [o.outputs[0].token_ids for o in generate(spec, prompts, params)] == expected
    assert expected != expected_free
