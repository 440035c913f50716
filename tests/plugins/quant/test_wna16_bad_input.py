"""Weight-only checkpoints the plugin cannot run, or that do not fit: errors name the value
or tensor and what is supported / expected."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
from test_quant_bad_input import edit_config, edit_tensors, load
from wna16_checkpoints import write_awq_checkpoint, write_gptq_checkpoint

from runtime_quant.awq import AwqMethod
from runtime_quant.compressed_tensors import CompressedTensorsMethod
from runtime_quant.gptq import GptqMethod

DOWN = "model.layers.1.mlp.down_proj"
K_PROJ = "model.layers.0.self_attn.k_proj"


@pytest.fixture
def gptq_checkpoint(float_checkpoint, tmp_path):
    return write_gptq_checkpoint(float_checkpoint, str(tmp_path / "gptq"), 4, 32)[0]


@pytest.mark.parametrize("settings,message", [
    ({"bits": 3}, r"gptq bits 3 is not supported; supported: 4, 8"),
    ({"bits": 2}, r"gptq bits 2 is not supported; supported: 4, 8"),
    ({"group_size": 48}, r"gptq group_size 48 is not supported; supported: -1, 16, 32, 64, 128, 256"),
    ({"checkpoint_format": "marlin"}, r"checkpoint_format 'marlin' is not supported; supported: gptq, gptq_v2"),
    ({"dynamic": {"+:.*down.*": {"group_size": 48}}},
     r"gptq quantization_config.dynamic\['\+:.\*down.\*'\]: gptq group_size 48 is not supported; supported: -1, 16"),
    ({"sym": "false"}, r"gptq quantization_config.sym must be true or false, got 'false'"),
    ({"desc_act": 1}, r"gptq quantization_config.desc_act must be true or false, got 1"),
    ({"lm_head": "yes"}, r"gptq quantization_config.lm_head must be true or false, got 'yes'"),
])
def test_gptq_settings_it_cannot_run(settings, message):
    config = {"quant_method": "gptq", "bits": 4, "group_size": 128, "desc_act": False, "sym": True, **settings}
    with pytest.raises(ValueError, match=message):
        GptqMethod().get_config(config, None)


@pytest.mark.parametrize("settings,message", [
    ({"bits": 8}, r"awq bits 8 is not supported; supported: 4"),
    ({"version": "gemv"}, r"awq version 'gemv' is not supported; supported: gemm"),
    ({"zero_point": False}, r"awq zero_point false .* is not supported; supported: zero_point true"),
    ({"group_size": 100}, r"awq group_size 100 is not supported; supported: -1, 16"),
])
def test_awq_settings_it_cannot_run(settings, message):
    config = {"quant_method": "awq", "bits": 4, "group_size": 128, "zero_point": True, "version": "gemm", **settings}
    with pytest.raises(ValueError, match=message):
        AwqMethod().get_config(config, None)


@pytest.mark.parametrize("weights,activations,message", [
    ({"num_bits": 2}, None, r"pack-quantized num_bits 2 is not supported; supported: 4, 8"),
    ({"group_size": 96}, None, r"pack-quantized group_size 96 is not supported; supported: -1, 16"),
    ({"actorder": "columns"}, None,
     r"pack-quantized actorder 'columns' is not supported; supported: none, weight, static, group, dynamic"),
    ({"strategy": "tensor"}, None, r"pack-quantized weight strategy 'tensor' is not supported"),
    ({}, {"num_bits": 8, "type": "int", "strategy": "token", "dynamic": True},
     r"pack-quantized with quantized activations is not supported"),
])
def test_pack_quantized_settings_it_cannot_run(weights, activations, message):
    args = {"num_bits": 4, "type": "int", "strategy": "group", "group_size": 32, "symmetric": True, **weights}
    config = {"quant_method": "compressed-tensors", "format": "pack-quantized", "config_groups": {
        "group_0": {"targets": ["Linear"], "weights": args, "input_activations": activations}}}
    with pytest.raises(ValueError, match=message):
        CompressedTensorsMethod().get_config(config, None)


def test_pack_quantized_weight_actorder_is_plain():
    """actorder "weight" orders GPTQ's calibration only: the tensors are in column order."""
    args = {"num_bits": 4, "type": "int", "strategy": "group", "group_size": 32, "symmetric": False,
            "actorder": "weight"}
    config = CompressedTensorsMethod().get_config({"quant_method": "compressed-tensors", "format": "pack-quantized",
                                                   "config_groups": {"g": {"targets": ["Linear"], "weights": args}}}, None)
    method = config.linear_method("model.layers.0.mlp.down_proj")
    assert method.scheme.describe == "compressed-tensors 4-bit weights in groups of 32, asymmetric"


