"""The rejection sampler: greedy verification, the distribution it emits, seeds, logprobs."""

from __future__ import annotations

import pytest
import torch
from scipy.stats import chisquare

from runtime.sample import Sampler, build_sampling_metadata
from runtime.sample.filters import apply_temperature, apply_top_k, apply_top_p
from runtime.sample.rejection_sampler import (
    PLACEHOLDER_TOKEN_ID,
    RejectionSampler,
    SpecDecodeLayout,
    flatten_drafts,
    max_drafts_for_min_tokens,
)
from runtime.sampling_params import SamplingParams

CPU = torch.device("cpu")
ALPHA = 1e-3  # goodness-of-fit tests fail when p < ALPHA (seeds are fixed, so runs are repeatable)


def metadata_for(params, vocab_size, outputs=None, generators=None):
    n = len(params)
    return build_sampling_metadata(
        params, [[0, 1]] * n, outputs if outputs is not None else [[]] * n,
        generators if generators is not None else [None] * n, vocab_size, CPU,
    )


def verify(logits, drafts: list[list[int]], params, draft_probs=None, outputs=None, generators=None):
    """Run the rejection sampler on per-request draft lists."""
    flat = torch.tensor([t for row in drafts for t in row], dtype=torch.int64)
    md = metadata_for(params, logits.shape[1], outputs, generators)
    return RejectionSampler()(logits, flat, [len(row) for row in drafts], md, draft_probs)


def greedy_logits(argmaxes: list[int], vocab_size: int, gen: torch.Generator) -> torch.Tensor:
    """Random rows whose argmax is ``argmaxes[i]`` by a clear margin."""
    logits = torch.randn(len(argmaxes), vocab_size, generator=gen)
    logits[torch.arange(len(argmaxes)), argmaxes] = 10.0
    return logits


# ------------------------------------------------------------------ greedy


def test_greedy_verification_takes_the_platforms_argmax_op():
    """Built inside a custom_ops_scope offering ``argmax``, the rejection sampler's greedy rows use it."""
    from runtime.models.ops import custom_ops_scope

    calls = []

    def counting_argmax(logits):
        calls.append(tuple(logits.shape))
        return logits.argmax(dim=1)

    with custom_ops_scope({"argmax": counting_argmax}):
        sampler = RejectionSampler()
    target = [5, 2, 7, 1, 3]
    logits = greedy_logits(target, 10, torch.Generator().manual_seed(2))
    md = metadata_for([SamplingParams(temperature=0.0)], 10)
    out = sampler(logits, torch.tensor([5, 2, 0, 1]), [4], md)
    assert out.token_lists() == [[5, 2, 7]] and calls == [(5, 10)]


@pytest.mark.parametrize("mismatch", [0, 1, 2, 3, None])
def test_greedy_keeps_drafts_until_the_first_mismatch(mismatch):
    gen = torch.Generator().manual_seed(1)
    target = [5, 2, 7, 1, 3]  # argmax at the 4 draft positions and the bonus position
    logits = greedy_logits(target, 10, gen)
    drafts = target[:4]
    if mismatch is not None:
        drafts[mismatch] = (drafts[mismatch] + 1) % 10
    out = verify(logits, [drafts], [SamplingParams(temperature=0.0)])
    n = 4 if mismatch is None else mismatch
    assert out.token_lists() == [target[: n + 1]]
    assert out.num_accepted.tolist() == [n]
    assert out.output_token_ids[0, n + 1 :].eq(PLACEHOLDER_TOKEN_ID).all()
    assert out.logprobs is None


def test_greedy_mixed_batch_with_different_k_and_no_drafts():
    gen = torch.Generator().manual_seed(2)
    # request 0: k=3, all accepted; 1: k=0; 2: k=1, rejected; 3: k=2, mismatch at 1; 4: k=0
    targets = [[1, 2, 3, 4], [6], [7, 0], [3, 3, 8], [9]]
    drafts = [[1, 2, 3], [], [8], [3, 4], []]
    logits = greedy_logits([t for row in targets for t in row], 10, gen)
    out = verify(logits, drafts, [SamplingParams(temperature=0.0)] * 5)
    assert out.token_lists() == [[1, 2, 3, 4], [6], [7], [3, 3], [9]]
    assert out.num_accepted.tolist() == [3, 0, 0, 1, 0]
    assert out.output_token_ids.shape == (5, 4)


