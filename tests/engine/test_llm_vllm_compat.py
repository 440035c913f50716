"""The offline ``LLM`` takes vLLM's argument names, and ``LLM()`` serves the embedded default model."""

from __future__ import annotations

import json
import logging
import os

import pytest

from runtime import LLM, SamplingParams

TEMPLATE = "{% for m in messages %}<<{{ m['content'] }}>>{% endfor %}"


@pytest.fixture(scope="module")
def model_path(tmp_path_factory) -> str:
    """A tiny model whose generation_config.json asks for greedy picks (top_k 1) and 3 new tokens."""
    from runtime.testing.models import build_tiny_model

    path = build_tiny_model("llama", tmp_path_factory.mktemp("llama"))
    with open(os.path.join(path, "generation_config.json"), "w") as f:
        json.dump({"top_k": 1, "max_new_tokens": 3, "eos_token_id": 2}, f)
    return path


@pytest.fixture(scope="module")
def llm(model_path):
    return LLM(
        model_path, dtype="float32", max_model_len=128, trust_remote_code=True, tokenizer_mode="auto",
        disable_log_stats=False, max_logprobs=3, chat_template=TEMPLATE, served_model_name=["tiny", "alias"],
        distributed_executor_backend="uni",
    )


def test_vllm_argument_names_are_accepted(llm):
    model_config = llm.llm_engine.config.model_config
    assert model_config.served_model_names == ("tiny", "alias") and model_config.served_model_name == "tiny"
    assert llm.engine_args.trust_remote_code and llm.engine_args.tokenizer_mode == "auto"
    assert llm.engine_args.executor == "uni"  # vLLM's keyword distributed_executor_backend
    with pytest.raises(ValueError, match="distributed_executor_backend and executor name the same engine argument"):
        LLM(llm.engine_args.model, distributed_executor_backend="mp", executor="uni")


def test_generation_config_defaults_apply_when_no_sampling_params_are_given(llm):
    defaults = llm.get_default_sampling_params()
    assert (defaults.top_k, defaults.max_tokens) == (1, 3)
    prompt = {"prompt_token_ids": [5, 6, 7, 8]}
    out = llm.generate(prompt, use_tqdm=False)[0].outputs[0]
    greedy = llm.generate(prompt, SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True), use_tqdm=False)
    assert len(out.token_ids) <= 3
    assert out.token_ids == greedy[0].outputs[0].token_ids[: len(out.token_ids)]
    # explicit SamplingParams are used as given (vLLM's rule)
    assert len(llm.generate(prompt, SamplingParams(max_tokens=5, ignore_eos=True), use_tqdm=False)[0].outputs[0].token_ids) == 5


def test_generation_config_vllm_ignores_the_models_file(model_path):
    from runtime.engine_args import EngineArgs

    config = EngineArgs(model=model_path, generation_config="vllm").create_engine_config()
    assert config.model_config.default_sampling_params == {}


def test_max_logprobs_limits_requests(llm):
    prompt = {"prompt_token_ids": [5, 6, 7]}
    with pytest.raises(ValueError, match="logprobs asks for 4 logprobs, more than max_logprobs 3"):
        llm.generate(prompt, SamplingParams(max_tokens=1, logprobs=4), use_tqdm=False)
    with pytest.raises(ValueError, match="prompt_logprobs asks for 5 logprobs, more than max_logprobs 3"):
        llm.generate(prompt, SamplingParams(max_tokens=1, prompt_logprobs=5), use_tqdm=False)
    out = llm.generate(prompt, SamplingParams(max_tokens=1, logprobs=3), use_tqdm=False)[0].outputs[0]
    assert len(out.logprobs[0]) >= 3


def test_chat_template_argument_replaces_the_models_template(llm):
    out = llm.chat([{"role": "user", "content": "hi"}], SamplingParams(max_tokens=1), use_tqdm=False)[0]
    assert out.prompt == "<<hi>>"


def test_stats_are_logged_unless_disabled(llm, model_path, caplog, monkeypatch):
    caplog.set_level(logging.INFO, logger="runtime.stats")
    llm.llm_engine.stat_logger.interval_s = 0.0  # a line after every step
    llm.generate({"prompt_token_ids": [5, 6]}, SamplingParams(max_tokens=2), use_tqdm=False)
    assert any(m.startswith("Avg prompt throughput: ") for m in caplog.messages)
    quiet = LLM(model_path, dtype="float32", max_model_len=128)  # vLLM's offline default: disable_log_stats=True
    assert quiet.engine_args.disable_log_stats and quiet.llm_engine.stat_logger is None


