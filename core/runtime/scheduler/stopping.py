"""Per-token stop checks and the speculative-decoding counters of the scheduler."""

from __future__ import annotations

import itertools

from runtime.messages import LogprobsLists
from runtime.scheduler.request import Request, RequestStatus


def check_stop(request: Request, max_model_len: int) -> bool:
    """Set the finished status if the last sampled token ends the request."""
    token = request.output_token_ids[-1]
    num_output = len(request.output_token_ids)
    if token in request.stop_ids and num_output >= request.sampling_params.min_tokens:
        request.status = RequestStatus.FINISHED_STOPPED
        if request.sampling_params.ignore_eos or token not in request.eos_token_ids:
            request.stop_reason = token  # a stop_token_ids entry; EOS leaves no stop reason
        return True
    if num_output >= request.max_tokens or request.num_tokens >= max_model_len:
        request.status = RequestStatus.FINISHED_LENGTH
        return True
    return False


class SpecDecodeStats:
    """Cumulative speculative-decoding counts (vLLM's spec_decode metrics).

    A draft is one request's drafts verified in one step; ``num_accepted_per_pos[j]``
    counts drafts whose position ``j`` was accepted.
    """

    __slots__ = ("num_drafts", "num_draft_tokens", "num_accepted_tokens", "num_accepted_per_pos")

    def __init__(self, num_speculative_tokens: int):
        self.num_drafts = 0
        self.num_draft_tokens = 0
        self.num_accepted_tokens = 0
        self.num_accepted_per_pos = [0] * num_speculative_tokens

    def observe(self, num_draft_tokens: int, num_accepted: int) -> None:
        self.num_drafts += 1
        self.num_draft_tokens += num_draft_tokens
        self.num_accepted_tokens += num_accepted
        per_pos = self.num_accepted_per_pos
        if num_accepted > len(per_pos):
            per_pos.extend([0] * (num_accepted - len(per_pos)))
        for j in range(num_accepted):
            per_pos[j] += 1

    def as_dict(self) -> dict:
        return {
            "spec_decode_num_drafts": self.num_drafts,
            "spec_decode_num_draft_tokens": self.num_draft_tokens,
            "spec_decode_num_accepted_tokens": self.num_accepted_tokens,
            "spec_decode_num_accepted_tokens_per_pos": list(self.num_accepted_per_pos),
        }


def join_logprobs(chunks: list[LogprobsLists]) -> LogprobsLists:
    return LogprobsLists(
        token_ids=list(itertools.chain.from_iterable(c.token_ids for c in chunks)),
        logprobs=list(itertools.chain.from_iterable(c.logprobs for c in chunks)),
        ranks=list(itertools.chain.from_iterable(c.ranks for c in chunks)),
    )
