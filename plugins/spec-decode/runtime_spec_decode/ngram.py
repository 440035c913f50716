"""The ``ngram`` proposer: prompt lookup decoding.

For each request, take the last ``n`` tokens (its suffix n-gram) for ``n`` from
``prompt_lookup_max`` down to ``prompt_lookup_min``; the first ``n`` that occurs earlier in
the request's tokens (prompt and output) wins, and of its occurrences the most recent one.
The drafts are the up to ``k`` tokens that followed that occurrence, fewer when the
sequence ends first (an occurrence may overlap the suffix itself). A request with no
occurrence gets no drafts. The drafts are deterministic, so ``probs`` is None (q = 1).

The search is batched with numpy: all requests' tokens in one flat array; one comparison
per n-gram position (at most ``prompt_lookup_max``) narrows the candidate end positions,
with no Python loop over tokens.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from runtime.spec_decode import DraftProposals, ProposalBatch
from runtime_spec_decode.options import speculative_options

# vLLM's defaults: both 5 when neither is given; one given sets the other to the same value.
DEFAULT_PROMPT_LOOKUP = 5


def resolve_lookup_range(prompt_lookup_min: Any = None, prompt_lookup_max: Any = None) -> tuple[int, int]:
    """Check the given values, fill in vLLM's defaults, check ``prompt_lookup_min <= prompt_lookup_max``."""
    for name, value in (("prompt_lookup_min", prompt_lookup_min), ("prompt_lookup_max", prompt_lookup_max)):
        if value is not None and (isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1):
            raise ValueError(
                f"{name} must be an integer >= 1 (valid: 1 <= prompt_lookup_min <= prompt_lookup_max), got {value!r}"
            )
    if prompt_lookup_min is None and prompt_lookup_max is None:
        prompt_lookup_min = prompt_lookup_max = DEFAULT_PROMPT_LOOKUP
    elif prompt_lookup_min is None:
        prompt_lookup_min = prompt_lookup_max
    elif prompt_lookup_max is None:
        prompt_lookup_max = prompt_lookup_min
    if prompt_lookup_min > prompt_lookup_max:
        raise ValueError(
            f"prompt_lookup_min ({prompt_lookup_min}) must not exceed prompt_lookup_max ({prompt_lookup_max}) "
            "(valid: 1 <= prompt_lookup_min <= prompt_lookup_max)"
        )
    return int(prompt_lookup_min), int(prompt_lookup_max)


class NgramProposer:
    """Prompt-lookup drafts; implements :class:`runtime.spec_decode.Proposer`."""

    uses_kv_cache = False
    needs_hidden_states = False

    def __init__(self, prompt_lookup_min: int | None = None, prompt_lookup_max: int | None = None):
        self.min_n, self.max_n = resolve_lookup_range(prompt_lookup_min, prompt_lookup_max)

    @classmethod
    def from_config(cls, config: Any) -> NgramProposer:
        """Build from an :class:`runtime.config.EngineConfig`: options in
        ``config.plugin_options["speculative_config"]`` (``prompt_lookup_min``, ``prompt_lookup_max``)."""
        options = speculative_options(config)
        return cls(options.get("prompt_lookup_min"), options.get("prompt_lookup_max"))

    def propose(self, batch: ProposalBatch) -> DraftProposals:
        return DraftProposals(token_ids=propose_ngram(batch.token_ids, batch.num_speculative_tokens, self.min_n, self.max_n))


def propose_ngram(token_ids: list, k: int, min_n: int, max_n: int) -> list[list[int]]:
    """Prompt-lookup drafts (up to ``k``) for each row of ``token_ids`` (lists or 1-D arrays)."""
    num_reqs = len(token_ids)
    if k <= 0 or num_reqs == 0:
        return [[] for _ in range(num_reqs)]
    rows = [np.asarray(row, dtype=np.int64).reshape(-1) for row in token_ids]
    lengths = np.fromiter((row.shape[0] for row in rows), dtype=np.int64, count=num_reqs)
    flat = np.concatenate(rows) if int(lengths.sum()) else np.zeros(0, dtype=np.int64)
    starts = np.cumsum(lengths) - lengths
    last = starts + lengths - 1  # flat index of each request's last token

    match_end = find_matches(flat, starts, lengths, min_n, max_n)  # [R] position in the request, -1: none
    matched = match_end >= 0
    drafts: list[list[int]] = [[] for _ in range(num_reqs)]
    if not matched.any():
        return drafts
    reqs = np.nonzero(matched)[0]
    first = starts[reqs] + match_end[reqs] + 1  # flat index of the first token after the occurrence
    counts = np.minimum(k, last[reqs] - first + 1)  # >= 1: an occurrence ends before the last token
    index = first[:, None] + np.arange(k)[None, :]
    tokens = flat[np.minimum(index, flat.shape[0] - 1)].tolist()
    for req, row, count in zip(reqs.tolist(), tokens, counts.tolist()):
        drafts[req] = row[:count]
    return drafts


def find_matches(flat: np.ndarray, starts: np.ndarray, lengths: np.ndarray, min_n: int, max_n: int) -> np.ndarray:
    """For each request, where its chosen earlier occurrence of a suffix n-gram ends.

    ``flat``: every request's tokens, request ``r`` at ``starts[r] : starts[r] + lengths[r]``.
    Returns [R] int64: the position (within the request) of the occurrence's last token, or
    -1. An occurrence must end before the request's last token (so a token follows it); the
    longest one (n capped at ``max_n``, at least ``min_n``) wins, then the most recent.
    """
    num_reqs = lengths.shape[0]
    result = np.full(num_reqs, -1, dtype=np.int64)
    if flat.shape[0] == 0:
        return result
    req_of = np.repeat(np.arange(num_reqs), lengths)  # [N]
    pos = np.arange(flat.shape[0]) - starts[req_of]  # [N] position within the request
    last = starts + lengths - 1  # [R]

    # Candidate ends: tokens equal to their request's last token, with a token after them.
    cand = np.nonzero((flat == flat[last[req_of]]) & (pos <= lengths[req_of] - 2))[0]
    run = np.ones(cand.shape[0], dtype=np.int64)  # matched length so far at each candidate end
    alive = np.arange(cand.shape[0])  # candidates whose match is still growing
    for j in range(1, max_n):
        ends = cand[alive]
        req = req_of[ends]
        ok = pos[ends] >= j  # the occurrence may not start before its request
        ok[ok] = flat[ends[ok] - j] == flat[last[req[ok]] - j]
        alive = alive[ok]
        if alive.shape[0] == 0:
            break
        run[alive] += 1

    good = run >= min_n
    if not good.any():
        return result
    cand, run = cand[good], run[good]
    width = int(lengths.max()) + 1
    score = run * width + pos[cand]  # longer first, then later
    best = np.full(num_reqs, -1, dtype=np.int64)
    np.maximum.at(best, req_of[cand], score)
    found = best >= 0
    result[found] = best[found] % width
    return result
