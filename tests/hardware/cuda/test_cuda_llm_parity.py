"""On a GPU: greedy tokens of the engine with each CUDA attention backend identical to transformers.

The engine runs in float32 on the GPU, transformers in float32 on the CPU; every
architecture is checked in settings that exercise prefix caching, chunked prefill and
preemption. Also: the KV cache sized from ``gpu_memory_utilization`` fits the card.
"""

from __future__ import annotations

import gc

import pytest
import torch

from runtime import LLM, SamplingParams

from runtime.testing.models import build_untokenized_model
from runtime.testing.reference import (
    check_logprobs_close,
    check_logprobs_close_until_divergence,
    check_outputs_equal,
    hf_greedy,
    make_prompts,
    reference_outputs,
)

pytestmark = pytest.mark.gpu

ARCHS = ["llama", "qwen2", "qwen3", "gemma3"]
# (attention backend, CUDA graphs for decode steps); sdpa reads host metadata and always runs eagerly.
MODES = [("triton", True), ("triton", False), ("sdpa", False)]
GRAPH_SIZES = [1, 2, 4, 8, 16]
NUM_NEW_TOKENS = 32
KV_BYTES = 256 << 20  # keep tests light; memory sizing is tested on its own below
SETTINGS = {
    "default": dict(),
    "prefix_caching": dict(enable_prefix_caching=True, block_size=4),
    "chunked_prefill": dict(max_num_batched_tokens=8, enable_prefix_caching=False),
    "preemption": dict(num_gpu_blocks_override=24, block_size=4, max_model_len=96, max_num_batched_tokens=64),
}
# The fastest configuration: graphs, and each step queued while the previous one runs.
ASYNC_SETTINGS = {name: dict(kwargs, async_scheduling=True) for name, kwargs in SETTINGS.items()}


@pytest.fixture(scope="module", params=ARCHS)
def reference(request, tmp_path_factory):
    path = build_untokenized_model(request.param, tmp_path_factory.mktemp(request.param))
    prompts = make_prompts()
    return request.param, path, prompts, reference_outputs(path, prompts, NUM_NEW_TOKENS)


def cuda_llm(path, backend, graphs: bool, dtype: str = "float32", **kwargs) -> LLM:
    kwargs.setdefault("kv_cache_memory_bytes", KV_BYTES)
    return LLM(path, platform="cuda", attention_backend=backend, dtype=dtype, skip_tokenizer_init=True,
               enforce_eager=not graphs, cuda_graph_sizes=GRAPH_SIZES, **kwargs)


def graph_replays(llm: LLM) -> int:
    graphs = llm.llm_engine.engine_core.executor.worker.model_runner.graphs
    return 0 if graphs is None else sum(graphs.replay_counts.values())


@pytest.mark.parametrize("setting", list(SETTINGS))
@pytest.mark.parametrize("backend,graphs", MODES, ids=[f"{b}-{'graphs' if g else 'eager'}" for b, g in MODES])
def test_greedy_matches_transformers_on_gpu(reference, backend, graphs, setting):
    arch, path, prompts, expected = reference
    llm = cuda_llm(path, backend, graphs, **SETTINGS[setting])
    params = SamplingParams(temperature=0.0, max_tokens=NUM_NEW_TOKENS, ignore_eos=True, logprobs=5, detokenize=False)
    for _ in range(2 if setting == "prefix_caching" else 1):  # the second run reads cached prefixes
        outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        label = f"{arch}/{backend}/{setting}"
        check_outputs_equal([e[0] for e in expected], [o.outputs[0].token_ids for o in outputs], label)
        for (_, ref_steps), out in zip(expected, outputs):
            check_logprobs_close(ref_steps, out.outputs[0].logprobs, atol=2e-3, label=label)
    assert (graph_replays(llm) > 0) == graphs
    scheduler = llm.llm_engine.engine_core.scheduler
    if setting == "prefix_caching":
        assert scheduler.kv_cache_manager.stats.hits > 0
    if setting == "preemption":
        assert scheduler.num_preemptions > 0


@pytest.mark.parametrize("setting", list(ASYNC_SETTINGS))
def test_greedy_matches_transformers_with_graphs_and_async_scheduling(reference, setting):
    arch, path, prompts, expected = reference
    llm = cuda_llm(path, "triton", True, **ASYNC_SETTINGS[setting])
    params = SamplingParams(temperature=0.0, max_tokens=NUM_NEW_TOKENS, ignore_eos=True, logprobs=5, detokenize=False)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    label = f"{arch}/triton-graphs-async/{setting}"
    check_outputs_equal([e[0] for e in expected], [o.outputs[0].token_ids for o in outputs], label)
    for (_, ref_steps), out in zip(expected, outputs):
        check_logprobs_close(ref_steps, out.outputs[0].logprobs, atol=2e-3, label=label)
    assert graph_replays(llm) > 0 and llm.llm_engine.engine_core.num_steps_ahead > 0


