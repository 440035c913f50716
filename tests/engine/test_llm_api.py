"""The offline API: prompts, chat, n, seeds, stop strings, logprobs, token-id-only mode."""

import pytest
import torch
from transformers import AutoModelForCausalLM

from runtime import LLM, SamplingParams

from runtime.testing.models import build_tiny_model


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    return build_tiny_model("qwen3", tmp_path_factory.mktemp("qwen3"))


@pytest.fixture(scope="module")
def llm(model_path):
    return LLM(model_path, dtype="float32", max_model_len=256, block_size=8)


def test_prompt_logprobs_match_transformers(llm, model_path):
    prompt = [101, 2045, 7, 880, 31000, 42, 42, 9001, 15]
    out = llm.generate({"prompt_token_ids": prompt}, SamplingParams(max_tokens=1, prompt_logprobs=3), use_tqdm=False)[0]
    hf = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).eval()
    with torch.inference_mode():
        ref = torch.log_softmax(hf(torch.tensor([prompt])).logits[0].float(), dim=-1)
    assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == len(prompt)
    for pos in range(1, len(prompt)):
        entry = out.prompt_logprobs[pos]
        token = prompt[pos]
        assert token in entry
        assert entry[token].logprob == pytest.approx(ref[pos - 1, token].item(), abs=1e-4)
        expected_rank = int((ref[pos - 1] > ref[pos - 1, token]).sum()) + 1
        assert entry[token].rank == expected_rank
        top = torch.topk(ref[pos - 1], 3).indices.tolist()
        assert set(top) <= set(entry)


def test_prompt_logprobs_over_chunked_prefill(model_path):
    small = LLM(model_path, dtype="float32", max_model_len=256, max_num_batched_tokens=4)
    prompt = list(range(200, 219))
    chunked = small.generate({"prompt_token_ids": prompt}, SamplingParams(max_tokens=2, prompt_logprobs=0), use_tqdm=False)[0]
    assert len(chunked.prompt_logprobs) == len(prompt)
    assert all(prompt[i] in chunked.prompt_logprobs[i] for i in range(1, len(prompt)))


def test_n_and_seed(llm):
    params = SamplingParams(n=3, temperature=1.0, seed=1234, max_tokens=8)
    first = llm.generate("hello there", params, use_tqdm=False)[0]
    assert [o.index for o in first.outputs] == [0, 1, 2]
    assert len({tuple(o.token_ids) for o in first.outputs}) > 1  # children draw differently
    # the same seed gives the same samples, alone or in a batch with other requests
    batch = llm.generate(["other prompt", "hello there"], [SamplingParams(temperature=1.0, max_tokens=8), params], use_tqdm=False)
    assert [o.token_ids for o in batch[1].outputs] == [o.token_ids for o in first.outputs]


def test_stop_strings(llm):
    greedy = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    full = llm.generate("a b c", greedy, use_tqdm=False)[0].outputs[0]
    assert len(full.text) > 6
    stop = full.text[3:6]
    cut = llm.generate("a b c", SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, stop=[stop]), use_tqdm=False)[0].outputs[0]
    assert cut.finish_reason == "stop" and cut.stop_reason == stop
    assert cut.text == full.text[: full.text.index(stop)]
    kept = llm.generate(
        "a b c", SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, stop=[stop], include_stop_str_in_output=True), use_tqdm=False
    )[0].outputs[0]
    assert kept.text == full.text[: full.text.index(stop) + len(stop)]
    assert not llm.llm_engine.has_unfinished_requests()


def test_stop_token_ids_and_max_tokens(llm):
    greedy = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    full = llm.generate("x y", greedy, use_tqdm=False)[0].outputs[0]
    assert full.finish_reason == "length" and len(full.token_ids) == 12
    target = full.token_ids[5]
    out = llm.generate("x y", SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, stop_token_ids=[target]), use_tqdm=False)[0].outputs[0]
    first = full.token_ids.index(target)
    assert out.token_ids == full.token_ids[: first + 1]
    assert out.finish_reason == "stop" and out.stop_reason == target


def test_chat_uses_the_template(llm):
    messages = [{"role": "user", "content": "hi"}]
    out = llm.chat(messages, SamplingParams(temperature=0.0, max_tokens=4), use_tqdm=False)[0]
    expected = llm.get_tokenizer().apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert out.prompt == expected
    assert out.prompt_token_ids == llm.get_tokenizer().encode(expected, add_special_tokens=False)


def test_skip_tokenizer_init_runs_on_ids(model_path, llm):
    bare = LLM(model_path, dtype="float32", max_model_len=256, skip_tokenizer_init=True)
    assert bare.get_tokenizer() is None
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    out = bare.generate({"prompt_token_ids": [5, 6, 7, 8]}, params, use_tqdm=False)[0].outputs[0]
    ref = llm.generate({"prompt_token_ids": [5, 6, 7, 8]}, params, use_tqdm=False)[0].outputs[0]
    assert out.token_ids == ref.token_ids and out.text == ""
    with pytest.raises(ValueError, match="text prompts need a tokenizer"):
        bare.generate("text", params, use_tqdm=False)


def test_priority_argument(model_path):
    llm = LLM(model_path, dtype="float32", max_model_len=256, block_size=8, scheduling_policy="priority")
    outs = llm.generate(["a", "b"], SamplingParams(max_tokens=2), priority=[1, 0], use_tqdm=False)
    assert [o.request_id for o in outs] == sorted(o.request_id for o in outs)
    with pytest.raises(ValueError, match="2 prompts but 1 priorities"):
        llm.generate(["a", "b"], SamplingParams(max_tokens=2), priority=[1], use_tqdm=False)


def test_priority_needs_the_priority_policy(llm):
    # as vLLM: under first-come-first-served scheduling a priority would be ignored, so it is refused
    with pytest.raises(ValueError, match="priority 1 needs --scheduling-policy priority; this engine schedules fcfs"):
        llm.generate(["a", "b"], SamplingParams(max_tokens=2), priority=[1, 0], use_tqdm=False)
    outs = llm.generate(["a", "b"], SamplingParams(max_tokens=2), priority=[0, 0], use_tqdm=False)
    assert len(outs) == 2 and all(o.finished for o in outs)


def test_min_tokens_holds_back_eos(llm):
    eos = llm.get_tokenizer().eos_token_id
    forced = dict(temperature=0.0, max_tokens=10, logit_bias={eos: 100.0})
    early = llm.generate("hi", SamplingParams(**forced), use_tqdm=False)[0].outputs[0]
    assert early.token_ids == [eos] and early.finish_reason == "stop"
    held = llm.generate("hi", SamplingParams(min_tokens=4, **forced), use_tqdm=False)[0].outputs[0]
    assert len(held.token_ids) == 5 and held.token_ids[-1] == eos and eos not in held.token_ids[:4]
    assert held.finish_reason == "stop"


def test_a_refused_prompt_leaves_none_of_the_call_behind(llm):
    """As vLLM: when a later prompt is refused, the prompts of the same call added before it are aborted, so the
    next call runs alone (the first prompt stayed waiting in the engine, and ran with the next call)."""
    too_long = {"prompt_token_ids": [7] * 300}  # max_model_len 256
    with pytest.raises(ValueError, match="256"):
        llm.generate([{"prompt_token_ids": [5, 6, 7]}, too_long], SamplingParams(max_tokens=2), use_tqdm=False)
    engine = llm.llm_engine
    assert not engine.has_unfinished_requests()
    outs = llm.generate(["a"], SamplingParams(max_tokens=2), use_tqdm=False)
    assert len(outs) == 1 and not engine.has_unfinished_requests()
