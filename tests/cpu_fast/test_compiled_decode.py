"""Compiled decode steps on the CPU (issue 17): greedy tokens identical to transformers.

The CPU platform compiles decode steps by default (inductor over the model's forward, the
attention traced with plain tensor ops); the suite turns that off (tests/conftest.py) and these
tests turn it back on with ``RUNTIME_CPU_COMPILE=1``.
One engine per architecture keeps the compilations few (one graph each, its batch size
symbolic): requests of different lengths make the decode batch shrink 4 -> 1, so decode
steps of batch 1 and of larger batches run it; prefills and mixed steps stay eager. The
llama engine also chunks prefills, caches prefixes (a second run reads them) and is short
of KV blocks (preemption); the qwen3 engine schedules asynchronously.
"""

from __future__ import annotations

import gc

import pytest

from runtime import LLM, SamplingParams
from runtime.testing.models import build_untokenized_model
from runtime.testing.reference import check_logprobs_close, check_outputs_equal, make_prompts, reference_outputs

NUM_NEW_TOKENS = 12
LOGPROB_ATOL = 2e-3
BASE = dict(dtype="float32", skip_tokenizer_init=True, max_num_seqs=4, block_size=4)
# llama: llama3 RoPE, untied head; qwen2: q/k/v biases, tied head; qwen3: q/k norms; gemma3: sliding
# windows, soft caps, Gemma norms.
SETTINGS = {
    "qwen2": dict(),
    "llama": dict(enable_prefix_caching=True, max_num_batched_tokens=16, num_gpu_blocks_override=24, max_model_len=96),
    "qwen3": dict(async_scheduling=True),  # a step's input tokens forwarded from the previous step's sampling
    "gemma3": dict(enable_prefix_caching=True),
}


def model_runner(llm: LLM):
    return llm.llm_engine.engine_core.executor.worker.model_runner


@pytest.fixture(scope="module")
def qwen3_path(tmp_path_factory):
    return build_untokenized_model("qwen3", tmp_path_factory.mktemp("qwen3"))


@pytest.mark.parametrize("arch", list(SETTINGS))
def test_compiled_decode_matches_transformers(arch, tmp_path_factory, monkeypatch):
    monkeypatch.setenv("RUNTIME_CPU_COMPILE", "1")
    path = build_untokenized_model(arch, tmp_path_factory.mktemp(arch))
    prompts = make_prompts()
    expected = reference_outputs(path, prompts, NUM_NEW_TOKENS)
    llm = LLM(path, **BASE, **SETTINGS[arch])
    graphs = model_runner(llm).graphs
    assert graphs is not None and graphs.compiled is not None
    assert graphs.compiled.calls_graph_directly  # past dynamo's frame (runtime_cpu.compile._direct_call)
    assert llm.llm_engine.engine_core.async_scheduling == SETTINGS[arch].get("async_scheduling", False)
    lengths = [NUM_NEW_TOKENS - len(prompts) + 1 + i for i in range(len(prompts))]  # the last ones decode alone
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True, logprobs=5) for n in lengths]
    for run in range(2 if "enable_prefix_caching" in SETTINGS[arch] else 1):
        outputs = [o.outputs[0] for o in llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)]
        label = f"compiled {arch} run {run}"
        check_outputs_equal([tokens[:n] for (tokens, _), n in zip(expected, lengths)], [o.token_ids for o in outputs], label)
        for (_, steps), out in zip(expected, outputs):
            check_logprobs_close(steps, out.logprobs, atol=LOGPROB_ATOL, label=label)
    assert graphs.replay_counts[1] >= 1 and any(graphs.replay_counts[s] for s in (2, 3, 4)), graphs.replay_counts
    scheduler = llm.llm_engine.engine_core.scheduler
    if "enable_prefix_caching" in SETTINGS[arch]:
        assert scheduler.kv_cache_manager.stats.hits > 0
    if "num_gpu_blocks_override" in SETTINGS[arch]:
        assert scheduler.num_preemptions > 0
    del llm
    gc.collect()


@pytest.mark.parametrize("env, enforce_eager, compiled", [(None, False, True), ("0", False, False), ("1", True, False)])
def test_compiling_is_on_by_default_and_off_with_the_setting_or_enforce_eager(qwen3_path, monkeypatch, env,
                                                                              enforce_eager, compiled):
    if env is None:
        monkeypatch.delenv("RUNTIME_CPU_COMPILE", raising=False)
    else:
        monkeypatch.setenv("RUNTIME_CPU_COMPILE", env)
    llm = LLM(qwen3_path, **BASE, enforce_eager=enforce_eager)
    graphs = model_runner(llm).graphs
    if enforce_eager:
        assert graphs is None
    elif compiled:
        assert graphs.compiled is not None and graphs.shape(1, 1, 1) is not None
    else:  # the platform declined: every step runs eagerly, nothing was warmed up
        assert graphs.compiled is None and graphs.shape(1, 1, 1) is None and not graphs.replay_counts
    out = llm.generate([{"prompt_token_ids": [5, 6, 7]}], SamplingParams(temperature=0.0, max_tokens=3), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 3
    if compiled:
        assert graphs.replay_counts[1] == 2  # the two decode steps after the prefill
    else:
        assert not graphs or not graphs.replay_counts


def test_compile_setting_is_validated(monkeypatch):
    from runtime_cpu.compile import compile_enabled

    monkeypatch.setenv("RUNTIME_CPU_COMPILE", "maybe")
    with pytest.raises(ValueError, match="RUNTIME_CPU_COMPILE must be 1 .* got 'maybe'"):
        compile_enabled()


def test_each_engine_compiles_its_own_code_object():
    """Dynamo's per-code-object limit (8 versions, fatal with fullgraph) must not be shared by engines."""
    from runtime_cpu.compile import _own_code

    def forward(x):
        return x + 1

    first, second = _own_code(forward), _own_code(forward)
    assert first.__code__ is not forward.__code__ and first.__code__ is not second.__code__
    assert first(1) == second(1) == 2
