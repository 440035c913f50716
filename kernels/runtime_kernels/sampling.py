"""Top-k / top-p filtering that avoids sorting the whole vocabulary (plain torch).

The reference (``runtime.sample.filters``) sorts each ``[V]`` row for top-p. Here each
row's ``num_candidates`` largest logits come from one ``torch.topk`` (a partial
selection); top-k and top-p are decided among those candidates, with top-p's softmax
denominator taken over the whole row by ``logsumexp``. A row whose kept set might reach
past the candidates (top-k off and the candidates hold less than ``top_p`` of the
mass) falls back to the reference for that row alone. Rows with neither filter are
returned unchanged. That fallback needs the host to know which rows, so the sampler
uses :func:`top_k_top_p_bounded` instead: when every row that top-p filters also has a
top-k, the ``max_top_k`` largest logits always cover the kept set, and nothing waits for
the device.

Differences from the reference, all on measure-zero inputs: tokens tied with the k-th
largest logit are kept only when they are among the candidates, and with ``top_p == 1``
nothing is dropped (the reference also drops tokens whose probability underflows to 0).
"""

from __future__ import annotations

import torch

DEFAULT_NUM_CANDIDATES = 1024


def top_k_top_p_filter(
    logits: torch.Tensor,  # [N, V] float
    top_k: torch.Tensor | None,  # [N] int, 0 = off
    top_p: torch.Tensor | None,  # [N] float, 1.0 = off
    max_top_k: int | None = None,
    num_candidates: int = DEFAULT_NUM_CANDIDATES,
) -> torch.Tensor:
    """``apply_top_p(apply_top_k(logits, top_k), top_p)`` with filtered tokens at -inf; a new tensor.

    Rows whose candidates may not cover their top-p set are redone with the full sort,
    which needs the host to see which rows those are (one device sync when top-p is on).
    """
    if top_k is None and top_p is None:
        return logits
    if top_k is not None and max_top_k is None:
        max_top_k = int(top_k.max())
    width = min(logits.shape[1], max(num_candidates, max_top_k or 0))
    result, covered, has_p = _filter_candidates(logits, top_k, top_p, width)
    fallback = (has_p & ~covered).nonzero().flatten()
    if fallback.numel():
        result[fallback] = top_k_top_p_filter_ref(
            logits[fallback], None if top_k is None else top_k[fallback], top_p[fallback], max_top_k
        )
    return result


def top_k_top_p_bounded(
    logits: torch.Tensor,  # [N, V] float
    top_k: torch.Tensor,  # [N] int, 0 = off
    top_p: torch.Tensor | None,  # [N] float, 1.0 = off; every row with top_p < 1 has top_k > 0
    max_top_k: int,  # top_k.max(), known on the host
) -> torch.Tensor:
    """Top-k then top-p when top-k bounds every filtered row: one ``topk``, no sort, no sync.

    The caller promises that each row filtered by top-p also has a top-k, so every kept
    token is among the row's ``max_top_k`` largest. The sampler uses this (nothing here
    waits for the device, so it fits between asynchronously scheduled steps).
    """
    assert 0 < max_top_k <= logits.shape[1], (max_top_k, logits.shape)
    return _filter_candidates(logits, top_k, top_p, max_top_k)[0]


def _filter_candidates(logits, top_k, top_p, width):
    """Filter each row among its ``width`` largest logits.

    Returns the filtered logits (rows without a filter unchanged), per row whether its
    kept set is known to lie among the candidates, and which rows top-p filters.
    """
    num_rows = logits.shape[0]
    values, indices = logits.topk(width, dim=1)  # [N, width], descending
    keep = torch.ones_like(values, dtype=torch.bool)
    has_k = torch.zeros(num_rows, dtype=torch.bool, device=logits.device)
    if top_k is not None:
        has_k = top_k > 0
        kth = values.gather(1, (top_k.clamp(min=1, max=width) - 1).long()[:, None])  # [N, 1]
        keep = values >= kth.masked_fill(~has_k[:, None], float("-inf"))
    has_p = torch.zeros_like(has_k) if top_p is None else top_p < 1.0
    covered = has_k.clone()  # rows whose kept tokens are all candidates
    if top_p is not None:
        keep_p, enough_mass = _top_p_among_candidates(logits, values, keep, has_k, top_p)
        keep = torch.where(has_p[:, None], keep_p, keep)
        covered |= enough_mass
    filtered = torch.full_like(logits, float("-inf")).scatter_(1, indices, values.masked_fill(~keep, float("-inf")))
    return torch.where((has_k | has_p)[:, None], filtered, logits), covered, has_p


