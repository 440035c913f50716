"""GPTQ checkpoints that quantize only some layers, or some layers differently: optimum's
``modules_in_block_to_quantize`` and GPTQModel's ``dynamic`` rules. The layers left out are stored
in bfloat16, as the exporters leave them; the reference is transformers' model with every layer's
weight as the checkpoint gives it (dequantized, or the bfloat16 values) in float32."""

from __future__ import annotations

import gc
import re

import pytest
import torch
from test_quant_parity import check_paged_logits, load_quantized
from wna16_checkpoints import dequantized_reference, write_gptq_checkpoint

from runtime import LLM, SamplingParams
from runtime.testing.reference import check_outputs_equal, hf_greedy, make_prompts
from runtime_quant.gptq import GptqMethod

LOGITS_ATOL = 1e-4
IN_BLOCK = [["self_attn.k_proj", "self_attn.v_proj", "self_attn.q_proj"], ["self_attn.o_proj"]]
# GPTQModel's rules, first match wins: layer 1's MLP stays 16-bit, the other MLP layers take 8 bits
# per channel, o_proj 8 bits in groups of 64 with act-order, lm_head 8 bits in groups of 32.
DYNAMIC = {
    r"-:model\.layers\.1\.mlp\..*": {},
    r"+:.*\.mlp\..*": {"bits": 8, "group_size": -1},
    r".*o_proj$": {"bits": 8, "group_size": 64, "desc_act": True, "sym": False},
    r"+:lm_head": {"bits": 8, "group_size": 32},
}


def dynamic_settings(prefix: str):
    """What the rules above give each layer, written independently for the checkpoint's writer."""
    if prefix.startswith("model.layers.1.mlp."):
        return None
    if ".mlp." in prefix:
        return {"bits": 8, "group": -1}
    if prefix.endswith("o_proj"):
        return {"bits": 8, "group": 64, "act_order": True, "symmetric": False}
    return {"bits": 8, "group": 32} if prefix == "lm_head" else {}


def quantized_layers(model) -> dict[str, str]:
    return {n: m.quant_method.scheme.describe for n, m in model.named_modules() if getattr(m, "quant_method", None)}


@torch.no_grad()
def test_modules_in_block_to_quantize_leaves_the_other_layers_16_bit(float_checkpoint, tmp_path):
    """optimum's list of lists: the MLP is stored in bfloat16 and loads as plain layers (was refused:
    'model.layers.0.mlp.down_proj.weight' is not part of gptq ...)."""
    path, real = write_gptq_checkpoint(
        float_checkpoint, str(tmp_path / "gptq"), 4, 32, symmetric=False, true_sequential=True,
        layer_settings=lambda prefix: {} if ".self_attn." in prefix else None, modules_in_block_to_quantize=IN_BLOCK)
    ours = load_quantized(path, None)
    assert sorted(quantized_layers(ours)) == [f"model.layers.{i}.self_attn.{p}" for i in (0, 1) for p in ("o_proj", "qkv_proj")]
    check_paged_logits(ours, dequantized_reference(float_checkpoint, real), "gptq in-block", LOGITS_ATOL)


@torch.no_grad()
def test_dynamic_rules_skip_and_override_layers(float_checkpoint, tmp_path):
    path, real = write_gptq_checkpoint(float_checkpoint, str(tmp_path / "gptq"), 4, 32, layer_settings=dynamic_settings,
                                       dynamic=DYNAMIC, lm_head=True)
    ours = load_quantized(path, None)
    layers = quantized_layers(ours)
    assert "model.layers.1.mlp.down_proj" not in layers and "model.layers.1.mlp.gate_up_proj" not in layers
    assert layers["model.layers.0.mlp.down_proj"] == "gptq 8-bit weights per channel, symmetric"
    assert layers["model.layers.1.self_attn.o_proj"] == "gptq 8-bit weights in groups of 64 (act-order), asymmetric"
    assert layers["model.layers.0.self_attn.qkv_proj"] == "gptq 4-bit weights in groups of 32, symmetric"
    assert layers["lm_head"] == "gptq 8-bit weights in groups of 32, symmetric"
    check_paged_logits(ours, dequantized_reference(float_checkpoint, real), "gptq dynamic", LOGITS_ATOL)


def test_dynamic_rules_on_a_tied_model_through_the_engine(float_checkpoints, tmp_path):
    """qwen2 (tied embeddings, q/k/v biases): greedy tokens of the engine equal the reference's."""
    src = float_checkpoints("qwen2")
    path, real = write_gptq_checkpoint(src, str(tmp_path / "gptq"), 4, 32, layer_settings=dynamic_settings, dynamic=DYNAMIC)
    prompts = make_prompts()[:3]
    expected = hf_greedy(dequantized_reference(src, real), prompts, 8)
    llm = LLM(path, dtype="float32", skip_tokenizer_init=True, kv_cache_memory_bytes=16 << 20)
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    check_outputs_equal([e[0] for e in expected], [o.outputs[0].token_ids for o in outputs], "qwen2 gptq dynamic")
    del llm
    gc.collect()


@pytest.mark.parametrize("settings,message", [
    ({"dynamic": {"+:.*down.*": {"bits": 3}}},
     r"gptq quantization_config.dynamic\['\+:.\*down.\*'\]: gptq bits 3 is not supported; supported: 4, 8"),
    ({"dynamic": {"+:.*down.*": {"sym": "no"}}},
     r"^gptq quantization_config.dynamic\['\+:.\*down.\*'\].sym must be true or false, got 'no'$"),
    ({"dynamic": {"-:.*(down": {}}}, r"gptq quantization_config.dynamic\['-:.\*\(down'\]: '.\*\(down' is not a regular"),
    ({"dynamic": {"+:.*down.*": 8}}, r"dynamic\['\+:.\*down.\*'\] must be an object of overrides .*, got 8"),
    ({"dynamic": ["-:.*down.*"]}, r"gptq quantization_config.dynamic must map module name patterns to overrides"),
    ({"pack_dtype": "int16"}, r"gptq quantization_config.pack_dtype 'int16' is not supported; supported: int32"),
    ({"is_marlin_format": True}, r"gptq quantization_config.is_marlin_format true \(Marlin-packed tensors\) is not "
                                 r"supported; supported: checkpoint_format gptq, gptq_v2"),
    ({"modules_in_block_to_quantize": "self_attn.q_proj"},
     r"gptq quantization_config.modules_in_block_to_quantize must be a list of module names .*got 'self_attn.q_proj'"),
    ({"modules_in_block_to_quantize": [["self_attn.q_proj", 3]]},
     r"modules_in_block_to_quantize must be a list of module names \(or of lists of them\)"),
])
def test_bad_layer_selection_names_the_field(settings, message):
    config = {"quant_method": "gptq", "bits": 4, "group_size": 128, "desc_act": False, "sym": True, **settings}
    with pytest.raises(ValueError, match=message):
        GptqMethod().get_config(config, None)


def test_fused_projections_given_different_schemes_are_named():
    """q/k/v run as one layer: a rule that splits them is refused naming the layer and each scheme."""
    from runtime.models.quantize import layer_linear_method

    config = GptqMethod().get_config({"quant_method": "gptq", "bits": 4, "group_size": 32,
                                      "dynamic": {r"+:.*k_proj": {"bits": 8}}}, None)
    prefixes = [f"model.layers.0.self_attn.{p}_proj" for p in "qkv"]
    with pytest.raises(ValueError, match=re.escape("must share one quantization scheme")):
        layer_linear_method(config, "model.layers.0.self_attn.qkv_proj", prefixes)
