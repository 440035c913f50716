"""Per-tensor KV cache scales from a checkpoint (``self_attn.k_scale`` / ``v_scale``, vLLM's names;
``kv_scale`` and compressed-tensors' ``k_proj.output_scale`` too) with ``kv_cache_dtype="fp8"``:
the cache holds ``k / k_scale`` and ``v / v_scale`` in float8_e4m3fn, and attention reads them
back times the scale. The reference is transformers with an attention that rounds each layer's
keys and values the same way. The scales are chosen large enough that rounding without them
gives other logits (checked), so a path that ignored them would fail. With a 16-bit cache the
scales are not used (vLLM's behaviour)."""

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AttentionInterface, AttentionMaskInterface, AutoModelForCausalLM
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import sdpa_mask

from runtime import LLM, SamplingParams
from runtime.testing.models import build_untokenized_model
from runtime.testing.reference import check_logprobs_close, check_outputs_equal, hf_greedy, make_prompts

FP8 = torch.float8_e4m3fn
NUM_NEW_TOKENS = 16
K_SCALES = [37.0, 23.0]  # per layer; keys / 37 land partly among float8's subnormals
V_SCALES = [29.0, 41.0]
SCALES: dict[int, tuple[float, float]] = {}  # layer -> (k, v) for the reference's attention


def scaled_fp8_kv_attention(module, query, key, value, *args, **kwargs):
    k_scale, v_scale = SCALES.get(module.layer_idx, (1.0, 1.0))
    key = (key / k_scale).to(FP8).to(key.dtype) * k_scale
    value = (value / v_scale).to(FP8).to(value.dtype) * v_scale
    return sdpa_attention_forward(module, query, key, value, *args, **kwargs)


AttentionInterface.register("runtime_test_scaled_fp8_kv", scaled_fp8_kv_attention)
AttentionMaskInterface.register("runtime_test_scaled_fp8_kv", sdpa_mask)


def add_tensors(path: str, tensors: dict[str, torch.Tensor]) -> None:
    file = f"{path}/model.safetensors"
    save_file({**load_file(file), **tensors}, file, metadata={"format": "pt"})


@pytest.fixture(scope="module")
def scaled(tmp_path_factory):
    path = build_untokenized_model("llama", tmp_path_factory.mktemp("kv-scales"))
    add_tensors(path, {f"model.layers.{i}.self_attn.{kind}_scale": torch.tensor(value)
                       for i, (k, v) in enumerate(zip(K_SCALES, V_SCALES)) for kind, value in (("k", k), ("v", v))})
    prompts = make_prompts()
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="runtime_test_scaled_fp8_kv")
    SCALES.update({i: (k, v) for i, (k, v) in enumerate(zip(K_SCALES, V_SCALES))})
    expected = hf_greedy(hf.eval(), prompts, NUM_NEW_TOKENS)
    SCALES.clear()  # the same rounding without the scales
    unscaled = hf_greedy(hf, prompts, NUM_NEW_TOKENS)
    return path, prompts, expected, unscaled


def test_the_scales_change_the_reference(scaled):
    _, _, expected, unscaled = scaled
    gaps = [abs(a[t] - b[t]) for (_, sa), (_, sb) in zip(expected, unscaled) for a, b in zip(sa, sb) for t in a if t in b]
    assert max(gaps) > 0.05, max(gaps)


@pytest.mark.parametrize("setting", [dict(), dict(max_num_batched_tokens=8, enable_prefix_caching=True, block_size=4)],
                         ids=["default", "chunked_prefix"])
def test_greedy_matches_transformers_with_scaled_fp8_keys_and_values(scaled, setting):
    path, prompts, expected, _ = scaled
    llm = LLM(path, dtype="float32", kv_cache_dtype="fp8", skip_tokenizer_init=True, kv_cache_memory_bytes=64 << 20,
              **setting)
    runner = llm.llm_engine.engine_core.executor.worker.model_runner
    layers = [layer.self_attn.attn for layer in runner.model.model.layers]
    assert [a.kv_scales for a in layers] == list(zip(K_SCALES, V_SCALES))
    params = SamplingParams(temperature=0.0, max_tokens=NUM_NEW_TOKENS, ignore_eos=True, logprobs=5)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    check_outputs_equal([e[0] for e in expected], [o.outputs[0].token_ids for o in outputs], "scaled fp8")
    for (_, ref_steps), out in zip(expected, outputs):
        check_logprobs_close(ref_steps, out.outputs[0].logprobs, atol=1e-2, label="scaled fp8")


def test_a_16_bit_cache_leaves_the_scales_unused(scaled):
    path = scaled[0]
    llm = LLM(path, dtype="float32", skip_tokenizer_init=True, kv_cache_memory_bytes=16 << 20)
    runner = llm.llm_engine.engine_core.executor.worker.model_runner
    attn = runner.model.model.layers[0].self_attn.attn
    assert (attn.k_scale, attn.v_scale, attn.kv_scales) == (K_SCALES[0], V_SCALES[0], None)


def test_older_names_and_bad_scales(tmp_path):
    from runtime.model_loader import load_model, resolve_model

    path = build_untokenized_model("llama", tmp_path / "llama")
    add_tensors(path, {"model.layers.0.self_attn.kv_scale": torch.tensor(3.0),
                       "model.layers.1.self_attn.k_proj.output_scale": torch.tensor([5.0]),
                       "model.layers.1.self_attn.v_proj.output_scale": torch.tensor([7.0])})
    model = load_model(resolve_model(path), dtype=torch.float32)
    scales = [(layer.self_attn.attn.k_scale, layer.self_attn.attn.v_scale) for layer in model.model.layers]
    assert scales == [(3.0, 3.0), (5.0, 7.0)]
    add_tensors(path, {"model.layers.0.self_attn.k_scale": torch.ones(4)})
    with pytest.raises(ValueError, match=r"'model\.layers\.0\.self_attn\.k_scale' has shape \[4\]: a KV cache scale is one value"):
        load_model(resolve_model(path), dtype=torch.float32)
    add_tensors(path, {"model.layers.0.self_attn.k_scale": torch.tensor(-1.0)})
    with pytest.raises(ValueError, match=r"'model\.layers\.0\.self_attn\.k_scale' is -1\.0: a KV cache scale must be positive"):
        load_model(resolve_model(path), dtype=torch.float32)
