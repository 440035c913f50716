"""The decode fast path's metadata: plain greedy rows get what the full build gives them."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from runtime.sample import build_sampling_metadata
from runtime.sample.metadata import greedy_metadata, is_plain_greedy
from runtime.sampling_params import SamplingParams


def test_greedy_metadata_equals_the_full_build():
    rows = [SamplingParams(temperature=0.0, seed=7), SamplingParams(temperature=0.0, max_tokens=3, stop_token_ids=[5])]
    assert all(is_plain_greedy(p) for p in rows)
    built = build_sampling_metadata(rows, [[1, 2], [3]], [[4], []], [None, None], 50, torch.device("cpu"))
    assert dataclasses.asdict(greedy_metadata(2)) == dataclasses.asdict(built)


@pytest.mark.parametrize(
    "changes",
    [
        {"temperature": 0.7},
        {"presence_penalty": 0.5},
        {"frequency_penalty": -0.5},
        {"repetition_penalty": 1.2},
        {"logit_bias": {3: 1.0}},
        {"min_tokens": 2},
        {"logprobs": 0},
        {"prompt_logprobs": 1},
    ],
)
def test_anything_that_touches_the_logits_is_not_plain(changes):
    assert not is_plain_greedy(SamplingParams(**{"temperature": 0.0, **changes}))
