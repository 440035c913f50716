"""Bad quantized checkpoints and flags: errors name the tensor or value and what is expected."""

from __future__ import annotations

import json
import os

import pytest
import torch
from quant_checkpoints import write_fp8_checkpoint
from safetensors.torch import load_file, save_file

from runtime import LLM

DOWN = "model.layers.1.mlp.down_proj"
QKV = "model.layers.0.self_attn.k_proj"


@pytest.fixture
def fp8_checkpoint(float_checkpoint, tmp_path):
    return write_fp8_checkpoint(float_checkpoint, str(tmp_path / "fp8"), "static")


def edit_tensors(path: str, edit) -> None:
    file = os.path.join(path, "model.safetensors")
    state = load_file(file)
    edit(state)
    save_file(state, file)


def edit_config(path: str, **quantization_config) -> None:
    with open(os.path.join(path, "config.json")) as f:
        config = json.load(f)
    config["quantization_config"].update(quantization_config)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config, f)


def load(path: str, **kwargs):
    return LLM(path, dtype="float32", skip_tokenizer_init=True, kv_cache_memory_bytes=16 << 20, **kwargs)


def test_unknown_quant_method_names_the_installed_ones(fp8_checkpoint):
    edit_config(fp8_checkpoint, quant_method="bitsandbytes")
    with pytest.raises(ValueError, match=r"quant_method 'bitsandbytes' is not supported; installed quant methods: "
                                         r"awq, compressed-tensors, fp8, gguf, gptq, int4_weight_only, int8, int8_weight_only$"):
        load(fp8_checkpoint)


def test_quantization_config_without_quant_method(fp8_checkpoint):
    """Not read as an unquantized checkpoint (whose FP8 tensors then 'match no parameter'): the field is named."""
    with open(os.path.join(fp8_checkpoint, "config.json")) as f:
        config = json.load(f)
    del config["quantization_config"]["quant_method"]
    with open(os.path.join(fp8_checkpoint, "config.json"), "w") as f:
        json.dump(config, f)
    with pytest.raises(ValueError, match=r"quantization_config \(keys: activation_scheme\) names no quant_method.* "
                                         r"installed quant methods: awq, compressed-tensors, fp8, gguf, gptq"):
        load(fp8_checkpoint)


def test_unknown_quantization_flag(float_checkpoint):
    with pytest.raises(ValueError, match=r"unknown quant method 'bitsandbytes'; installed: awq, compressed-tensors, fp8, "
                                         r"gguf, gptq, int4_weight_only, int8, int8_weight_only$"):
        load(float_checkpoint, quantization="bitsandbytes")


def test_flag_that_contradicts_the_checkpoint(fp8_checkpoint):
    with pytest.raises(ValueError, match=r"--quantization 'int8' does not match the checkpoint, which is quantized with 'fp8'"):
        load(fp8_checkpoint, quantization="int8")


def test_missing_scale_tensors(fp8_checkpoint):
    edit_tensors(fp8_checkpoint, lambda s: s.pop(f"{DOWN}.weight_scale"))
    with pytest.raises(ValueError, match=rf"lacks weights .*{DOWN}.weight_scale \(float32 \[1\]\)"):
        load(fp8_checkpoint)


def test_missing_scale_of_one_fused_projection(fp8_checkpoint):
    edit_tensors(fp8_checkpoint, lambda s: s.pop(f"{QKV}.input_scale"))
    with pytest.raises(ValueError, match=r"lacks weights .*model.layers.0.self_attn.qkv_proj.input_scale \(float32 \[3\]\)"):
        load(fp8_checkpoint)


def test_mismatched_weight_shape(fp8_checkpoint):
    def cut(state):
        state[f"{DOWN}.weight"] = state[f"{DOWN}.weight"][:, :-1].contiguous()

    edit_tensors(fp8_checkpoint, cut)
    with pytest.raises(ValueError, match=rf"'{DOWN}.weight' has shape \[64, 127\], expected float8_e4m3fn \[64, 128\]"):
        load(fp8_checkpoint)


