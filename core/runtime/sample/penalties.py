"""Logit changes that apply to every row, greedy or random: logit_bias, the
min_tokens stop mask, and the repetition / frequency / presence penalties.

Each function returns a new tensor and leaves its input unchanged.
"""

from __future__ import annotations

import torch


def apply_logit_bias(
    logits: torch.Tensor, logit_bias: tuple[torch.Tensor, torch.Tensor, torch.Tensor]
) -> torch.Tensor:
    """Add each row's bias to its listed tokens. logits: [N, V]."""
    rows, token_ids, values = logit_bias  # each [B]
    return logits.index_put((rows, token_ids), values, accumulate=True)


def apply_min_tokens_mask(logits: torch.Tensor, mask: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """Forbid the stop tokens of rows that have not reached min_tokens. logits: [N, V]."""
    rows, token_ids = mask  # each [S]
    minus_inf = torch.full((), float("-inf"), dtype=logits.dtype, device=logits.device)  # a fill, not a host copy
    return logits.index_put((rows, token_ids), minus_inf)


def token_counts(token_ids: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Count each token per row. token_ids: [N, L] padded with vocab_size -> [N, V] int64."""
    counts = torch.zeros(token_ids.shape[0], vocab_size + 1, dtype=torch.int64, device=token_ids.device)
    counts.scatter_add_(1, token_ids, torch.ones_like(token_ids))
    return counts[:, :vocab_size]


def apply_penalties(
    logits: torch.Tensor,
    prompt_token_ids: torch.Tensor | None,
    output_token_ids: torch.Tensor,
    presence_penalties: torch.Tensor | None,
    frequency_penalties: torch.Tensor | None,
    repetition_penalties: torch.Tensor | None,
) -> torch.Tensor:
    """Apply the penalties of vLLM / OpenAI / Hugging Face.

    Repetition (HF): a token seen in the prompt or the output has its logit divided
    by the penalty when positive and multiplied by it otherwise. Frequency and
    presence (OpenAI), over output tokens only: subtract ``frequency * count`` and
    ``presence * (count > 0)``.

    logits: [N, V]; token ids: [N, P] / [N, O] padded with V; penalties: [N].
    """
    vocab_size = logits.shape[1]
    output_counts = token_counts(output_token_ids, vocab_size)  # [N, V]
    is_in_output = output_counts > 0  # [N, V]
    if repetition_penalties is not None:
        assert prompt_token_ids is not None, "repetition_penalty needs the prompt token ids"
        is_in_prompt = token_counts(prompt_token_ids, vocab_size) > 0  # [N, V]
        penalty = torch.where(is_in_prompt | is_in_output, repetition_penalties[:, None], 1.0)  # [N, V]
        logits = torch.where(logits > 0, logits / penalty, logits * penalty)
    if frequency_penalties is not None:
        logits = logits - frequency_penalties[:, None] * output_counts
    if presence_penalties is not None:
        logits = logits - presence_penalties[:, None] * is_in_output
    return logits