def test_no_drafts_at_all_is_the_sampler():
    gen = torch.Generator().manual_seed(3)
    logits = torch.randn(4, 12, generator=gen)
    out = verify(logits, [[]] * 4, [SamplingParams(temperature=0.0)] * 4)
    assert out.token_lists() == [[t] for t in logits.argmax(dim=1).tolist()]
    assert out.num_accepted.tolist() == [0] * 4


def test_greedy_penalties_count_the_earlier_drafts():
    # Token 3 leads token 4 by 1.5 at every position; a frequency penalty of 2 per occurrence
    # makes position 1 (which sees draft 0 = 3 as output) prefer 4, as sequential decoding would.
    logits = torch.zeros(3, 6)
    logits[:, 3] = 6.0
    logits[:, 4] = 4.5
    out = verify(logits, [[3, 3]], [SamplingParams(temperature=0.0, frequency_penalty=2.0)])
    assert out.token_lists() == [[3, 4]]
    assert out.num_accepted.tolist() == [1]


def test_greedy_equals_sequential_sampler_with_penalties_and_bias():
    gen = torch.Generator().manual_seed(4)
    vocab, k = 7, 4
    params = [
        SamplingParams(temperature=0.0, repetition_penalty=1.5),
        SamplingParams(temperature=0.0, presence_penalty=0.8, frequency_penalty=0.3),
        SamplingParams(temperature=0.0, logit_bias={2: 1.5, 5: -0.5}),
        SamplingParams(temperature=0.0),
    ]
    prompts = [[1, 2], [3], [4, 4, 0], [6]]
    outputs = [[2, 5], [1, 1], [], [3]]
    for trial in range(20):
        logits = torch.randn(len(params) * (k + 1), vocab, generator=gen)
        # drafts that often agree with the plain argmax, so acceptance runs are long
        plain = logits.argmax(dim=1).view(len(params), k + 1)
        drafts = torch.where(torch.rand(len(params), k, generator=gen) < 0.8, plain[:, :k], plain[:, 1:])
        md = build_sampling_metadata(params, prompts, outputs, [None] * len(params), vocab, CPU)
        out = RejectionSampler()(logits, drafts.flatten(), [k] * len(params), md).token_lists()
        for i, p in enumerate(params):
            expected, history = [], list(outputs[i])
            for j in range(k + 1):  # what one-token-per-step decoding would emit
                row_md = build_sampling_metadata([p], [prompts[i]], [history], [None], vocab, CPU)
                token = Sampler()(logits[i * (k + 1) + j][None], row_md).sampled_token_ids.item()
                expected.append(token)
                if j == k or token != drafts[i, j].item():
                    break
                history.append(token)
            assert out[i] == expected, (trial, i)


# ------------------------------------------------------------------ the emitted distribution


def _assert_distributed_as(tokens: torch.Tensor, p: torch.Tensor, what: str):
    """Chi-square goodness of fit of ``tokens`` to ``p`` over the cells with p > 0."""
    counts = torch.bincount(tokens, minlength=p.numel()).double()
    assert counts[p == 0].sum() == 0, f"{what}: tokens outside the support of p"
    support = p > 0
    p = p.double()
    expected = p[support] / p[support].sum() * counts.sum()
    pvalue = chisquare(counts[support].numpy(), expected.numpy()).pvalue
    assert pvalue > ALPHA, f"{what}: chi-square p-value {pvalue:.2e}, counts {counts.tolist()} vs {expected.tolist()}"


def _check_positions(out, target_p: torch.Tensor, k: int):
    """Every emitted position j (given that j drafts were accepted) is distributed as p_j."""
    emitted = out.num_accepted + 1
    for j in range(k + 1):
        reached = emitted > j
        assert reached.sum() > 1500, f"too few samples reach position {j}"
        _assert_distributed_as(out.output_token_ids[reached, j], target_p[j], f"position {j}")


