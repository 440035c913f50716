"""top_k_top_p_filter (partial selection) against the sampler's sort-based filters."""

from __future__ import annotations

import pytest
import torch

from runtime_kernels.sampling import top_k_top_p_filter, top_k_top_p_filter_ref

VOCAB = 3000


def logits_rows(num_rows: int, seed: int, spread: float = 3.0) -> torch.Tensor:
    return torch.randn(num_rows, VOCAB, generator=torch.Generator().manual_seed(seed)) * spread


@pytest.mark.parametrize(
    "top_k, top_p",
    [
        ([0, 5, 50, 1, 0, 2999], None),  # top-k only, incl. "off" rows
        (None, [0.9, 0.5, 1.0, 0.99, 0.1, 0.7]),  # top-p only, incl. an "off" row
        ([10, 0, 0, 400, 3, 0], [0.8, 0.95, 1.0, 0.5, 1.0, 0.3]),  # both, mixed
    ],
)
def test_matches_reference(top_k, top_p):
    logits = logits_rows(6, seed=1)
    k = None if top_k is None else torch.tensor(top_k)
    p = None if top_p is None else torch.tensor(top_p)
    got = top_k_top_p_filter(logits, k, p, num_candidates=256)
    expected = top_k_top_p_filter_ref(logits, k, p)
    assert torch.equal(got.isinf(), expected.isinf())
    assert torch.equal(got, expected)


def test_flat_rows_fall_back_to_the_full_sort():
    # Nearly uniform rows: 64 candidates hold ~2% of the mass, far below top_p.
    logits = logits_rows(3, seed=2, spread=0.01)
    p = torch.tensor([0.9, 0.5, 0.99])
    got = top_k_top_p_filter(logits, None, p, num_candidates=64)
    expected = top_k_top_p_filter_ref(logits, None, p)
    assert (~got.isinf()).sum(dim=1).min() > 64  # more tokens kept than there were candidates
    assert torch.equal(got, expected)


def test_no_filter_returns_input():
    logits = logits_rows(2, seed=3)
    assert top_k_top_p_filter(logits, None, None) is logits
    assert torch.equal(top_k_top_p_filter(logits, torch.tensor([0, 0]), torch.tensor([1.0, 1.0])), logits)
