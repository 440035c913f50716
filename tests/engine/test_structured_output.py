"""Structured output in the engine, with a token-trie guided backend defined by the tests.

The grammar says which token ids may come next; the engine must compile it off the step loop,
mask the logits of constrained rows only, advance the grammar on sampled tokens, finish the
request when the grammar is complete, and fail a request whose grammar does not compile (or
compiles too slowly) without disturbing the others. Greedy constrained tokens equal
transformers' greedy tokens under the same mask, in every setting of the parity suite.
"""

from __future__ import annotations

import gc
import random

import numpy as np
import pytest
import torch

from runtime import LLM, SamplingParams, StructuredOutputsParams
from runtime.sample.bitmask import apply_token_bitmask, unpack_bitmask
from runtime.structured_output import allocate_token_bitmask
from runtime.testing.conformance import SETTINGS
from runtime.testing.models import build_tiny_model
from runtime.testing.reference import check_outputs_equal
from support.token_trie_grammar import BACKEND_NAME, TrieBackendPlugin, TrieGrammar, choice_spec

MAX_TOKENS = 12
# Token-id sequences the constrained requests must produce (one is a prefix of another).
SEQUENCES = [[100, 200, 300, 301, 302], [100, 200, 400], [100, 200, 400, 500, 600, 700], [700, 800, 900, 1000, 1100, 1200]]


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    return build_tiny_model("llama", tmp_path_factory.mktemp("structured_llama"))


@pytest.fixture(scope="module")
def prompts():
    rng = random.Random(0)
    prefix = [rng.randrange(3, 40000) for _ in range(9)]
    return [prefix + [rng.randrange(3, 40000) for _ in range(n)] for n in (3, 11, 6, 17, 2, 8)]


@pytest.fixture
def trie_backend(plugin_manager):
    plugin_manager.register(TrieBackendPlugin, "token_trie_test")
    return plugin_manager


@pytest.fixture(scope="module")
def reference(model_path, prompts):
    """transformers' greedy tokens: even prompts free, odd prompts under the trie grammar's mask."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).eval()
    eos = hf.config.eos_token_id
    results = []
    for i, prompt in enumerate(prompts):
        grammar = TrieGrammar([tuple(s) for s in SEQUENCES], eos) if i % 2 else None
        ids, out = list(prompt), []
        while len(out) < MAX_TOKENS:
            with torch.no_grad():
                logits = hf(torch.tensor([ids])).logits[0, -1]
            if grammar is not None:
                mask = allocate_token_bitmask(1, logits.shape[0])
                grammar.fill_bitmask(mask, 0)
                apply_token_bitmask(logits.unsqueeze(0), mask)
            token = int(logits.argmax())
            out.append(token)
            ids.append(token)
            if grammar is not None:
                assert grammar.accept_tokens([token])
                if grammar.is_terminated():
                    break
            elif token == eos:
                break
        results.append(out)
    return results


def sequence_of(token_ids: list[int], eos: int = 2) -> list[int]:
    """The constrained output without the EOS that may end it (SmolLM2's tokenizer: EOS is 2)."""
    return token_ids[:-1] if token_ids and token_ids[-1] == eos else token_ids


def request_params(i: int, **extra) -> SamplingParams:
    if i % 2 == 0:
        return SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, **extra)
    constraint = StructuredOutputsParams(choice=choice_spec(SEQUENCES))
    return SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, structured_outputs=constraint, **extra)


def make_llm(model_path, **kwargs) -> LLM:
    kwargs = dict(dtype="float32", max_model_len=128, guided_decoding_backend=BACKEND_NAME) | kwargs
    return LLM(model_path, **kwargs)


@pytest.mark.parametrize("setting", list(SETTINGS))
def test_greedy_constrained_and_free_requests_match_transformers(trie_backend, model_path, prompts, reference, setting):
    llm = make_llm(model_path, **SETTINGS[setting])
    tokenizer = llm.llm_engine.tokenizer
    params = [request_params(i) for i in range(len(prompts))]
    runs = 2 if "prefix" in setting else 1
    for _ in range(runs):
        outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        tokens = [o.outputs[0].token_ids for o in outputs]
        check_outputs_equal(reference, tokens, f"structured/{setting}")
        for i, out in enumerate(outputs):
            if i % 2:
                assert sequence_of(tokens[i]) in SEQUENCES, tokens[i]
                assert out.outputs[0].finish_reason == "stop"
                # Ended by its grammar on a text token: that token's text is kept (an EOS's is not).
                assert out.outputs[0].text == tokenizer.decode(sequence_of(tokens[i]), skip_special_tokens=True)
    scheduler = llm.llm_engine.engine_core.scheduler
    if "preemption" in setting:
        assert scheduler.num_preemptions > 0
    if "prefix" in setting:
        assert scheduler.kv_cache_manager.stats.hits > 0
    del llm
    gc.collect()


