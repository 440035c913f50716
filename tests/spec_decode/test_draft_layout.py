"""A draft (or EAGLE head) that cannot run beside a tensor-parallel target is refused before any
worker starts, with an error that names the draft, its sizes and the valid sizes."""

from __future__ import annotations

import pytest

from runtime import LLM
from runtime.executor import multiproc
from runtime.testing.models import UNTOKENIZED_VOCAB_SIZE, build_untokenized_model

from spec_decode.heads import build_eagle3_head, edit_config


@pytest.fixture(scope="module")
def target(tmp_path_factory) -> str:
    return build_untokenized_model("llama", tmp_path_factory.mktemp("layout") / "target")


@pytest.fixture
def no_workers(monkeypatch):
    """Starting worker processes fails the test: every refusal must come first."""

    def refuse(*args, **kwargs):
        raise AssertionError("worker processes were started")

    monkeypatch.setattr(multiproc, "WorkerProcesses", refuse)


def three_head_draft(path, vocab_size: int = UNTOKENIZED_VOCAB_SIZE) -> str:
    from transformers import LlamaConfig

    LlamaConfig(vocab_size=vocab_size, hidden_size=48, intermediate_size=96, num_hidden_layers=1,
                num_attention_heads=3, num_key_value_heads=3).save_pretrained(str(path))
    return str(path)


def start(target: str, speculative_config: dict) -> LLM:
    return LLM(target, dtype="float32", skip_tokenizer_init=True, load_format="dummy", tensor_parallel_size=2,
               speculative_config=speculative_config, max_model_len=64, num_gpu_blocks_override=16)


def test_draft_model_whose_heads_do_not_split_is_refused_before_workers_start(target, tmp_path, no_workers):
    draft = three_head_draft(tmp_path / "draft")
    with pytest.raises(ValueError, match=rf"draft model '{draft}' cannot run under tensor parallelism.*tensor_parallel_size "
                                         r"2 does not split the model's 3 attention heads \(3 KV heads\) and an MLP of 96 "
                                         r"evenly; valid: 1, 3"):
        start(target, {"method": "draft_model", "model": draft, "num_speculative_tokens": 2})


def test_eagle3_head_whose_heads_do_not_split_is_refused_before_workers_start(target, tmp_path, no_workers):
    head = build_eagle3_head(tmp_path / "eagle3", UNTOKENIZED_VOCAB_SIZE, [0, 1, 1], UNTOKENIZED_VOCAB_SIZE // 2)
    edit_config(head, lambda config: config.update(hidden_size=48, num_attention_heads=3, num_key_value_heads=3,
                                                   intermediate_size=96))
    with pytest.raises(ValueError, match=rf"eagle3 head '{head}' cannot run under tensor parallelism.*3 attention heads.*"
                                         r"valid: 1, 3"):
        start(target, {"method": "eagle3", "model": head, "num_speculative_tokens": 2})


def test_draft_of_another_vocabulary_is_refused_before_workers_start(target, tmp_path, no_workers):
    draft = three_head_draft(tmp_path / "draft", vocab_size=UNTOKENIZED_VOCAB_SIZE + 8)
    with pytest.raises(ValueError, match=rf"draft model '{draft}' has vocab_size {UNTOKENIZED_VOCAB_SIZE + 8}, the target "
                                         rf"model {UNTOKENIZED_VOCAB_SIZE}"):
        start(target, {"method": "draft_model", "model": draft, "num_speculative_tokens": 2})


def test_a_bad_draft_is_refused_before_the_target_loads_at_tp_1(target, tmp_path, monkeypatch):
    """One process (no workers to start): the draft is still checked before the executor loads the target."""
    from runtime.engine import core

    def refuse(*args, **kwargs):
        raise AssertionError("the executor (the target model) was started")

    monkeypatch.setattr(core, "create_executor", refuse)
    draft = three_head_draft(tmp_path / "draft", vocab_size=UNTOKENIZED_VOCAB_SIZE + 8)
    with pytest.raises(ValueError, match="vocab"):
        LLM(target, dtype="float32", skip_tokenizer_init=True, load_format="dummy", max_model_len=64,
            num_gpu_blocks_override=16, speculative_config={"method": "draft_model", "model": draft,
                                                             "num_speculative_tokens": 2})
