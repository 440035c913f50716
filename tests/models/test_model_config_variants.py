"""Config variants the shared tiny models do not cover give transformers' logits too.

Each variant is a tiny random float32 checkpoint written by transformers; our model runs
prompts longer than the sliding windows as one flat batch over a paged KV cache, then decode
steps, and every logits row is compared with transformers' full forward pass. RoPE types
we do not implement are a clear error, never ignored.
"""

from __future__ import annotations

import json
import os

import pytest
import torch
from support.paged_batch import PagedRunner

from runtime.model_loader import load_model, resolve_model

ATOL = 1e-4
VOCAB_SIZE = 512
PROMPT_LENS = (5, 13, 23)  # the windows below are 8
NUM_DECODE_STEPS = 3
COMMON = dict(vocab_size=VOCAB_SIZE, hidden_size=64, intermediate_size=128, num_attention_heads=4,
              num_key_value_heads=2, num_hidden_layers=2, max_position_embeddings=512, rms_norm_eps=1e-6,
              initializer_range=0.1)
GEMMA3 = dict(head_dim=16, query_pre_attn_scalar=16, sliding_window=8,
              layer_types=["sliding_attention", "full_attention"])


def variant_config(name: str):
    import transformers as tf

    if name == "llama_tied_mqa":
        return tf.LlamaConfig(tie_word_embeddings=True, **{**COMMON, "num_key_value_heads": 1})
    if name == "llama_biases_mha_head_dim_24":
        return tf.LlamaConfig(attention_bias=True, mlp_bias=True, head_dim=24, **{**COMMON, "num_key_value_heads": 4})
    if name in ("llama_linear_rope", "llama_legacy_rope_scaling"):
        return tf.LlamaConfig(rope_parameters={"rope_type": "linear", "factor": 4.0, "rope_theta": 5000.0}, **COMMON)
    if name == "mistral_sliding_window":
        return tf.MistralConfig(sliding_window=8, **COMMON)
    if name == "qwen2_sliding_window_untied":
        return tf.Qwen2Config(use_sliding_window=True, sliding_window=8, max_window_layers=1,
                              tie_word_embeddings=False, **COMMON)
    if name == "qwen3_sliding_window_bias":
        return tf.Qwen3Config(use_sliding_window=True, sliding_window=8, max_window_layers=1, attention_bias=True,
                              head_dim=8, **COMMON)
    if name == "gemma3_linear_rope_on_global_layers":
        rope = {"full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6},
                "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}}
        return tf.Gemma3TextConfig(rope_parameters=rope, **GEMMA3, **COMMON)
    if name == "gemma3_attn_logit_softcapping_untied":  # transformers never applies the attention soft-cap
        return tf.Gemma3TextConfig(attn_logit_softcapping=5.0, tie_word_embeddings=False, **GEMMA3, **COMMON)
    raise ValueError(name)


VARIANTS = ("llama_tied_mqa", "llama_biases_mha_head_dim_24", "llama_linear_rope", "llama_legacy_rope_scaling",
            "mistral_sliding_window", "qwen2_sliding_window_untied", "qwen3_sliding_window_bias",
            "gemma3_linear_rope_on_global_layers", "gemma3_attn_logit_softcapping_untied")


def to_legacy_rope_scaling(path: str) -> None:
    """Rewrite config.json as transformers 4 wrote it: ``rope_scaling`` with ``type``, and ``rope_theta``."""
    file = os.path.join(path, "config.json")
    with open(file) as f:
        config = json.load(f)
    rope = config.pop("rope_parameters")
    config["rope_theta"] = rope.pop("rope_theta")
    config["rope_scaling"] = {"type": rope.pop("rope_type"), **rope}
    with open(file, "w") as f:
        json.dump(config, f)


def build_variant(name: str, path) -> str:
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(variant_config(name), dtype=torch.float32)
    with torch.no_grad():  # non-trivial norms and biases (transformers initializes them to constants)
        for param_name, param in model.named_parameters():
            if "norm" in param_name:
                param.add_(torch.randn_like(param) * 0.1)
            elif param_name.endswith(".bias"):
                param.copy_(torch.randn_like(param) * 0.1)
    model.save_pretrained(str(path))
    if name == "llama_legacy_rope_scaling":
        to_legacy_rope_scaling(str(path))
    return str(path)


def reference_logits(model, tokens: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([tokens])).logits[0].float()  # [len, vocab]


@pytest.mark.parametrize("name", VARIANTS)
def test_variant_matches_transformers(name, tmp_path):
    from transformers import AutoModelForCausalLM

    path = build_variant(name, tmp_path)
    reference = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    ours = load_model(resolve_model(path), dtype=torch.float32, device="cpu")
    generator = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, VOCAB_SIZE, (n,), generator=generator).tolist() for n in PROMPT_LENS]
    runner = PagedRunner(ours, num_requests=len(prompts), block_size=4, seed=3)
    for prompt, logits in zip(prompts, runner.step(prompts)):
        expected = reference_logits(reference, prompt)
        assert expected.abs().max() > 0.05, "logits too small to make the comparison meaningful"
        torch.testing.assert_close(logits, expected, atol=ATOL, rtol=0, msg=f"{name} prefill")
    for step in range(NUM_DECODE_STEPS):
        new = [[int(torch.randint(0, VOCAB_SIZE, (), generator=generator))] for _ in prompts]
        for i, logits in enumerate(runner.step(new)):
            expected = reference_logits(reference, runner.tokens[i])[-1:]
            torch.testing.assert_close(logits, expected, atol=ATOL, rtol=0, msg=f"{name} decode {step} request {i}")


def test_gemma3_attention_is_not_soft_capped(tmp_path):
    path = build_variant("gemma3_attn_logit_softcapping_untied", tmp_path)
    ours = load_model(resolve_model(path), load_format="dummy", dtype=torch.float32)
    assert [s.logits_soft_cap for s in ours.attention_specs()] == [None, None]


@pytest.mark.parametrize("rope", [
    {"rope_type": "dynamic", "factor": 2.0},
    {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 128},
    {"type": "longrope", "short_factor": [1.0] * 8, "long_factor": [2.0] * 8, "original_max_position_embeddings": 128},
])
def test_unsupported_rope_type_is_an_error_naming_it(rope, tmp_path):
    config = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", **COMMON, "rope_theta": 10000.0,
              "rope_scaling": rope}
    with open(tmp_path / "config.json", "w") as f:
        json.dump(config, f)
    rope_type = rope.get("rope_type", rope.get("type"))
    with pytest.raises(ValueError, match=f"unsupported rope_type '{rope_type}'; supported: default, linear, llama3"):
        load_model(resolve_model(str(tmp_path)), load_format="dummy", dtype=torch.float32)
