"""Tensor and pipeline parallelism over real worker processes (gloo on the CPU): greedy tokens
identical to one worker and to transformers, for every tiny architecture, across the paged-cache
settings.

Each case starts one multiproc engine (the default executor once tensor x pipeline > 1); the
settings are spread over the cases so that every one is covered and the whole file stays short:
chunked prefill with prefix caching and forced preemption, async scheduling, prefix caching, KV
heads replicated over four ranks (two KV heads, TP=4), PP=2 and TP=2 x PP=2.
"""

from __future__ import annotations

import gc

import pytest

from runtime import LLM, SamplingParams
from runtime.testing.models import build_untokenized_model
from runtime.testing.reference import check_logprobs_close, check_outputs_equal, make_prompts, reference_outputs

NUM_NEW_TOKENS = 12
LOGPROB_ATOL = 1e-3  # float32; the ranks' partial sums add up in another order than one matmul

CHUNKED_PREFIX_PREEMPTION = dict(
    enable_prefix_caching=True, block_size=4, num_gpu_blocks_override=24, max_model_len=96, max_num_batched_tokens=8
)
PREFIX_CACHING = dict(enable_prefix_caching=True, block_size=4)
CASES = [  # (arch, tensor_parallel_size, pipeline_parallel_size, engine arguments)
    ("llama", 2, 1, CHUNKED_PREFIX_PREEMPTION),
    ("qwen2", 2, 1, dict(async_scheduling=True)),
    ("qwen3", 2, 1, PREFIX_CACHING),
    ("gemma3", 2, 1, dict()),
    ("llama", 4, 1, dict()),  # 2 KV heads over 4 ranks: each KV head on two ranks
    ("qwen3", 1, 2, dict(async_scheduling=True, **CHUNKED_PREFIX_PREEMPTION)),
    ("gemma3", 2, 2, PREFIX_CACHING),  # 4 layers: 2 per stage
]
NUM_LAYERS = {"llama": 2, "qwen2": 2, "qwen3": 2, "gemma3": 4}


@pytest.fixture(scope="module")
def references(tmp_path_factory):
    """arch -> (checkpoint, prompts, transformers' (tokens, top-5 logprobs) per prompt), built once."""
    cache = {}

    def get(arch):
        if arch not in cache:
            path = build_untokenized_model(arch, tmp_path_factory.mktemp(f"tp_{arch}"))
            prompts = make_prompts()
            cache[arch] = path, prompts, reference_outputs(path, prompts, NUM_NEW_TOKENS)
        return cache[arch]

    return get


def generate(llm: LLM, prompts, params=None):
    params = params or SamplingParams(temperature=0.0, max_tokens=NUM_NEW_TOKENS, ignore_eos=True, logprobs=5)
    return [o.outputs[0] for o in llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)]


def seeded_samples(llm: LLM, prompts) -> list[list[int]]:
    """Random sampling with a seed per request: the same tokens whatever the number of workers."""
    params = [SamplingParams(temperature=1.0, top_p=0.9, seed=i, max_tokens=6, ignore_eos=True) for i in range(len(prompts))]
    return [o.token_ids for o in generate(llm, prompts, params)]


@pytest.mark.parametrize(("arch", "tp", "pp", "settings"), CASES, ids=[f"{a}-tp{tp}-pp{pp}" for a, tp, pp, _ in CASES])
def test_parallel_greedy_matches_one_worker_and_transformers(references, arch, tp, pp, settings):
    path, prompts, expected = references(arch)
    single = LLM(path, dtype="float32", skip_tokenizer_init=True, **settings)
    one_worker = [o.token_ids for o in generate(single, prompts)]
    one_worker_sampled = seeded_samples(single, prompts)
    del single
    gc.collect()

    llm = LLM(path, dtype="float32", skip_tokenizer_init=True, tensor_parallel_size=tp, pipeline_parallel_size=pp, **settings)
    core = llm.llm_engine.engine_core
    assert type(core.executor).__name__ == "MultiprocExecutor"
    assert core.async_scheduling is bool(settings.get("async_scheduling")), "async scheduling fell back"
    label = f"{arch} tp={tp} pp={pp} {settings}"
    # A call that fails on the workers raises naming a rank, and leaves the engine working.
    with pytest.raises(RuntimeError, match=r"(?s)worker rank \d failed in no_such_method:\n.*AttributeError"):
        core.executor.collective_rpc("no_such_method")
    for _ in range(2 if settings.get("enable_prefix_caching") else 1):  # the second run reads cached prefixes
        outputs = generate(llm, prompts)
        check_outputs_equal([tokens for tokens, _ in expected], [o.token_ids for o in outputs], label + " vs hf")
        check_outputs_equal(one_worker, [o.token_ids for o in outputs], label + " vs tp=1")
        for (_, ref_steps), out in zip(expected, outputs):
            check_logprobs_close(ref_steps, out.logprobs, atol=LOGPROB_ATOL, label=label)
    check_outputs_equal(one_worker_sampled, seeded_samples(llm, prompts), label + " seeded sampling vs tp=1")
    scheduler = core.scheduler
    if settings.get("enable_prefix_caching"):
        assert scheduler.kv_cache_manager.stats.hits > 0, f"{label}: the second run hit no cached prefix"
    if "num_gpu_blocks_override" in settings:
        assert scheduler.num_preemptions > 0, f"{label}: nothing was preempted"
    # Every rank holds its share of the heads, of its stage's layers.
    specs = core.executor.collective_rpc("attention_specs")  # per rank, rank = stage * tp + tp rank
    num_layers = NUM_LAYERS[arch]
    for rank, rank_specs in enumerate(specs):
        stage = rank // tp
        assert [s.layer_idx for s in rank_specs] == list(range(stage * num_layers // pp, (stage + 1) * num_layers // pp))
        assert all((s.num_heads, s.num_kv_heads) == (4 // tp, max(1, 2 // tp)) for s in rank_specs)
    expected_collectives = "torch.distributed (gloo)" if tp > 1 else "none (one worker per stage)"
    assert [i["collectives"] for i in core.executor.collective_rpc("describe")] == [expected_collectives] * (tp * pp)
    llm.llm_engine.engine_core.shutdown()
    assert not any(p.is_alive() for p in core.executor.processes)
