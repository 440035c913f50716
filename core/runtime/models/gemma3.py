"""Gemma 3 text model (``Gemma3ForCausalLM``).

Differences from Llama: embeddings scaled by ``sqrt(hidden_size)``, Gemma norms
(``1 + weight``) before and after both attention and MLP, per-head q/k norms, a
``gelu_pytorch_tanh`` MLP, attention scaled by ``query_pre_attn_scalar ** -0.5``,
sliding-window layers mixed with global ones (each with its own RoPE theta), and
optional soft-capping of the final logits (``attn_logit_softcapping`` is not used, as in
transformers).
"""

from __future__ import annotations

import torch
from torch import nn

from runtime.models.layers import MLP, GemmaRMSNorm, norm_into
from runtime.models.linear import VocabParallelEmbedding
from runtime.models.pipeline import is_last_stage, stage_input, stage_layers
from runtime.models.llama import LlamaAttention, LlamaForCausalLM, head_dim
from runtime.models.rotary import RotaryEmbedding, Rotation, rope_parameters

SLIDING, FULL = "sliding_attention", "full_attention"


def gemma3_layer_types(config) -> list[str]:
    """``config.layer_types``, or the older every-Nth-layer-is-global pattern."""
    layer_types = getattr(config, "layer_types", None)
    if layer_types:
        return list(layer_types)
    pattern = getattr(config, "sliding_window_pattern", None) or getattr(config, "_sliding_window_pattern", 6)
    return [SLIDING if (i + 1) % pattern else FULL for i in range(config.num_hidden_layers)]


class Gemma3DecoderLayer(nn.Module):
    def __init__(self, config, layer_idx: int, layer_type: str):
        super().__init__()
        self.layer_type = layer_type
        bias = bool(getattr(config, "attention_bias", False))
        # No soft-cap of attention scores: Gemma 3's config carries ``attn_logit_softcapping``
        # (from Gemma 2), but transformers' and Google's Gemma 3 never apply it.
        self.self_attn = LlamaAttention(
            config,
            layer_idx,
            qkv_bias=bias,
            o_bias=bias,
            qk_norm=GemmaRMSNorm,
            scale=config.query_pre_attn_scalar**-0.5,
            sliding_window=config.sliding_window if layer_type == SLIDING else None,
        )
        activation = getattr(config, "hidden_activation", None) or config.hidden_act
        self.mlp = MLP(config.hidden_size, config.intermediate_size, activation)
        eps = config.rms_norm_eps
        self.input_layernorm = GemmaRMSNorm(config.hidden_size, eps)
        self.post_attention_layernorm = GemmaRMSNorm(config.hidden_size, eps)
        self.pre_feedforward_layernorm = GemmaRMSNorm(config.hidden_size, eps)
        self.post_feedforward_layernorm = GemmaRMSNorm(config.hidden_size, eps)

    def forward(
        self, hidden: torch.Tensor, residual: torch.Tensor | None, rotation: Rotation
    ) -> tuple[torch.Tensor, torch.Tensor]:
        # x + post_attn_norm(attn(input_norm(x))), then x + post_ff_norm(mlp(pre_ff_norm(x))),
        # with x carried as hidden + residual (as in LlamaDecoderLayer).
        # The norms before q/k/v and before gate/up may fuse into those projections (one-row steps);
        # the norms after attention and the MLP read their outputs, and gelu-tanh has no fused op.
        qkv, residual = norm_into(self.input_layernorm, self.self_attn.qkv_proj, hidden, residual)
        hidden = self.post_attention_layernorm(self.self_attn.attend(qkv, rotation))
        hidden, residual = self.mlp.after_norm(self.pre_feedforward_layernorm, hidden, residual)
        return self.post_feedforward_layernorm(hidden), residual


class Gemma3Model(nn.Module):
    def __init__(self, config):
        super().__init__()
        if getattr(config, "use_bidirectional_attention", False):
            raise ValueError("Gemma 3 with use_bidirectional_attention=True (an encoder) is not supported")
        layer_types = gemma3_layer_types(config)
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size)
        self.embed_scale = config.hidden_size**0.5
        self.layers, self.held_layers = stage_layers(
            len(layer_types), lambda i: Gemma3DecoderLayer(config, i, layer_types[i])
        )
        self.norm = GemmaRMSNorm(config.hidden_size, config.rms_norm_eps)
        size, max_pos = head_dim(config), config.max_position_embeddings
        self.rotary_emb = nn.ModuleDict(
            {t: RotaryEmbedding(size, rope_parameters(config, t), max_pos) for t in sorted(set(layer_types))}
        )
        self._scale_by_dtype: dict[torch.dtype, float] = {}

    def _embed_scale(self, dtype: torch.dtype) -> float:
        # Hugging Face multiplies by the scale rounded to the weights' dtype.
        if dtype not in self._scale_by_dtype:
            self._scale_by_dtype[dtype] = torch.tensor(self.embed_scale, dtype=dtype).item()
        return self._scale_by_dtype[dtype]

    def _embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        hidden = self.embed_tokens(input_ids)  # [T, hidden]
        return hidden * self._embed_scale(hidden.dtype)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        weight = self.norm.weight
        hidden, residual = stage_input(self._embed, input_ids, weight.shape[0], weight.dtype)
        rotations = {t: emb.rotation(positions, hidden.dtype) for t, emb in self.rotary_emb.items()}
        for layer in self.held_layers:
            hidden, residual = layer(hidden, residual, rotations[layer.layer_type])
        if not is_last_stage(hidden, residual):
            return hidden  # sent on to the next stage
        hidden, _ = self.norm(hidden, residual)
        return hidden


class Gemma3ForCausalLM(LlamaForCausalLM):
    def build_model(self, config) -> nn.Module:
        return Gemma3Model(config)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = super().compute_logits(hidden)  # [N, vocab] float32
        cap = getattr(self.config, "final_logit_softcapping", None)
        if cap is not None:
            logits = torch.tanh(logits / cap) * cap
        return logits

    def compute_logits_for_argmax(self, hidden: torch.Tensor) -> torch.Tensor:
        # The softcap is monotone, but in float32 it can make two logits equal: the argmax takes the capped ones.
        if getattr(self.config, "final_logit_softcapping", None) is not None:
            return self.compute_logits(hidden)
        return super().compute_logits_for_argmax(hidden)
