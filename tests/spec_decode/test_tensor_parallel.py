"""Worker proposers under tensor parallelism: real worker processes (gloo on the CPU).

Each rank runs the proposer on its shard (a draft model and an EAGLE-3 head are split like the
target); with chunked prefill and prefix caching, TP=2's greedy tokens equal TP=1's and
transformers', and seeded random sampling equals TP=1's (ngram too: every rank keeps the output
rank's verified tokens). Sampled drafts are the first rank's on
every rank (:func:`runtime.worker.draft_passes.share_first_rank_drafts`), checked with two
processes whose random generators differ.
"""

from __future__ import annotations

import gc
import multiprocessing

import pytest
import torch

from runtime import LLM, SamplingParams
from runtime.testing.models import UNTOKENIZED_VOCAB_SIZE, build_untokenized_model
from runtime.testing.reference import check_outputs_equal, reference_outputs

from spec_decode.heads import build_eagle3_head
from spec_decode.engine_runs import generate, repetitive_prompts, spec_counts

NUM_NEW_TOKENS = 10
# A small KV cache: each worker allocates (and the OS zeroes) only what the prompts need.
CHUNKED_PREFIX = dict(max_num_batched_tokens=8, enable_prefix_caching=True, block_size=4, num_gpu_blocks_override=64,
                      max_model_len=64)
GREEDY = SamplingParams(temperature=0.0, max_tokens=NUM_NEW_TOKENS, ignore_eos=True)


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    """(llama target, a qwen2 draft of other weights, an EAGLE-3 head, prompts, transformers' greedy tokens)."""
    root = tmp_path_factory.mktemp("tp_spec")
    path = build_untokenized_model("llama", root / "target")
    draft = build_untokenized_model("qwen2", root / "draft", seed=1)
    eagle3 = build_eagle3_head(root / "eagle3", UNTOKENIZED_VOCAB_SIZE, [0, 1, 1], UNTOKENIZED_VOCAB_SIZE // 2)
    prompts = repetitive_prompts(UNTOKENIZED_VOCAB_SIZE)
    expected = [tokens for tokens, _ in reference_outputs(path, prompts, NUM_NEW_TOKENS)]
    return path, {"draft_model": draft, "eagle3": eagle3}, prompts, expected


def seeded(prompts) -> list[SamplingParams]:
    return [SamplingParams(temperature=0.9, seed=i, max_tokens=NUM_NEW_TOKENS, ignore_eos=True) for i in range(len(prompts))]


def run(llm: LLM, prompts) -> tuple[list[list[list[int]]], list[list[int]]]:
    """(greedy tokens of two runs, the second reading cached prefixes; seeded random tokens)."""
    greedy = [[o.outputs[0].token_ids for o in generate(llm, prompts, GREEDY)] for _ in range(2)]
    return greedy, [o.outputs[0].token_ids for o in generate(llm, prompts, seeded(prompts))]


@pytest.mark.parametrize("method", ["draft_model", "eagle3", "ngram"])
def test_tp2_equals_tp1_and_transformers(target, method):
    path, proposers, prompts, expected = target
    config = {"method": method, "num_speculative_tokens": 3}
    config.update({"model": proposers[method]} if method in proposers else {"prompt_lookup_min": 2, "prompt_lookup_max": 4})
    single = LLM(path, dtype="float32", skip_tokenizer_init=True, speculative_config=config, **CHUNKED_PREFIX)
    one_greedy, one_sampled = run(single, prompts)
    del single
    gc.collect()
    for tokens in one_greedy:
        check_outputs_equal(expected, tokens, f"{method} tp=1 vs hf")

    llm = LLM(path, dtype="float32", skip_tokenizer_init=True, speculative_config=config, tensor_parallel_size=2,
              **CHUNKED_PREFIX)
    core = llm.llm_engine.engine_core
    try:
        assert type(core.executor).__name__ == "MultiprocExecutor"
        greedy, sampled = run(llm, prompts)
        for tokens in greedy:
            check_outputs_equal(expected, tokens, f"{method} tp=2 vs hf")
        check_outputs_equal(one_sampled, sampled, f"{method} tp=2 seeded sampling vs tp=1")
        assert spec_counts(llm)[0] > 0, "nothing was drafted"
        assert core.scheduler.kv_cache_manager.stats.hits > 0, "the second run hit no cached prefix"
        specs = core.executor.collective_rpc("attention_specs")
        assert all((s.num_heads, s.num_kv_heads) == (2, 1) for rank in specs for s in rank)  # the target's halves
    finally:
        core.shutdown()
    assert not any(p.is_alive() for p in core.executor.processes)


def _draft_rank(rank: int, init_method: str, results) -> None:
    from runtime.distributed import destroy_distributed, init_distributed
    from runtime.platforms import select_platform
    from runtime.sample.filters import random_sample
    from runtime.worker.draft_passes import DraftRequest, sample_drafts

    init_distributed(select_platform("cpu"), rank, 2, 1, init_method)
    logits = torch.zeros(6, 64)  # equal on both ranks, flat: a draw is all chance
    requests = [DraftRequest(i, 1, 1.0 if i % 3 else 0.0, None, 0) for i in range(6)]  # rows 0 and 3 greedy
    torch.manual_seed(100 + rank)  # the ranks' generators differ
    own = random_sample(torch.softmax(logits, dim=-1), {}).tolist()
    tokens, probs = sample_drafts(logits, requests, 0)
    results.put((rank, own, tokens.tolist(), probs.sum().item()))
    destroy_distributed()


def test_sampled_drafts_are_the_first_ranks_on_every_rank(tmp_path):
    ctx = multiprocessing.get_context("spawn")
    results = ctx.Queue()
    init_method = f"file://{tmp_path / 'rendezvous'}"
    workers = [ctx.Process(target=_draft_rank, args=(rank, init_method, results)) for rank in range(2)]
    for w in workers:
        w.start()
    got = dict((rank, rest) for rank, *rest in (results.get(timeout=120) for _ in workers))
    for w in workers:
        w.join(30)
        assert w.exitcode == 0
    (own0, tokens0, mass0), (own1, tokens1, mass1) = got[0], got[1]
    assert own0 != own1, "the ranks' generators should differ for this check to mean anything"
    assert tokens0 == tokens1 and tokens0[0] == tokens0[3] == 0  # greedy rows: the argmax (first of ties)
    assert mass0 == mass1 == pytest.approx(6.0)


def test_pipeline_parallel_is_refused_naming_the_size(tmp_path):
    from types import SimpleNamespace

    from runtime.config import ParallelConfig
    from runtime.worker.spec_decode_runner import SpecDecodeRunner

    from spec_decode.heads import build_medusa_head

    head = build_medusa_head(tmp_path / "medusa", UNTOKENIZED_VOCAB_SIZE)
    config = SimpleNamespace(
        plugin_options={"speculative_config": {"method": "medusa", "model": head, "num_speculative_tokens": 2}},
        parallel_config=ParallelConfig(tensor_parallel_size=2, executor="multiproc", pipeline_parallel_size=3),
        model_config=SimpleNamespace(vocab_size=UNTOKENIZED_VOCAB_SIZE),
    )
    with pytest.raises(ValueError, match="'medusa' runs a proposer in the worker, which does not support pipeline "
                                         "parallelism.*got pipeline_parallel_size 3; use tensor_parallel_size"):
        SpecDecodeRunner.maybe_create(config, None, None, None, None)
