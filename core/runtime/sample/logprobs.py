"""Logprobs of the chosen tokens, their ranks and the top-K alternatives."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from runtime.messages import LogprobsLists


@dataclass(slots=True)
class LogprobsTensors:
    """Column 0 is the chosen token, columns 1..K the top K in descending order."""

    token_ids: torch.Tensor  # [N, K + 1] int64
    logprobs: torch.Tensor  # [N, K + 1] float32
    ranks: torch.Tensor  # [N] int64, 1-based rank of the chosen token


def gather_logprobs(logprobs: torch.Tensor, num_logprobs: int, chosen: torch.Tensor) -> LogprobsTensors:
    """Pick the chosen token's logprob and rank and the top ``num_logprobs``.

    logprobs: [N, V] float32 (log_softmax output); chosen: [N] int64.
    The rank is 1 + the number of tokens with a strictly greater logprob.
    """
    assert 0 <= num_logprobs <= logprobs.shape[1], num_logprobs
    top_logprobs, top_ids = logprobs.topk(num_logprobs, dim=1)  # [N, K] each
    chosen = chosen.to(torch.int64)[:, None]  # [N, 1]
    chosen_logprobs = logprobs.gather(1, chosen)  # [N, 1]
    ranks = (logprobs > chosen_logprobs).sum(dim=1) + 1  # [N]
    return LogprobsTensors(
        token_ids=torch.cat([chosen, top_ids], dim=1),
        logprobs=torch.cat([chosen_logprobs, top_logprobs], dim=1),
        ranks=ranks,
    )


def compute_prompt_logprobs(logits: torch.Tensor, target_token_ids: torch.Tensor, num_logprobs: int) -> LogprobsTensors:
    """Logprobs of the next prompt tokens.

    logits: [M, V], row i predicting the token ``target_token_ids[i]`` ([M]).
    """
    logprobs = logits.to(torch.float32).log_softmax(dim=1)  # [M, V]
    return gather_logprobs(logprobs, num_logprobs, target_token_ids)


def to_lists(tensors: LogprobsTensors, num_logprobs_per_row: list[int]) -> LogprobsLists:
    """Move to Python lists, keeping row i's first ``num_logprobs_per_row[i] + 1`` entries."""
    num_rows = tensors.token_ids.shape[0]
    if len(num_logprobs_per_row) != num_rows:
        raise ValueError(f"num_logprobs_per_row has {len(num_logprobs_per_row)} entries for {num_rows} rows")
    width = tensors.token_ids.shape[1]
    for k in num_logprobs_per_row:
        if not 0 <= k < width:
            raise ValueError(f"a row asks for {k} logprobs; these tensors hold 0 to {width - 1}")
    token_ids = tensors.token_ids.tolist()
    logprobs = tensors.logprobs.tolist()
    return LogprobsLists(
        token_ids=[row[: k + 1] for row, k in zip(token_ids, num_logprobs_per_row)],
        logprobs=[row[: k + 1] for row, k in zip(logprobs, num_logprobs_per_row)],
        ranks=tensors.ranks.tolist(),
    )
