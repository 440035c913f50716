"""EAGLE and Medusa heads read the target's hidden states: a head trained for a target of another
hidden size is refused when the engine starts, naming both sizes (it used to start and then fail
every step with a matrix-shape error)."""

from __future__ import annotations

import pytest
import torch

from runtime import LLM
from runtime.testing.models import UNTOKENIZED_VOCAB_SIZE

from spec_decode.heads import HIDDEN, build_eagle1_head, build_eagle3_head, build_medusa_head

WIDE = 2 * HIDDEN


@pytest.fixture(scope="module")
def wide_target(tmp_path_factory) -> str:
    """A target twice as wide as the heads of spec_decode.heads."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    path = tmp_path_factory.mktemp("wide") / "target"
    config = LlamaConfig(vocab_size=UNTOKENIZED_VOCAB_SIZE, hidden_size=WIDE, intermediate_size=WIDE,
                         num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=256, bos_token_id=1, eos_token_id=2)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(str(path))
    return str(path)


@pytest.mark.parametrize("method", ["eagle", "eagle3", "medusa"])
def test_head_of_another_hidden_size_is_refused_at_start_up(wide_target, tmp_path, method):
    builders = {
        "eagle": lambda: build_eagle1_head(tmp_path / "head", UNTOKENIZED_VOCAB_SIZE),
        "eagle3": lambda: build_eagle3_head(tmp_path / "head", UNTOKENIZED_VOCAB_SIZE, [0, 1, 2], UNTOKENIZED_VOCAB_SIZE // 2),
        "medusa": lambda: build_medusa_head(tmp_path / "head", UNTOKENIZED_VOCAB_SIZE),
    }
    head = builders[method]()
    with pytest.raises(ValueError, match=rf"{method} head '{head}' reads target hidden states of size {HIDDEN}, but the "
                                         rf"target model's hidden_size is {WIDE}"):
        LLM(wide_target, dtype="float32", skip_tokenizer_init=True, max_model_len=64,
            speculative_config={"method": method, "model": head, "num_speculative_tokens": 2})
