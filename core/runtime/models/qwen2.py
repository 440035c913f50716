"""Qwen2: the Llama decoder with biases on the q/k/v projections (none on o_proj)."""

from __future__ import annotations

from typing import Any

from runtime.models.llama import LlamaDecoderLayer, LlamaForCausalLM


class Qwen2DecoderLayer(LlamaDecoderLayer):
    @staticmethod
    def attention_options(config) -> dict[str, Any]:
        return {"qkv_bias": True, "o_bias": False}


class Qwen2ForCausalLM(LlamaForCausalLM):
    decoder_layer_cls = Qwen2DecoderLayer
