"""A Medusa or EAGLE head that does not fit the target is refused before any worker starts, with the
same clear error under tensor parallelism (TP=2: worker processes, gloo on the CPU) as with one worker.

The checks read only the head's config.json and its tensors' names and shapes; they used to run when
each worker loaded the head, so under TP=2 a bad head failed inside the workers."""

from __future__ import annotations

import json
import os

import pytest
from safetensors.torch import load_file, save_file

from runtime import LLM
from runtime.testing.models import UNTOKENIZED_VOCAB_SIZE, build_untokenized_model

from spec_decode.heads import HIDDEN, build_eagle1_head, build_eagle3_head, build_medusa_head, edit_config

ENGINE = dict(dtype="float32", skip_tokenizer_init=True, max_model_len=64, num_gpu_blocks_override=16)


@pytest.fixture(scope="module")
def target(tmp_path_factory) -> str:
    return build_untokenized_model("llama", tmp_path_factory.mktemp("head_checks") / "target")


def medusa_without_head_1_block(path) -> str:
    """A Medusa checkpoint whose second head lacks its residual block."""
    head = build_medusa_head(path, UNTOKENIZED_VOCAB_SIZE)
    file = os.path.join(head, "medusa_lm_head.safetensors")
    tensors = {k: v for k, v in load_file(file).items() if not k.startswith("1.0.")}
    save_file(tensors, file)
    return head


def eagle3_reading_layer(path, layer: int) -> str:
    return build_eagle3_head(path, UNTOKENIZED_VOCAB_SIZE, [0, 1, layer], UNTOKENIZED_VOCAB_SIZE // 2)


def eagle3_listing_two_layers(path) -> str:
    """An EAGLE-3 head whose fc reads three target layers, its config.json naming two."""
    return edit_config(eagle3_reading_layer(path, 1),
                       lambda config: config["eagle_config"].update(eagle_aux_hidden_state_layer_ids=[0, 1]))


BAD_HEADS = {  # method, builder, the error expected
    "medusa_vocab": ("medusa", lambda p: build_medusa_head(p, 256),
                     r"medusa head '.*' predicts 256 tokens, the target model has 512"),
    "medusa_missing": ("medusa", medusa_without_head_1_block,
                       r"medusa head '.*' does not match its config.json \(3 heads of 1 residual blocks\): "
                       r"missing tensors 1\.0\.linear\.bias, 1\.0\.linear\.weight"),
    "eagle3_layer": ("eagle3", lambda p: eagle3_reading_layer(p, 5),
                     r"eagle3 head '.*' reads target layer 5 \(eagle_aux_hidden_state_layer_ids\), but the target "
                     r"model has 2 layers"),
    "eagle3_fc": ("eagle3", eagle3_listing_two_layers,
                  rf"eagle3 head '.*' has fc.weight of shape \[{HIDDEN}, {3 * HIDDEN}\], but its config.json makes it "
                  rf"\[{HIDDEN}, {2 * HIDDEN}\] \(it reads 2 target layers of size {HIDDEN}\)"),
    "eagle1_as_eagle3": ("eagle3", lambda p: build_eagle1_head(p, UNTOKENIZED_VOCAB_SIZE),
                         r"eagle3 head '.*' has no 'midlayer.\*' tensors"),
}


@pytest.mark.parametrize("tp", [1, 2])
@pytest.mark.parametrize("case", sorted(BAD_HEADS))
def test_bad_head_is_refused_before_workers_start(target, tmp_path, case, tp):
    method, build, message = BAD_HEADS[case]
    head = build(tmp_path / case)
    with pytest.raises(ValueError, match=message):
        LLM(target, tensor_parallel_size=tp, **ENGINE,
            speculative_config={"method": method, "model": head, "num_speculative_tokens": 2})


def test_medusa_of_another_hidden_size_is_refused_under_tp2(tmp_path):
    from transformers import AutoModelForCausalLM, LlamaConfig

    wide = 2 * HIDDEN
    path = str(tmp_path / "wide")
    config = LlamaConfig(vocab_size=UNTOKENIZED_VOCAB_SIZE, hidden_size=wide, intermediate_size=wide, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)
    AutoModelForCausalLM.from_config(config).save_pretrained(path)
    head = build_medusa_head(tmp_path / "medusa", UNTOKENIZED_VOCAB_SIZE)
    with open(os.path.join(head, "config.json")) as f:
        assert json.load(f)["medusa_num_heads"] == 3
    with pytest.raises(ValueError, match=rf"medusa head '{head}' reads target hidden states of size {HIDDEN}, but the "
                                         rf"target model's hidden_size is {wide}"):
        LLM(path, tensor_parallel_size=2, **ENGINE,
            speculative_config={"method": "medusa", "model": head, "num_speculative_tokens": 2})


def test_medusa_more_drafts_than_heads_is_refused(target, tmp_path):
    """Head i drafts token i: a k beyond the heads used to be padded with tokens the target verified
    every step for nothing."""
    head = build_medusa_head(tmp_path / "medusa2", UNTOKENIZED_VOCAB_SIZE, num_heads=2)
    with pytest.raises(ValueError, match=r"num_speculative_tokens is 3, but medusa head '.*' has 2 heads \(one draft "
                                         r"each\): valid values are 1\.\.2"):
        LLM(target, **ENGINE, speculative_config={"method": "medusa", "model": head, "num_speculative_tokens": 3})
    llm = LLM(target, **ENGINE, speculative_config={"method": "medusa", "model": head, "num_speculative_tokens": 2})
    assert llm.llm_engine.engine_core.num_speculative_tokens == 2
