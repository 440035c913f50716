"""``kv_cache_dtype="fp8"``: keys and values stored as float8_e4m3fn, unscaled.

The reference is transformers with an attention function (registered through its
``AttentionInterface``) that rounds every key and value to float8_e4m3fn before SDPA,
which is what the engine's cache does to them: greedy tokens must be identical and
logprobs close, also when chunked prefill and prefix caching read earlier chunks back
from the cache.
"""

import pytest
import torch
from transformers import AttentionInterface, AttentionMaskInterface, AutoModelForCausalLM
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import sdpa_mask

from runtime import LLM, SamplingParams
from runtime.testing.models import build_untokenized_model
from runtime.testing.reference import check_logprobs_close, check_outputs_equal, hf_greedy, make_prompts

ARCHS = ["llama", "qwen3", "gemma3"]
NUM_NEW_TOKENS = 24
FP8 = torch.float8_e4m3fn


def fp8_kv_attention(module, query, key, value, *args, **kwargs):
    """SDPA over keys and values rounded to float8_e4m3fn and back."""
    return sdpa_attention_forward(module, query, key.to(FP8).to(key.dtype), value.to(FP8).to(value.dtype), *args, **kwargs)


AttentionInterface.register("runtime_test_fp8_kv", fp8_kv_attention)
AttentionMaskInterface.register("runtime_test_fp8_kv", sdpa_mask)  # SDPA's masks (sliding windows too)


@pytest.fixture(scope="module", params=ARCHS)
def reference(request, tmp_path_factory):
    path = build_untokenized_model(request.param, tmp_path_factory.mktemp(f"fp8-{request.param}"))
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="runtime_test_fp8_kv").eval()
    prompts = make_prompts()
    return request.param, path, prompts, hf_greedy(hf, prompts, NUM_NEW_TOKENS)


SETTINGS = {
    "default": dict(),
    "chunked_prefix": dict(max_num_batched_tokens=8, enable_prefix_caching=True, block_size=4),
}


@pytest.mark.parametrize("setting", list(SETTINGS))
def test_greedy_matches_transformers_with_fp8_keys_and_values(reference, setting):
    arch, path, prompts, expected = reference
    # Any platform: the CPU's in CI, the GPU's (Triton kernels) on a GPU machine.
    llm = LLM(path, dtype="float32", kv_cache_dtype="fp8", skip_tokenizer_init=True, kv_cache_memory_bytes=64 << 20,
              **SETTINGS[setting])
    assert all(c.dtype == FP8 for c in llm.llm_engine.engine_core.executor.worker.model_runner.kv_caches)
    params = SamplingParams(temperature=0.0, max_tokens=NUM_NEW_TOKENS, ignore_eos=True, logprobs=5)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    label = f"{arch}/{setting}/fp8"
    check_outputs_equal([e[0] for e in expected], [o.outputs[0].token_ids for o in outputs], label)
    for (_, ref_steps), out in zip(expected, outputs):
        # Float32 everywhere else; a key rounding to the other side of an fp8 step now and
        # then (float32 noise before the rounding) moves a logprob by a few thousandths.
        check_logprobs_close(ref_steps, out.outputs[0].logprobs, atol=1e-2, label=label)


def test_fp8_cache_holds_twice_the_blocks(tmp_path):
    path = build_untokenized_model("llama", tmp_path / "llama")
    blocks = {}
    for dtype in ("auto", "fp8"):
        llm = LLM(path, dtype="bfloat16", kv_cache_dtype=dtype, kv_cache_memory_bytes=4 << 20, max_model_len=256,
                  skip_tokenizer_init=True)
        blocks[dtype] = llm.llm_engine.engine_core.executor.worker.model_runner.num_blocks
    assert blocks["fp8"] == 2 * blocks["auto"]


def test_bad_kv_cache_dtype_names_the_valid_ones(tmp_path):
    path = build_untokenized_model("llama", tmp_path / "llama")
    with pytest.raises(ValueError, match=r"kv_cache_dtype 'int8'.*auto, fp8, fp8_e4m3"):
        LLM(path, kv_cache_dtype="int8", skip_tokenizer_init=True)


def test_backend_without_fp8_support_is_refused(tmp_path, monkeypatch):
    from runtime_cpu.attention import CPUPagedAttentionBackend

    monkeypatch.setattr(CPUPagedAttentionBackend, "supports_fp8_kv_cache", False)
    path = build_untokenized_model("llama", tmp_path / "llama")
    with pytest.raises(ValueError, match="'cpu_paged' does not support kv_cache_dtype 'fp8'"):
        LLM(path, kv_cache_dtype="fp8", platform="cpu", skip_tokenizer_init=True)