def test_gptq_needs_a_quantized_checkpoint(float_checkpoint):
    with pytest.raises(ValueError, match=r"gptq reads quantized checkpoints .*--quantization fp8 or int8"):
        load(float_checkpoint, quantization="gptq")


def test_detected_from_quantization_config_and_flag_agrees(gptq_checkpoint, float_checkpoint, tmp_path):
    from runtime.model_loader import resolve_model
    from runtime.quantization import select_quant_method

    assert select_quant_method(None, resolve_model(gptq_checkpoint).hf_config) == "gptq"
    assert select_quant_method("gptq", resolve_model(gptq_checkpoint).hf_config) == "gptq"
    awq = write_awq_checkpoint(float_checkpoint, str(tmp_path / "awq"), 32)[0]
    assert select_quant_method(None, resolve_model(awq).hf_config) == "awq"
    with pytest.raises(ValueError, match=r"--quantization 'gptq' does not match the checkpoint, which is quantized "
                                         r"with 'awq'"):
        load(awq, quantization="gptq")


def test_vllm_kernel_names_select_their_method(gptq_checkpoint, float_checkpoint, tmp_path):
    """``--quantization gptq_marlin`` / ``awq_marlin`` (vLLM's Marlin kernels) load as gptq / awq."""
    from runtime import LLM

    awq = write_awq_checkpoint(float_checkpoint, str(tmp_path / "awq"), 32)[0]
    for path, flag, method in ((gptq_checkpoint, "gptq_marlin", "gptq"), (awq, "awq_marlin", "awq")):
        llm = LLM(path, dtype="float32", skip_tokenizer_init=True, quantization=flag, kv_cache_memory_bytes=16 << 20)
        assert llm.llm_engine.config.model_config.quantization == method
        del llm


def _transpose(name):
    return lambda s: s.__setitem__(name, s[name].t().contiguous())


@pytest.mark.parametrize("edit,message", [
    (lambda s: s.pop(f"{DOWN}.qzeros"), rf"lacks weights .*{DOWN}.qzeros \(int32 \[4, 8\]\)"),
    (_transpose(f"{K_PROJ}.qweight"),
     rf"'{K_PROJ}.qweight' has shape \[32, 8\], expected int32 \[8, 32\] \(\[in / pack, out\], packed along in\)"),
    (lambda s: s.__setitem__(f"{DOWN}.qweight", s[f"{DOWN}.qweight"].float()),
     rf"'{DOWN}.qweight' has dtype float32, expected int32 \[16, 64\]"),
    (lambda s: s.__setitem__(f"{K_PROJ}.scales", s[f"{K_PROJ}.scales"][:1].contiguous()),
     rf"'{K_PROJ}.scales' has shape \[1, 32\], expected float \[2, 32\] \(\[groups, out\]\)"),
], ids=["missing_qzeros", "transposed_qweight", "float_qweight", "too_few_scales"])
def test_tensors_that_do_not_fit(gptq_checkpoint, edit, message):
    edit_tensors(gptq_checkpoint, edit)
    with pytest.raises(ValueError, match=message):
        load(gptq_checkpoint)