def test_mismatched_scale_shape(fp8_checkpoint):
    edit_tensors(fp8_checkpoint, lambda s: s.__setitem__(f"{QKV}.weight_scale", torch.ones(4)))
    with pytest.raises(ValueError, match=rf"'{QKV}.weight_scale' has shape \[4\], expected float32 \[\] or \[1\]"):
        load(fp8_checkpoint)


def test_unquantized_weight_in_an_fp8_checkpoint(fp8_checkpoint):
    edit_tensors(fp8_checkpoint, lambda s: s.__setitem__(f"{DOWN}.weight", s[f"{DOWN}.weight"].float()))
    with pytest.raises(ValueError, match=rf"'{DOWN}.weight' has dtype float32, expected float8_e4m3fn \[64, 128\]"):
        load(fp8_checkpoint)


def test_block_scales_of_the_wrong_layout(float_checkpoint, tmp_path):
    path = write_fp8_checkpoint(float_checkpoint, str(tmp_path / "block"), "dynamic", [32, 32])
    edit_tensors(path, lambda s: s.__setitem__(f"{DOWN}.weight_scale_inv", torch.ones(2, 2)))
    with pytest.raises(ValueError, match=rf"'{DOWN}.weight_scale_inv' has shape \[2, 2\], expected float32 \[2, 4\] "
                                         r"\(one scale per 32x32 block\)"):
        load(path)


@pytest.mark.parametrize("shape", [[8], [2, 4, 1]], ids=["flat", "three_dims"])
def test_block_scales_of_the_right_size_but_not_a_matrix(float_checkpoint, tmp_path, shape):
    """A [2, 4] block-scale matrix stored flat (or with an extra dimension) is refused naming the tensor and
    the expected shape; it was reshaped into place silently (its values in whatever order they came)."""
    path = write_fp8_checkpoint(float_checkpoint, str(tmp_path / "block"), "dynamic", [32, 32])
    edit_tensors(path, lambda s: s.__setitem__(f"{DOWN}.weight_scale_inv", s[f"{DOWN}.weight_scale_inv"].reshape(shape)))
    with pytest.raises(ValueError, match=rf"'{DOWN}.weight_scale_inv' has shape \[{', '.join(map(str, shape))}\], "
                                         r"expected float32 \[2, 4\] \(one scale per 32x32 block\)"):
        load(path)


def test_flattened_fp8_weight(fp8_checkpoint):
    edit_tensors(fp8_checkpoint, lambda s: s.__setitem__(f"{DOWN}.weight", s[f"{DOWN}.weight"].flatten()))
    with pytest.raises(ValueError, match=rf"'{DOWN}.weight' has shape \[8192\], expected float8_e4m3fn \[64, 128\]"):
        load(fp8_checkpoint)


def test_unsupported_settings(fp8_checkpoint):
    edit_config(fp8_checkpoint, activation_scheme="per-head")
    with pytest.raises(ValueError, match=r"activation_scheme 'per-head' is not supported; supported: static, dynamic"):
        load(fp8_checkpoint)
    edit_config(fp8_checkpoint, activation_scheme="static", weight_block_size=[128, 128])
    with pytest.raises(ValueError, match=r"weight_block_size\) need activation_scheme 'dynamic'"):
        load(fp8_checkpoint)


def test_int8_refuses_a_quantized_checkpoint():
    from runtime_quant.int8 import Int8Method

    with pytest.raises(ValueError, match=r"already quantized \(quant_method 'fp8'\).*compressed-tensors"):
        Int8Method().get_config({"quant_method": "fp8"}, None)


