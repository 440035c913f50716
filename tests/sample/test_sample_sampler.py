"""The whole sampler: greedy, seeded rows, batches of mixed parameters."""

from __future__ import annotations

import torch

from runtime.sample import Sampler, build_sampling_metadata, to_lists
from runtime.sample.metadata import greedy_metadata
from runtime.sampling_params import SamplingParams

VOCAB = 50


def seeded(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def test_greedy_is_argmax(run_sampler):
    gen = torch.Generator().manual_seed(6)
    logits = torch.randn(7, VOCAB, generator=gen)
    out = run_sampler(logits, [SamplingParams(temperature=0.0)] * 7)
    assert torch.equal(out.sampled_token_ids, logits.argmax(dim=1))
    assert out.logprobs is None


def test_greedy_accepts_half_precision_logits(run_sampler):
    gen = torch.Generator().manual_seed(7)
    logits = torch.randn(3, VOCAB, generator=gen).to(torch.bfloat16)
    out = run_sampler(logits, [SamplingParams(temperature=0.0)] * 3)
    assert torch.equal(out.sampled_token_ids, logits.float().argmax(dim=1))


def test_argmax_only_rows_take_the_argmax_in_the_logits_own_dtype(monkeypatch):
    """All greedy with nothing that changes or reads back the logits: no float32 copy of the [rows, vocab] logits
    (the argmax sees bf16, ties included, and picks what the widened logits give); anything else widens first."""
    seen = []
    sampler = Sampler()
    real = sampler.argmax
    sampler.argmax = lambda logits: seen.append(logits.dtype) or real(logits)
    gen = torch.Generator().manual_seed(8)
    logits = torch.randn(6, VOCAB, generator=gen).to(torch.bfloat16)
    logits[2, 7] = logits[2, 30] = logits[2].max() + 1  # a tie: the first wins, as after widening
    out = sampler(logits, greedy_metadata(6))
    assert seen == [torch.bfloat16] and out.logprobs is None
    assert torch.equal(out.sampled_token_ids, logits.float().argmax(dim=1)) and out.sampled_token_ids[2] == 7
    for params in (SamplingParams(temperature=0.0, logit_bias={3: 1.0}), SamplingParams(temperature=0.0, logprobs=1),
                   SamplingParams(temperature=0.0, repetition_penalty=1.2),
                   SamplingParams(temperature=0.0, min_tokens=2, stop_token_ids=[3]),
                   SamplingParams(temperature=0.0, allowed_token_ids=[3, 9])):
        seen.clear()
        metadata = build_sampling_metadata([params] * 6, [[0, 1]] * 6, [[]] * 6, [None] * 6, VOCAB, logits.device)
        assert not Sampler.argmax_only(metadata)
        sampler(logits, metadata)
        assert seen == [torch.float32], params


def test_all_greedy_metadata_builds_nothing_extra():
    params = [SamplingParams(temperature=0.0, top_k=5, top_p=0.5, seed=3)] * 4
    metadata = build_sampling_metadata(params, [[1]] * 4, [[2]] * 4, [seeded(3)] * 4, VOCAB, torch.device("cpu"))
    assert metadata.all_greedy and not metadata.all_random
    assert metadata.temperature is None and metadata.top_k is None and metadata.top_p is None
    assert metadata.min_p is None and metadata.no_penalties and metadata.prompt_token_ids is None
    assert metadata.logit_bias is None and metadata.min_tokens_mask is None
    assert metadata.generators == {} and metadata.max_num_logprobs is None


def test_seeded_row_is_independent_of_batch(run_sampler):
    gen = torch.Generator().manual_seed(8)
    row_logits = torch.randn(1, VOCAB, generator=gen)
    params = SamplingParams(temperature=1.0, top_p=0.95, seed=1234)
    alone_gen = seeded(1234)
    alone = [run_sampler(row_logits, [params], generators=[alone_gen]).sampled_token_ids.item() for _ in range(6)]
    assert len(set(alone)) > 1  # the generator advances from step to step

    others = [SamplingParams(temperature=0.7), SamplingParams(temperature=0.0), SamplingParams(seed=9, top_k=3)]
    batch_gen = seeded(1234)
    in_batch = []
    for step in range(6):
        logits = torch.randn(4, VOCAB, generator=gen)
        position = step % 4  # the seeded row moves around the batch
        logits[position] = row_logits[0]
        params_rows = others[:position] + [params] + others[position:]
        generators = [None, None, seeded(9)]
        generators = generators[:position] + [batch_gen] + generators[position:]
        out = run_sampler(logits, params_rows, generators=generators).sampled_token_ids
        in_batch.append(out[position].item())
    assert in_batch == alone


def test_mixed_batch_gives_each_row_what_it_gets_alone(run_sampler):
    eos = VOCAB - 1
    rows = [
        SamplingParams(temperature=0.0, repetition_penalty=1.5, logprobs=2),
        SamplingParams(temperature=0.9, top_k=5, seed=1, logprobs=0),
        SamplingParams(temperature=1.2, top_p=0.7, presence_penalty=0.5, seed=2),
        SamplingParams(temperature=0.6, min_p=0.2, logit_bias={3: 2.0}, seed=3, logprobs=4),
        SamplingParams(temperature=0.0, min_tokens=4, frequency_penalty=1.0),
        SamplingParams(temperature=1.0, top_k=10, top_p=0.9, min_p=0.05, seed=4, repetition_penalty=0.9),
    ]
    for p in rows:
        p.all_stop_token_ids.add(eos)
    gen = torch.Generator().manual_seed(9)
    logits = torch.randn(len(rows), VOCAB, generator=gen) * 3
    logits[4, eos] = 20.0  # the min_tokens row would stop at once
    prompts = [[i, i + 1, 7] for i in range(len(rows))]
    outputs = [[7, i, i] for i in range(len(rows))]

    def generators(indices):
        return [seeded(rows[i].seed) if rows[i].seed is not None else None for i in indices]

    batch = run_sampler(logits, rows, prompts, outputs, generators(range(len(rows))))
    batch_lists = to_lists(batch.logprobs, [p.logprobs or 0 for p in rows])
    for i, p in enumerate(rows):
        alone = run_sampler(logits[i : i + 1], [p], prompts[i : i + 1], outputs[i : i + 1], generators([i]))
        assert alone.sampled_token_ids.item() == batch.sampled_token_ids[i].item(), i
        if p.logprobs is not None:
            alone_lists = to_lists(alone.logprobs, [p.logprobs])
            assert alone_lists.token_ids[0] == batch_lists.token_ids[i]
            assert alone_lists.ranks[0] == batch_lists.ranks[i]
            torch.testing.assert_close(alone_lists.logprobs[0], batch_lists.logprobs[i])
    assert batch.sampled_token_ids[4].item() != eos


def test_logprobs_are_raw_before_processing(run_sampler):
    gen = torch.Generator().manual_seed(10)
    logits = torch.randn(2, VOCAB, generator=gen)
    params = [
        SamplingParams(temperature=0.0, logit_bias={5: 50.0}, logprobs=3),
        SamplingParams(temperature=0.3, top_k=2, repetition_penalty=2.0, logprobs=1, seed=0),
    ]
    out = run_sampler(logits, params, generators=[None, seeded(0)])
    assert out.sampled_token_ids[0].item() == 5
    raw = logits.log_softmax(dim=1)
    assert out.logprobs.token_ids.shape == (2, 4)
    torch.testing.assert_close(out.logprobs.logprobs[:, 0], raw.gather(1, out.sampled_token_ids[:, None])[:, 0])
    torch.testing.assert_close(out.logprobs.logprobs[:, 1:], raw.topk(3, dim=1).values)


def test_allowed_token_ids_restrict_greedy_and_random_rows():
    """vLLM's allowed_token_ids: a greedy row takes the best of its allowed ids, a random row draws only among them;
    a row without them is untouched."""
    logits = torch.randn(3, VOCAB, generator=torch.Generator().manual_seed(4))
    allowed = [5, 17, 30]
    params = [SamplingParams(temperature=0.0, allowed_token_ids=allowed), SamplingParams(temperature=0.0),
              SamplingParams(temperature=1.0, allowed_token_ids=allowed, seed=9)]
    seen = set()
    for step in range(200):
        metadata = build_sampling_metadata(params, [[0]] * 3, [[]] * 3, [None, None, seeded(step)], VOCAB, torch.device("cpu"))
        out = Sampler()(logits, metadata).sampled_token_ids.tolist()
        assert out[0] == allowed[int(logits[0, allowed].argmax())] and out[1] == int(logits[1].argmax())
        assert out[2] in allowed
        seen.add(out[2])
    assert seen == set(allowed)  # all three drawn over 200 steps (uniform-ish logits)
