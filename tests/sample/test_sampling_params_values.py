"""SamplingParams refuses values that would turn logits into NaN (and NaN logits sample any token), and
non-numbers, with a ValueError naming the field and the value."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from runtime.sampling_params import SamplingParams


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(temperature=math.inf), r"temperature must be finite \(at most 3.4e38, the largest float32\), got inf"),
        (dict(temperature=1e39), "temperature must be finite .*, got 1e\\+39"),  # inf once float32
        (dict(repetition_penalty=math.inf), "repetition_penalty must be finite .*, got inf"),
        (dict(logit_bias={7: math.nan}), r"logit_bias must be finite .* or -inf \(to ban a token\), got nan for token 7"),
        (dict(logit_bias={7: math.inf}), "got inf for token 7"),
        (dict(logit_bias={7: 1e39}), "got 1e\\+39 for token 7"),
        (dict(logit_bias={"seven": 1.0}), "logit_bias must map token ids to numbers"),
        (dict(temperature="0.5"), "temperature must be a number, got '0.5'"),
        (dict(presence_penalty=None), "presence_penalty must be a number, got None"),
        (dict(top_p=True), "top_p must be a number, got True"),
    ],
)
def test_bad_values_name_the_field(kwargs, match):
    with pytest.raises(ValueError, match=match):
        SamplingParams(**kwargs)


def test_numpy_numbers_are_accepted():
    params = SamplingParams(temperature=np.float32(0.5), top_p=np.float64(0.9), min_p=np.float32(0.1))
    assert params.temperature == pytest.approx(0.5) and params.top_p == pytest.approx(0.9)


@pytest.mark.parametrize("temperature", [1e6, 3e38])
def test_a_large_temperature_samples_only_allowed_tokens(run_sampler, temperature):
    # One past float32's range (inf there) sampled token 0, outside allowed_token_ids: -inf / inf is NaN.
    logits = torch.randn(4, 50)
    out = run_sampler(logits, [SamplingParams(temperature=temperature, allowed_token_ids=[3, 4])] * 4)
    assert set(out.sampled_token_ids.tolist()) <= {3, 4}


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_minus_inf_logit_bias_bans_the_token(run_sampler, temperature):
    logits = torch.zeros(8, 5)
    logits[:, 2] = 10.0  # the favourite, banned
    out = run_sampler(logits, [SamplingParams(temperature=temperature, logit_bias={2: -math.inf}, logprobs=1)] * 8)
    assert 2 not in out.sampled_token_ids.tolist()
    # logprobs are the raw ones (vLLM's default): the banned token is still the most likely there.
    assert out.logprobs.token_ids[:, 1].tolist() == [2] * 8