def test_free_requests_get_the_same_tokens_alone_and_beside_constrained_ones(trie_backend, model_path, prompts):
    llm = make_llm(model_path)
    free_prompts = [{"prompt_token_ids": p} for p in prompts[::2]]
    free = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=3)
    alone = llm.generate(free_prompts, free, use_tqdm=False)
    constrained = SamplingParams(
        temperature=0.9, seed=1, max_tokens=MAX_TOKENS, n=3, structured_outputs=StructuredOutputsParams(choice=choice_spec(SEQUENCES))
    )
    mixed = llm.generate(
        free_prompts + [{"prompt_token_ids": p} for p in prompts[1::2]],
        [free] * len(free_prompts) + [constrained] * len(prompts[1::2]),
        use_tqdm=False,
    )
    for a, m in zip(alone, mixed):
        assert a.outputs[0].token_ids == m.outputs[0].token_ids
        # Same tokens; logprobs equal up to float32 rounding of a different batch shape.
        for pa, pm in zip(a.outputs[0].logprobs, m.outputs[0].logprobs):
            assert list(pa) == list(pm)
            assert [lp.logprob for lp in pa.values()] == pytest.approx([lp.logprob for lp in pm.values()], abs=1e-5)
    for out in mixed[len(free_prompts):]:
        assert len(out.outputs) == 3
        for completion in out.outputs:
            assert sequence_of(completion.token_ids) in SEQUENCES
            assert completion.finish_reason == "stop"


def test_random_sampling_and_logprobs_stay_inside_the_grammar(trie_backend, model_path, prompts):
    llm = make_llm(model_path)
    constraint = StructuredOutputsParams(choice=choice_spec(SEQUENCES))
    params = SamplingParams(temperature=1.5, top_p=0.95, max_tokens=MAX_TOKENS, n=8, logprobs=2, structured_outputs=constraint)
    seen = set()
    for out in llm.generate([{"prompt_token_ids": p} for p in prompts[:3]], params, use_tqdm=False):
        for completion in out.outputs:
            assert sequence_of(completion.token_ids) in SEQUENCES
            seen.add(tuple(sequence_of(completion.token_ids)))
            grammar = TrieGrammar([tuple(q) for q in SEQUENCES], eos_token_id=2)
            for token, position in zip(completion.token_ids, completion.logprobs):
                allowed = grammar._allowed(grammar.state)
                assert token in allowed and position[token].logprob > float("-inf")
                # logprobs come from the masked logits: disallowed tokens rank last, at -inf
                assert all(t in allowed or lp.logprob == float("-inf") for t, lp in position.items())
                assert grammar.accept_tokens([token])
    assert len(seen) > 1  # the draws explore more than one allowed sequence


def test_a_grammar_that_does_not_compile_fails_only_its_request(trie_backend, model_path, prompts):
    llm = make_llm(model_path)
    bad = SamplingParams(max_tokens=4, structured_outputs=StructuredOutputsParams(regex="fail"))
    with pytest.raises(ValueError, match="invalid regex for structured output: this regex is not supported"):
        llm.generate([{"prompt_token_ids": prompts[0]}, {"prompt_token_ids": prompts[1]}], [request_params(0), bad], use_tqdm=False)
    engine = llm.llm_engine
    assert not engine.has_unfinished_requests()
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts[:2]], [request_params(0), request_params(1)], use_tqdm=False)
    assert sequence_of(outputs[1].outputs[0].token_ids) in SEQUENCES


def test_a_compile_past_its_time_limit_fails_the_request(trie_backend, model_path, prompts):
    llm = make_llm(model_path, structured_output_compile_timeout=0.3)
    slow = SamplingParams(max_tokens=4, structured_outputs=StructuredOutputsParams(regex="slow:2"))
    with pytest.raises(ValueError, match=r"took longer than 0.3 s \(structured_output_compile_timeout\)"):
        llm.generate([{"prompt_token_ids": prompts[0]}], slow, use_tqdm=False)
    outputs = llm.generate([{"prompt_token_ids": prompts[1]}], request_params(1), use_tqdm=False)
    assert sequence_of(outputs[0].outputs[0].token_ids) in SEQUENCES


@pytest.mark.parametrize("memory", [0, 1000, -1, 2.5, True, "4G"])
def test_a_bad_compile_memory_limit_names_the_flag(memory):
    from runtime.engine_args import EngineArgs

    with pytest.raises(ValueError, match=r"structured_output_compile_memory_bytes must be an integer number of bytes, "
                                         r"at least 1 MiB, got"):
        EngineArgs(model="unused", structured_output_compile_memory_bytes=memory).create_engine_config()