def test_llm_without_a_model_uses_the_embedded_default(model_path, monkeypatch):
    import runtime.entrypoints.llm as llm_module
    from runtime.model_loader.default_model import default_model_path
    from runtime.testing.models import SMOLLM2_GGUF

    assert os.path.basename(default_model_path()) == SMOLLM2_GGUF
    monkeypatch.setattr(llm_module, "default_model_path", lambda: model_path)  # the tiny model stands in: fast
    assert LLM(dtype="float32", max_model_len=128).llm_engine.config.model_config.model == model_path


def test_bad_words_are_never_generated_and_tokens_equal_transformers(model_path):
    """vLLM's ``bad_words``: each word as its tokens with and without a leading space; once the output ends with
    all of a variant's tokens but the last, that last token gets -inf. Greedy tokens equal a transformers loop with
    the same rule, and the banned sequences never appear in the output; requests without bad words beside them are
    untouched (also under async scheduling, where such a request is not scheduled ahead)."""
    import torch
    from transformers import AutoModelForCausalLM

    from runtime.engine.input_processor import bad_words_token_ids

    prompts = ["Hello there", "Once upon a time", "The capital of France is"]
    for settings in ({}, {"async_scheduling": True}):
        engine = LLM(model_path, dtype="float32", max_model_len=128, block_size=4, **settings)
        free = engine.generate(prompts, SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True), use_tqdm=False)
        words = sorted({w for o in free for w in o.outputs[0].text.split()[1:3]})  # words the model does produce
        tokenizer = engine.get_tokenizer()
        sequences = bad_words_token_ids(tokenizer, words)
        assert any(len(s) > 1 for s in sequences) and any(len(s) == 1 for s in sequences), sequences
        params = [SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True, bad_words=words),
                  SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)]
        banned = engine.generate([p for p in prompts for _ in params], params * len(prompts), use_tqdm=False)
        del engine
        model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).eval()
        for i, prompt in enumerate(prompts):
            ids = tokenizer.encode(prompt)
            output: list[int] = []
            with torch.no_grad():
                for _ in range(20):
                    logits = model(torch.tensor([ids + output])).logits[0, -1]
                    for seq in sequences:
                        if len(seq) == 1 or output[len(output) - len(seq) + 1:] == seq[:-1]:
                            logits[seq[-1]] = float("-inf")
                    output.append(int(logits.argmax()))
            got = banned[2 * i].outputs[0].token_ids
            assert got == output, (settings, prompt)
            assert not any(got[j:j + len(s)] == s for s in sequences for j in range(len(got)))
            assert banned[2 * i + 1].outputs[0].token_ids == free[i].outputs[0].token_ids
        assert any(banned[2 * i].outputs[0].token_ids != free[i].outputs[0].token_ids for i in range(len(prompts)))


def test_truncate_prompt_tokens_keeps_the_last_tokens(llm):
    """vLLM's SamplingParams.truncate_prompt_tokens, offline: the prompt is its last k tokens (-1: the last
    max_model_len); 0 is refused naming the field."""
    ids = list(range(300, 320))
    params = dict(temperature=0.0, max_tokens=4, ignore_eos=True)
    (cut,) = llm.generate([{"prompt_token_ids": ids}], SamplingParams(truncate_prompt_tokens=6, **params), use_tqdm=False)
    (last,) = llm.generate([{"prompt_token_ids": ids[-6:]}], SamplingParams(**params), use_tqdm=False)
    assert cut.prompt_token_ids == ids[-6:] and cut.outputs[0].token_ids == last.outputs[0].token_ids
    (text,) = llm.generate(["one two three four five six"], SamplingParams(truncate_prompt_tokens=2, **params), use_tqdm=False)
    assert len(text.prompt_token_ids) == 2
    (all_of_it,) = llm.generate([{"prompt_token_ids": ids}], SamplingParams(truncate_prompt_tokens=-1, **params),
                                use_tqdm=False)
    assert all_of_it.prompt_token_ids == ids
    with pytest.raises(ValueError, match="truncate_prompt_tokens must be None, -1"):
        SamplingParams(truncate_prompt_tokens=0)


def test_a_torch_dtype_is_accepted_as_vllm_accepts_it(model_path):
    import torch

    llm = LLM(model_path, dtype=torch.float32, max_model_len=64)
    assert llm.llm_engine.config.model_config.dtype == torch.float32
    out = llm.generate("hello", SamplingParams(max_tokens=2), use_tqdm=False)[0]
    assert len(out.outputs[0].token_ids) == 2
    with pytest.raises(ValueError, match=r"dtype 'int8' is not valid; choose one of: auto, float32"):
        LLM(model_path, dtype=torch.int8, max_model_len=64)
