"""apply_token_bitmask (Triton, in place, no temporaries) against core's torch reference."""

from __future__ import annotations

import numpy as np
import pytest
import torch

pytest.importorskip("triton")

from runtime.sample.bitmask import apply_token_bitmask as reference  # noqa: E402
from runtime_kernels.bitmask import apply_token_bitmask  # noqa: E402


def random_bitmask(rows: int, words: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    bitmask = torch.randint(-(2**31), 2**31 - 1, (rows, words), dtype=torch.int32, generator=gen)
    bitmask[0] = 0  # nothing allowed
    bitmask[-1] = -1  # everything allowed
    bitmask[1, 2] = -(2**31)  # a word with the sign bit alone: of its 32 tokens only the last is allowed
    return bitmask


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    "vocab, words, rows",
    [
        (4100, 129, None),  # every logits row; vocab not a multiple of 32
        (4100, 120, None),  # a bitmask narrower than the vocabulary: the tokens past it are not allowed
        (3000, 94, [4, 0, 2]),  # some logits rows, in another order
    ],
)
def test_matches_reference(device, dtype, vocab, words, rows):
    num_rows = 5
    logits = torch.randn(num_rows, vocab, generator=torch.Generator().manual_seed(1)).to(dtype)
    bitmask = random_bitmask(num_rows if rows is None else len(rows), words, seed=2)
    expected = reference(logits.clone(), bitmask, rows)
    out = logits.to(device)
    assert apply_token_bitmask(out, bitmask, rows) is out  # in place
    torch.testing.assert_close(out.cpu(), expected, rtol=0, atol=0)
    assert torch.isinf(expected).any() and torch.isfinite(expected).any()


def test_rows_are_needed_for_fewer_bitmask_rows(device):
    with pytest.raises(ValueError, match="needs `rows`"):
        apply_token_bitmask(torch.zeros(3, 64, device=device), torch.zeros(2, 2, dtype=torch.int32))


@pytest.mark.parametrize("rows", [None, [3, 1, 0, 2]])
def test_slots_match_the_gathered_bitmask(device, rows):
    """With slots, row i is masked by table row slots[i] (a slot < 0 masks nothing): as the
    reference does with the rows gathered first."""
    vocab, words = 3000, 94
    table = random_bitmask(6, words, seed=3)
    slots = np.array([5, 0, -1, 2], dtype=np.int32)
    logits = torch.randn(4, vocab, generator=torch.Generator().manual_seed(4))
    gathered = torch.stack([table[s] if s >= 0 else torch.full((words,), -1, dtype=torch.int32) for s in slots])
    expected = reference(logits.clone(), gathered, rows)
    torch.testing.assert_close(reference(logits.clone(), table, rows, slots=slots), expected, rtol=0, atol=0)
    out = logits.to(device)
    apply_token_bitmask(out, table.to(device), rows, slots=slots)
    torch.testing.assert_close(out.cpu(), expected, rtol=0, atol=0)
    row_of = list(range(4)) if rows is None else rows
    assert torch.isfinite(expected[row_of[2]]).all()  # slot -1: untouched
