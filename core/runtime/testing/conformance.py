"""The parity suite: greedy tokens identical to transformers, for every architecture.

Each tiny random float32 checkpoint (:mod:`runtime.testing.models`) runs through the
offline ``LLM`` on the target platform and attention backend (the ``conformance_target``
fixture, see :mod:`runtime.testing.plugin`) in settings that exercise the paged KV cache:
prefix caching, chunked prefill with tiny budgets, forced preemption, and the asynchronous
step pipeline. Tokens must equal transformers' greedy tokens (float32 on the CPU) and the
top-5 logprobs must agree within ``LOGPROB_ATOL``.

Import the tests into a test module of your own (``from runtime.testing.conformance import *``)
or run ``pytest -p runtime.testing.plugin --pyargs runtime.testing``.
"""

from __future__ import annotations

import gc

import pytest

from runtime.testing.models import TINY_ARCHS, build_untokenized_model
from runtime.testing.reference import check_logprobs_close, check_outputs_equal, make_prompts, reference_outputs

__all__ = ["conformance_reference", "test_greedy_tokens_match_transformers", "SETTINGS"]

NUM_NEW_TOKENS = 24
LOGPROB_ATOL = 2e-3

# Engine arguments of each setting; every one runs every architecture.
SETTINGS = {
    "default": dict(),
    "prefix_caching": dict(enable_prefix_caching=True, block_size=4),
    "chunked_prefill": dict(max_num_batched_tokens=8, enable_prefix_caching=False),
    "preemption": dict(num_gpu_blocks_override=24, block_size=4, max_model_len=96, max_num_batched_tokens=64),
    # The next step is scheduled while the current one runs (tokens forwarded on the device).
    "async": dict(async_scheduling=True),
    "async_preemption": dict(async_scheduling=True, num_gpu_blocks_override=24, block_size=4, max_model_len=96,
                             max_num_batched_tokens=64),
    "async_chunked_prefix": dict(async_scheduling=True, max_num_batched_tokens=8, enable_prefix_caching=True,
                                 block_size=4),
}


@pytest.fixture(scope="module", params=TINY_ARCHS)
def conformance_reference(request, tmp_path_factory):
    """(arch, checkpoint path, prompts, transformers' (tokens, top-5 logprobs) per prompt)."""
    arch = request.param
    path = build_untokenized_model(arch, tmp_path_factory.mktemp(f"conformance_{arch}"))
    prompts = make_prompts()
    return arch, path, prompts, reference_outputs(path, prompts, NUM_NEW_TOKENS)


@pytest.mark.parametrize("setting", list(SETTINGS))
def test_greedy_tokens_match_transformers(conformance_target, conformance_reference, setting):
    from runtime import LLM, SamplingParams

    arch, path, prompts, expected = conformance_reference
    llm = LLM(path, dtype="float32", skip_tokenizer_init=True, **conformance_target.engine_args(), **SETTINGS[setting])
    params = SamplingParams(temperature=0.0, max_tokens=NUM_NEW_TOKENS, ignore_eos=True, logprobs=5)
    label = f"{conformance_target} {arch}/{setting}"
    runs = 2 if "prefix" in setting else 1  # the second run reads the cached prefixes
    for _ in range(runs):
        outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        check_outputs_equal([tokens for tokens, _ in expected], [o.outputs[0].token_ids for o in outputs], label)
        for (_, ref_steps), out in zip(expected, outputs):
            check_logprobs_close(ref_steps, out.outputs[0].logprobs, atol=LOGPROB_ATOL, label=label)
    scheduler = llm.llm_engine.engine_core.scheduler
    if "prefix" in setting:
        assert scheduler.kv_cache_manager.stats.hits > 0, f"{label}: the second run hit no cached prefix"
    if "preemption" in setting:
        assert scheduler.num_preemptions > 0, f"{label}: nothing was preempted"
    del llm
    gc.collect()