def test_act_order_g_idx_with_uneven_groups(float_checkpoint, tmp_path):
    path = write_gptq_checkpoint(float_checkpoint, str(tmp_path / "act"), 4, 32, act_order=True)[0]
    edit_tensors(path, lambda s: s.__setitem__(f"{DOWN}.g_idx", torch.zeros(128, dtype=torch.int32)))
    with pytest.raises(ValueError, match=rf"{DOWN}: .*g_idx does not give every group 32 rows \(group sizes \[128\]"):
        load(path)
    edit_config(path, desc_act=False)  # without act-order g_idx is not read: rows are in group order
    load(path)


@pytest.mark.parametrize("bad", [-1, 4], ids=["negative", "past_the_last_group"])
def test_act_order_g_idx_out_of_range(float_checkpoint, tmp_path, bad):
    """A g_idx entry outside the layer's 4 groups is named with the layer (a negative one was torch's
    'bincount only supports 1-d non-negative integral inputs', naming nothing)."""
    path = write_gptq_checkpoint(float_checkpoint, str(tmp_path / "act"), 4, 32, act_order=True)[0]

    def corrupt(state):
        g_idx = state[f"{DOWN}.g_idx"].clone()
        g_idx[5] = bad
        state[f"{DOWN}.g_idx"] = g_idx

    edit_tensors(path, corrupt)
    low, high = min(bad, 0), max(bad, 3)
    with pytest.raises(ValueError, match=rf"{DOWN}: gptq 4-bit weights in groups of 32 \(act-order\), symmetric: g_idx "
                                         rf"holds groups from {low} to {high}; expected 0 \.\. 3 \(128 input rows\)"):
        load(path)


