"""4-bit weight-only checkpoints with the engine's features: a GPTQ checkpoint with act-order (the
input permutation too) and a GGUF file kept packed (``--quantization gguf``), through
``runtime.LLM`` with prefix caching, chunked prefill on a tiny budget, forced preemption, the
asynchronous pipeline with preemption and with chunked prefix caching, two greedy samples a
prompt (n=2), and ngram speculative decoding (the drafts verified through the packed layers). Greedy tokens must equal the reference's: transformers' model with the GPTQ weights
dequantized, and the GGUF file dequantized at load (both compute in float32).
"""

from __future__ import annotations

import gc

import pytest
from wna16_checkpoints import dequantized_reference, write_gptq_checkpoint

from runtime import LLM, SamplingParams
from runtime.testing.conformance import SETTINGS
from runtime.testing.models import UNTOKENIZED_VOCAB_SIZE
from runtime.testing.reference import check_outputs_equal, hf_greedy, make_prompts

from spec_decode.engine_runs import repetitive_prompts, spec_counts

NUM_NEW_TOKENS = 12
NGRAM = dict(speculative_config={"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1,
                                 "prompt_lookup_max": 3})
FEATURES = {**{name: SETTINGS[name] for name in ("prefix_caching", "chunked_prefill", "preemption", "async_preemption",
                                                 "async_chunked_prefix")}, "n2": {}, "ngram": NGRAM}


def generate(llm: LLM, prompts, n: int = 1) -> list[list[list[int]]]:
    params = SamplingParams(n=n, temperature=0.0, max_tokens=NUM_NEW_TOKENS, ignore_eos=True)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [[c.token_ids for c in o.outputs] for o in outputs]


@pytest.fixture(scope="module")
def sources(float_checkpoints, tmp_path_factory):
    """name -> (path, --quantization, the reference's greedy tokens per prompt), and the prompts."""
    import gguf
    from spec_decode.gguf_models import write_qwen2_gguf

    prompts = make_prompts()[:3] + repetitive_prompts(UNTOKENIZED_VOCAB_SIZE)  # the latter for ngram to find
    src = float_checkpoints("llama")
    gptq, real = write_gptq_checkpoint(src, str(tmp_path_factory.mktemp("gptq") / "q"), 4, 64, act_order=True)
    gptq_expected = [tokens for tokens, _ in hf_greedy(dequantized_reference(src, real), prompts, NUM_NEW_TOKENS)]
    path = write_qwen2_gguf(float_checkpoints("qwen2"), tmp_path_factory.mktemp("gguf") / "tiny.gguf",
                            gguf.GGMLQuantizationType.Q4_0)
    llm = LLM(path, dtype="float32", skip_tokenizer_init=True)  # dequantized at load
    gguf_expected = [samples[0] for samples in generate(llm, prompts)]
    del llm
    gc.collect()
    return {"gptq": (gptq, None, gptq_expected), "gguf": (path, "gguf", gguf_expected)}, prompts


@pytest.mark.parametrize("feature", list(FEATURES))
@pytest.mark.parametrize("source", ["gptq", "gguf"])
def test_greedy_tokens_with_engine_features(sources, source, feature):
    by_name, prompts = sources
    path, quantization, expected = by_name[source]
    llm = LLM(path, dtype="float32", quantization=quantization, skip_tokenizer_init=True, **FEATURES[feature])
    packed = [m for m in llm.llm_engine.engine_core.executor.worker.model_runner.model.modules()
              if getattr(m, "quant_method", None) is not None]
    assert packed, f"{source}: no layer kept its quantized weights"
    label = f"{source}/{feature}"
    n = 2 if feature == "n2" else 1
    for _ in range(2 if "prefix" in feature else 1):  # the second run reads cached blocks
        outputs = generate(llm, prompts, n)
        for sample in range(n):
            check_outputs_equal(expected, [samples[sample] for samples in outputs], f"{label} sample {sample}")
    scheduler = llm.llm_engine.engine_core.scheduler
    if "prefix" in feature:
        assert scheduler.kv_cache_manager.stats.hits > 0, label
    if "preemption" in feature:
        assert scheduler.num_preemptions > 0, label
    if feature == "ngram":
        assert spec_counts(llm)[0] > 0, f"{label}: no draft was verified"
    del llm
    gc.collect()
