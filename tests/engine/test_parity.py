"""Greedy tokens identical to transformers, for every architecture, in four engine settings."""

import random

import pytest
import torch
from transformers import AutoModelForCausalLM

from runtime import LLM, SamplingParams

from hf_reference import check_logprobs_close, check_outputs_equal, hf_greedy
from tiny_models import build_tiny_model

ARCHS = ["llama", "qwen2", "qwen3", "gemma3"]
NUM_NEW_TOKENS = 32
PROMPT_LENS = [5, 17, 33, 9, 41]
SHARED_PREFIX = 24


def make_prompts(vocab_size: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    prefix = [rng.randrange(100, vocab_size) for _ in range(SHARED_PREFIX)]
    distinct = [[rng.randrange(100, vocab_size) for _ in range(n)] for n in PROMPT_LENS]
    shared = [prefix + [rng.randrange(100, vocab_size) for _ in range(n % 7 + 1)] for n in PROMPT_LENS[:3]]
    return distinct + shared


@pytest.fixture(scope="module", params=ARCHS)
def reference(request, tmp_path_factory):
    path = build_tiny_model(request.param, tmp_path_factory.mktemp(request.param))
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    prompts = make_prompts(hf.config.vocab_size)
    return request.param, path, prompts, hf_greedy(hf, prompts, NUM_NEW_TOKENS)


SETTINGS = {
    "default": dict(),
    "prefix_caching": dict(enable_prefix_caching=True, block_size=4),
    "chunked_prefill": dict(max_num_batched_tokens=8, enable_prefix_caching=False),
    "preemption": dict(num_gpu_blocks_override=24, block_size=4, max_model_len=96, max_num_batched_tokens=64),
    # The next step is scheduled while the current one runs (tokens forwarded on the device).
    "async": dict(async_scheduling=True),
    "async_preemption": dict(
        async_scheduling=True, num_gpu_blocks_override=24, block_size=4, max_model_len=96, max_num_batched_tokens=64
    ),
    "async_chunked_prefix": dict(async_scheduling=True, max_num_batched_tokens=8, enable_prefix_caching=True, block_size=4),
}


@pytest.mark.parametrize("setting", list(SETTINGS))
def test_greedy_matches_transformers(reference, setting):
    arch, path, prompts, expected = reference
    llm = LLM(path, dtype="float32", **SETTINGS[setting])
    params = SamplingParams(temperature=0.0, max_tokens=NUM_NEW_TOKENS, ignore_eos=True, logprobs=5)
    runs = 2 if "prefix" in setting else 1  # the second run reads the cached prefixes
    for _ in range(runs):
        outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        label = f"{arch}/{setting}"
        check_outputs_equal([e[0] for e in expected], [o.outputs[0].token_ids for o in outputs], label)
        for (_, ref_steps), out in zip(expected, outputs):
            check_logprobs_close(ref_steps, out.outputs[0].logprobs, atol=2e-3, label=label)
    core = llm.llm_engine.engine_core
    stats = core.scheduler
    if "prefix" in setting:
        assert stats.kv_cache_manager.stats.hits > 0
    if "preemption" in setting:
        assert stats.num_preemptions > 0
    if "async" in setting:
        assert core.num_steps_ahead > NUM_NEW_TOKENS // 2  # most steps were queued behind a running one