@pytest.mark.parametrize("with_q", [True, False], ids=["draft_probs", "q_is_one"])
def test_emitted_tokens_follow_the_target_distribution(with_q):
    torch.manual_seed(5)
    gen = torch.Generator().manual_seed(5)
    vocab, k, num_reqs = 8, 2, 40000
    target_logits = torch.randn(k + 1, vocab, generator=gen) * 1.5  # p_j, the same for every request
    target_p = target_logits.softmax(dim=1)
    logits = target_logits.repeat(num_reqs, 1)  # [num_reqs * (k + 1), V]
    if with_q:
        q = (target_logits[:k] + torch.randn(k, vocab, generator=gen)).softmax(dim=1)  # q_j, near p_j
        draft_probs = q.repeat(num_reqs, 1)
        drafts = torch.multinomial(draft_probs, 1, generator=gen).squeeze(1)
        expected_accept = torch.minimum(target_p[0], q[0]).sum()
    else:
        # ngram-style drafts (no q): any draft distribution works; draw from r_j = p_j here, which
        # the sampler does not know, so acceptance at position 0 is sum_x p(x)^2.
        draft_probs = None
        drafts = torch.multinomial(target_p[:k].repeat(num_reqs, 1), 1, generator=gen).squeeze(1)
        expected_accept = (target_p[0] ** 2).sum()
    md = metadata_for([SamplingParams(temperature=1.0)] * num_reqs, vocab)
    out = RejectionSampler()(logits, drafts, [k] * num_reqs, md, draft_probs)
    _check_positions(out, target_p, k)
    # The first draft's acceptance rate is sum_x min(p(x), q(x)) (within 5 standard deviations).
    rate = (out.num_accepted > 0).double().mean().item()
    sd = (expected_accept * (1 - expected_accept) / num_reqs).sqrt().item()
    assert abs(rate - expected_accept.item()) < 5 * sd


def test_target_distribution_gets_temperature_top_k_top_p():
    torch.manual_seed(6)
    gen = torch.Generator().manual_seed(6)
    vocab, k, num_reqs = 10, 2, 30000
    target_logits = torch.randn(k + 1, vocab, generator=gen) * 2
    params = SamplingParams(temperature=0.6, top_k=5, top_p=0.9)
    processed = apply_temperature(target_logits, torch.full((k + 1,), 0.6))
    processed = apply_top_k(processed, torch.full((k + 1,), 5), 5)
    processed = apply_top_p(processed, torch.full((k + 1,), 0.9))
    target_p = processed.softmax(dim=1)
    assert (target_p == 0).sum(dim=1).min() >= 5  # the filters cut something
    # Drafts from the unfiltered distribution mixed with uniform: often outside the kept set.
    q = 0.5 * target_logits[:k].softmax(dim=1) + 0.5 / vocab
    draft_probs = q.repeat(num_reqs, 1)
    drafts = torch.multinomial(draft_probs, 1, generator=gen).squeeze(1)
    md = metadata_for([params] * num_reqs, vocab)
    out = RejectionSampler()(target_logits.repeat(num_reqs, 1), drafts, [k] * num_reqs, md, draft_probs)
    _check_positions(out, target_p, k)


def test_mixed_greedy_and_random_requests_with_different_k():
    torch.manual_seed(7)
    gen = torch.Generator().manual_seed(7)
    vocab, num_pairs = 6, 6000
    ks = [2, 0] * num_pairs  # random requests with 2 drafts, greedy requests with none, interleaved
    row_logits = torch.randn(3, vocab, generator=gen)
    greedy_row = torch.randn(1, vocab, generator=gen)
    logits = torch.cat([row_logits, greedy_row]).repeat(num_pairs, 1)
    drafts = torch.randint(0, vocab, (2 * num_pairs,), generator=gen)
    params = [SamplingParams(temperature=1.0), SamplingParams(temperature=0.0)] * num_pairs
    md = metadata_for(params, vocab)
    out = RejectionSampler()(logits, drafts, ks, md)
    greedy_out = out.output_token_ids[1::2]
    assert greedy_out[:, 0].eq(greedy_row.argmax()).all() and out.num_accepted[1::2].eq(0).all()
    random_out = out.output_token_ids[0::2]
    emitted = out.num_accepted[0::2] + 1
    p = row_logits.softmax(dim=1)
    for j in range(3):
        _assert_distributed_as(random_out[emitted > j, j], p[j], f"position {j}")


# ------------------------------------------------------------------ seeds


