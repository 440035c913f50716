"""Structured output after the reasoning (``structured_outputs.reasoning``, set by ``--reasoning-parser``).

A model whose weights make it answer ``<think>Let me think</think>Hello`` to any chat prompt: with the tags
given, the reasoning is sampled free and the grammar (outlines, a JSON schema) constrains only what follows
``</think>``, starting fresh there, so the answer is ``<think>Let me think</think>`` and then JSON valid
under the schema (never ``Hello``). The same with async scheduling, preemption by recompute, n=2, and
ngram drafts that would run past the end tag.
"""

from __future__ import annotations

import gc
import json

import jsonschema
import pytest

from runtime import LLM, SamplingParams, StructuredOutputsParams
from runtime.sampling_params import ReasoningTags
from runtime.scheduler.reasoning_gate import CONTENT, OPENING, REASONING, ReasoningGate
from runtime.testing.models import build_tiny_model
from support.scripted_model import build_scripted_model

SCRIPT = ["<think>", "Let", " me", " think", "</think>", "Hello"]
THOUGHT = "<think>Let me think</think>"
SCHEMA = {"type": "object", "properties": {"answer": {"enum": ["yes", "no"]}}, "required": ["answer"],
          "additionalProperties": False}
KWARGS = dict(dtype="float32", max_model_len=256)


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    folder = tmp_path_factory.mktemp("reasoning_grammar")
    source = build_tiny_model("llama", folder / "source")
    return build_scripted_model(source, folder / "model", SCRIPT, added_tokens=["<think>", "</think>"])


@pytest.fixture(scope="module")
def llm(model_path):
    engine = LLM(model_path, **KWARGS)
    yield engine
    del engine
    gc.collect()


@pytest.fixture(scope="module")
def ids(llm):
    tokenizer = llm.get_tokenizer()
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=True,
                                           tokenize=True, return_dict=True)["input_ids"]
    start, end = tokenizer.convert_tokens_to_ids(["<think>", "</think>"])
    return dict(prompt=prompt, start=start, end=end, script=tokenizer.convert_tokens_to_ids(["Let", "Ġme", "Ġthink"]))


def tags(ids, kind: str) -> ReasoningTags:
    """deepseek_r1's reading (reasoning from the first token) or qwen3's (the output may open the block)."""
    if kind == "deepseek_r1":
        return ReasoningTags([ids["end"]])
    return ReasoningTags([ids["end"]], [ids["start"]], starts_in_reasoning=False)


def params(reasoning: ReasoningTags | None, **kwargs) -> SamplingParams:
    kwargs.setdefault("temperature", 0.0)
    return SamplingParams(max_tokens=40, structured_outputs=StructuredOutputsParams(json=SCHEMA, reasoning=reasoning),
                          **kwargs)


def texts(llm, ids, sampling: SamplingParams, num_prompts: int = 1) -> list[str]:
    outputs = llm.generate([{"prompt_token_ids": ids["prompt"]}] * num_prompts, sampling, use_tqdm=False)
    return [c.text for o in outputs for c in o.outputs]


def check_answer(text: str) -> None:
    """The free reasoning, then JSON valid under the schema (the grammar completed it: finish "stop")."""
    assert text.startswith(THOUGHT), text
    jsonschema.validate(json.loads(text[len(THOUGHT):]), SCHEMA)


def test_unconstrained_and_grammar_from_the_first_token(llm, ids):
    """What the gate changes: free, the model says Hello after thinking; constrained from the first token, it
    cannot think at all."""
    assert texts(llm, ids, SamplingParams(temperature=0.0, max_tokens=40)) == [THOUGHT + "Hello"]
    (text,) = texts(llm, ids, params(None))
    jsonschema.validate(json.loads(text), SCHEMA)


@pytest.mark.parametrize("kind", ["deepseek_r1", "qwen3"])
def test_reasoning_is_free_and_the_content_follows_the_schema(llm, ids, kind):
    (text,) = texts(llm, ids, params(tags(ids, kind)))
    check_answer(text)


def test_an_output_that_does_not_open_the_block_is_constrained_at_once(llm, ids):
    """qwen3's reading: the first token may be the start tag or the grammar's; here the start tag is " me",
    which the model does not pick first, so the grammar holds from the first token."""
    reasoning = ReasoningTags([ids["end"]], [ids["script"][1]], starts_in_reasoning=False)
    (text,) = texts(llm, ids, params(reasoning))
    jsonschema.validate(json.loads(text), SCHEMA)


def test_n2_sampled_each_choice_thinks_then_answers(llm, ids):
    """Each child request has its own gate and grammar; sampled at temperature 1, the content's tokens vary."""
    outputs = texts(llm, ids, params(tags(ids, "qwen3"), n=2, temperature=1.0, seed=7), num_prompts=2)
    assert len(outputs) == 4
    for text in outputs:
        check_answer(text)


