"""Tiny GPTQ, AWQ and compressed-tensors ``pack-quantized`` checkpoints, and their references.

Weights of a tiny float32 model are rounded to the nearest code per group (RTN), then packed
the way each project's own packer does it, written independently of the plugin's code:
AutoGPTQ's loop over word slots (``qweight`` along the input rows, ``qzeros`` stored as
``z - 1`` in the original format), AutoAWQ's loop over its interleaved order
``[0, 2, 4, 6, 1, 3, 5, 7]``, and for compressed-tensors the ``compressed-tensors``
package itself (``ModelCompressor``). The reference is transformers' model with every
quantized projection's weight replaced by its dequantized value ``(q - z) * s`` in float32.
"""

from __future__ import annotations

import os

import torch
from quant_checkpoints import PROJECTIONS, _copy_folder, layer_prefixes, save_compressed
from safetensors.torch import load_file

AWQ_ORDER = [0, 2, 4, 6, 1, 3, 5, 7]


def rtn(w: torch.Tensor, bits: int, group: int, symmetric: bool, g_idx: torch.Tensor):
    """``w`` [out, in] -> codes [in, out] (unsigned), scales and zeros [groups, out], real weight [out, in]."""
    out_features, in_features = w.shape
    maxq = (1 << bits) - 1
    groups = int(g_idx.max()) + 1
    scales = torch.empty(groups, out_features)
    zeros = torch.empty(groups, out_features)
    for g in range(groups):
        cols = w[:, g_idx == g]
        if symmetric:
            scales[g] = (cols.abs().amax(1) * 2 / maxq).clamp(min=1e-8)
            zeros[g] = (maxq + 1) // 2
        else:
            low, high = cols.amin(1).clamp(max=0), cols.amax(1).clamp(min=0)
            scales[g] = ((high - low) / maxq).clamp(min=1e-8)
            zeros[g] = (-low / scales[g]).round().clamp(0, maxq)
    scales = scales.half().float()  # the checkpoints store float16 scales
    s, z = scales[g_idx], zeros[g_idx]  # [in, out]
    codes = (w.t() / s).round().add(z).clamp(0, maxq)
    return codes.int(), scales, zeros.int(), ((codes - z) * s).t().contiguous()


