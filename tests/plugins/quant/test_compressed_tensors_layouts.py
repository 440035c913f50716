"""compressed-tensors checkpoints with several config groups, ``re:`` ignore entries, the ``static``
actorder alias and ``kv_cache_scheme``, written by the ``compressed-tensors`` package itself.

A layer matched by several groups' targets is quantized by the most specific one (a module name,
then a ``re:`` pattern, then the class ``Linear``), as ``apply_quantization_config`` assigns them:
the checkpoint holds that group's tensors, so any other choice cannot load it (or loads it wrong)."""

from __future__ import annotations

import os

import pytest
import torch
from quant_checkpoints import _copy_folder, dequantized, fake_quant, layer_prefixes, save_compressed
from safetensors.torch import load_file
from test_quant_parity import check_paged_logits, load_quantized
from wna16_checkpoints import _input_seed, dequantized_reference, group_index, rtn

from runtime_quant.compressed_tensors import PACKED, CompressedTensorsMethod

W4A16 = {"num_bits": 4, "type": "int", "symmetric": False, "strategy": "group", "group_size": 32, "actorder": "static"}
IGNORE = ["lm_head", r"re:model\.layers\.1\.self_attn\.o_proj$"]
KV_FP8 = {"num_bits": 8, "type": "float", "strategy": "tensor", "dynamic": False, "symmetric": True}


@torch.no_grad()
def write_mixed_checkpoint(src: str, dst: str):
    """int8 W8A8 for every Linear, W4A16 (actorder "static") for ``re:.*down_proj$``, FP8 for layer 0's
    down_proj by name; layer 1's o_proj ignored by a pattern. Returns the path and the 4-bit layers'
    dequantized weights (``fake_quantize``)."""
    from compressed_tensors.quantization import (
        QuantizationConfig,
        QuantizationScheme,
        apply_quantization_config,
        preset_name_to_scheme,
    )
    from compressed_tensors.quantization.lifecycle import fake_quantize
    from compressed_tensors.quantization.utils import calculate_qparams
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32).eval()
    groups = {  # the general group first: a first-group-wins reading gives every layer int8
        "group_0": preset_name_to_scheme("W8A8", ["Linear"]),
        "group_1": QuantizationScheme(targets=["re:.*down_proj$"], weights=W4A16),
        "group_2": preset_name_to_scheme("FP8_DYNAMIC", ["model.layers.0.mlp.down_proj"]),
    }
    apply_quantization_config(model, QuantizationConfig(config_groups=groups, ignore=IGNORE))
    real = {}
    for name, module in model.named_modules():
        scheme = getattr(module, "quantization_scheme", None)
        if scheme is None:
            continue
        w, args = module.weight.data, scheme.weights
        grouped = w.unflatten(1, (-1, args.group_size)) if args.strategy == "group" else w.unsqueeze(1)
        scale, zero_point = calculate_qparams(grouped.amin(-1), grouped.amax(-1), args)
        module.weight_scale.data.copy_(scale.reshape(module.weight_scale.shape))
        if args.strategy == "group":
            module.weight_zero_point.data.copy_(zero_point.reshape(module.weight_zero_point.shape))
            real[name] = fake_quantize(w, module.weight_scale.data, module.weight_zero_point.data, args)
    return save_compressed(model, src, dst, None), real


