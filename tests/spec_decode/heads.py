"""Random EAGLE-1, EAGLE-3 and Medusa heads written in their published checkpoint layouts."""

from __future__ import annotations

import json
import os

import torch

HIDDEN, INTERMEDIATE, HEADS, KV_HEADS, HEAD_DIM = 64, 128, 4, 2, 16


def edit_config(path, change) -> str:
    """``path`` after ``change(config)`` edited its config.json in place."""
    config_file = os.path.join(path, "config.json")
    with open(config_file) as f:
        config = json.load(f)
    change(config)
    with open(config_file, "w") as f:
        json.dump(config, f)
    return path


def _llama_head_config(vocab_size: int, **extra) -> dict:
    return {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": HIDDEN,
        "intermediate_size": INTERMEDIATE, "num_attention_heads": HEADS, "num_key_value_heads": KV_HEADS,
        "head_dim": HEAD_DIM, "num_hidden_layers": 1, "vocab_size": vocab_size, "rms_norm_eps": 1e-6,
        "max_position_embeddings": 512, "hidden_act": "silu", "rope_theta": 10000.0, **extra,
    }


def _write(path, config: dict, tensors: dict, filename: str) -> str:
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config, f)
    if filename.endswith(".safetensors"):
        from safetensors.torch import save_file

        save_file({k: v.contiguous() for k, v in tensors.items()}, os.path.join(path, filename))
    else:
        torch.save(tensors, os.path.join(path, filename))
    return str(path)


def _attention_and_mlp(prefix: str, in_size: int, gen: torch.Generator) -> dict:
    def rand(*shape):
        return torch.randn(*shape, generator=gen) * 0.1

    return {
        f"{prefix}self_attn.q_proj.weight": rand(HEADS * HEAD_DIM, in_size),
        f"{prefix}self_attn.k_proj.weight": rand(KV_HEADS * HEAD_DIM, in_size),
        f"{prefix}self_attn.v_proj.weight": rand(KV_HEADS * HEAD_DIM, in_size),
        f"{prefix}self_attn.o_proj.weight": rand(HIDDEN, HEADS * HEAD_DIM),
        f"{prefix}mlp.gate_proj.weight": rand(INTERMEDIATE, HIDDEN),
        f"{prefix}mlp.up_proj.weight": rand(INTERMEDIATE, HIDDEN),
        f"{prefix}mlp.down_proj.weight": rand(HIDDEN, INTERMEDIATE),
        f"{prefix}post_attention_layernorm.weight": 1 + rand(HIDDEN),
    }


def build_eagle1_head(path, vocab_size: int, seed: int = 0) -> str:
    """SafeAILab EAGLE-1: fc (with bias) on [embed, hidden], ``layers.0`` without input norm,
    no final norm, no embeddings or LM head of its own (the target's), pytorch_model.bin."""
    gen = torch.Generator().manual_seed(seed)
    tensors = {"fc.weight": torch.randn(HIDDEN, 2 * HIDDEN, generator=gen) * 0.1,
               "fc.bias": torch.randn(HIDDEN, generator=gen) * 0.1}
    tensors.update(_attention_and_mlp("layers.0.", HIDDEN, gen))
    return _write(path, _llama_head_config(vocab_size), tensors, "pytorch_model.bin")


def build_eagle3_head(path, vocab_size: int, target_layers: list[int], draft_vocab_size: int, seed: int = 0) -> str:
    """EAGLE-3: ``midlayer`` (attention over 2H), fc [H, 3H], norm, its own lm_head over a
    draft vocabulary with ``d2t`` offsets (draft id i -> target id 2i here) and ``t2d``."""
    gen = torch.Generator().manual_seed(seed)
    tensors = {
        "fc.weight": torch.randn(HIDDEN, len(target_layers) * HIDDEN, generator=gen) * 0.1,
        "norm.weight": 1 + torch.randn(HIDDEN, generator=gen) * 0.1,
        "lm_head.weight": torch.randn(draft_vocab_size, HIDDEN, generator=gen) * 0.3,
        "midlayer.input_layernorm.weight": 1 + torch.randn(HIDDEN, generator=gen) * 0.1,
        "midlayer.hidden_norm.weight": 1 + torch.randn(HIDDEN, generator=gen) * 0.1,
        "d2t": torch.arange(draft_vocab_size, dtype=torch.int64),
        "t2d": torch.arange(vocab_size) % 2 == 0,
    }
    tensors.update(_attention_and_mlp("midlayer.", 2 * HIDDEN, gen))
    config = _llama_head_config(vocab_size, architectures=["LlamaForCausalLMEagle3"], draft_vocab_size=draft_vocab_size,
                                eagle_config={"eagle_aux_hidden_state_layer_ids": target_layers})
    return _write(path, config, tensors, "model.safetensors")


def build_medusa_head(path, vocab_size: int, num_heads: int = 3, seed: int = 0) -> str:
    """FasterDecoding Medusa: ``{i}.0.linear.weight/bias`` (one residual block) and ``{i}.1.weight``
    (the head's LM head) in medusa_lm_head.safetensors."""
    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    for i in range(num_heads):
        tensors[f"{i}.0.linear.weight"] = torch.randn(HIDDEN, HIDDEN, generator=gen) * 0.1
        tensors[f"{i}.0.linear.bias"] = torch.randn(HIDDEN, generator=gen) * 0.1
        tensors[f"{i}.1.weight"] = torch.randn(vocab_size, HIDDEN, generator=gen) * 0.3
    config = {"medusa_num_heads": num_heads, "medusa_num_layers": 1, "base_model_name_or_path": "tiny"}
    return _write(path, config, tensors, "medusa_lm_head.safetensors")
