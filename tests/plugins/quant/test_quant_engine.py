"""The engine with quantized linear layers: ``--quantization fp8`` on a float checkpoint
through ``runtime.LLM`` (bf16 and float32), with prefix caching, chunked prefill and forced
preemption; ``runtime plugins`` lists the methods; the unquantized path is untouched."""

from __future__ import annotations

import gc

import pytest
import torch
from quant_checkpoints import FP8, reference_model, write_fp8_checkpoint

from runtime import LLM, SamplingParams
from runtime.cli.plugins_cmd import collect
from runtime.testing.conformance import SETTINGS
from runtime.testing.models import build_untokenized_model
from runtime.testing.reference import check_outputs_equal, hf_greedy, make_prompts

NUM_NEW_TOKENS = 16
FEATURES = ("prefix_caching", "chunked_prefill", "preemption")


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory):
    """A float checkpoint, its FP8 (static) checkpoint, and both references' greedy outputs."""
    src = build_untokenized_model("qwen3", tmp_path_factory.mktemp("engine-qwen3"))
    fp8 = write_fp8_checkpoint(src, str(tmp_path_factory.mktemp("engine-fp8") / "fp8"), "static")
    prompts = make_prompts()
    online = hf_greedy(reference_model(src, "token", FP8), prompts, NUM_NEW_TOKENS)
    static = hf_greedy(reference_model(src, "tensor", FP8, quant_path=fp8), prompts, NUM_NEW_TOKENS)
    return {"online": (src, "fp8", online), "checkpoint": (fp8, None, static)}, prompts


def generate(llm: LLM, prompts):
    params = SamplingParams(temperature=0.0, max_tokens=NUM_NEW_TOKENS, ignore_eos=True)
    return [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)]


@pytest.mark.parametrize("source", ["online", "checkpoint"])
@pytest.mark.parametrize("setting", FEATURES)
def test_greedy_tokens_with_engine_features(qwen3, source, setting):
    sources, prompts = qwen3
    path, quantization, expected = sources[source]
    llm = LLM(path, dtype="float32", quantization=quantization, skip_tokenizer_init=True, **SETTINGS[setting])
    label = f"qwen3/{source}/{setting}"
    for _ in range(2 if setting == "prefix_caching" else 1):  # the second run reads cached blocks
        check_outputs_equal([e[0] for e in expected], generate(llm, prompts), label)
    scheduler = llm.llm_engine.engine_core.scheduler
    if setting == "prefix_caching":
        assert scheduler.kv_cache_manager.stats.hits > 0, label
    if setting == "preemption":
        assert scheduler.num_preemptions > 0, label
    del llm
    gc.collect()


def test_fp8_on_a_bf16_checkpoint_loads_and_generates(tmp_path):
    src = build_untokenized_model("llama", tmp_path / "llama")
    llm = LLM(src, dtype="bfloat16", quantization="fp8", skip_tokenizer_init=True, kv_cache_memory_bytes=16 << 20)
    runner = llm.llm_engine.engine_core.executor.worker.model_runner
    assert llm.llm_engine.engine_core.executor.worker.model_runner.config.model_config.quantization == "fp8"
    qkv = runner.model.model.layers[0].self_attn.qkv_proj
    assert qkv.weight.dtype == FP8 and qkv.weight_scale.shape == (qkv.out_features,)
    assert runner.model.lm_head.quant_method is None and runner.model.lm_head.weight.dtype == torch.bfloat16
    tokens = generate(llm, make_prompts()[:2])
    assert all(len(t) == NUM_NEW_TOKENS for t in tokens)


def test_detected_from_the_checkpoint(qwen3):
    sources, _ = qwen3
    llm = LLM(sources["checkpoint"][0], dtype="float32", skip_tokenizer_init=True, kv_cache_memory_bytes=16 << 20)
    assert llm.llm_engine.engine_core.executor.worker.model_runner.config.model_config.quantization == "fp8"


def test_unquantized_layers_are_plain(tmp_path):
    """Without a quant config no layer gets a method: today's path, same parameters."""
    src = build_untokenized_model("llama", tmp_path / "llama")
    llm = LLM(src, dtype="float32", skip_tokenizer_init=True, kv_cache_memory_bytes=16 << 20)
    model = llm.llm_engine.engine_core.executor.worker.model_runner.model
    assert all(getattr(m, "quant_method", None) is None for m in model.modules())
    assert all(p.dtype == torch.float32 for p in model.parameters())


def test_runtime_plugins_lists_the_quant_methods():
    rows = {row["name"]: row for row in collect()}
    assert rows["quant"]["registered"]["quant_method"] == ["fp8", "int8", "compressed-tensors", "gptq", "awq", "gguf"]
    assert rows["quant"]["distribution"] == "runtime-plugin-quant"
