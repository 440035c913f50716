"""Speculative decoding's verification: the rejection sampler.

A proposer drafted ``k_i`` tokens for request ``i``; the target model ran on ``1 + k_i``
positions of it. The rejection sampler keeps the longest prefix of drafts the target
agrees with and adds one token of the target's own, so a request emits between 1 and
``k_i + 1`` tokens per step, distributed exactly as if the target had sampled them one by
one (Leviathan et al. 2023, "Fast Inference from Transformers via Speculative Decoding";
Chen et al. 2023, "Accelerating LLM decoding with speculative sampling").

Layout (vLLM V1's): requests in batch order, request ``i`` with ``k_i >= 0`` drafts.

* ``logits`` [sum(k_i + 1), V]: request ``i`` owns rows ``row_start[i] .. row_start[i] + k_i``
  where ``row_start[i] = sum_{j<i} (k_j + 1)``; its row ``row_start[i] + j`` (j < k_i) is the
  target's distribution for draft ``j``, its last row the one for the bonus token.
* ``draft_token_ids`` [sum(k_i)]: the drafts, request-major (request ``i``'s drafts start at
  ``cu_num_draft_tokens[i - 1]``, the exclusive prefix sum of ``num_draft_tokens``).
* ``draft_probs`` [sum(k_i), V] or None: the proposal distribution q of each draft, rows as
  ``draft_token_ids``; None means q = 1 for the drafted token (ngram, greedy drafts).
* ``metadata``: the :class:`SamplingMetadata` of the requests, one row per request, the same
  as the normal :class:`Sampler` gets (``generators`` keyed by request row).

The target distribution p of every position is processed exactly as the :class:`Sampler`
processes a row: logit_bias, the min_tokens mask and the penalties (position ``j`` counts the
request's first ``j`` drafts as output tokens, as sequential decoding would), then for random
rows temperature, top-k, top-p (the platform's ``top_k_top_p`` op under the same condition)
and min-p. Greedy rows (temperature below ``MIN_TEMPERATURE``) take the argmax of the
processed logits.

* Greedy request: drafts are kept while each equals the target's argmax at its position; the
  first mismatch is replaced by the argmax; when all match, the argmax of the bonus row follows.
* Random request: draft ``x`` at position ``j`` is accepted with probability
  ``min(1, p_j(x) / q_j(x))``; at the first rejection the token is drawn from
  ``normalize(max(p_j - q_j, 0))`` and the rest are dropped; when all are accepted the bonus
  token is drawn from ``p_k``. A seeded request draws its uniforms (one per draft) and its
  final token's noise from its own generator only, so they do not depend on the rest of the
  batch; with no drafts it consumes the generator exactly as the :class:`Sampler` does (same token).
* Seeded request whose position the metadata names (``metadata.seeds``, as the model runner
  gives it), whatever its drafts' q: position ``j`` samples its own token
  ``s_j`` from ``p_j`` with the noise of :func:`step_generator` at its output position, as the
  :class:`Sampler` would there; drafts are kept while ``s_j`` equals them and the first ``s_j``
  that differs (or the bonus position's) follows. For q one-hot this is the rule above (``x`` is
  kept with probability ``p_j(x)``, and a rejection draws from ``p_j`` without ``x``, the
  residual), and it emits exactly the tokens the request would get without drafts. So its tokens
  depend neither on the batch nor on how many drafts a step verifies (which the token budget and
  free blocks decide). With a draft distribution q (a draft model) the rule is a coupling
  rather than the ``p / q`` test: the draft passes sample a seeded request's draft ``j`` with
  that same noise (``argmax q_j / E_j`` against the target's ``argmax p_j / E_j``), so a draft
  model whose q is close to p is kept often, and one whose q equals p always.

Logprobs follow the :class:`Sampler`: the log_softmax of the logits as given (before
penalties and temperature), one row per emitted token (see :class:`RejectionSamplerOutput`).

One known approximation: ``SamplingMetadata`` carries the min_tokens stop mask, not the
counts, so a request short of ``min_tokens`` has its stop tokens masked at all of its
positions. It is exact when the caller drafts at most ``min_tokens - num_output_tokens - 1``
tokens for such a request (see :func:`max_drafts_for_min_tokens`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn

from runtime.sample.filters import (
    MIN_TEMPERATURE,
    random_sample,
)
from runtime.sample.logprobs import LogprobsTensors, gather_logprobs
from runtime.sample.metadata import SamplingMetadata, step_generator
from runtime.sample.sampler import Sampler
from runtime.sample.spec_layout import SpecDecodeLayout, expand_metadata, flatten_drafts

__all__ = ["PLACEHOLDER_TOKEN_ID", "RejectionSampler", "RejectionSamplerOutput", "SpecDecodeLayout", "expand_metadata",
           "flatten_drafts", "max_drafts_for_min_tokens"]

PLACEHOLDER_TOKEN_ID = -1  # fills output_token_ids after each request's emitted tokens


@dataclass(slots=True)
class RejectionSamplerOutput:
    """What one verification step emits.

    ``output_token_ids[i, :num_accepted[i]]`` are request ``i``'s accepted drafts and
    ``output_token_ids[i, num_accepted[i]]`` the recovered token (first rejection, or the
    target's argmax at a greedy mismatch) or the bonus token (all accepted); the rest of the
    row is ``PLACEHOLDER_TOKEN_ID``.
    """

    output_token_ids: torch.Tensor  # [num_reqs, max_k + 1] int64
    num_accepted: torch.Tensor  # [num_reqs] int64, accepted drafts (emitted = num_accepted + 1)
    # One row per emitted token, request-major then position (request i contributes
    # num_accepted[i] + 1 consecutive rows); K = metadata.max_num_logprobs. None if no row
    # wants logprobs.
    logprobs: LogprobsTensors | None

    def token_lists(self) -> list[list[int]]:
        """Each request's emitted tokens as a Python list (one device sync)."""
        rows = torch.cat([self.num_accepted[:, None], self.output_token_ids], dim=1).tolist()
        return [row[1 : row[0] + 2] for row in rows]


def max_drafts_for_min_tokens(min_tokens: int, num_output_tokens: int, k: int) -> int:
    """The most drafts that keep the min_tokens stop mask exact for a request this step."""
    if num_output_tokens >= min_tokens:
        return k
    return max(0, min(k, min_tokens - num_output_tokens - 1))


class RejectionSampler(nn.Module):
    def __init__(self):
        super().__init__()
        # p of random rows comes from the Sampler's own filters, and greedy rows take its argmax (the
        # platform's top-k/top-p and argmax ops when built inside a custom_ops_scope offering them).
        self.sampler = Sampler()

    def forward(
        self,
        logits: torch.Tensor,
        draft_token_ids: torch.Tensor,
        num_draft_tokens: Sequence[int] | torch.Tensor,
        metadata: SamplingMetadata,
        draft_probs: torch.Tensor | None = None,
    ) -> RejectionSamplerOutput:
        """Verify the drafts of one step; shapes and semantics in the module docstring.

        logits: [sum(k_i + 1), V] any float dtype; draft_token_ids: [sum(k_i)] int;
        num_draft_tokens: k_i per request (a list, or a CPU tensor); metadata: one row per
        request; draft_probs: [sum(k_i), V] or None (q = 1 for the drafted token).
        """
        device = logits.device
        layout = SpecDecodeLayout.build(num_draft_tokens, device)
        self._check_inputs(logits, draft_token_ids, layout, metadata, draft_probs)
        num_reqs = metadata.num_rows
        vocab_size = logits.shape[1]
        draft_token_ids = draft_token_ids.to(device=device, dtype=torch.int64)

        logits = logits.to(torch.float32)
        raw_logprobs = logits.log_softmax(dim=1) if metadata.max_num_logprobs is not None else None
        rows_md = expand_metadata(metadata, layout, draft_token_ids, vocab_size)
        logits = Sampler.process_logits(logits, rows_md)  # [T, V]

        if metadata.all_greedy:
            is_greedy = torch.ones(num_reqs, dtype=torch.bool, device=device)
        else:
            assert metadata.temperature is not None
            is_greedy = metadata.temperature < MIN_TEMPERATURE  # [R]
        argmax = None if metadata.all_random else self.sampler.argmax(logits)  # [T]
        probs = None if metadata.all_greedy else self.target_probs(logits, rows_md)  # [T, V]

        # Seeded rows named by position: each position's own sample (see the module docstring).
        positional = {} if probs is None else self._positional_samples(probs, layout, metadata)
        generators = {row: g for row, g in metadata.generators.items() if row not in positional}
        # Accept or reject every draft at once; a request keeps the prefix before its first rejection.
        accepted = torch.zeros(layout.num_drafts, dtype=torch.bool, device=device)
        if argmax is not None:
            accepted = draft_token_ids == argmax[layout.draft_rows]
        if probs is not None:
            p_draft = probs[layout.draft_rows, draft_token_ids]  # [D]
            if draft_probs is None:
                q_draft = torch.ones_like(p_draft)
            else:
                q_draft = draft_probs.to(torch.float32).gather(1, draft_token_ids[:, None]).squeeze(1)
            uniform = self._uniforms(layout, generators)  # [D]
            # u < p / q, written without a division: q = 0 accepts any p > 0, p = 0 never accepts.
            random_accepted = uniform * q_draft < p_draft
            accepted = torch.where(is_greedy[layout.draft_req], accepted, random_accepted)
            for row, (start, samples) in positional.items():
                count = samples.shape[0] - 1
                accepted[start : start + count] = samples[:count] == draft_token_ids[start : start + count]
        accept_matrix = torch.zeros(num_reqs, max(layout.max_k, 1), dtype=torch.int64, device=device)
        accept_matrix[layout.draft_req, layout.draft_pos] = accepted.to(torch.int64)
        num_accepted = accept_matrix.cumprod(dim=1).sum(dim=1)  # [R]
        final_rows = layout.row_start + num_accepted  # [R] the row of the recovered / bonus token

        final = None if argmax is None else argmax[final_rows]
        if probs is not None:
            final_probs = probs[final_rows]  # [R, V]
            rejected = num_accepted < layout.num_draft_tokens  # [R]
            if layout.num_drafts > 0:
                # q of the rejected draft (clamped index for requests that rejected none).
                rejected_draft = (layout.draft_start + num_accepted).clamp(max=layout.num_drafts - 1)
                if draft_probs is None:
                    q = torch.zeros_like(final_probs)
                    q.scatter_(1, draft_token_ids[rejected_draft][:, None], 1.0)
                else:
                    q = draft_probs.to(torch.float32)[rejected_draft]
                residual = (final_probs - q).clamp(min=0.0)
                # Rounding can leave no mass when p ~ q; p itself is then the residual's limit.
                usable = rejected & (residual.sum(dim=1) > 0)
                final_probs = torch.where(usable[:, None], residual, final_probs)
            # random_sample draws from unnormalised weights (the exponential race is scale-free).
            sampled = random_sample(final_probs, generators)  # [R]
            for row, (_, samples) in positional.items():
                sampled[row] = samples[num_accepted[row]]
            final = sampled if final is None else torch.where(is_greedy, final, sampled)
        assert final is not None

        output = torch.full((num_reqs, layout.max_k + 1), PLACEHOLDER_TOKEN_ID, dtype=torch.int64, device=device)
        kept = layout.draft_pos < num_accepted[layout.draft_req]
        output[layout.draft_req, layout.draft_pos] = torch.where(kept, draft_token_ids, PLACEHOLDER_TOKEN_ID)
        output.scatter_(1, num_accepted[:, None], final[:, None])

        logprobs = None
        if raw_logprobs is not None:
            emitted = (layout.row_pos <= num_accepted[layout.row_req]).nonzero().squeeze(1)  # [E]
            chosen = output[layout.row_req[emitted], layout.row_pos[emitted]]
            logprobs = gather_logprobs(raw_logprobs[emitted], metadata.max_num_logprobs, chosen)
        return RejectionSamplerOutput(output_token_ids=output, num_accepted=num_accepted, logprobs=logprobs)

    def target_probs(self, logits: torch.Tensor, metadata: SamplingMetadata) -> torch.Tensor:
        """The random rows' distribution p: the Sampler's filters in the Sampler's order, then softmax.

        logits: [N, V] float32 after :meth:`Sampler.process_logits`; metadata: one row per logits row.
        """
        return self.sampler.random_probs(logits, metadata)

    @staticmethod
    def _positional_samples(
        probs: torch.Tensor, layout: SpecDecodeLayout, metadata: SamplingMetadata
    ) -> dict[int, tuple[int, torch.Tensor]]:
        """Request row -> (its first draft's index, its token at each of its ``k + 1`` positions), for the
        seeded rows of ``metadata.seeds``: position ``j`` draws as :func:`random_sample` draws with
        ``step_generator(seed, output position + j)``, the generator the Sampler takes there."""
        if not metadata.seeds:
            return {}
        counts = layout.num_draft_tokens.tolist()
        row_starts = layout.row_start.tolist()
        draft_starts = layout.draft_start.tolist()
        result = {}
        for row, (seed, position) in metadata.seeds.items():
            rows = probs[row_starts[row] : row_starts[row] + counts[row] + 1]  # [k + 1, V]
            noise = torch.empty_like(rows)
            for j in range(rows.shape[0]):
                noise[j].exponential_(generator=step_generator(seed, position + j, probs.device))
            noise.clamp_(min=torch.finfo(noise.dtype).tiny)
            result[row] = (draft_starts[row], rows.div(noise).argmax(dim=1))
        return result

    @staticmethod
    def _uniforms(layout: SpecDecodeLayout, generators: dict[int, torch.Generator]) -> torch.Tensor:
        """One U[0, 1) per draft; a seeded request's come from its own generator, in order."""
        uniform = torch.empty(layout.num_drafts, dtype=torch.float32, device=layout.draft_req.device)
        if len(generators) < layout.num_rows - layout.num_drafts:
            uniform.uniform_()
        if generators:
            starts = layout.draft_start.tolist()
            counts = layout.num_draft_tokens.tolist()
            for row, generator in generators.items():
                if counts[row]:
                    uniform[starts[row] : starts[row] + counts[row]].uniform_(generator=generator)
        return uniform

    @staticmethod
    def _check_inputs(
        logits: torch.Tensor,
        draft_token_ids: torch.Tensor,
        layout: SpecDecodeLayout,
        metadata: SamplingMetadata,
        draft_probs: torch.Tensor | None,
    ) -> None:
        num_reqs = layout.num_rows - layout.num_drafts
        if metadata.num_rows != num_reqs:
            raise ValueError(f"metadata has {metadata.num_rows} rows for {num_reqs} requests (one row per request)")
        if logits.dim() != 2 or logits.shape[0] != layout.num_rows:
            raise ValueError(
                f"logits must be [sum(num_draft_tokens) + num_reqs = {layout.num_rows}, vocab_size], "
                f"got {list(logits.shape)}"
            )
        if draft_token_ids.dim() != 1 or draft_token_ids.shape[0] != layout.num_drafts:
            raise ValueError(
                f"draft_token_ids must be [sum(num_draft_tokens) = {layout.num_drafts}], got {list(draft_token_ids.shape)}"
            )
        if draft_probs is not None and tuple(draft_probs.shape) != (layout.num_drafts, logits.shape[1]):
            raise ValueError(
                f"draft_probs must be [sum(num_draft_tokens) = {layout.num_drafts}, vocab_size = {logits.shape[1]}], "
                f"got {list(draft_probs.shape)}"
            )
