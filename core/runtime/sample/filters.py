"""Random sampling: temperature, top-k / top-p / min-p filtering and the draw.

A filtered-out token gets a logit of -inf. Each function returns a new tensor.
"""

from __future__ import annotations

import torch

MIN_TEMPERATURE = 1e-5  # below this a row is greedy (SamplingParams agrees)


def apply_temperature(logits: torch.Tensor, temperature: torch.Tensor) -> torch.Tensor:
    """Divide each row by its temperature; greedy rows (0) are left as they are.

    logits: [N, V]; temperature: [N].
    """
    safe = torch.where(temperature < MIN_TEMPERATURE, 1.0, temperature)  # [N]
    return logits / safe[:, None]


def apply_top_k(logits: torch.Tensor, top_k: torch.Tensor, max_top_k: int) -> torch.Tensor:
    """Keep the k largest logits of each row (0 = keep all), without a full sort.

    Tokens tied with the k-th largest logit are kept too. logits: [N, V]; top_k: [N].
    """
    assert 0 < max_top_k <= logits.shape[1]
    largest = logits.topk(max_top_k, dim=1).values  # [N, max_top_k], descending
    kth_index = (top_k.clamp(min=1) - 1)[:, None]  # [N, 1]
    threshold = largest.gather(1, kth_index)  # [N, 1]
    threshold = threshold.masked_fill(top_k[:, None] == 0, float("-inf"))
    return logits.masked_fill(logits < threshold, float("-inf"))


def apply_top_p(logits: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Keep the smallest set of most likely tokens whose probability sums to >= p.

    logits: [N, V]; top_p: [N] (1.0 = keep all).
    """
    sorted_logits, order = logits.sort(dim=1)  # ascending, [N, V]
    cumulative = sorted_logits.softmax(dim=1).cumsum(dim=1)  # [N, V]
    # Drop a token when the tokens above it already hold at least p.
    drop = cumulative <= (1.0 - top_p)[:, None]
    drop[:, -1] = False  # the most likely token always stays
    sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    return torch.empty_like(logits).scatter_(1, order, sorted_logits)


def apply_min_p(logits: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Drop tokens whose probability is below ``min_p`` times the row's largest.

    logits: [N, V]; min_p: [N] (0.0 = keep all).
    """
    probs = logits.softmax(dim=1)  # [N, V]
    threshold = probs.amax(dim=1, keepdim=True) * min_p[:, None]  # [N, 1]
    return logits.masked_fill(probs < threshold, float("-inf"))


def random_sample(probs: torch.Tensor, generators: dict[int, torch.Generator]) -> torch.Tensor:
    """Draw one token per row from ``probs`` [N, V] -> [N] int64.

    Uses the exponential race: ``argmax(probs / E)`` with ``E ~ Exponential(1)``
    picks token i with probability probs[i]. A seeded row draws its noise from its
    own generator only, so its tokens do not depend on the rest of the batch.
    """
    noise = torch.empty_like(probs)  # [N, V]
    if len(generators) < probs.shape[0]:
        noise.exponential_()
    for row, generator in generators.items():
        noise[row].exponential_(generator=generator)
    # Exponential noise can be exactly 0; keep the division finite.
    noise.clamp_(min=torch.finfo(noise.dtype).tiny)
    return probs.div(noise).argmax(dim=1)
