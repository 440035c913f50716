"""Build a registered model class on a device and fill its weights.

The model is created on the meta device (no memory, no random init), cast to the
target dtype there, then materialized with ``to_empty`` and filled from the
checkpoint, so a large model is never initialized twice.
"""

from __future__ import annotations

import torch
from torch import nn

from runtime.config import LOAD_FORMATS
from runtime.model_loader.resolve import ResolvedModel
from runtime.models.linear import MergedLinear
from runtime.models.quantize import (
    checkpoint_prefixes,
    process_quantized,
    quantize_linears,
    quantize_tied_head,
    quantized_layers,
)
from runtime.quantization import QuantConfig, detect_quant_method, hf_quantization_config

DUMMY_STD = 0.02
EIGHT_BIT_DTYPES = (torch.int8, torch.uint8, torch.float8_e4m3fn, torch.float8_e5m2)


def load_model(
    resolved: ResolvedModel,
    *,
    load_format: str = "auto",
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
    seed: int = 0,
    quant_config: QuantConfig | None = None,
) -> nn.Module:
    """The model of ``resolved`` on ``device`` in ``dtype``, in eval mode without grads.

    ``quant_config`` (default: ``resolved.quant_config``, which the engine sets from
    ``--quantization`` or the checkpoint) builds the linear layers through a quant method.
    """
    if load_format not in LOAD_FORMATS:
        raise ValueError(f"unknown load_format {load_format!r}; valid: {', '.join(LOAD_FORMATS)}")
    quant_config = quant_config if quant_config is not None else resolved.quant_config
    _check_quantized_checkpoint(resolved, quant_config)
    model = build_empty_model(resolved, dtype, torch.device(device), quant_config)
    with torch.no_grad():
        if load_format == "dummy":
            init_dummy_weights(model, seed)
        else:
            fmt = _weights_format(resolved, load_format)
            loaded = model.load_weights(_weights(resolved, fmt, model, quant_config))
            _check_all_loaded(model, loaded, resolved.gguf_file or resolved.path)
        process_quantized(model)
        if quant_config is not None:
            quantize_tied_head(model, quant_config)
    model.eval()
    model.requires_grad_(False)
    return model


def build_empty_model(
    resolved: ResolvedModel, dtype: torch.dtype, device: torch.device, quant_config: QuantConfig | None = None
) -> nn.Module:
    """The registered class for the architecture, with uninitialized weights on ``device``.

    Linear layers are built through ``quant_config`` (after the cast to ``dtype``, which
    would otherwise widen 8-bit weights).
    """
    from runtime.plugins import get_registry

    model_cls = get_registry("model").create(resolved.architecture)
    with torch.device("meta"):
        model = model_cls(resolved.hf_config).to(dtype=dtype)
        quantize_linears(model, quant_config, dtype)
    return model.to_empty(device=device)


def _check_quantized_checkpoint(resolved: ResolvedModel, quant_config: QuantConfig | None) -> None:
    declared = detect_quant_method(hf_quantization_config(resolved.hf_config))
    if declared is not None and quant_config is None:
        raise ValueError(
            f"checkpoint {resolved.path!r} is quantized (quant_method {declared!r}) but no quant config was given; "
            "load it through runtime.LLM, or pass quant_config=runtime.quantization.build_quant_config(...)"
        )