def mixed_reference(src: str, path: str, real: dict[str, torch.Tensor]):
    """transformers' model: 8-bit layers dequantized with their inputs rounded per token to their
    weights' dtype, 4-bit layers dequantized, the ignored layers as they are."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32).eval()
    state = load_file(os.path.join(path, "model.safetensors"))
    for name, module in model.named_modules():
        if name in real:
            module.weight.data = real[name].float()
        elif state.get(f"{name}.weight", torch.empty(0)).element_size() == 1:
            dtype = state[f"{name}.weight"].dtype
            module.weight.data = dequantized(state, name, None)
            module.register_forward_pre_hook(lambda m, args, d=dtype: (fake_quant(args[0], "token", d),))
    return model


@torch.no_grad()
def test_each_layer_takes_its_most_specific_group(float_checkpoint, tmp_path):
    """Was: every layer took group_0 (int8), so the 4-bit down_proj's weight_packed was refused."""
    path, real = write_mixed_checkpoint(float_checkpoint, str(tmp_path / "mixed"))
    ours = load_quantized(path, None)
    described = {n: m.quant_method.scheme.describe for n, m in ours.named_modules() if getattr(m, "quant_method", None)}
    assert described["model.layers.0.mlp.down_proj"] == "fp8 weights per channel, dynamic per-token activations"
    assert described["model.layers.1.mlp.down_proj"] == "compressed-tensors 4-bit weights in groups of 32, asymmetric"
    assert described["model.layers.1.mlp.gate_up_proj"] == "int8 weights per channel, dynamic per-token activations"
    assert "model.layers.1.self_attn.o_proj" not in described and "lm_head" not in described
    assert "model.layers.0.self_attn.o_proj" in described
    check_paged_logits(ours, mixed_reference(float_checkpoint, path, real), "compressed-tensors mixed groups", 2e-2)


def test_target_precedence_agrees_with_compressed_tensors():
    """Names before patterns (sorted) before ``Linear``, whatever the groups' order; a target named by two
    groups takes the later one's scheme: each layer's pick is the one ``match_targets`` makes."""
    from compressed_tensors.utils.match import match_targets

    def group(targets, bits):
        return {"targets": targets, "format": "pack-quantized",
                "weights": {"num_bits": bits, "type": "int", "strategy": "channel", "symmetric": True}}

    groups = {"a": group(["Linear"], 4), "b": group(["re:.*q_proj$", "re:.*proj$"], 8), "c": group(["re:.*up_proj$"], 4),
              "d": group(["re:.*q_proj$", "model.layers.0.self_attn.q_proj"], 4), "e": group(["re:.*o_proj"], 8)}
    config = CompressedTensorsMethod().get_config({"quant_method": "compressed-tensors", "config_groups": groups}, None)
    target_bits = {t: spec["weights"]["num_bits"] for spec in groups.values() for t in spec["targets"]}
    prefixes = [f"model.layers.{i}.{p}" for i in (0, 1) for p in ("self_attn.q_proj", "self_attn.o_proj", "mlp.up_proj")]
    for prefix in prefixes + ["lm_head"]:
        expected = target_bits[match_targets(prefix, torch.nn.Linear(1, 1), target_bits)[0]]
        assert config.linear_method(prefix).scheme.bits == expected, prefix
    # the general group first: "first group that matches" would give every layer 4 bits
    assert {config.linear_method(p).scheme.bits for p in prefixes} == {4, 8}


def test_actorder_static_is_the_weight_alias():
    """compressed-tensors writes actorder "static" (its alias of "weight", llm-compressor's GPTQ default):
    the tensors are in column order, as without actorder (was refused as '(weight_g_idx)')."""
    weights = {**W4A16, "actorder": "static"}
    config = CompressedTensorsMethod().get_config({"quant_method": "compressed-tensors", "format": "pack-quantized",
                                                   "config_groups": {"g": {"targets": ["Linear"], "weights": weights}}}, None)
    assert not config.linear_method("model.layers.0.mlp.down_proj").scheme.act_order


