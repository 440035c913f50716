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

DUMMY_STD = 0.02


def load_model(
    resolved: ResolvedModel,
    *,
    load_format: str = "auto",
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
    seed: int = 0,
) -> nn.Module:
    """The model of ``resolved`` on ``device`` in ``dtype``, in eval mode without grads."""
    if load_format not in LOAD_FORMATS:
        raise ValueError(f"unknown load_format {load_format!r}; valid: {', '.join(LOAD_FORMATS)}")
    model = build_empty_model(resolved, dtype, torch.device(device))
    with torch.no_grad():
        if load_format == "dummy":
            init_dummy_weights(model, seed)
        else:
            fmt = _weights_format(resolved, load_format)
            loaded = model.load_weights(_weights(resolved, fmt))
            _check_all_loaded(model, loaded, resolved.gguf_file or resolved.path)
    model.eval()
    model.requires_grad_(False)
    return model


def build_empty_model(resolved: ResolvedModel, dtype: torch.dtype, device: torch.device) -> nn.Module:
    """The registered class for the architecture, with uninitialized weights on ``device``."""
    from runtime.plugins import get_registry

    model_cls = get_registry("model").get(resolved.architecture)()
    with torch.device("meta"):
        model = model_cls(resolved.hf_config)
    return model.to(dtype=dtype).to_empty(device=device)


def init_dummy_weights(model: nn.Module, seed: int) -> None:
    """Random weights for benchmarks: N(0, 0.02) matrices, zero biases, neutral norms."""
    generator = torch.Generator(device=next(model.parameters()).device).manual_seed(seed)
    for module in model.modules():
        if hasattr(module, "reset_parameters") and "Norm" in type(module).__name__:
            module.reset_parameters()
            continue
        for param in module.parameters(recurse=False):
            if param.dim() >= 2:
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


def _weights(resolved: ResolvedModel, fmt: str):
    if fmt == "gguf":
        from runtime.model_loader.gguf_weights import gguf_weights

        return gguf_weights(resolved.gguf_file, resolved.hf_config)
    from runtime.model_loader.safetensors_weights import safetensors_weights

    return safetensors_weights(resolved.path)


def _check_all_loaded(model: nn.Module, loaded: set[str], source: str) -> None:
    missing = sorted(name for name, _ in model.named_parameters() if name not in loaded)
    if missing:
        shown = ", ".join(missing[:8]) + (f" and {len(missing) - 8} more" if len(missing) > 8 else "")
        raise ValueError(f"checkpoint {source!r} lacks weights for {type(model).__name__}: {shown}")
