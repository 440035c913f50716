"""The sampler: one token per row from the logits of one step.

Order (steps 1-3 as in vLLM V1):
1. raw logprobs: log_softmax of the logits as given, if any row wants logprobs;
2. logit_bias, the min_tokens stop mask, then the penalties (every row);
3. greedy rows take the argmax;
4. random rows: temperature, top-k, top-p, min-p, softmax, then one draw. This is transformers'
   order of its warpers; vLLM V1 applies min-p before top-k/top-p, so with min-p and top-p
   together the kept tokens may differ from vLLM's.

Top-p sorts each row, unless the platform offers a ``top_k_top_p`` op
(``runtime.models.ops``) and every row that top-p filters also has a top-k: then the
kept tokens all lie among the ``max_top_k`` largest and one partial selection does.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from runtime.sample.filters import (
    MIN_TEMPERATURE,
    apply_min_p,
    apply_temperature,
    apply_top_k,
    apply_top_p,
    random_sample,
)
from runtime.models.ops import lookup
from runtime.sample.logprobs import LogprobsTensors, gather_logprobs
from runtime.sample.metadata import SamplingMetadata
from runtime.sample.penalties import apply_logit_bias, apply_min_tokens_mask, apply_penalties


@dataclass(slots=True)
class SamplerOutput:
    sampled_token_ids: torch.Tensor  # [N] int64
    logprobs: LogprobsTensors | None  # K = metadata.max_num_logprobs; None if no row wants them


class Sampler(nn.Module):
    def __init__(self):
        super().__init__()
        # The platform's sort-free top-k + top-p, if built inside a custom_ops_scope offering one.
        self.top_k_top_p = lookup("top_k_top_p")
        self.argmax = lookup("argmax") or (lambda logits: logits.argmax(dim=1))

    def forward(self, logits: torch.Tensor, metadata: SamplingMetadata) -> SamplerOutput:
        """logits: [N, V] in any float dtype, rows in the order of ``metadata``."""
        assert logits.shape[0] == metadata.num_rows, (logits.shape, metadata.num_rows)
        if self.argmax_only(metadata):  # in the logits' own dtype: widening cannot change an argmax
            return SamplerOutput(sampled_token_ids=self.argmax(logits), logprobs=None)
        logits = logits.to(torch.float32)
        raw_logprobs = None
        if metadata.max_num_logprobs is not None:
            raw_logprobs = logits.log_softmax(dim=1)  # [N, V]
        logits = self.process_logits(logits, metadata)
        sampled = self.sample(logits, metadata)
        logprobs = None
        if raw_logprobs is not None:
            logprobs = gather_logprobs(raw_logprobs, metadata.max_num_logprobs, sampled)
        return SamplerOutput(sampled_token_ids=sampled, logprobs=logprobs)

    @staticmethod
    def argmax_only(metadata: SamplingMetadata) -> bool:
        """Every row greedy, with nothing that changes the logits or reads them back."""
        return (metadata.all_greedy and metadata.num_rows > 0 and metadata.max_num_logprobs is None
                and metadata.logit_bias is None and metadata.min_tokens_mask is None and metadata.allowed_tokens is None
                and metadata.no_penalties)

    @staticmethod
    def process_logits(logits: torch.Tensor, metadata: SamplingMetadata) -> torch.Tensor:
        """Apply allowed_token_ids, logit_bias, min_tokens and the penalties. logits: [N, V] float32."""
        if metadata.allowed_tokens is not None:
            rows, allowed = metadata.allowed_tokens
            logits = logits.index_put((rows,), logits[rows].masked_fill(~allowed, float("-inf")))
        if metadata.logit_bias is not None:
            logits = apply_logit_bias(logits, metadata.logit_bias)
        if metadata.min_tokens_mask is not None:
            logits = apply_min_tokens_mask(logits, metadata.min_tokens_mask)
        if not metadata.no_penalties:
            logits = apply_penalties(
                logits,
                metadata.prompt_token_ids,
                metadata.output_token_ids,
                metadata.presence_penalties,
                metadata.frequency_penalties,
                metadata.repetition_penalties,
            )
        return logits

    def random_probs(self, logits: torch.Tensor, metadata: SamplingMetadata) -> torch.Tensor:
        """The distribution random rows draw from: temperature, top-k, top-p, min-p, then softmax.

        logits: [N, V] float32 after :meth:`process_logits`; metadata: one row per logits row.
        """
        assert metadata.temperature is not None
        logits = apply_temperature(logits, metadata.temperature)
        if self.top_k_top_p is not None and metadata.top_k is not None and metadata.top_k_bounds_top_p:
            logits = self.top_k_top_p(logits, metadata.top_k, metadata.top_p, metadata.max_top_k)
        else:
            if metadata.top_k is not None:
                logits = apply_top_k(logits, metadata.top_k, metadata.max_top_k)
            if metadata.top_p is not None:
                logits = apply_top_p(logits, metadata.top_p)
        if metadata.min_p is not None:
            logits = apply_min_p(logits, metadata.min_p)
        return logits.softmax(dim=1)

    def sample(self, logits: torch.Tensor, metadata: SamplingMetadata) -> torch.Tensor:
        """Greedy rows take the argmax, random rows draw. logits: [N, V] -> [N] int64."""
        greedy = None if metadata.all_random else self.argmax(logits)  # [N]
        if metadata.all_greedy:
            return greedy
        sampled = random_sample(self.random_probs(logits, metadata), metadata.generators)  # [N]
        if greedy is None:
            return sampled
        return torch.where(metadata.temperature < MIN_TEMPERATURE, greedy, sampled)