@pytest.mark.parametrize("setting", ["async", "preempt"])
def test_async_scheduling_and_preemption(model_path, ids, setting):
    """Async: the end tag is in flight when the next step is scheduled, so that step's row is filled after it
    is back. Preemption: requests recomputed mid-reasoning or mid-content keep their phase and grammar."""
    extra = dict(async_scheduling=True) if setting == "async" else dict(num_gpu_blocks_override=8, max_model_len=128)
    engine = LLM(model_path, **{**KWARGS, **extra})
    try:
        reasoning = [tags(ids, "deepseek_r1"), tags(ids, "qwen3")]
        prompts = [{"prompt_token_ids": ids["prompt"]}] * 8
        outputs = engine.generate(prompts, [params(reasoning[i % 2]) for i in range(8)], use_tqdm=False)
        for output in outputs:
            check_answer(output.outputs[0].text)
        scheduler = engine.llm_engine.engine_core.scheduler
        if setting == "preempt":
            assert scheduler.num_preemptions > 0
        else:
            assert engine.llm_engine.engine_core.num_steps_ahead > 0
    finally:
        del engine
        gc.collect()


def test_ngram_drafts_stop_before_the_end_tag(model_path, ids):
    """The prompt holds the whole script, so ngram drafts "Let me think</think>Hello": the drafts are cut before
    ``</think>``, which the step samples itself; the content after it is constrained (no draft is checked
    against the grammar)."""
    spec = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 2, "prompt_lookup_min": 2}
    engine = LLM(model_path, **KWARGS, speculative_config=spec)
    try:
        tokenizer = engine.get_tokenizer()
        hello = tokenizer.convert_tokens_to_ids("Hello")
        echo = [ids["prompt"][-1], ids["start"], *ids["script"], ids["end"], hello]
        prompt = {"prompt_token_ids": echo + ids["prompt"]}
        free = engine.generate([prompt], SamplingParams(temperature=0.0, max_tokens=40), use_tqdm=False)
        assert free[0].outputs[0].text == THOUGHT + "Hello"
        stats = engine.llm_engine.engine_core.scheduler.spec_stats
        accepted = stats.num_accepted_tokens
        assert accepted >= 4  # the free run took drafts past the end tag
        for kind in ("deepseek_r1", "qwen3"):
            (output,) = engine.generate([prompt], params(tags(ids, kind)), use_tqdm=False)
            check_answer(output.outputs[0].text)
        assert stats.num_accepted_tokens - accepted >= 2 * 3  # "Let me think" drafted in each reasoning
    finally:
        del engine
        gc.collect()


def test_gate_phases_and_draft_cuts():
    """The gate alone: a two-token end tag, matched only inside the reasoning and only as that sequence."""
    gate = ReasoningGate(ReasoningTags([8, 9], [5], starts_in_reasoning=False))
    assert gate.phase == OPENING and gate.num_free_drafts([], [1]) == 0
    output: list[int] = []
    for token, takes, phase in [(5, False, REASONING), (9, False, REASONING), (8, False, REASONING),
                                (7, False, REASONING), (8, False, REASONING), (9, False, CONTENT), (8, True, CONTENT)]:
        output.append(token)
        assert (gate.advance(output), gate.phase) == (takes, phase), output
        if output == [5]:
            assert gate.num_free_drafts(output, [8, 9, 1]) == 1  # "8" may be verified, "9" would end it
            assert gate.num_free_drafts(output, [9, 8, 7]) == 3
        if output == [5, 9, 8, 7, 8]:
            assert gate.num_free_drafts(output, [9, 1]) == 0
    assert gate.num_free_drafts(output, [1]) == 0
    across_the_start = ReasoningGate(ReasoningTags([5, 9], [5], starts_in_reasoning=False))
    assert [across_the_start.advance(o) for o in ([5], [5, 9])] == [False, False]
    assert across_the_start.phase == REASONING  # the start tag is not part of an end tag
    opened_elsewhere = ReasoningGate(ReasoningTags([8], [5], starts_in_reasoning=False))
    assert (opened_elsewhere.advance([4]), opened_elsewhere.phase) == (True, CONTENT)
    assert ReasoningGate(ReasoningTags([8], [5, 6], starts_in_reasoning=False)).phase == CONTENT  # start of 2 tokens
    with pytest.raises(ValueError, match="end_token_ids must be a non-empty list of token ids"):
        ReasoningTags([])
    with pytest.raises(ValueError, match="reasoning must be ReasoningTags or a dict"):
        StructuredOutputsParams(json_object=True, reasoning=[8])
    assert SamplingParams(structured_outputs={"json_object": True, "reasoning": {"end_token_ids": [8]}}
                          ).structured_outputs.reasoning == ReasoningTags([8])
