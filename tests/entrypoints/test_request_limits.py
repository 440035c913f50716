"""Issue 11's bounds without a server: n and choices, the context check, 64-bit integers, text length, fan-out."""

from __future__ import annotations

from types import SimpleNamespace

import pydantic
import pytest

from runtime.engine.async_llm import split_outputs
from runtime.engine.input_processor import InputProcessor
from runtime.engine.output_processor import OutputProcessor
from runtime.engine.parent_request import ParentRequest, fan_out
from runtime.entrypoints.openai.errors import from_exception
from runtime.entrypoints.openai.limits import RequestLimits, check_context_length
from runtime.entrypoints.openai.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    Texts,
    TokenIdLists,
    TokenIds,
)
from runtime.messages import EngineCoreOutput, EngineCoreRequest, LogprobsLists
from runtime.sampling_params import SamplingParams
from runtime.testing.models import smollm2_tokenizer


def test_limits_name_the_flag_and_the_numbers():
    limits = RequestLimits()
    assert (limits.max_n, limits.max_choices_per_request) == (128, 2048)
    limits.check_n(128)
    limits.check_n(1, num_prompts=2048)
    with pytest.raises(ValueError, match=r"n must be at most 128 on this server \(--max-n\), got 1000000"):
        limits.check_n(10**6)
    with pytest.raises(ValueError, match=r"100 prompts with n=100 ask for 10000 completions.*at most 2048") as info:
        limits.check_n(100, num_prompts=100)
    assert from_exception(info.value).param == "prompt"
    for flag, kwargs in [("--max-n", {"max_n": 0}), ("--max-choices-per-request", {"max_choices_per_request": -1}),
                         ("--max-body-bytes", {"max_body_bytes": 0})]:
        with pytest.raises(ValueError, match=f"{flag} must be an integer >= 1"):
            RequestLimits(**kwargs)


def test_serve_refuses_a_bad_limit_before_loading_anything(capsys):
    from runtime.cli.main import main

    assert main(["serve", "/nonexistent", "--max-n", "0"]) == 2
    assert "--max-n must be an integer >= 1, got 0" in capsys.readouterr().err


def test_context_check_names_both_numbers():
    check_context_length(8151, 41, 8192, "max_tokens")  # exactly fills the context
    check_context_length(8151, None, 8192, "max_tokens")  # no max_tokens: up to the context
    with pytest.raises(ValueError) as info:
        check_context_length(8151, 500, 8192, "max_tokens")
    message = str(info.value)
    assert "maximum context length is 8192 tokens" in message and "8651" in message
    assert "8151 in the prompt" in message and "500 in the completion" in message and "at most 41" in message
    assert from_exception(info.value).param == "max_tokens"


@pytest.mark.parametrize("field", ["n", "seed", "top_k", "max_tokens", "min_tokens", "priority", "logprobs", "best_of"])
@pytest.mark.parametrize("value", [2**63, -(2**63) - 1, 10**30])
def test_integers_past_64_bits_are_validation_errors(field, value):
    with pytest.raises(pydantic.ValidationError, match=field):
        CompletionRequest(prompt="hi", **{field: value})
    CompletionRequest(prompt="hi", **{field: 2**63 - 1 if value > 0 else -(2**63)})  # the bounds themselves parse


def test_integer_lists_and_floats_are_bounded():
    for bad in ({"prompt": [1, 2**64]}, {"prompt": [[1], [2**64]]}, {"prompt": "hi", "stop_token_ids": [2**64]}):
        with pytest.raises(pydantic.ValidationError):
            CompletionRequest(**bad)
    with pytest.raises(pydantic.ValidationError):
        DetokenizeRequest(tokens=[2**64])
    with pytest.raises(pydantic.ValidationError, match="max_completion_tokens"):
        ChatCompletionRequest(messages=[{"role": "user", "content": "x"}], max_completion_tokens=10**30)
    with pytest.raises(pydantic.ValidationError, match="temperature"):
        CompletionRequest(prompt="hi", temperature=float("inf"))


