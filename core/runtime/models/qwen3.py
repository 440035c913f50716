"""Qwen3: the Llama decoder with an RMSNorm over each q and k head before RoPE."""

from __future__ import annotations

from typing import Any

from runtime.models.layers import RMSNorm
from runtime.models.llama import LlamaDecoderLayer, LlamaForCausalLM


class Qwen3DecoderLayer(LlamaDecoderLayer):
    @staticmethod
    def attention_options(config) -> dict[str, Any]:
        bias = bool(getattr(config, "attention_bias", False))
        return {"qkv_bias": bias, "o_bias": bias, "qk_norm": RMSNorm}


class Qwen3ForCausalLM(LlamaForCausalLM):
    decoder_layer_cls = Qwen3DecoderLayer
