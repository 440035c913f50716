"""What the model runner needs of a model class (built-in or registered by a plugin)."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Protocol, runtime_checkable

import torch

from runtime.attention.backend import AttentionLayerSpec


@runtime_checkable
class CausalLM(Protocol):
    """A decoder-only language model over the flat, unpadded batch of one engine step.

    Built as ``cls(hf_config)`` on the meta device; parameter names follow Hugging Face's,
    so checkpoints load by name. Attention layers read the step's KV cache and backend from
    :func:`runtime.forward_context.get_forward_context`.
    """

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """``input_ids``/``positions`` [num_tokens] -> hidden states [num_tokens, hidden_size]."""

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[num_rows, hidden_size] -> [num_rows, vocab_size] float logits."""

    # Optional: ``compute_logits_for_argmax(hidden)``, logits with the same argmax as ``compute_logits`` in the
    # cheapest dtype (the lm_head's). The model runner takes it for steps whose rows need only the argmax, so a
    # 16-bit model skips widening a [rows, vocab] tensor to float32 (which cannot change an argmax).

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Copy checkpoint tensors in by Hugging Face name; return the names loaded."""

    def attention_specs(self) -> list[AttentionLayerSpec]:
        """One spec per attention layer, in ``layer_idx`` order (KV cache sizing, backends)."""
