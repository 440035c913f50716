"""Tiny quantized checkpoints in the published layouts, and their dequantized references.

Checkpoints are written from a tiny float32 model: the ``fp8`` layout by hand (vLLM's /
transformers' FP8 format), compressed-tensors by the ``compressed-tensors`` package itself
(an independent packer). The reference is transformers' model with every quantized linear
layer's weight replaced by ``codes * scales`` and its input rounded to 8 bits the way the
scheme says (a forward pre-hook): a dequantize-then-matmul model.
"""

from __future__ import annotations

import json
import os
import shutil

import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

from runtime.testing.reference import make_prompts

FP8 = torch.float8_e4m3fn
PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
MIN_SCALE = 1.0 / (448.0 * 512.0)


def qmax(dtype: torch.dtype) -> float:
    return 448.0 if dtype == FP8 else 127.0


def to_codes(x: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    q = x.float() / scale
    if dtype == FP8:
        return q.clamp(-448.0, 448.0).to(dtype)
    return q.round().clamp(-128, 127).to(dtype)  # int8's whole range, as compressed-tensors packs


def expand_blocks(scale: torch.Tensor, shape: torch.Size, block: list[int]) -> torch.Tensor:
    """Block scales [rows/bn, cols/bk] -> [rows, cols]."""
    return scale.repeat_interleave(block[0], 0).repeat_interleave(block[1], 1)[: shape[0], : shape[1]]


def block_amax(w: torch.Tensor, block: list[int]) -> torch.Tensor:
    bn, bk = block
    padded = F.pad(w.abs(), (0, -w.shape[1] % bk, 0, -w.shape[0] % bn))
    return padded.view(padded.shape[0] // bn, bn, padded.shape[1] // bk, bk).amax(dim=(1, 3))


def layer_prefixes(state: dict[str, torch.Tensor]) -> list[str]:
    return [n.removesuffix(".weight") for n in state if n.removesuffix(".weight").endswith(PROJECTIONS)]


@torch.no_grad()
def input_amax(path: str) -> dict[str, float]:
    """Largest |input| of each projection over the test prompts (static activation scales)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    amax: dict[str, float] = {}

    def record(name):
        return lambda module, args: amax.__setitem__(name, max(amax.get(name, 0.0), args[0].abs().max().item()))

    for name, module in model.named_modules():
        if isinstance(module, torch.nn.Linear):
            module.register_forward_pre_hook(record(name))
    for prompt in make_prompts():
        model(torch.tensor([prompt]))
    return amax


def _copy_folder(src: str, dst: str, state: dict[str, torch.Tensor], quantization_config: dict) -> str:
    shutil.copytree(src, dst)
    save_file(state, os.path.join(dst, "model.safetensors"))
    with open(os.path.join(dst, "config.json")) as f:
        config = json.load(f)
    config["quantization_config"] = quantization_config
    with open(os.path.join(dst, "config.json"), "w") as f:
        json.dump(config, f)
    return dst


def write_fp8_checkpoint(src: str, dst: str, activation_scheme: str, block: list[int] | None = None) -> str:
    """vLLM's FP8 layout: float8_e4m3fn ``weight``, ``weight_scale`` [] (or ``weight_scale_inv``
    per block), ``input_scale`` [] for static activations."""
    state = load_file(os.path.join(src, "model.safetensors"))
    amax_in = input_amax(src) if activation_scheme == "static" else {}
    for prefix in layer_prefixes(state):
        w = state[f"{prefix}.weight"]
        if block:
            scale = (block_amax(w, block) / 448.0).clamp(min=MIN_SCALE)
            state[f"{prefix}.weight"] = to_codes(w, expand_blocks(scale, w.shape, block), FP8)
            state[f"{prefix}.weight_scale_inv"] = scale
        else:
            scale = (w.abs().max() / 448.0).float()
            state[f"{prefix}.weight"], state[f"{prefix}.weight_scale"] = to_codes(w, scale, FP8), scale
        if activation_scheme == "static":
            state[f"{prefix}.input_scale"] = torch.tensor(amax_in[prefix] / 448.0)
    config = {"quant_method": "fp8", "activation_scheme": activation_scheme}
    if block:
        config["weight_block_size"] = block
    return _copy_folder(src, dst, state, config)


@torch.no_grad()
def write_compressed_tensors_checkpoint(src: str, dst: str, preset: str, ignore: list[str]) -> str:
    """A compressed-tensors checkpoint of ``preset`` (``FP8``, ``FP8_DYNAMIC``, ``W8A8``,
    ``FP8_BLOCK``), its scales from ``calculate_qparams`` and packed by ``ModelCompressor``."""
    from compressed_tensors.quantization import QuantizationConfig, apply_quantization_config, preset_name_to_scheme
    from compressed_tensors.quantization.utils import calculate_qparams
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32).eval()
    amax_in = input_amax(src)
    if model.config.tie_word_embeddings:  # the head is the embedding table: never quantized
        ignore = sorted(set(ignore) | {"lm_head"})
    config = QuantizationConfig(config_groups={"group_0": preset_name_to_scheme(preset, ["Linear"])}, ignore=ignore)
    apply_quantization_config(model, config)
    for name, module in model.named_modules():
        scheme = getattr(module, "quantization_scheme", None)
        if scheme is None:
            continue
        w, args = module.weight.data, scheme.weights
        if args.strategy == "channel":
            low, high = w.amin(1, keepdim=True), w.amax(1, keepdim=True)
        elif args.strategy == "tensor":
            low, high = w.amin().reshape(1), w.amax().reshape(1)
        else:
            high = block_amax(w, args.block_structure)
            low = -high
        module.weight_scale.data.copy_(calculate_qparams(low, high, args)[0].reshape(module.weight_scale.shape))
        if hasattr(module, "input_scale"):
            bound = torch.tensor([amax_in[name]])
            module.input_scale.data.copy_(calculate_qparams(-bound, bound, scheme.input_activations)[0])
    return save_compressed(model, src, dst, None)


def save_compressed(model, src: str, dst: str, quantization_format: str | None) -> str:
    """Compress ``model`` (its quantization config applied, scales set) with ``ModelCompressor``
    and write it as a copy of the folder ``src``."""
    from compressed_tensors.compressors import ModelCompressor

    compressor = ModelCompressor.from_pretrained_model(model, quantization_format=quantization_format)
    compressor.compress_model(model)
    state = {k: v.clone().contiguous() for k, v in model.state_dict().items()}
    if model.config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    shutil.copytree(src, dst)
    save_file(state, os.path.join(dst, "model.safetensors"))
    compressor.update_config(dst)
    return dst


# ---------------------------------------------------------------- references
def fake_quant(x: torch.Tensor, kind: str, dtype: torch.dtype, input_scale=None, group: int = 0) -> torch.Tensor:
    """``x`` rounded to 8-bit codes and back: per token, per tensor (static scale), per group."""
    if kind == "token":
        scale = (x.abs().amax(-1, keepdim=True) / qmax(dtype)).clamp(min=MIN_SCALE)
    elif kind == "tensor":
        scale = input_scale
    else:
        grouped = F.pad(x, (0, -x.shape[-1] % group)).unflatten(-1, (-1, group))
        scale = (grouped.abs().amax(-1, keepdim=True) / qmax(dtype)).clamp(min=MIN_SCALE)
        return (to_codes(grouped, scale, dtype).float() * scale).flatten(-2)[..., : x.shape[-1]]
    return to_codes(x, scale, dtype).float() * scale


def dequantized(state: dict[str, torch.Tensor], prefix: str, block: list[int] | None) -> torch.Tensor:
    codes = state[f"{prefix}.weight"]
    scale = state.get(f"{prefix}.weight_scale", state.get(f"{prefix}.weight_scale_inv")).float()
    if block:
        return codes.float() * expand_blocks(scale, codes.shape, block)
    return codes.float() * (scale if scale.dim() == 2 else scale.reshape(()))


def reference_model(
    float_path: str, act: str | None, dtype: torch.dtype, quant_path: str | None = None, block: list[int] | None = None
):
    """transformers' model with dequantized weights and 8-bit activations (``act``: token,
    tensor, group, or None). ``quant_path`` None: quantize per channel here (online methods)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(float_path, dtype=torch.float32).eval()
    state = load_file(os.path.join(quant_path, "model.safetensors")) if quant_path else None
    for name, module in model.named_modules():
        if not isinstance(module, torch.nn.Linear):
            continue
        if state is None:
            if not name.endswith(PROJECTIONS):
                continue
            w = module.weight.data
            scale = (w.abs().amax(1, keepdim=True) / qmax(dtype)).clamp(min=MIN_SCALE)
            module.weight.data = to_codes(w, scale, dtype).float() * scale
        elif state.get(f"{name}.weight", torch.empty(0)).element_size() == 1:
            module.weight.data = dequantized(state, name, block)
        else:
            continue
        if act is not None:
            input_scale = state.get(f"{name}.input_scale") if state else None
            module.register_forward_pre_hook(
                lambda m, args, s=input_scale: (fake_quant(args[0], act, dtype, s, block[1] if block else 0),)
            )
    return model
