"""The flattened layout of a speculative step (requests in batch order, request ``i`` with ``k_i`` drafts and
``k_i + 1`` logits rows; see :mod:`runtime.sample.rejection_sampler`) and the per-position sampling metadata built
on it."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from runtime.sample.metadata import SamplingMetadata
from runtime.sample.upload import upload


@dataclass(slots=True)
class SpecDecodeLayout:
    """Index tensors of one step's flattened layout (see the module docstring)."""

    num_draft_tokens: torch.Tensor  # [R] int64, k_i
    cu_num_draft_tokens: torch.Tensor  # [R] int64, inclusive prefix sum of k_i (vLLM's)
    draft_start: torch.Tensor  # [R] int64, index of request i's first draft
    row_start: torch.Tensor  # [R] int64, request i's first logits row
    draft_req: torch.Tensor  # [D] int64, request of each draft
    draft_pos: torch.Tensor  # [D] int64, position of each draft within its request
    draft_rows: torch.Tensor  # [D] int64, the logits row that verifies each draft
    row_req: torch.Tensor  # [T] int64, request of each logits row
    row_pos: torch.Tensor  # [T] int64, position of each logits row within its request
    max_k: int
    num_drafts: int  # D
    num_rows: int  # T = D + R

    @classmethod
    def build(cls, num_draft_tokens: Sequence[int] | torch.Tensor, device: torch.device | str) -> SpecDecodeLayout:
        """Computed on the host (the counts are host values) and uploaded in one asynchronous copy."""
        k = np.asarray(num_draft_tokens.tolist() if torch.is_tensor(num_draft_tokens) else num_draft_tokens, dtype=np.int64)
        if (k < 0).any():
            raise ValueError(f"num_draft_tokens must be >= 0 for every request, got {int(k[k < 0][0])}")
        num_reqs, num_drafts = len(k), int(k.sum())
        cu = np.cumsum(k)
        draft_start = cu - k
        reqs = np.arange(num_reqs, dtype=np.int64)
        row_start = draft_start + reqs
        draft_req = np.repeat(reqs, k)
        draft_pos = np.arange(num_drafts, dtype=np.int64) - draft_start[draft_req]
        row_req = np.repeat(reqs, k + 1)
        row_pos = np.arange(num_drafts + num_reqs, dtype=np.int64) - row_start[row_req]
        parts = (k, cu, draft_start, row_start, draft_req, draft_pos, row_start[draft_req] + draft_pos, row_req, row_pos)
        packed = upload(np.concatenate(parts), torch.int64, device)
        views = packed.split([len(p) for p in parts])
        return cls(*views, max_k=int(k.max(initial=0)), num_drafts=num_drafts, num_rows=num_drafts + num_reqs)


def flatten_drafts(
    token_ids: list[list[int]], probs: torch.Tensor | None, device: torch.device | str
) -> tuple[torch.Tensor, list[int], torch.Tensor | None]:
    """A proposer's :class:`runtime.spec_decode.DraftProposals` fields in this module's layout.

    ``token_ids``: drafts per request; ``probs``: [num_reqs, k, V] or None. Returns
    ``(draft_token_ids [D], num_draft_tokens, draft_probs [D, V] or None)``.
    """
    counts = [len(row) for row in token_ids]
    flat = torch.tensor([t for row in token_ids for t in row], dtype=torch.int64).to(device)
    if probs is None:
        return flat, counts, None
    if probs.dim() != 3 or probs.shape[0] != len(counts) or probs.shape[1] < max(counts, default=0):
        raise ValueError(
            f"draft probs must be [num_reqs={len(counts)}, k >= {max(counts, default=0)}, vocab_size], "
            f"got {list(probs.shape)}"
        )
    layout = SpecDecodeLayout.build(counts, probs.device)
    return flat, counts, probs[layout.draft_req, layout.draft_pos].to(device)


def expand_metadata(
    metadata: SamplingMetadata, layout: SpecDecodeLayout, draft_token_ids: torch.Tensor, vocab_size: int
) -> SamplingMetadata:
    """Per-request metadata -> per-position metadata ([T] rows, the logits' rows).

    Every position repeats its request's parameters; position ``j`` sees the request's
    output tokens followed by its first ``j`` drafts (penalties as in sequential decoding);
    logit_bias, allowed_token_ids and the min_tokens mask apply to every position of their request. The
    result carries no generators (the rejection sampler draws per request).
    """
    idx = layout.row_req

    def take(t: torch.Tensor | None) -> torch.Tensor | None:
        return None if t is None else t.index_select(0, idx)

    output_ids = None
    if metadata.output_token_ids is not None:
        drafts = torch.full((metadata.num_rows, layout.max_k), vocab_size, dtype=torch.int64, device=idx.device)
        drafts[layout.draft_req, layout.draft_pos] = draft_token_ids
        drafts = drafts.index_select(0, idx)  # [T, max_k]
        cols = torch.arange(layout.max_k, device=idx.device)
        drafts = drafts.masked_fill(cols[None, :] >= layout.row_pos[:, None], vocab_size)
        output_ids = torch.cat([take(metadata.output_token_ids), drafts], dim=1)

    return SamplingMetadata(
        num_rows=layout.num_rows,
        all_greedy=metadata.all_greedy,
        all_random=metadata.all_random,
        temperature=take(metadata.temperature),
        top_k=take(metadata.top_k),
        max_top_k=metadata.max_top_k,
        top_p=take(metadata.top_p),
        top_k_bounds_top_p=metadata.top_k_bounds_top_p,
        min_p=take(metadata.min_p),
        presence_penalties=take(metadata.presence_penalties),
        frequency_penalties=take(metadata.frequency_penalties),
        repetition_penalties=take(metadata.repetition_penalties),
        prompt_token_ids=take(metadata.prompt_token_ids),
        output_token_ids=output_ids,
        logit_bias=_expand_entries(metadata.logit_bias, layout),
        min_tokens_mask=_expand_entries(metadata.min_tokens_mask, layout),
        allowed_tokens=_expand_entries(metadata.allowed_tokens, layout),
        generators={},
        max_num_logprobs=metadata.max_num_logprobs,
    )


def _expand_entries(entries: tuple[torch.Tensor, ...] | None, layout: SpecDecodeLayout) -> tuple[torch.Tensor, ...] | None:
    """Per-request entries ``(request rows [B], values [B, ...], ...)`` -> one copy per position of each request:
    ``(logits rows [B'], values [B', ...], ...)``."""
    if entries is None:
        return None
    rows, *values = entries
    counts = layout.num_draft_tokens[rows] + 1  # [B]
    entry = torch.arange(rows.shape[0], device=rows.device).repeat_interleave(counts)  # [B']
    first = (counts.cumsum(0) - counts)[entry]
    offset = torch.arange(entry.shape[0], device=rows.device) - first
    return (layout.row_start[rows[entry]] + offset, *(value[entry] for value in values))