def test_compressed_tensors_schemes_it_cannot_run():
    from runtime_quant.compressed_tensors import CompressedTensorsMethod

    w4 = {"quant_method": "compressed-tensors", "format": "marlin-24", "config_groups": {"group_0": {
        "targets": ["Linear"], "weights": {"num_bits": 4, "type": "int", "strategy": "group", "symmetric": True}}}}
    with pytest.raises(ValueError, match=r"group 'group_0': format 'marlin-24' is not supported; supported: 8-bit"):
        CompressedTensorsMethod().get_config(w4, None)
    w4["format"] = "int-quantized"
    with pytest.raises(ValueError, match=r"group 'group_0': 4-bit int is not supported"):
        CompressedTensorsMethod().get_config(w4, None)
    with pytest.raises(ValueError, match=r"reads quantized checkpoints.*--quantization fp8 or int8"):
        CompressedTensorsMethod().get_config(None, None)


def _fp8_head(with_scale: bool):
    def edit(state):
        w = state["lm_head.weight"]
        scale = (w.abs().max() / 448.0).float()
        state["lm_head.weight"] = (w / scale).to(torch.float8_e4m3fn)
        if with_scale:
            state["lm_head.weight_scale"] = scale
    return edit


@pytest.mark.parametrize("with_scale", [True, False], ids=["with_scale", "codes_alone"])
def test_quantized_lm_head_where_fp8_keeps_it_plain(fp8_checkpoint, with_scale):
    """fp8 keeps lm_head unquantized: an FP8 head is refused naming it and the layout it expects
    (its codes alone were loaded as if they were weights; with a scale, a misleading 'another architecture')."""
    edit_tensors(fp8_checkpoint, _fp8_head(with_scale))
    with pytest.raises(ValueError, match=r"checkpoint tensor 'lm_head.weight' is quantized \(its dtype float8_e4m3fn .*"
                                         r"leaves lm_head unquantized .*expected lm_head.weight as 16/32-bit floats "
                                         r"\[512, 64\]"):
        load(fp8_checkpoint)


def test_ignored_fused_layer_with_quantized_tensors(fp8_checkpoint):
    """A config that ignores q/k/v while the checkpoint holds them in FP8: named, not an AttributeError."""
    edit_config(fp8_checkpoint, ignored_layers=["q_proj", "k_proj", "v_proj"])
    with pytest.raises(ValueError, match=r"checkpoint tensor 'model.layers.0.self_attn.\w_proj.\w+' is quantized .*"
                                         r"leaves model.layers.0.self_attn.\w_proj unquantized .*\[\d+, 64\]"):
        load(fp8_checkpoint)


@pytest.mark.parametrize("entry", ["model.layers.1", "layers.1.mlp"])
@torch.no_grad()
def test_ignored_layers_by_module_prefix(float_checkpoint, tmp_path, entry):
    """``ignored_layers`` / ``modules_to_not_convert`` entries naming a module skip every layer under it
    (transformers' and vLLM's reading); the model then matches the reference with those layers float."""
    from quant_checkpoints import FP8, reference_model
    from test_quant_parity import check_paged_logits, load_quantized

    path = write_fp8_checkpoint(float_checkpoint, str(tmp_path / "fp8"), "dynamic")
    float_state = load_file(os.path.join(float_checkpoint, "model.safetensors"))

    def under(name: str) -> bool:
        return f".{entry}." in f".{name}."

    def keep_float(state):
        for name in [n for n in state if under(n)]:
            if name.endswith("_proj.weight_scale"):
                del state[name]
            elif name.endswith("_proj.weight"):
                state[name] = float_state[name]

    edit_tensors(path, keep_float)
    edit_config(path, modules_to_not_convert=[entry])
    model = load_quantized(path, None)
    plain = {n for n, m in model.named_modules() if n.endswith("_proj") and m.quant_method is None}
    quantized = {n for n, m in model.named_modules() if n.endswith("_proj") and m.quant_method is not None}
    assert plain and all(under(n) for n in plain), plain
    assert quantized and not any(under(n) for n in quantized), quantized
    check_paged_logits(model, reference_model(float_checkpoint, "token", FP8, quant_path=path), entry, 2e-2)