def _top_p_among_candidates(logits, values, keep, has_k, top_p):
    """Top-p over the candidates ``values`` [N, width] that survived top-k (``keep``).

    Returns the new keep mask and, per row, whether the candidates hold at least
    ``top_p`` of the probability (then no token outside them can be kept).
    """
    kept_values = values.masked_fill(~keep, float("-inf"))
    denominator = torch.where(has_k, kept_values.logsumexp(dim=1), logits.logsumexp(dim=1))  # [N]
    probs = (kept_values - denominator[:, None]).exp()  # [N, width], 0 where dropped
    above = probs.cumsum(dim=1) - probs  # mass of the more likely tokens
    keep_p = above < top_p[:, None]
    keep_p[:, 0] = True  # the most likely token always stays
    return keep & keep_p, probs.sum(dim=1) >= top_p


def top_k_top_p_filter_ref(
    logits: torch.Tensor, top_k: torch.Tensor | None, top_p: torch.Tensor | None, max_top_k: int | None = None
) -> torch.Tensor:
    """The sampler's own filters, in its order (top-k, then top-p over a full sort)."""
    from runtime.sample.filters import apply_top_k, apply_top_p

    if top_k is not None:
        logits = apply_top_k(logits, top_k, max_top_k or max(1, int(top_k.max())))
    if top_p is not None:
        logits = apply_top_p(logits, top_p)
    return logits


ARGMAX_CHUNK = 4096  # vocabulary entries a program of the first pass takes
# Rows past which torch's argmax (a block a row) already fills the GPU: on an H100 over 128,256 logits the two passes
# took 3.9 / 4.2 / 16.1 µs at 1 / 4 / 64 rows against torch's 26.0 / 27.0 / 27.4, and 55.9 against 54.4 at 256.
ARGMAX_MAX_ROWS = 64


def argmax(logits: torch.Tensor) -> torch.Tensor:
    """``logits.argmax(dim=1)`` for ``[N, V]`` logits (the greedy rows' tokens), exactly: the first of equal
    maxima, a NaN counting as the largest. Two launches that spread each row over many programs, where torch's
    reduction gives a row one block (a 128k vocabulary took it ~27 µs on an H100 at N = 1); over
    ``ARGMAX_MAX_ROWS`` rows, torch's own."""
    from runtime_kernels.jit.argmax import argmax_chunks_kernel, argmax_rows_kernel
    from runtime_kernels.utils import check_last_dim_contiguous, next_power_of_2, require_triton

    require_triton("argmax")
    check_last_dim_contiguous("logits", logits)
    rows, vocab = logits.shape
    if rows == 0 or vocab == 0 or rows > ARGMAX_MAX_ROWS:
        return logits.argmax(dim=1)  # an empty row: torch's own error
    out = torch.empty(rows, dtype=torch.int64, device=logits.device)
    num_chunks = -(-vocab // ARGMAX_CHUNK)
    values = torch.empty(rows, num_chunks, dtype=torch.float32, device=logits.device)
    indices = torch.empty(rows, num_chunks, dtype=torch.int64, device=logits.device)
    argmax_chunks_kernel[(rows, num_chunks)](logits, values, indices, vocab, logits.stride(0), CHUNK=ARGMAX_CHUNK,
                                             NUM_CHUNKS=num_chunks)
    argmax_rows_kernel[(rows,)](values, indices, out, NUM_CHUNKS=num_chunks, CHUNKS_PAD=next_power_of_2(num_chunks))
    return out
