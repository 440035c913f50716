"""Temperature, top-k, top-p and min-p against plain references written here."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from runtime.sample.filters import apply_min_p, apply_top_k, apply_top_p
from runtime.sampling_params import SamplingParams


def softmax(x: np.ndarray) -> np.ndarray:
    e = np.exp(x - x.max())
    return e / e.sum()


def ref_top_k_keep(logits: np.ndarray, k: int) -> set[int]:
    return set(np.argsort(-logits)[:k].tolist()) if k else set(range(len(logits)))


def ref_top_p_keep(logits: np.ndarray, p: float) -> set[int]:
    """Smallest set of most likely tokens whose probability sums to >= p."""
    probs = softmax(logits.astype(np.float64))
    kept, total = set(), 0.0
    for token in np.argsort(-probs):
        kept.add(int(token))
        total += probs[token]
        if total >= p:
            break
    return kept


def ref_min_p_keep(logits: np.ndarray, min_p: float) -> set[int]:
    probs = softmax(logits.astype(np.float64))
    return {i for i in range(len(probs)) if probs[i] > 0 and probs[i] >= min_p * probs.max()}


def kept(row: torch.Tensor) -> set[int]:
    return set(torch.nonzero(torch.isfinite(row)).flatten().tolist())


def draw_support(run_sampler, logits_row: torch.Tensor, params: SamplingParams, num_draws: int) -> np.ndarray:
    """Sample one row ``num_draws`` times (as a batch) and return the token counts."""
    logits = logits_row.expand(num_draws, -1).contiguous()
    tokens = run_sampler(logits, [params] * num_draws).sampled_token_ids
    return np.bincount(tokens.numpy(), minlength=logits_row.shape[0])


def test_top_k_filter_matches_reference():
    gen = torch.Generator().manual_seed(1)
    logits = torch.randn(5, 30, generator=gen)
    ks = [0, 1, 3, 7, 30]
    out = apply_top_k(logits, torch.tensor(ks), max_top_k=max(ks))
    for row, k in enumerate(ks):
        assert kept(out[row]) == ref_top_k_keep(logits[row].numpy(), k)
        finite = torch.isfinite(out[row])
        assert torch.equal(out[row][finite], logits[row][finite])  # kept logits unchanged


def test_top_p_filter_matches_reference():
    gen = torch.Generator().manual_seed(2)
    logits = torch.randn(6, 40, generator=gen) * 2
    ps = [1.0, 0.05, 0.3, 0.5, 0.8, 0.95]
    out = apply_top_p(logits, torch.tensor(ps))
    for row, p in enumerate(ps):
        assert kept(out[row]) == ref_top_p_keep(logits[row].numpy(), p), p


def test_min_p_filter_matches_reference():
    gen = torch.Generator().manual_seed(3)
    logits = torch.randn(4, 25, generator=gen) * 2
    min_ps = [0.0, 0.05, 0.2, 0.9]
    out = apply_min_p(logits, torch.tensor(min_ps))
    for row, min_p in enumerate(min_ps):
        assert kept(out[row]) == ref_min_p_keep(logits[row].numpy(), min_p), min_p


def test_top_k_sampling_support_is_exactly_the_k_best(run_sampler):
    logits = torch.tensor([0.5, 2.0, -1.0, 1.5, 1.9, 0.0, 1.0, -0.5])
    counts = draw_support(run_sampler, logits, SamplingParams(temperature=1.0, top_k=3), 4000)
    assert set(np.nonzero(counts)[0].tolist()) == ref_top_k_keep(logits.numpy(), 3) == {1, 3, 4}


def test_top_p_sampling_support(run_sampler):
    probs = torch.tensor([0.05, 0.4, 0.1, 0.3, 0.15])
    logits = probs.log()
    counts = draw_support(run_sampler, logits, SamplingParams(temperature=1.0, top_p=0.8), 4000)
    # 0.4 + 0.3 = 0.7 < 0.8, adding 0.15 reaches 0.85.
    assert set(np.nonzero(counts)[0].tolist()) == ref_top_p_keep(logits.numpy(), 0.8) == {1, 3, 4}
    expected = np.array([0, 0.4, 0, 0.3, 0.15]) / 0.85
    assert np.abs(counts / counts.sum() - expected).max() < 0.03


def test_min_p_sampling_support(run_sampler):
    probs = torch.tensor([0.5, 0.02, 0.2, 0.08, 0.2])
    logits = probs.log()
    counts = draw_support(run_sampler, logits, SamplingParams(temperature=1.0, min_p=0.3), 4000)
    assert set(np.nonzero(counts)[0].tolist()) == ref_min_p_keep(logits.numpy(), 0.3) == {0, 2, 4}


@pytest.mark.parametrize(
    ("top_k", "top_p", "min_p", "expected"),
    [
        (3, 0.75, 0.0, {0, 1}),  # top-p alone would keep 3: it runs on the top-k renormalised probs
        (5, 0.9, 0.33, {0, 1}),  # top-k and top-p keep 3, min-p drops the third
    ],
)
def test_top_k_top_p_min_p_combined_support(run_sampler, top_k, top_p, min_p, expected):
    logits = torch.tensor([3.0, 2.5, 2.4, 2.0, 1.0, 0.5, 0.0, -1.0])
    params = SamplingParams(temperature=0.5, top_k=top_k, top_p=top_p, min_p=min_p)
    counts = draw_support(run_sampler, logits, params, 4000)
    # Reference in the sampler's order: temperature, top-k, top-p, min-p.
    after_k = logits.numpy() / 0.5
    after_k[list(set(range(8)) - ref_top_k_keep(after_k, top_k))] = -np.inf
    after_p = after_k.copy()
    after_p[list(set(range(8)) - ref_top_p_keep(after_k, top_p))] = -np.inf
    assert ref_min_p_keep(after_p, min_p) == expected
    assert set(np.nonzero(counts)[0].tolist()) == expected


@pytest.mark.parametrize("temperature", [0.7, 1.0, 1.8])
def test_temperature_distribution_matches_softmax(run_sampler, temperature):
    logits = torch.tensor([1.0, 0.2, -0.5, 0.8, -1.5])
    counts = draw_support(run_sampler, logits, SamplingParams(temperature=temperature), 20000)
    expected = softmax(logits.numpy().astype(np.float64) / temperature)
    # Standard error is at most sqrt(0.25 / 20000) = 0.0035; allow ~4 sigma.
    assert np.abs(counts / counts.sum() - expected).max() < 0.015
