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
    )


def test_vllm_argument_names_are_accepted(llm):
    model_config = llm.llm_engine.config.model_config
    assert model_config.served_model_names == ("tiny", "alias") and model_config.served_model_name == "tiny"
    assert llm.engine_args.trust_remote_code and llm.engine_args.tokenizer_mode == "auto"


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
