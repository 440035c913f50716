"""Batched sampling parameters of one step, built from the rows' SamplingParams.

The model runner builds one :class:`SamplingMetadata` per step for the rows that
produce a token (batch order). Everything a row does not use stays ``None`` so the
common case, all greedy with no penalties, costs one small loop and no tensors.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from runtime.sample.upload import upload
from runtime.sampling_params import SamplingParams


@dataclass(slots=True)
class SamplingMetadata:
    num_rows: int
    all_greedy: bool
    all_random: bool
    # [N] float32, 0.0 for greedy rows; None when every row is greedy.
    temperature: torch.Tensor | None
    # [N] int64, 0 = off, clamped to the vocabulary; None when no row uses top-k.
    top_k: torch.Tensor | None
    max_top_k: int  # largest top_k of the batch, 0 when top_k is None
    top_p: torch.Tensor | None  # [N] float32, 1.0 = off
    top_k_bounds_top_p: bool  # every row with top_p < 1 also has top_k > 0 (True without top-p)
    min_p: torch.Tensor | None  # [N] float32, 0.0 = off
    presence_penalties: torch.Tensor | None  # [N] float32, 0.0 = off
    frequency_penalties: torch.Tensor | None  # [N] float32, 0.0 = off
    repetition_penalties: torch.Tensor | None  # [N] float32, 1.0 = off
    # [N, P] int64 padded with vocab_size; only when a row uses repetition_penalty.
    prompt_token_ids: torch.Tensor | None
    # [N, O] int64 padded with vocab_size; only when a row uses any penalty.
    output_token_ids: torch.Tensor | None
    # logit_bias as three [B] tensors: logits[rows, token_ids] += values.
    logit_bias: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None
    # min_tokens (and bad words) as two [S] tensors: logits[rows, token_ids] = -inf.
    min_tokens_mask: tuple[torch.Tensor, torch.Tensor] | None
    # allowed_token_ids as rows [A] and a bool mask [A, V] of the tokens each may sample (the others get -inf).
    allowed_tokens: tuple[torch.Tensor, torch.Tensor] | None = None
    # row index -> the request's generator, for seeded random rows only.
    generators: dict[int, torch.Generator] = field(default_factory=dict)
    # row index -> (seed, output position of the row's token), for seeded random rows whose caller names the position
    # (the model runner): a token at a later position (a speculative step's) draws from step_generator(seed, position).
    seeds: dict[int, tuple[int, int]] = field(default_factory=dict)
    max_num_logprobs: int | None = None  # max of params.logprobs; None if no row wants them

    @property
    def no_penalties(self) -> bool:
        return self.output_token_ids is None


def step_generator(seed: int, num_output_tokens: int, device: torch.device) -> torch.Generator:
    """A generator for one sampled position of a seeded request.

    Deriving it from (seed, position) keeps seeded outputs identical whatever the
    batch, across preemption and recompute, and with or without speculative drafts.
    """
    return torch.Generator(device=device).manual_seed(hash((seed, num_output_tokens)) & 0x7FFF_FFFF_FFFF_FFFF)


def is_plain_greedy(params: SamplingParams) -> bool:
    """Greedy with nothing that changes the logits or reads them back (penalties, logit_bias,
    min_tokens, logprobs, prompt logprobs): the row needs only the argmax."""
    return (
        params.is_greedy
        and params.presence_penalty == 0.0
        and params.frequency_penalty == 0.0
        and params.repetition_penalty == 1.0
        and not params.logit_bias
        and params.allowed_token_ids is None
        and not params.bad_words_token_ids
        and params.min_tokens == 0
        and params.logprobs is None
        and params.prompt_logprobs is None
    )


def greedy_metadata(num_rows: int) -> SamplingMetadata:
    """What :func:`build_sampling_metadata` gives for ``num_rows`` plain greedy rows, without
    looking at them (the common decode step; see :func:`is_plain_greedy`)."""
    return SamplingMetadata(
        num_rows=num_rows, all_greedy=True, all_random=num_rows == 0, temperature=None, top_k=None, max_top_k=0,
        top_p=None, top_k_bounds_top_p=True, min_p=None, presence_penalties=None, frequency_penalties=None,
        repetition_penalties=None, prompt_token_ids=None, output_token_ids=None, logit_bias=None, min_tokens_mask=None,
    )


def build_sampling_metadata(
    params: list[SamplingParams],
    prompt_token_ids: list[list[int]],
    output_token_ids: list[list[int]],
    generators: list[torch.Generator | None],
    vocab_size: int,
    device: torch.device,
    seeds: list[tuple[int, int] | None] | None = None,
) -> SamplingMetadata:
    """Batch the rows' parameters; rows are in the order of the logits rows. ``seeds``: per row, the
    (seed, output position) its generator was made from (:func:`step_generator`), or None."""
    num_rows = len(params)
    assert len(prompt_token_ids) == len(output_token_ids) == len(generators) == num_rows
    is_greedy = [p.is_greedy for p in params]
    all_greedy = all(is_greedy)
    random_params = [p for p, greedy in zip(params, is_greedy) if not greedy]

    def floats(values: list[float]) -> torch.Tensor:
        return upload(values, torch.float32, device)

    temperature = top_k = top_p = min_p = None
    max_top_k = 0
    if not all_greedy:
        temperature = floats([0.0 if g else p.temperature for p, g in zip(params, is_greedy)])
        if any(p.top_k > 0 for p in random_params):
            ks = [min(p.top_k, vocab_size) if not g else 0 for p, g in zip(params, is_greedy)]
            top_k = upload(ks, torch.int64, device)
            max_top_k = max(ks)
        if any(p.top_p < 1.0 for p in random_params):
            top_p = floats([1.0 if g else p.top_p for p, g in zip(params, is_greedy)])
        if any(p.min_p > 0.0 for p in random_params):
            min_p = floats([0.0 if g else p.min_p for p, g in zip(params, is_greedy)])

    presence = frequency = repetition = prompt_ids = output_ids = None
    if any(p.presence_penalty != 0.0 for p in params):
        presence = floats([p.presence_penalty for p in params])
    if any(p.frequency_penalty != 0.0 for p in params):
        frequency = floats([p.frequency_penalty for p in params])
    if any(p.repetition_penalty != 1.0 for p in params):
        repetition = floats([p.repetition_penalty for p in params])
        prompt_ids = _pad(prompt_token_ids, vocab_size, device)
    if presence is not None or frequency is not None or repetition is not None:
        output_ids = _pad(output_token_ids, vocab_size, device)

    logprob_counts = [p.logprobs for p in params if p.logprobs is not None]
    return SamplingMetadata(
        num_rows=num_rows,
        all_greedy=all_greedy,
        all_random=not any(is_greedy),
        temperature=temperature,
        top_k=top_k,
        max_top_k=max_top_k,
        top_p=top_p,
        top_k_bounds_top_p=all(p.top_k > 0 for p in random_params if p.top_p < 1.0),
        min_p=min_p,
        presence_penalties=presence,
        frequency_penalties=frequency,
        repetition_penalties=repetition,
        prompt_token_ids=prompt_ids,
        output_token_ids=output_ids,
        logit_bias=_logit_bias(params, vocab_size, device),
        min_tokens_mask=_banned_tokens(params, output_token_ids, vocab_size, device),
        allowed_tokens=_allowed_tokens(params, vocab_size, device),
        generators={i: g for i, g in enumerate(generators) if g is not None and not is_greedy[i]},
        seeds={i: key for i, key in enumerate(seeds or ()) if key is not None and not is_greedy[i]},
        max_num_logprobs=max(logprob_counts) if logprob_counts else None,
    )


def _pad(rows: list[list[int]], vocab_size: int, device: torch.device) -> torch.Tensor:
    """Right-pad token id lists with ``vocab_size`` into one [N, max_len] tensor."""
    width = max((len(r) for r in rows), default=0)
    padded = np.full((len(rows), width), vocab_size, dtype=np.int64)
    for i, row in enumerate(rows):
        padded[i, : len(row)] = row
    return upload(padded, torch.int64, device)


def _logit_bias(
    params: list[SamplingParams], vocab_size: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    rows: list[int] = []
    token_ids: list[int] = []
    values: list[float] = []
    for i, p in enumerate(params):
        for token_id, bias in (p.logit_bias or {}).items():
            if not 0 <= token_id < vocab_size:
                raise ValueError(f"logit_bias token id {token_id} is out of the vocabulary [0, {vocab_size})")
            rows.append(i)
            token_ids.append(token_id)
            values.append(bias)
    if not rows:
        return None
    return (
        upload(rows, torch.int64, device),
        upload(token_ids, torch.int64, device),
        upload(values, torch.float32, device),
    )


def _allowed_tokens(
    params: list[SamplingParams], vocab_size: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(rows, [rows, V] mask of the tokens they may sample) for the rows with allowed_token_ids."""
    rows = [i for i, p in enumerate(params) if p.allowed_token_ids is not None]
    if not rows:
        return None
    mask = np.zeros((len(rows), vocab_size), dtype=np.bool_)
    for r, i in enumerate(rows):
        mask[r, params[i].allowed_token_ids] = True  # in range: the input processor checked them
    return upload(rows, torch.int64, device), torch.from_numpy(mask).to(device)


def _banned_tokens(
    params: list[SamplingParams], output_token_ids: list[list[int]], vocab_size: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(row, token) pairs to forbid: stop tokens of rows still short of min_tokens, and the token that would
    complete one of a row's bad words (its output ends with all of the word's tokens but the last)."""
    rows: list[int] = []
    token_ids: list[int] = []
    for i, (p, output) in enumerate(zip(params, output_token_ids)):
        for sequence in p.bad_words_token_ids:
            prefix = len(sequence) - 1
            if sequence[-1] < vocab_size and (prefix == 0 or (len(output) >= prefix and list(output[-prefix:]) == sequence[:-1])):
                rows.append(i)
                token_ids.append(sequence[-1])
        if len(output) >= p.min_tokens:
            continue
        # A stop id outside the logits can never be produced, so it needs no mask.
        stop_ids = [t for t in p.all_stop_token_ids if t < vocab_size]
        rows.extend([i] * len(stop_ids))
        token_ids.extend(stop_ids)
    if not rows:
        return None
    return (
        upload(rows, torch.int64, device),
        upload(token_ids, torch.int64, device),
    )