def init_dummy_weights(model: nn.Module, seed: int) -> None:
    """Random weights for benchmarks: N(0, 0.02) matrices, zero biases, neutral norms."""
    generator = torch.Generator(device=next(model.parameters()).device).manual_seed(seed)
    for module in model.modules():
        if hasattr(module, "reset_parameters") and "Norm" in type(module).__name__:
            module.reset_parameters()
            continue
        for name, param in module.named_parameters(recurse=False):
            if param.dtype in EIGHT_BIT_DTYPES:  # a pre-quantized layout: unit scales, small codes
                values = torch.empty(param.shape, device=param.device).normal_(0.0, DUMMY_STD, generator=generator)
                param.copy_(values if param.dtype.is_floating_point else (values * 64).round())
            elif not param.dtype.is_floating_point and param.dtype not in EIGHT_BIT_DTYPES:
                if "g_idx" not in name:  # packed sub-byte codes and zero points: any bits (g_idx stays valid)
                    info = torch.iinfo(param.dtype)
                    param.copy_(torch.randint(info.min, info.max, param.shape, generator=generator, device=param.device,
                                              dtype=torch.int64).to(param.dtype))
            elif "scale" in name and getattr(module, "quant_method", None) is not None:
                param.fill_(1 / 64 if getattr(module, "weight", None) is not None and module.weight.dtype == torch.int8 else 1.0)
            elif param.dim() >= 2:
                param.normal_(0.0, DUMMY_STD, generator=generator)
            else:
                param.zero_()


def _weights_format(resolved: ResolvedModel, load_format: str) -> str:
    detected = "gguf" if resolved.gguf_file else "safetensors"
    if load_format == "auto":
        return detected
    if load_format != detected:
        raise ValueError(
            f"load_format {load_format!r} does not match the model at {resolved.gguf_file or resolved.path!r}, "
            f"which is {detected}; use load_format='auto' or 'dummy'"
        )
    return load_format


def _weights(resolved: ResolvedModel, fmt: str, model: nn.Module, quant_config: QuantConfig | None):
    if fmt == "gguf":
        from runtime.model_loader.gguf_weights import gguf_weights

        packed_types = getattr(quant_config, "gguf_packed_types", ())
        return gguf_weights(resolved.gguf_file, resolved.hf_config, _packed_names(model) if packed_types else (), packed_types)
    from runtime.model_loader.safetensors_weights import safetensors_weights

    weights = safetensors_weights(resolved.path)
    if quant_config is None:
        return weights
    from runtime.model_loader.unquantized_layers import check_unquantized_layers

    return check_unquantized_layers(model, weights)


def _packed_names(model: nn.Module) -> frozenset[str]:
    """The checkpoint weight names of the quantized layers (a fused layer's projections)."""
    stacked = getattr(model, "stacked_params", {})
    return frozenset(
        f"{prefix}.weight"
        for path, layer in quantized_layers(model).items()
        for prefix in checkpoint_prefixes(path, layer, stacked)
    )


def _check_all_loaded(model: nn.Module, loaded: set[str], source: str) -> None:
    params = dict(model.named_parameters())
    missing = sorted(name for name in params if name not in loaded)
    if missing:
        quantized = tuple(f"{path}." for path in quantized_layers(model))
        # A quantized layer's tensors are named with their expected layout (dtype, shape); a plain
        # fused one's with the checkpoint tensors that did not arrive.
        missing = [
            f"{n} ({str(params[n].dtype).removeprefix('torch.')} {list(params[n].shape)})" if n.startswith(quantized)
            else _with_missing_projections(model, n, loaded)
            for n in missing
        ]
        shown = ", ".join(missing[:8]) + (f" and {len(missing) - 8} more" if len(missing) > 8 else "")
        raise ValueError(f"checkpoint {source!r} lacks weights for {type(model).__name__}: {shown}")


def _with_missing_projections(model: nn.Module, name: str, loaded: set[str]) -> str:
    """``name``, followed by the checkpoint tensors it lacks where it is a fused projection's
    parameter (``...qkv_proj.weight (no ...v_proj.weight)``)."""
    module_path, _, param_name = name.rpartition(".")
    module = model.get_submodule(module_path)
    if not isinstance(module, MergedLinear):
        return name
    try:
        prefixes = checkpoint_prefixes(module_path, module, getattr(model, "stacked_params", {}))
    except ValueError:  # a model without checkpoint names for its projections
        return name
    absent = [f"{prefix}.{param_name}" for prefix in prefixes if f"{prefix}.{param_name}" not in loaded]
    return f"{name} (no {', '.join(absent)})" if absent else name
