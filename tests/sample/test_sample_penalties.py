"""Penalties, logit_bias and min_tokens against loop references written here."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from runtime.sample import Sampler, build_sampling_metadata
from runtime.sampling_params import SamplingParams

VOCAB = 12


def ref_penalties(logits: np.ndarray, prompt: list[int], output: list[int], p: SamplingParams) -> np.ndarray:
    out = logits.astype(np.float64).copy()
    for token in range(len(out)):
        if token in prompt or token in output:
            r = p.repetition_penalty
            out[token] = out[token] / r if out[token] > 0 else out[token] * r
        count = output.count(token)
        out[token] -= p.frequency_penalty * count
        out[token] -= p.presence_penalty * (count > 0)
    return out


def processed(logits: torch.Tensor, params, prompts, outputs) -> torch.Tensor:
    metadata = build_sampling_metadata(params, prompts, outputs, [None] * len(params), VOCAB, torch.device("cpu"))
    return Sampler.process_logits(logits, metadata)


PENALTY_ROWS = [
    SamplingParams(temperature=0.0, repetition_penalty=1.3),
    SamplingParams(temperature=0.0, frequency_penalty=0.7),
    SamplingParams(temperature=0.0, presence_penalty=-0.5),
    SamplingParams(temperature=0.8, repetition_penalty=0.8, frequency_penalty=-0.4, presence_penalty=1.5),
    SamplingParams(temperature=0.0),  # no penalty, batched with rows that have some
]


def test_penalties_match_loop_reference():
    gen = torch.Generator().manual_seed(4)
    logits = torch.randn(len(PENALTY_ROWS), VOCAB, generator=gen) * 2
    prompts = [[1, 2, 3], [4], [5, 5, 6, 7, 8], [0, 11], [1, 2]]
    outputs = [[3, 9, 9], [4, 4, 4, 10], [], [11, 2, 2, 6], [1]]
    out = processed(logits, PENALTY_ROWS, prompts, outputs)
    for row, p in enumerate(PENALTY_ROWS):
        expected = ref_penalties(logits[row].numpy(), prompts[row], outputs[row], p)
        np.testing.assert_allclose(out[row].numpy(), expected, rtol=1e-5, atol=1e-5)


def test_repetition_penalty_changes_greedy_choice(run_sampler):
    logits = torch.tensor([[0.0, 3.0, 2.0, -1.0] + [-5.0] * (VOCAB - 4)])
    params = [SamplingParams(temperature=0.0, repetition_penalty=2.0)]
    assert run_sampler(logits, params, prompts=[[0]], outputs=[[]]).sampled_token_ids.item() == 1
    # Token 1 seen in the output: 3.0 / 2 = 1.5 < 2.0.
    assert run_sampler(logits, params, prompts=[[0]], outputs=[[1]]).sampled_token_ids.item() == 2


def test_no_penalty_builds_no_penalty_tensors():
    metadata = build_sampling_metadata(
        [SamplingParams(frequency_penalty=0.5), SamplingParams()], [[1], [2]], [[3], []], [None, None], VOCAB, "cpu"
    )
    assert metadata.presence_penalties is None and metadata.repetition_penalties is None
    assert metadata.prompt_token_ids is None  # only repetition_penalty needs the prompt
    assert metadata.output_token_ids.tolist() == [[3], [VOCAB]]


def test_logit_bias_matches_reference(run_sampler):
    gen = torch.Generator().manual_seed(5)
    logits = torch.randn(3, VOCAB, generator=gen)
    biases = [{2: 100.0, 5: -3.0}, None, {0: -100.0, 11: 0.25}]
    params = [SamplingParams(temperature=0.0, logit_bias=b) for b in biases]
    out = processed(logits, params, [[1]] * 3, [[]] * 3)
    expected = logits.clone()
    for row, bias in enumerate(biases):
        for token, value in (bias or {}).items():
            expected[row, token] += value
    torch.testing.assert_close(out, expected)
    sampled = run_sampler(logits, params).sampled_token_ids
    assert sampled[0].item() == 2
    assert sampled.tolist() == expected.argmax(dim=1).tolist()


def test_logit_bias_out_of_vocab_is_an_error():
    with pytest.raises(ValueError, match=r"token id 12 .*\[0, 12\)"):
        processed(torch.zeros(1, VOCAB), [SamplingParams(logit_bias={12: 1.0})], [[1]], [[]])


def min_tokens_params(min_tokens: int, temperature: float = 0.0, top_k: int = 0) -> SamplingParams:
    p = SamplingParams(temperature=temperature, top_k=top_k, min_tokens=min_tokens, stop_token_ids=[5])
    p.all_stop_token_ids |= {VOCAB - 1}  # the engine adds EOS
    return p


def test_min_tokens_blocks_eos_and_stop_ids_until_reached(run_sampler):
    eos = VOCAB - 1
    logits = torch.full((1, VOCAB), -2.0)
    logits[0, eos], logits[0, 5], logits[0, 7] = 4.0, 3.0, 1.0
    for num_output in range(4):
        out = run_sampler(logits, [min_tokens_params(3)], outputs=[[0] * num_output]).sampled_token_ids.item()
        assert out == (7 if num_output < 3 else eos), num_output


def test_min_tokens_blocks_stop_ids_when_sampling(run_sampler):
    eos = VOCAB - 1
    logits = torch.zeros(2000, VOCAB)
    logits[:, eos], logits[:, 5] = 3.0, 3.0
    params = [min_tokens_params(2, temperature=1.0)] * 2000
    short = run_sampler(logits, params, outputs=[[1]] * 2000).sampled_token_ids
    assert not torch.isin(short, torch.tensor([5, eos])).any()
    done = run_sampler(logits, params, outputs=[[1, 2]] * 2000).sampled_token_ids
    assert torch.isin(done, torch.tensor([5, eos])).float().mean() > 0.5