def test_act_order_fused_projections_with_different_orders(float_checkpoint, tmp_path):
    """q, k and v share one input, so GPTQ gives them one g_idx; a layer that does not is refused."""
    path = write_gptq_checkpoint(float_checkpoint, str(tmp_path / "act"), 4, 32, act_order=True)[0]
    edit_tensors(path, lambda s: s.__setitem__(f"{K_PROJ}.g_idx", (torch.arange(64) // 32).int()))
    with pytest.raises(ValueError, match=r"model.layers.0.self_attn.qkv_proj: gptq 4-bit weights in groups of 32 "
                                         r"\(act-order\), symmetric: the projections fused into this layer have "
                                         r"different g_idx"):
        load(path)


@pytest.mark.parametrize("name,value,message", [
    ("RUNTIME_WNA16_CUDA_GEMV_MAX_ROWS", "x", "'x' is not an integer; it takes an integer from 1 to 4"),
    ("RUNTIME_WNA16_CUDA_GEMV_PROLOGUE_MAX_ROWS", "9", "=9 is out of range; it takes an integer from 0 to 4"),
    ("RUNTIME_WNA16_CUDA_GEMV_PDL", "yes", "'yes': it takes 0 (off) or 1 (on)"),
    ("RUNTIME_WNA16_CUDA_GEMV_VARIANT", "3,3,16", "columns,min_blocks must be one of [(4, 2), (4, 1), (2, 2), (2, 3)]"),
    ("RUNTIME_WNA16_CUDA_GEMV_LARGE_VARIANT", "4,2", "'4,2': it takes columns,min_blocks,chunks_per_block"),
    ("RUNTIME_WNA16_CUDA_GEMV_CLUSTERS", "on", "'on': it takes 0 (off) or 1 (on)"),
    ("RUNTIME_WNA16_DEQUANT_MIN_ROWS", "0", "=0 is out of range; it takes an integer >= 1"),
])
def test_bad_kernel_settings_name_the_variable_and_what_it_takes(name, value, message):
    """The plugin's environment settings are read at import: a bad value stops it with an error that
    names the variable, the value and what it takes (not a bare int() failure)."""
    result = subprocess.run([sys.executable, "-c", "import runtime_quant.wna16_gpu"], capture_output=True, text=True,
                            env={**os.environ, name: value}, timeout=120)
    assert result.returncode != 0 and f"ValueError: {name}" in result.stderr and message in result.stderr, result.stderr


def test_one_row_layers_of_32mi_weights_take_the_large_variant():
    """One-row calls of Llama-3-8B's gate_up [4096 x 28672] and down [14336 x 4096] take 4 columns a lane,
    qkv and o the default 2; several rows the multi-row variant; RUNTIME_WNA16_CUDA_GEMV_LARGE_VARIANT picks
    another, and "" none (every one-row layer on the default)."""
    from runtime_quant import w4a16_cuda

    assert w4a16_cuda.LARGE == w4a16_cuda.Variant(4, 2, 16)
    assert w4a16_cuda.variant_for(1, 4096, 28672) == w4a16_cuda.variant_for(1, 14336, 4096) == w4a16_cuda.LARGE
    assert w4a16_cuda.variant_for(1, 4096, 6144) == w4a16_cuda.variant_for(1, 4096, 4096) == w4a16_cuda.DEFAULT
    assert w4a16_cuda.variant_for(3, 4096, 28672) == w4a16_cuda.MULTI_ROW
    script = "from runtime_quant import w4a16_cuda as w; print(w.LARGE, w.variant_for(1, 4096, 28672).columns)"
    for value, expected in (("", "None 2"), ("2,3,8", "Variant(columns=2, min_blocks=3, chunks_per_block=8) 2")):
        result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120,
                                env={**os.environ, "RUNTIME_WNA16_CUDA_GEMV_LARGE_VARIANT": value})
        assert result.stdout.strip() == expected, result.stderr


def test_awq_checkpoint_with_a_quantized_lm_head_is_refused(float_checkpoint, tmp_path):
    """AWQ keeps lm_head unquantized: a packed head is named with the layout expected, not 'matches no parameter'."""
    path = write_awq_checkpoint(float_checkpoint, str(tmp_path / "awq"), 32)[0]

    def pack_head(state):
        w = state.pop("lm_head.weight")
        state["lm_head.qweight"] = torch.zeros(w.shape[1], w.shape[0] // 8, dtype=torch.int32)
        state["lm_head.qzeros"] = torch.zeros(w.shape[1] // 32, w.shape[0] // 8, dtype=torch.int32)
        state["lm_head.scales"] = torch.ones(w.shape[1] // 32, w.shape[0], dtype=torch.float16)

    edit_tensors(path, pack_head)
    with pytest.raises(ValueError, match=r"checkpoint tensor 'lm_head.(qweight|qzeros|scales)' is quantized .*leaves "
                                         r"lm_head unquantized .*expected lm_head.weight as 16/32-bit floats \[512, 64\]"):
        load(path)


def test_gptq_modules_to_not_convert_names_a_module_holding_layers(float_checkpoint, tmp_path):
    """``modules_to_not_convert: ["model.layers.1"]`` keeps every projection of layer 1 float (vLLM and
    transformers read entries as module prefixes); the model matches the reference with them float."""
    from safetensors.torch import load_file
    from test_quant_parity import check_paged_logits, load_quantized
    from wna16_checkpoints import dequantized_reference

    path, real = write_gptq_checkpoint(float_checkpoint, str(tmp_path / "gptq"), 4, 32)
    float_state = load_file(os.path.join(float_checkpoint, "model.safetensors"))

    def keep_layer_1_float(state):
        for name in [n for n in state if n.startswith("model.layers.1.") and n.endswith(("qweight", "qzeros", "scales", "g_idx"))]:
            del state[name]
        state.update({n: t for n, t in float_state.items() if n.startswith("model.layers.1.")})

    edit_tensors(path, keep_layer_1_float)
    edit_config(path, modules_to_not_convert=["model.layers.1"])
    model = load_quantized(path, None)
    assert [n for n, m in model.named_modules() if n.endswith("_proj") and m.quant_method is not None] == [
        f"model.layers.0.{n}" for n in ("self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj", "mlp.down_proj")]
    reference = dequantized_reference(float_checkpoint, {n: w for n, w in real.items() if not n.startswith("model.layers.1.")})
    with torch.no_grad():
        check_paged_logits(model, reference, "gptq layer 1 not converted", 1e-4)