def test_prompt_list_forms_stop_at_their_first_bad_item():
    """A union tries every list form; each failing form stops at its first bad item (one error, not one
    per item), so 200k small prompts cost one pass instead of ~1 s of collected errors."""
    for form, value in [(TokenIds, [[1]] * 1000), (Texts, [1] * 1000), (TokenIdLists, ["a"] * 1000)]:
        with pytest.raises(pydantic.ValidationError) as info:
            pydantic.TypeAdapter(form).validate_python(value)
        assert info.value.error_count() == 1
    assert len(CompletionRequest.model_validate({"prompt": [[1]] * 200_000}).prompts()) == 200_000


@pytest.fixture(scope="module")
def processor() -> InputProcessor:
    config = SimpleNamespace(model="tiny", max_model_len=100, vocab_size=49152)  # what InputProcessor reads
    return InputProcessor(config, smollm2_tokenizer())


def test_text_too_long_to_fit_is_refused_before_tokenizing(processor):
    limit = processor.max_prompt_chars
    longest = max(len(piece.encode()) for piece in processor.tokenizer.get_vocab())
    assert limit == 100 * longest
    processor.check_text("x" * limit)
    with pytest.raises(ValueError, match=rf"prompt has {limit + 1} characters; no text of more than {limit}"):
        processor.encode("x" * (limit + 1))
    with pytest.raises(ValueError, match="messages is not valid Unicode: surrogates not allowed at character 1"):
        processor.check_text("a\ud800", "messages")
    assert processor.encode("héllo") == processor.tokenizer.encode("héllo")


def test_fan_out_copies_params_shallowly_and_seeds_each_child():
    params = SamplingParams(n=4, seed=7, stop=["END"], logit_bias={3: 1.0})
    children = fan_out(EngineCoreRequest(request_id="r", prompt_token_ids=[1, 2], sampling_params=params))
    assert [c.request_id for c in children] == ["0_r", "1_r", "2_r", "3_r"]
    assert [c.sampling_params.seed for c in children] == [7, 8, 9, 10]
    assert all(c.sampling_params.n == 1 and c.sampling_params is not params for c in children)
    assert all(c.sampling_params.stop is params.stop for c in children)  # shared, read-only: O(1) per child
    assert params.n == 4 and params.seed == 7


def test_states_are_built_apart_and_tracked_all_or_none():
    processor = OutputProcessor(smollm2_tokenizer())
    request = EngineCoreRequest(request_id="r", prompt_token_ids=[1, 2], sampling_params=SamplingParams(n=3))
    children = fan_out(request)
    states = processor.new_states(children, "hi", ParentRequest(request))
    assert not processor.has_unfinished_requests()  # built, not tracked
    processor.add_states(states)
    assert processor.get_num_unfinished_requests() == 3
    again = processor.new_states(children[1:], "hi", ParentRequest(request))
    with pytest.raises(ValueError, match="'1_r' is already running"):
        processor.add_states(again)
    assert processor.get_num_unfinished_requests() == 3
    assert processor.abort_requests(["r"]) == ["0_r", "1_r", "2_r"]
    assert not processor.has_unfinished_requests()


def test_step_outputs_are_routed_in_chunks_of_bounded_work():
    """A step's outputs reach their requests in runs of about 4096 logprob entries, with the event loop
    free in between: 128 prompts' logprobs in one step no longer hold every other client for seconds."""
    rows = LogprobsLists(token_ids=[[1] * 21] * 100, logprobs=[[0.0] * 21] * 100, ranks=[1] * 100)  # 2100 entries
    heavy = [EngineCoreOutput(f"h{i}", [1], new_prompt_logprobs=rows) for i in range(4)]
    light = [EngineCoreOutput(f"l{i}", [1]) for i in range(5000)]
    chunks = list(split_outputs(heavy + light, 4096))
    assert [len(c) for c in chunks[:2]] == [2, 2]  # 2 x 2101 entries each
    assert sum(len(c) for c in chunks) == 5004 and [o for c in chunks for o in c] == heavy + light
    assert all(len(c) <= 4096 for c in chunks[2:])
