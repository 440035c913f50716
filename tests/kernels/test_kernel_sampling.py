"""top_k_top_p_filter / top_k_top_p_bounded (partial selection) against the sampler's sort-based filters,
and the sampler drawing the same tokens with the bounded op as with its sort."""

from __future__ import annotations

import pytest
import torch

from runtime.models.ops import custom_ops_scope
from runtime.sample import Sampler, build_sampling_metadata
from runtime.sampling_params import SamplingParams
from runtime_kernels.sampling import top_k_top_p_bounded, top_k_top_p_filter, top_k_top_p_filter_ref

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


def test_bounded_matches_reference(device):
    logits = logits_rows(6, seed=4).to(device)
    k = torch.tensor([10, 0, 1, 400, 3, 0], device=device)  # rows 1 and 5: no top-k, so no top-p either
    p = torch.tensor([0.8, 1.0, 0.5, 0.5, 1.0, 1.0], device=device)
    got = top_k_top_p_bounded(logits, k, p, max_top_k=400)
    assert torch.equal(got, top_k_top_p_filter_ref(logits, k, p))
    assert torch.equal(got[1], logits[1]) and torch.equal(got[5], logits[5])
    assert torch.equal(top_k_top_p_bounded(logits, k, None, max_top_k=400), top_k_top_p_filter_ref(logits, k, None))


def _sample(sampler: Sampler, logits: torch.Tensor, params: list[SamplingParams], seed: int) -> torch.Tensor:
    generators = [torch.Generator(logits.device).manual_seed(seed + i) for i in range(len(params))]
    metadata = build_sampling_metadata(params, [[0]] * len(params), [[]] * len(params), generators, VOCAB, logits.device)
    return sampler(logits, metadata).sampled_token_ids


@pytest.mark.parametrize("bounded", [True, False])
def test_sampler_with_the_op_draws_the_reference_tokens(bounded, device):
    rows = [SamplingParams(temperature=0.0), SamplingParams(temperature=0.9, top_k=40, top_p=0.8),
            SamplingParams(temperature=1.2, top_k=5), SamplingParams(temperature=0.7, top_k=300, top_p=0.95),
            SamplingParams(temperature=1.0, top_p=0.9 if not bounded else 1.0)]  # unbounded: top-p without top-k
    calls = []

    def counting_op(*args):
        calls.append(args)
        return top_k_top_p_bounded(*args)

    with custom_ops_scope({"top_k_top_p": counting_op}):
        fused = Sampler()
    plain = Sampler()
    assert plain.top_k_top_p is None
    for step in range(5):
        logits = logits_rows(len(rows), seed=10 + step).to(device)
        assert torch.equal(_sample(fused, logits, rows, seed=step), _sample(plain, logits, rows, seed=step))
    assert len(calls) == (5 if bounded else 0)  # the op runs only when top-k bounds every top-p row



@pytest.mark.parametrize("rows, vocab", [(1, 128256), (3, 4096), (2, 4097), (5, 100), (4, 9000), (70, 300)])
def test_argmax_matches_torch(device, rows, vocab):
    """Random rows, and rows built to tie: the first of equal maxima, a NaN anywhere (the first NaN wins, as in
    torch), a row of -inf (index 0), maxima on chunk edges; past ARGMAX_MAX_ROWS rows, torch's own."""
    from runtime_kernels.sampling import ARGMAX_CHUNK, argmax

    logits = torch.randn(rows, vocab, generator=torch.Generator().manual_seed(rows + vocab)) * 5
    if vocab > ARGMAX_CHUNK:
        logits[0, ARGMAX_CHUNK - 1] = logits[0, vocab - 1] = 100.0  # tie across chunks: the earlier index
    if rows > 1:
        logits[1, vocab // 3] = logits[1, vocab - 1] = float("nan")
    if rows > 2:
        logits[2] = float("-inf")
    if rows > 3:
        logits[3, vocab // 2] = float("inf")
    logits = logits.to(device)
    got = argmax(logits)
    assert got.dtype == torch.int64
    assert torch.equal(got, logits.argmax(dim=1))
    assert torch.equal(argmax(logits.to(torch.bfloat16)), logits.to(torch.bfloat16).argmax(dim=1))


def test_greedy_rows_take_the_argmax_op(device):
    from runtime_kernels.sampling import argmax

    calls = []

    def counting_argmax(logits):
        calls.append(logits.shape)
        return argmax(logits)

    with custom_ops_scope({"argmax": counting_argmax}):
        fused = Sampler()
    rows = [SamplingParams(temperature=0.0), SamplingParams(temperature=0.9, top_k=40), SamplingParams(temperature=0.0)]
    for step in range(3):
        logits = logits_rows(len(rows), seed=20 + step).to(device)
        assert torch.equal(_sample(fused, logits, rows, seed=step), _sample(Sampler(), logits, rows, seed=step))
    assert calls == [(3, VOCAB)] * 3