def group_index(in_features: int, group: int, act_order: bool, seed: int) -> torch.Tensor:
    rows = in_features if group == -1 else group
    g_idx = torch.arange(in_features) // rows
    if act_order:  # input rows visited in a random order: row perm[i] joins group i // rows
        perm = torch.randperm(in_features, generator=torch.Generator().manual_seed(seed))
        g_idx = torch.empty_like(g_idx).index_put_((perm,), torch.arange(in_features) // rows)
    return g_idx.int()


def _input_seed(prefix: str) -> int:
    """One seed per layer input: q/k/v share one, gate/up another."""
    parent, _, name = prefix.rpartition(".")
    shared = {"k_proj": "q_proj", "v_proj": "q_proj", "up_proj": "gate_proj"}.get(name, name)
    return sum(map(ord, f"{parent}.{shared}")) * 7919 % (1 << 31)


def pack_rows(q: torch.Tensor, bits: int) -> torch.Tensor:
    """AutoGPTQ: ``qweight[i] |= q[i * pack + j] << (bits * j)``."""
    pack = 32 // bits
    out = torch.zeros(q.shape[0] // pack, q.shape[1], dtype=torch.int64)
    for j in range(pack):
        out |= (q[j::pack].long() & ((1 << bits) - 1)) << (bits * j)
    return (out - ((out >> 31) << 32)).int()  # two's complement into int32


def pack_cols(q: torch.Tensor, bits: int, order=None) -> torch.Tensor:
    pack = 32 // bits
    order = order or list(range(pack))
    out = torch.zeros(q.shape[0], q.shape[1] // pack, dtype=torch.int64)
    for j in range(pack):
        out |= (q[:, order[j]::pack].long() & ((1 << bits) - 1)) << (bits * j)
    return (out - ((out >> 31) << 32)).int()


def write_gptq_checkpoint(src: str, dst: str, bits: int, group: int, symmetric: bool = True,
                          act_order: bool = False, checkpoint_format: str = "gptq", layer_settings=None, **config):
    """A GPTQ checkpoint (and ``{prefix: dequantized weight}``). ``layer_settings(prefix)`` may give a
    layer its own ``bits`` / ``group`` / ``symmetric`` / ``act_order`` (a dict), or None: the layer is
    stored unquantized in bfloat16 (as GPTQModel leaves the layers it skips); ``config``: more fields."""
    state = load_file(os.path.join(src, "model.safetensors"))
    real = {}
    for prefix in layer_prefixes(state) + (["lm_head"] if config.get("lm_head") else []):
        settings = {"bits": bits, "group": group, "symmetric": symmetric, "act_order": act_order}
        override = layer_settings(prefix) if layer_settings else {}
        if override is None:
            state[f"{prefix}.weight"] = state[f"{prefix}.weight"].bfloat16()
            real[prefix] = state[f"{prefix}.weight"].float()
            continue
        settings.update(override)
        b, g = settings["bits"], settings["group"]
        w = state.pop(f"{prefix}.weight")
        # GPTQ orders a layer's inputs by its Hessian, the same for projections of one input
        g_idx = group_index(w.shape[1], g, settings["act_order"], seed=_input_seed(prefix))
        codes, scales, zeros, real[prefix] = rtn(w, b, g, settings["symmetric"], g_idx)
        stored = zeros - 1 if checkpoint_format == "gptq" else zeros
        state[f"{prefix}.qweight"] = pack_rows(codes, b)
        state[f"{prefix}.qzeros"] = pack_cols(stored, b)
        state[f"{prefix}.scales"] = scales.half()
        state[f"{prefix}.g_idx"] = g_idx
    config = {"quant_method": "gptq", "bits": bits, "group_size": group, "desc_act": act_order, "sym": symmetric,
              "checkpoint_format": checkpoint_format, **config}
    return _copy_folder(src, dst, state, config), real


def write_awq_checkpoint(src: str, dst: str, group: int):
    state = load_file(os.path.join(src, "model.safetensors"))
    real = {}
    for prefix in layer_prefixes(state):
        w = state.pop(f"{prefix}.weight")
        codes, scales, zeros, real[prefix] = rtn(w, 4, group, False, group_index(w.shape[1], group, False, 0))
        # AutoAWQ: word c, slot i holds column c * 8 + AWQ_ORDER[i]
        state[f"{prefix}.qweight"] = _awq_pack(codes)
        state[f"{prefix}.qzeros"] = _awq_pack(zeros)
        state[f"{prefix}.scales"] = scales.half()
    config = {"quant_method": "awq", "bits": 4, "group_size": group, "zero_point": True, "version": "gemm"}
    return _copy_folder(src, dst, state, config), real


def _awq_pack(q: torch.Tensor) -> torch.Tensor:
    out = torch.zeros(q.shape[0], q.shape[1] // 8, dtype=torch.int64)
    for col in range(q.shape[1] // 8):
        for i in range(8):
            out[:, col] |= q[:, col * 8 + AWQ_ORDER[i]].long() << (4 * i)
    return (out - ((out >> 31) << 32)).int()


@torch.no_grad()
def write_pack_quantized_checkpoint(src: str, dst: str, bits: int, group: int | None, symmetric: bool):
    """compressed-tensors ``pack-quantized``, scales from ``calculate_qparams`` over each group's
    min/max, quantized and packed by ``ModelCompressor``; the reference weight from its ``fake_quantize``."""
    from compressed_tensors.quantization import QuantizationConfig, QuantizationScheme, apply_quantization_config
    from compressed_tensors.quantization.lifecycle import fake_quantize
    from compressed_tensors.quantization.utils import calculate_qparams
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32).eval()
    weights = {"num_bits": bits, "type": "int", "symmetric": symmetric,
               "strategy": "group" if group else "channel", "group_size": group}
    scheme = QuantizationScheme(targets=[f"re:.*({'|'.join(PROJECTIONS)})$"], weights=weights)
    apply_quantization_config(model, QuantizationConfig(config_groups={"group_0": scheme}))
    real = {}
    for name, module in model.named_modules():
        if getattr(module, "quantization_scheme", None) is None:
            continue
        w, args = module.weight.data, module.quantization_scheme.weights
        grouped = w.unflatten(1, (-1, group)) if group else w.unsqueeze(1)  # [out, groups, rows]
        scale, zero_point = calculate_qparams(grouped.amin(-1), grouped.amax(-1), args)
        module.weight_scale.data.copy_(scale.reshape(module.weight_scale.shape))
        if hasattr(module, "weight_zero_point"):
            module.weight_zero_point.data.copy_(zero_point.reshape(module.weight_zero_point.shape))
        real[name] = fake_quantize(w, module.weight_scale.data, getattr(module, "weight_zero_point", None), args)
    return save_compressed(model, src, dst, "pack-quantized"), real


def dequantized_reference(float_path: str, real: dict[str, torch.Tensor]):
    """transformers' model with each quantized projection's weight dequantized (float32)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(float_path, dtype=torch.float32).eval()
    for name, module in model.named_modules():
        if name in real:
            module.weight.data = real[name].float()
    return model