def test_runaway_compiles_do_not_starve_the_others(trie_backend, model_path, prompts):
    # Two compiles that outlive their requests' time limit hold both compile threads (a thread
    # cannot be stopped); a third spec must still compile, in new threads.
    llm = make_llm(model_path, structured_output_compile_timeout=0.5)
    for spec in ("slow:4", "slow:4.0"):
        slow = SamplingParams(max_tokens=4, structured_outputs=StructuredOutputsParams(regex=spec))
        with pytest.raises(ValueError, match="took longer than 0.5 s"):
            llm.generate([{"prompt_token_ids": prompts[0]}], slow, use_tqdm=False)
    outputs = llm.generate([{"prompt_token_ids": prompts[1]}], request_params(1), use_tqdm=False)
    assert sequence_of(outputs[0].outputs[0].token_ids) in SEQUENCES


def test_async_scheduling_queues_constrained_requests_ahead(trie_backend, model_path, prompts, reference):
    # Constrained requests alone: each step is queued while the previous one runs (the engine
    # collects it before the bitmask is filled), and the tokens are still transformers'.
    llm = make_llm(model_path, async_scheduling=True)
    core = llm.llm_engine.engine_core
    odd = range(1, len(prompts), 2)
    outputs = llm.generate([{"prompt_token_ids": prompts[i]} for i in odd], [request_params(i) for i in odd], use_tqdm=False)
    check_outputs_equal([reference[i] for i in odd], [o.outputs[0].token_ids for o in outputs], "structured/async constrained only")
    assert core.num_steps_ahead > 0
    assert core.scheduler.can_schedule_ahead() and not core.scheduler.requests


def test_structured_output_without_a_backend_names_the_plugin(plugin_manager, model_path, prompts, monkeypatch):
    llm = LLM(model_path, dtype="float32", max_model_len=128)
    llm.llm_engine.input_processor.guided_backend = None  # as if no guided backend were installed
    params = SamplingParams(structured_outputs=StructuredOutputsParams(choice=["a", "b"]))
    with pytest.raises(ValueError, match="runtime-plugin-outlines"):
        llm.generate([{"prompt_token_ids": prompts[0]}], params, use_tqdm=False)


def test_unknown_backend_flag_names_the_installed_ones(plugin_manager, model_path):
    with pytest.raises(ValueError, match=r"--guided-decoding-backend: unknown guided backend 'nope'"):
        LLM(model_path, dtype="float32", max_model_len=128, guided_decoding_backend="nope")


@pytest.mark.parametrize(
    "params, message",
    [
        (dict(), "exactly one of json, regex, choice, grammar, json_object, got none"),
        (dict(regex="a", choice=["a"]), "got regex, choice"),
        (dict(json="{not json"), "structured_outputs.json is not valid JSON"),
        (dict(json="[1]"), "must be a JSON schema object"),
        (dict(choice=[]), "non-empty list of strings"),
        (dict(choice=["a", 3]), "non-empty list of strings"),
    ],
)
def test_structured_outputs_params_name_the_bad_field(params, message):
    with pytest.raises(ValueError, match=message):
        StructuredOutputsParams(**params)
    with pytest.raises(ValueError, match="unknown field"):
        SamplingParams(structured_outputs={"jsn": {}})


def test_bitmask_unpacks_every_bit_and_masks_only_the_given_rows():
    vocab = 70  # not a multiple of 32: the last word is partial
    rng = random.Random(0)
    allowed = [set(rng.sample(range(vocab), rng.randrange(1, vocab))) for _ in range(3)]
    words = np.zeros((3, (vocab + 31) // 32), dtype=np.uint32)
    for row, tokens in enumerate(allowed):
        for token in tokens:
            words[row, token // 32] |= np.uint32(1 << (token % 32))
    bitmask = torch.from_numpy(words.view(np.int32))
    assert bitmask.shape == allocate_token_bitmask(3, vocab).shape
    unpacked = unpack_bitmask(bitmask, vocab)
    assert [set(torch.nonzero(r).flatten().tolist()) for r in unpacked] == allowed
    assert unpack_bitmask(bitmask, vocab + 40)[:, vocab:].sum() == 0  # past the bitmask: disallowed
    logits = torch.randn(5, vocab)
    original = logits.clone()
    apply_token_bitmask(logits, bitmask, rows=[4, 0, 2])
    for mask_row, logits_row in enumerate([4, 0, 2]):
        finite = set(torch.nonzero(torch.isfinite(logits[logits_row])).flatten().tolist())
        assert finite == allowed[mask_row]
    assert torch.equal(logits[1], original[1]) and torch.equal(logits[3], original[3])