@torch.no_grad()
def write_group_actorder_checkpoint(src: str, dst: str, group: int = 32):
    """``pack-quantized`` with actorder ``group`` as compressed-tensors < 0.12 wrote it (the current
    package refuses to make it): columns in their order, each one's group in ``weight_g_idx`` (q/k/v and
    gate/up share one), packed by compressed-tensors' ``pack_to_int32`` (signed codes, offset 8)."""
    from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32

    state = load_file(os.path.join(src, "model.safetensors"))
    real = {}
    for prefix in layer_prefixes(state):
        w = state.pop(f"{prefix}.weight")
        g_idx = group_index(w.shape[1], group, True, seed=_input_seed(prefix))
        codes, scales, zeros, real[prefix] = rtn(w, 4, group, False, g_idx)  # [in, out], [groups, out] x2
        state[f"{prefix}.weight_packed"] = pack_to_int32((codes.t() - 8).to(torch.int8).contiguous(), 4)
        state[f"{prefix}.weight_scale"] = scales.t().contiguous()
        state[f"{prefix}.weight_zero_point"] = pack_to_int32((zeros.t() - 8).to(torch.int8).contiguous(), 4, packed_dim=0)
        state[f"{prefix}.weight_shape"] = torch.tensor(list(w.shape))
        state[f"{prefix}.weight_g_idx"] = g_idx
    weights = {**W4A16, "group_size": group, "actorder": "group", "dynamic": False}
    config = {"quant_method": "compressed-tensors", "format": PACKED, "quantization_status": "compressed",
              "ignore": ["lm_head"], "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights}}}
    return _copy_folder(src, dst, state, config), real


@torch.no_grad()
def test_group_actorder_reads_weight_g_idx(float_checkpoints, tmp_path):
    """Older W4A16 checkpoints (actorder "group", tied qwen2 here) load through weight_g_idx (were refused)."""
    src = float_checkpoints("qwen2")
    path, real = write_group_actorder_checkpoint(src, str(tmp_path / "ct"))
    ours = load_quantized(path, None)
    layers = [m for m in ours.modules() if getattr(m, "quant_method", None)]
    assert len(layers) == 8 and all(m.quant_method.scheme.act_order and m.perm is not None for m in layers)
    check_paged_logits(ours, dequantized_reference(src, real), "compressed-tensors actorder group", 1e-4)


@torch.no_grad()
def test_kv_cache_scheme_alone_loads_plain_layers_and_the_kv_scales(float_checkpoint, tmp_path):
    """llm-compressor's KV-cache-only checkpoint: no config_groups, 16/32-bit weights and per-layer
    ``self_attn.k_scale`` / ``v_scale`` (was refused: 'a quantization_config with config_groups')."""
    state = load_file(os.path.join(float_checkpoint, "model.safetensors"))
    scales = {f"model.layers.{i}.self_attn.{kv}_scale": torch.tensor([0.01 * (i + 1) + (kv == "v") * 0.005])
              for i in (0, 1) for kv in "kv"}
    path = str(tmp_path / "kv")
    _copy_folder(float_checkpoint, path, {**state, **scales},
                 {"quant_method": "compressed-tensors", "format": "dense", "config_groups": {}, "ignore": [],
                  "kv_cache_scheme": KV_FP8, "quantization_status": "compressed"})
    ours = load_quantized(path, None)
    assert not any(getattr(m, "quant_method", None) for m in ours.modules())
    attn = [m for n, m in ours.named_modules() if n.endswith("self_attn.attn")]
    assert [s for a in attn for s in (a.k_scale, a.v_scale)] == pytest.approx([0.01, 0.015, 0.02, 0.025])


@pytest.mark.parametrize("change,message", [
    ({"type": "int"}, r"kv_cache_scheme with type 'int' is not supported; supported: type 'float', num_bits 8, "
                      r"strategy 'tensor', symmetric True, dynamic False"),
    ({"strategy": "attn_head"}, r"kv_cache_scheme with strategy 'attn_head' is not supported"),
    ({"symmetric": False, "num_bits": 4}, r"kv_cache_scheme with num_bits 4, symmetric False is not supported"),
    ({"dynamic": True}, r"kv_cache_scheme with dynamic True is not supported"),
])
def test_kv_cache_schemes_the_core_cannot_use_are_refused(change, message):
    """Scales of another kind would be read as FP8 per-tensor scales by an fp8 KV cache (were accepted
    silently): refused at the config, naming the field."""
    group = {"targets": ["Linear"], "format": "pack-quantized", "weights": W4A16}
    config = {"quant_method": "compressed-tensors", "config_groups": {"g": group}, "kv_cache_scheme": {**KV_FP8, **change}}
    with pytest.raises(ValueError, match=message):
        CompressedTensorsMethod().get_config(config, None)
