"""Llama (and Mistral) decoder, written so that Qwen2, Qwen3 and Gemma 3 reuse its parts.

Forward takes a flat batch: ``input_ids`` and ``positions`` are ``[num_tokens]`` with
every scheduled token of the step, and attention goes through the forward context's
backend and paged KV cache.

Decoder layers pass the residual stream along (``hidden, residual = norm(hidden,
residual)``) so that "add the residual, then normalize" is one call, which a platform
may fuse into one kernel; in plain torch it is the same ``x + f(x)`` as before. A norm and
the projection after it go together too (``norm_into``), and the MLP takes its norm
(``MLP.after_norm``): a batch-1 step runs the norm, gate/up and SiLU as one gemv where it can,
else fuses the norm into gate/up and the activation into down.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from runtime.attention.backend import AttentionLayerSpec
from runtime.distributed import tp_all_gather, tp_size
from runtime.models.layers import MLP, Attention, RMSNorm, norm_into, pre_norm
from runtime.models.linear import (
    MergedLinear,
    ParallelLMHead,
    RowParallelLinear,
    VocabParallelEmbedding,
    divide,
    kv_head_replicas,
    one_row_linear,
)
from runtime.models.ops import lookup
from runtime.models.pipeline import MissingLayer, is_last_stage, stage_input, stage_layers
from runtime.models.rotary import RotaryEmbedding, Rotation, rope_parameters
from runtime.models.weights import load_hf_weights

# Hugging Face module name -> (our fused module, shard).
STACKED_PARAMS = {
    "q_proj": ("qkv_proj", "q"),
    "k_proj": ("qkv_proj", "k"),
    "v_proj": ("qkv_proj", "v"),
    "gate_proj": ("gate_up_proj", "gate"),
    "up_proj": ("gate_up_proj", "up"),
}


def head_dim(config) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


def layer_sliding_window(config, layer_idx: int) -> int | None:
    """The window of a layer: per ``layer_types`` when present, else one for all (Mistral)."""
    if getattr(config, "use_sliding_window", True) is False:
        return None
    window = getattr(config, "sliding_window", None)
    layer_types = getattr(config, "layer_types", None)
    if layer_types is not None:
        return window if layer_types[layer_idx] == "sliding_attention" else None
    return window


class LlamaAttention(nn.Module):
    """Self-attention with fused q/k/v, optional per-head q/k norm (Qwen3, Gemma 3) and RoPE.

    With tensor parallelism each rank runs ``1/tp`` of the query heads and their KV heads
    (a KV head is held by several ranks when there are fewer KV heads than ranks).
    """

    def __init__(
        self,
        config,
        layer_idx: int,
        *,
        qkv_bias: bool = False,
        o_bias: bool = False,
        qk_norm: type[RMSNorm] | None = None,
        scale: float | None = None,
        sliding_window: int | None = None,
        logits_soft_cap: float | None = None,
    ):
        super().__init__()
        tp = tp_size()
        total_kv_heads = config.num_key_value_heads
        replicas = kv_head_replicas(total_kv_heads, tp)
        self.num_heads = divide(config.num_attention_heads, tp, "the number of attention heads")
        self.num_kv_heads = total_kv_heads * replicas // tp  # this rank's
        self.head_size = head_dim(config)
        q_size, kv_size = config.num_attention_heads * self.head_size, total_kv_heads * self.head_size
        self.qkv_proj = MergedLinear(
            config.hidden_size, {"q": q_size, "k": kv_size, "v": kv_size}, qkv_bias, replicas={"k": replicas, "v": replicas}
        )
        self.split_sizes = self.qkv_proj.output_sizes
        self.o_proj = RowParallelLinear(q_size, config.hidden_size, bias=o_bias)
        self.q_norm = qk_norm(self.head_size, config.rms_norm_eps) if qk_norm else None
        self.k_norm = qk_norm(self.head_size, config.rms_norm_eps) if qk_norm else None
        self.attn = Attention(
            layer_idx,
            self.num_heads,
            self.num_kv_heads,
            self.head_size,
            scale if scale is not None else self.head_size**-0.5,
            sliding_window=sliding_window,
            logits_soft_cap=logits_soft_cap,
        )

    def forward(self, x: torch.Tensor, rotation: Rotation) -> torch.Tensor:  # [T, hidden] -> [T, hidden]
        return self.attend(self.qkv_proj(x), rotation)

    def attend(self, qkv: torch.Tensor, rotation: Rotation) -> torch.Tensor:
        """The layer from ``qkv_proj``'s output [T, (heads + 2 * kv_heads) * head_size] on (a
        decoder layer may compute that together with the norm before it)."""
        num_tokens = qkv.shape[0]
        q, k, v = qkv.split(self.split_sizes, dim=-1)
        q = q.view(num_tokens, self.num_heads, self.head_size)
        k = k.view(num_tokens, self.num_kv_heads, self.head_size)
        v = v.view(num_tokens, self.num_kv_heads, self.head_size)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        out = self.attn(q, k, v, rotation)  # [T, num_heads, head_size]
        return self.o_proj(out.reshape(num_tokens, -1))


class LlamaDecoderLayer(nn.Module):
    """Pre-norm block: ``x + attn(norm(x))`` then ``x + mlp(norm(x))``, with ``x`` carried
    as ``hidden + residual`` (the sum is taken inside the next norm)."""

    def __init__(self, config, layer_idx: int):
        super().__init__()
        window = layer_sliding_window(config, layer_idx)
        self.self_attn = LlamaAttention(config, layer_idx, sliding_window=window, **self.attention_options(config))
        mlp_bias = bool(getattr(config, "mlp_bias", False))
        self.mlp = MLP(config.hidden_size, config.intermediate_size, config.hidden_act, mlp_bias)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    @staticmethod
    def attention_options(config) -> dict[str, Any]:
        bias = bool(getattr(config, "attention_bias", False))
        return {"qkv_bias": bias, "o_bias": bias}

    def forward(
        self, hidden: torch.Tensor, residual: torch.Tensor | None, rotation: Rotation
    ) -> tuple[torch.Tensor, torch.Tensor]:
        # hidden: [T, hidden], this layer's input minus ``residual`` (None: the first layer).
        # Each norm goes with the projection after it, so that a batch-1 step may fuse the two.
        qkv, residual = norm_into(self.input_layernorm, self.self_attn.qkv_proj, hidden, residual)
        hidden = self.self_attn.attend(qkv, rotation)
        return self.mlp.after_norm(self.post_attention_layernorm, hidden, residual)  # the next layer adds them


class LlamaModel(nn.Module):
    def __init__(self, config, decoder_layer_cls: type[LlamaDecoderLayer]):
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size)
        # this pipeline stage's layers (all of them without pipeline parallelism)
        self.layers, self.held_layers = stage_layers(
            config.num_hidden_layers, lambda i: decoder_layer_cls(config, i)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.rotary_emb = RotaryEmbedding(head_dim(config), rope_parameters(config), config.max_position_embeddings)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        dtype = self.norm.weight.dtype
        hidden, residual = stage_input(self.embed_tokens, input_ids, self.norm.weight.shape[0], dtype)  # [T, hidden]
        rotation = self.rotary_emb.rotation(positions, hidden.dtype)
        for layer in self.held_layers:
            hidden, residual = layer(hidden, residual, rotation)
        if not is_last_stage(hidden, residual):
            return hidden  # sent on to the next stage
        hidden, _ = self.norm(hidden, residual)
        return hidden


class LlamaForCausalLM(nn.Module):
    """Llama / Mistral. Subclasses swap the decoder layer or the whole body."""

    decoder_layer_cls: type[LlamaDecoderLayer] = LlamaDecoderLayer
    stacked_params = STACKED_PARAMS

    def __init__(self, config):
        super().__init__()
        self.config = config
        self.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", False))
        self.model = self.build_model(config)
        self.lm_head = None
        if not self.tie_word_embeddings:
            self.lm_head = ParallelLMHead(config.hidden_size, config.vocab_size)
        self._linear = one_row_linear(lookup("gemv"))
        self.tp_size = tp_size()

    def build_model(self, config) -> nn.Module:
        return LlamaModel(config, self.decoder_layer_cls)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids, positions)  # [T, hidden]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self._lm_head_logits(hidden).float()  # [N, vocab]

    def compute_logits_for_argmax(self, hidden: torch.Tensor) -> torch.Tensor:
        """The logits in the lm_head's dtype (see runtime.models.interface)."""
        return self._lm_head_logits(hidden)

    def _lm_head_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.lm_head is not None and self.lm_head.quant_method is not None:
            logits = self.lm_head(hidden)
        else:
            weight = self.model.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
            logits = self._linear(hidden, weight)  # [N, vocab / tp] (this rank's slice, padded)
        if self.tp_size > 1:
            logits = tp_all_gather(logits)[:, : self.config.vocab_size]
        return logits  # [N, vocab]

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        return load_hf_weights(self, weights, self.stacked_params, self.tie_word_embeddings)

    def attention_specs(self) -> list[AttentionLayerSpec]:
        return [layer.self_attn.attn.spec for layer in self.model.layers if not isinstance(layer, MissingLayer)]


__all__ = ["LlamaForCausalLM", "LlamaModel", "LlamaDecoderLayer", "LlamaAttention", "pre_norm"]
