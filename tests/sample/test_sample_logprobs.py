"""Logprobs, ranks and top-K against a numpy reference written here."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from runtime.messages import LogprobsLists
from runtime.sample import LogprobsTensors, compute_prompt_logprobs, gather_logprobs, to_lists


def ref_row(logits: np.ndarray, chosen: int, k: int) -> tuple[list[int], list[float], int]:
    x = logits.astype(np.float64)
    logprobs = x - x.max() - np.log(np.exp(x - x.max()).sum())
    top = sorted(range(len(x)), key=lambda t: -logprobs[t])[:k]
    rank = 1 + sum(1 for t in range(len(x)) if logprobs[t] > logprobs[chosen])
    return [chosen] + top, [logprobs[chosen]] + [logprobs[t] for t in top], rank


def check_against_reference(out: LogprobsTensors, logits: torch.Tensor, chosen: list[int], k: int) -> None:
    assert out.token_ids.shape == out.logprobs.shape == (len(chosen), k + 1)
    for row, token in enumerate(chosen):
        ids, logprobs, rank = ref_row(logits[row].numpy(), token, k)
        assert out.token_ids[row].tolist() == ids
        np.testing.assert_allclose(out.logprobs[row].numpy(), logprobs, rtol=1e-5, atol=1e-5)
        assert out.ranks[row].item() == rank


@pytest.mark.parametrize("k", [0, 1, 5])
def test_gather_logprobs_matches_reference(k):
    gen = torch.Generator().manual_seed(11)
    logits = torch.randn(4, 30, generator=gen) * 2
    chosen = [int(logits[0].argmax()), 7, 29, int(logits[3].argmin())]
    out = gather_logprobs(logits.log_softmax(dim=1), k, torch.tensor(chosen))
    check_against_reference(out, logits, chosen, k)
    assert out.ranks[0].item() == 1 and out.ranks[3].item() == 30


def test_rank_counts_only_strictly_greater():
    logprobs = torch.tensor([[-1.0, -0.5, -0.5, -2.0]])
    out = gather_logprobs(logprobs, 2, torch.tensor([2]))
    assert out.ranks.tolist() == [1]  # tied with the best
    assert gather_logprobs(logprobs, 2, torch.tensor([3])).ranks.tolist() == [4]


def test_prompt_logprobs_match_reference():
    gen = torch.Generator().manual_seed(12)
    # Distinct values that bf16 holds exactly, so the top-K order has no ties.
    logits = torch.stack([torch.randperm(20, generator=gen) * 0.25 - 2.0 for _ in range(6)]).to(torch.bfloat16)
    targets = [3, 0, 19, 5, 5, 11]
    out = compute_prompt_logprobs(logits, torch.tensor(targets), 3)
    check_against_reference(out, logits.float(), targets, 3)


def test_to_lists_slices_each_row_to_its_count():
    gen = torch.Generator().manual_seed(13)
    logits = torch.randn(3, 10, generator=gen)
    out = gather_logprobs(logits.log_softmax(dim=1), 4, torch.tensor([1, 2, 3]))
    lists = to_lists(out, [0, 4, 2])
    assert isinstance(lists, LogprobsLists)
    assert lists.token_ids == [out.token_ids[0, :1].tolist(), out.token_ids[1].tolist(), out.token_ids[2, :3].tolist()]
    assert [len(row) for row in lists.logprobs] == [1, 5, 3]
    assert lists.logprobs[2] == out.logprobs[2, :3].tolist()
    assert lists.ranks == out.ranks.tolist()
    with pytest.raises(ValueError, match="asks for 5 logprobs"):
        to_lists(out, [0, 5, 2])