def seeded(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def test_seeded_requests_are_reproducible_and_independent_of_the_batch():
    gen = torch.Generator().manual_seed(8)
    vocab, k = 20, 4
    row_logits = torch.randn(k + 1, vocab, generator=gen)
    row_drafts = row_logits[:k].argmax(dim=1)  # likely drafts, so some steps accept several
    params = SamplingParams(temperature=1.0, seed=42)

    def alone(generator):
        return verify(row_logits, [row_drafts.tolist()], [params], generators=[generator]).token_lists()[0]

    g1, g2 = seeded(42), seeded(42)
    first = [alone(g1) for _ in range(8)]
    assert first == [alone(g2) for _ in range(8)]
    assert len({tuple(t) for t in first}) > 1  # the generator advances from step to step

    # The same request inside a batch with other (unseeded, greedy, other seed) requests.
    batch_gen = seeded(42)
    others = [SamplingParams(temperature=0.8), SamplingParams(temperature=0.0), SamplingParams(seed=3)]
    in_batch = []
    for step in range(8):
        position = step % 4
        other_ks = [1, 3, 0]
        ks = other_ks[:position] + [k] + other_ks[position:]
        blocks, drafts = [], []
        for i, n in enumerate(ks):
            if i == position:
                blocks.append(row_logits)
                drafts.append(row_drafts.tolist())
            else:
                blocks.append(torch.randn(n + 1, vocab, generator=gen))
                drafts.append(torch.randint(0, vocab, (n,), generator=gen).tolist())
        params_rows = others[:position] + [params] + others[position:]
        generators = [None, None, seeded(step)]
        generators = generators[:position] + [batch_gen] + generators[position:]
        out = verify(torch.cat(blocks), drafts, params_rows, generators=generators)
        in_batch.append(out.token_lists()[position])
    assert in_batch == first


def test_seeded_request_without_drafts_matches_the_sampler():
    gen = torch.Generator().manual_seed(9)
    logits = torch.randn(1, 30, generator=gen)
    params = [SamplingParams(temperature=0.9, top_k=10, seed=5)]
    g_rs, g_s = seeded(5), seeded(5)
    for _ in range(5):
        ours = verify(logits, [[]], params, generators=[g_rs]).token_lists()[0]
        md = metadata_for(params, 30, generators=[g_s])
        assert ours == Sampler()(logits, md).sampled_token_ids.tolist()


# ------------------------------------------------------------------ logprobs, layout, errors


def test_logprobs_are_the_samplers_for_every_emitted_token():
    gen = torch.Generator().manual_seed(10)
    vocab = 9
    logits = torch.randn(3 + 1 + 2, vocab, generator=gen)  # k = 2, 0, 1
    drafts = [[int(logits[0].argmax()), int(logits[1].argmax())], [], [(int(logits[4].argmax()) + 1) % vocab]]
    params = [SamplingParams(temperature=0.0, logprobs=3), SamplingParams(temperature=0.0), SamplingParams(temperature=0.0, logprobs=1)]
    out = verify(logits, drafts, params)
    assert out.num_accepted.tolist() == [2, 0, 0]
    emitted_rows = [0, 1, 2, 3, 4]  # every row of request 0, request 1's only row, request 2's first
    tokens = [t for row in out.token_lists() for t in row]
    raw = logits.log_softmax(dim=1)[emitted_rows]
    assert out.logprobs.token_ids.shape == (5, 4)
    assert out.logprobs.token_ids[:, 0].tolist() == tokens
    assert torch.allclose(out.logprobs.logprobs[:, 0], raw[torch.arange(5), tokens])
    assert torch.equal(out.logprobs.token_ids[:, 1:], raw.topk(3, dim=1).indices)
    assert out.logprobs.ranks.tolist() == [1] * 5


def test_layout_matches_vllm_v1():
    layout = SpecDecodeLayout.build([2, 0, 3], CPU)
    assert layout.cu_num_draft_tokens.tolist() == [2, 2, 5]
    assert layout.row_start.tolist() == [0, 3, 4]
    assert layout.draft_rows.tolist() == [0, 1, 4, 5, 6]
    assert layout.row_req.tolist() == [0, 0, 0, 1, 2, 2, 2, 2]
    assert layout.row_pos.tolist() == [0, 1, 2, 0, 0, 1, 2, 3]


def test_flatten_drafts_takes_each_requests_first_k_i_probs():
    probs = torch.arange(2 * 3 * 4, dtype=torch.float32).view(2, 3, 4)
    ids, counts, flat_probs = flatten_drafts([[1, 2], [3]], probs, CPU)
    assert ids.tolist() == [1, 2, 3] and counts == [2, 1]
    assert torch.equal(flat_probs, torch.stack([probs[0, 0], probs[0, 1], probs[1, 0]]))
    assert flatten_drafts([[], [5]], None, CPU)[2] is None
    with pytest.raises(ValueError, match=r"draft probs must be \[num_reqs=2, k >= 2, vocab_size\]"):
        flatten_drafts([[1, 2], [3]], probs[:, :1], CPU)


def test_max_drafts_for_min_tokens():
    assert max_drafts_for_min_tokens(min_tokens=0, num_output_tokens=0, k=4) == 4
    assert max_drafts_for_min_tokens(min_tokens=3, num_output_tokens=0, k=4) == 2
    assert max_drafts_for_min_tokens(min_tokens=3, num_output_tokens=2, k=4) == 0
    assert max_drafts_for_min_tokens(min_tokens=3, num_output_tokens=3, k=4) == 4


def test_bad_shapes_name_what_was_expected():
    md = metadata_for([SamplingParams(temperature=0.0)] * 2, 5)
    sampler = RejectionSampler()
    with pytest.raises(ValueError, match=r"logits must be \[sum\(num_draft_tokens\) \+ num_reqs = 4, vocab_size\], got \[3, 5\]"):
        sampler(torch.zeros(3, 5), torch.zeros(2, dtype=torch.int64), [1, 1], md)
    with pytest.raises(ValueError, match=r"draft_token_ids must be \[sum\(num_draft_tokens\) = 2\], got \[3\]"):
        sampler(torch.zeros(4, 5), torch.zeros(3, dtype=torch.int64), [1, 1], md)
    with pytest.raises(ValueError, match="metadata has 2 rows for 3 requests"):
        sampler(torch.zeros(5, 5), torch.zeros(2, dtype=torch.int64), [1, 1, 0], md)
    with pytest.raises(ValueError, match=r"draft_probs must be \[sum\(num_draft_tokens\) = 2, vocab_size = 5\]"):
        sampler(torch.zeros(4, 5), torch.zeros(2, dtype=torch.int64), [1, 1], md, torch.zeros(2, 4))
    with pytest.raises(ValueError, match="num_draft_tokens must be >= 0 for every request, got -1"):
        sampler(torch.zeros(4, 5), torch.zeros(2, dtype=torch.int64), [3, -1], md)


def test_a_seeded_row_named_by_position_emits_the_samplers_token_at_each_position():
    """With ``seeds`` (seed, output position) and one-hot drafts, position j's token is the one the Sampler draws
    with ``step_generator(seed, position + j)``, whatever the drafts: kept while equal to it, replaced by it at
    the first difference. So the tokens do not depend on how many drafts a step verifies."""
    from runtime.sample.metadata import step_generator

    vocab, seed, position = 40, 11, 7
    params = SamplingParams(temperature=1.3, seed=seed)
    logits = torch.randn(4, vocab, generator=torch.Generator().manual_seed(3))

    def sampler_token(j: int) -> int:
        md = build_sampling_metadata([params], [[0, 1]], [[]], [step_generator(seed, position + j, CPU)], vocab, CPU)
        return int(Sampler()(logits[j : j + 1], md).sampled_token_ids[0])

    own = [sampler_token(j) for j in range(4)]
    other = [(t + 1) % vocab for t in own]
    for drafts, expected in (
        (own[:3], own),  # all kept, then the bonus position's token
        (own[:1] + other[1:3], own[:2]),  # the second differs: the Sampler's token there ends the step
        (other[:2], own[:1]),
        ([], own[:1]),  # no drafts: the Sampler's own draw
    ):
        k = len(drafts)
        md = build_sampling_metadata([params], [[0, 1]], [[]], [step_generator(seed, position, CPU)], vocab, CPU,
                                     seeds=[(seed, position)])
        out = RejectionSampler()(logits[: k + 1], torch.tensor(drafts, dtype=torch.int64), [k], md)
        assert out.token_lists()[0] == expected, (drafts, expected)
