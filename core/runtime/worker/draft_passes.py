"""The passes of a draft module (draft model, EAGLE) over its own paged KV cache.

One step of a worker proposer with KV (see :mod:`runtime.spec_decode`):

1. **Catch-up pass**, every scheduled request at once: the module computes the positions it
   has not computed yet (``[start_i, end_i)``), which include everything the target computes
   this step that is already known, so its KV covers the same blocks as the target's. A
   request that drafts ``m_i`` tokens takes its first draft from the last row.
2. **Draft passes** ``j = 1 .. m - 1``: one token per request still drafting, at the position
   after its previous one, fed its previous draft (and the module's carried hidden state).

Drafts of greedy requests are the argmax; those of random requests are sampled from
``q = softmax(logits / temperature)``, whose rows go to the rejection sampler. A seeded
request samples from its own generator (derived from its seed, output length and draft
index), so its drafts, and therefore its tokens, do not depend on the batch. Under tensor
parallelism every rank runs the module on its shard (logits gathered over the group) and the
ranks keep their group's first rank's sampled drafts (:func:`share_first_rank_drafts`).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from runtime.attention.backend import AttentionMetadata
from runtime.distributed import get_parallel_state
from runtime.forward_context import set_forward_context
from runtime.sample.filters import random_sample
from runtime.sample.metadata import step_generator
from runtime.worker.input_batch import table_width


@dataclass(slots=True)
class PassRows:
    """One pass's tokens: request ``r`` (index into the step's states) owns a run of rows."""

    req_index: np.ndarray  # [R] the states that take part
    rows: np.ndarray  # [R] the step-state row of each (the input batch's row)
    starts: np.ndarray  # [R] first position
    counts: np.ndarray  # [R] positions (>= 1)


@dataclass(slots=True)
class DraftRequest:
    """A request that drafts this step: how many, and how to sample them."""

    index: int  # into the step's states
    num_drafts: int
    temperature: float  # 0: greedy
    seed: int | None
    num_output_tokens: int  # before this step (with the seed, names its drafts' generators)


def pass_metadata(backend, rows: PassRows, block_table: np.ndarray, block_size: int, device: torch.device):
    """Attention metadata and (positions, slot mapping) for ``rows`` over the shared block table."""
    num_reqs = len(rows.req_index)
    query_start_loc = np.zeros(num_reqs + 1, dtype=np.int32)
    np.cumsum(rows.counts, out=query_start_loc[1:])
    num_tokens = int(query_start_loc[-1])
    owner = np.repeat(np.arange(num_reqs), rows.counts)
    positions = np.arange(num_tokens, dtype=np.int64) - query_start_loc[:-1][owner] + rows.starts[owner]
    seq_lens = (rows.starts + rows.counts).astype(np.int32)
    table_rows = rows.rows[owner]
    slots = block_table[table_rows, positions // block_size].astype(np.int64) * block_size + positions % block_size
    width = table_width(int(seq_lens.max()), block_size, getattr(backend, "block_table_width_multiple", 1))
    metadata = AttentionMetadata(
        num_reqs=num_reqs,
        num_tokens=num_tokens,
        max_query_len=int(rows.counts.max()),
        max_seq_len=int(seq_lens.max()),
        query_start_loc=torch.from_numpy(query_start_loc).to(device),
        seq_lens=torch.from_numpy(seq_lens).to(device),
        block_table=torch.from_numpy(np.ascontiguousarray(block_table[rows.rows, :width])).to(device),
        slot_mapping=torch.from_numpy(slots).to(device),
        query_start_loc_cpu=query_start_loc,
        seq_lens_cpu=seq_lens,
        block_size=block_size,
    )
    return backend.build_metadata(metadata), positions, query_start_loc


def run_pass(module, backend, kv_caches, rows: PassRows, input_ids: torch.Tensor, hidden: torch.Tensor | None,
             block_table: np.ndarray, block_size: int, device: torch.device):
    """One forward pass of ``module`` on ``rows``; returns (logits hidden, carried hidden, end of each run)."""
    metadata, positions, query_start_loc = pass_metadata(backend, rows, block_table, block_size, device)
    with set_forward_context(backend, metadata, kv_caches):
        out, carry = module(input_ids, torch.from_numpy(positions).to(device), hidden)
    return out, carry, query_start_loc[1:] - 1


def sample_drafts(
    logits: torch.Tensor, requests: list[DraftRequest], draft_index: int
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Draft ``draft_index`` of each request: one per row of ``logits`` [N, V] (row ``i`` for ``requests[i]``).

    Returns (token ids [N] int64, q [N, V] float32 or None when every request is greedy).
    """
    greedy = logits.argmax(dim=-1)
    random_rows = [i for i, r in enumerate(requests) if r.temperature > 0]
    if not random_rows:
        return greedy, None
    temperature = torch.tensor([r.temperature if r.temperature > 0 else 1.0 for r in requests],
                               dtype=torch.float32, device=logits.device)
    probs = torch.softmax(logits.float() / temperature[:, None], dim=-1)
    # A seeded request's draft takes the noise its target position samples with (step_generator at that output
    # position): the rejection sampler keeps the draft where the target's own sample equals it, so a draft model
    # close to the target has its drafts kept about as often as under p / q, and the tokens stay those of no drafts.
    generators = {
        i: step_generator(requests[i].seed, requests[i].num_output_tokens + draft_index, logits.device)
        for i in random_rows if requests[i].seed is not None
    }
    sampled = random_sample(probs, generators)
    is_random = torch.zeros(len(requests), dtype=torch.bool, device=logits.device)
    is_random[random_rows] = True
    tokens = share_first_rank_drafts(torch.where(is_random, sampled, greedy))
    # A greedy request's draft is deterministic: q = 1 for it (the sampler only compares argmaxes).
    one_hot = torch.zeros_like(probs).scatter_(1, greedy[:, None], 1.0)
    return tokens, torch.where(is_random[:, None], probs, one_hot)


def share_first_rank_drafts(tokens: torch.Tensor) -> torch.Tensor:
    """Tensor-parallel ranks keep their group's first rank's sampled drafts (in place).

    Every rank computes the same q (the draft's logits are gathered over the group), but a
    sampled draft is only as equal as the ranks' random generators; the drafts are the target's
    input, whose partial sums the ranks add up, so they must be equal. One small broadcast per
    draft pass with random requests (greedy drafts are argmaxes of equal logits).
    """
    state = get_parallel_state()
    if state.tp_size > 1:
        import torch.distributed as dist

        dist.broadcast(tokens, src=state.pp_rank * state.tp_size, group=state.tp_group)
    return tokens