@pytest.fixture(scope="module", params=ARCHS)
def bf16_reference(request, tmp_path_factory):
    """transformers in bfloat16 on the GPU: greedy tokens and top-5 logprobs."""
    from transformers import AutoModelForCausalLM

    path = build_untokenized_model(request.param, tmp_path_factory.mktemp(f"{request.param}-bf16"))
    prompts = make_prompts()
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).cuda().eval()
    expected = hf_greedy(hf, prompts, NUM_NEW_TOKENS)
    del hf
    torch.cuda.empty_cache()
    return request.param, path, prompts, expected


@pytest.mark.parametrize("graphs", [True, False], ids=["graphs", "eager"])
def test_bf16_logprobs_close_to_transformers(bf16_reference, graphs):
    """bf16 rounding may flip a near-tie: compare until the first differing token, vLLM-style."""
    arch, path, prompts, expected = bf16_reference
    llm = cuda_llm(path, "triton", graphs, dtype="bfloat16")
    params = SamplingParams(temperature=0.0, max_tokens=NUM_NEW_TOKENS, ignore_eos=True, logprobs=5, detokenize=False)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    for (ref_tokens, ref_steps), out in zip(expected, outputs):
        check_logprobs_close_until_divergence(
            ref_tokens, ref_steps, out.outputs[0].token_ids, out.outputs[0].logprobs, atol=0.1, label=f"{arch}/bf16"
        )
    assert (graph_replays(llm) > 0) == graphs


@pytest.mark.parametrize("graphs", [True, False], ids=["graphs", "eager"])
def test_bf16_batch_1_decode_with_fused_prologues(bf16_reference, graphs, monkeypatch):
    """One sequence at a time: every decode step is batch 1, where each norm before q/k/v and
    gate/up runs inside that projection's gemv (rms_norm_gemv), and a SiLU MLP's activation as
    gate/up's gemv stores (rms_norm_gemv with gated), so silu_and_mul_gemv is not called (recorded
    while the graphs are captured, or on every eager step)."""
    import runtime_kernels.gemv as kernels

    calls = {"rms_norm_gemv": 0, "rms_norm_gemv(gated)": 0, "silu_and_mul_gemv": 0}
    for name in ("rms_norm_gemv", "silu_and_mul_gemv"):
        def counting(*args, _op=getattr(kernels, name), _name=name, **kwargs):
            calls[_name] += 1
            calls[f"{_name}(gated)"] = calls.get(f"{_name}(gated)", 0) + bool(kwargs.get("gated"))
            return _op(*args, **kwargs)

        monkeypatch.setattr(kernels, name, counting)  # the platform's custom_ops() imports them when the model is built
    arch, path, prompts, expected = bf16_reference
    llm = cuda_llm(path, "triton", graphs, dtype="bfloat16")
    params = SamplingParams(temperature=0.0, max_tokens=NUM_NEW_TOKENS, ignore_eos=True, logprobs=5, detokenize=False)
    for prompt, (ref_tokens, ref_steps) in zip(prompts[:3], expected):
        out = llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)[0].outputs[0]
        check_logprobs_close_until_divergence(ref_tokens, ref_steps, out.token_ids, out.logprobs, atol=0.1,
                                              label=f"{arch}/bf16 batch 1")
    assert calls["rms_norm_gemv"] > 0 and (calls["rms_norm_gemv(gated)"] > 0) == (arch != "gemma3"), calls
    assert calls["silu_and_mul_gemv"] == 0, calls
    assert (graph_replays(llm) > 0) == graphs


def test_kv_cache_sized_from_gpu_memory_utilization(tmp_path):
    path = build_untokenized_model("qwen3", tmp_path / "m")
    gc.collect()  # engines of earlier tests give their memory back first
    torch.cuda.empty_cache()
    # Large blocks: a tiny model's per-token KV is so small that 16-token blocks would number millions.
    llm = LLM(path, platform="cuda", dtype="bfloat16", skip_tokenizer_init=True, gpu_memory_utilization=0.5,
              block_size=128)
    total = torch.cuda.mem_get_info()[1]
    used_by_us = torch.cuda.memory_reserved()
    assert 0.3 * total < used_by_us <= 0.5 * total, (used_by_us / 2**30, total / 2**30)
    out = llm.generate([{"prompt_token_ids": [5, 6, 7]}], SamplingParams(temperature=0.0, max_tokens=4), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 4


def test_auto_detection_picks_cuda_and_triton(tmp_path):
    path = build_untokenized_model("llama", tmp_path / "m")
    llm = LLM(path, dtype="bfloat16", skip_tokenizer_init=True, kv_cache_memory_bytes=KV_BYTES)
    config = llm.llm_engine.config.device_config
    assert config.platform == "cuda"
    runner = llm.llm_engine.engine_core.executor.worker.model_runner
    assert runner.attn_backend.name == "triton" and runner.kv_caches[0].is_cuda
