"""Refuse quantized tensors for the linear layers a quantized model keeps unquantized.

A quant config leaves some linear layers plain (``lm_head`` where the method does not quantize
it, the layers of an ``ignore`` / ``modules_to_not_convert`` list); they load a 16/32-bit
``weight`` (and ``bias``). A checkpoint that holds such a layer quantized anyway (packed
``qweight``, ``weight_scale``, an 8-bit ``weight``) does not fit the config: without this check
its tensors would reach the plain layer, to fail deep inside torch (a fused layer has no
``weight_scale``) or, for an 8-bit ``weight`` alone, to load its codes as if they were weights.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch
from torch import nn

from runtime.models.linear import Linear, MergedLinear
from runtime.models.weights import IGNORED_SUFFIXES, KV_SCALE_SUFFIXES, fused_target

PLAIN_PARAMS = ("weight", "bias")


def _plain_layer(model: nn.Module, name: str) -> tuple[str, Linear, int] | None:
    """``(checkpoint prefix, layer, projection index)`` when ``name`` is a tensor of an unquantized
    linear layer (a fused one's projection ``index``), else None."""
    prefix, _, _ = name.rpartition(".")
    path, shard, _ = fused_target(name, getattr(model, "stacked_params", {})) or (prefix, None, None)
    try:
        layer = model.get_submodule(path)
    except AttributeError:
        return None  # not a module of this model: the weight loader names it
    if not isinstance(layer, Linear) or layer.quant_method is not None:
        return None
    index = list(layer.shard_offsets).index(shard) if isinstance(layer, MergedLinear) and shard in layer.shard_offsets else 0
    return prefix, layer, index


def _quantized_form(param: str, tensor: torch.Tensor) -> str | None:
    """Why the checkpoint tensor ``param`` is part of a quantized layout, or None when it is plain."""
    if param not in PLAIN_PARAMS:
        return f"{param!r} is a quantized layout's tensor"
    if not tensor.dtype.is_floating_point or tensor.element_size() < 2:
        return f"its dtype {str(tensor.dtype).removeprefix('torch.')} is a quantized layout's"
    return None


def check_unquantized_layers(model: nn.Module, weights: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
    """Pass ``weights`` through; a quantized tensor of a layer the quant config leaves unquantized
    is a ValueError naming the tensor, the layer and the layout it expects."""
    for name, tensor in weights:
        if not name.endswith(IGNORED_SUFFIXES) and not any(name.endswith(s) for s in KV_SCALE_SUFFIXES):
            found = _plain_layer(model, name)
            why = None if found is None else _quantized_form(name.rpartition(".")[2], tensor)
            if why is not None:
                prefix, layer, index = found
                shape = f"[{layer.output_sizes[index]}, {layer.in_features}]" if layer.tp_size == 1 else "[out, in]"
                raise ValueError(
                    f"checkpoint tensor {name!r} is quantized ({why}), but the checkpoint's quantization config "
                    f"leaves {prefix} unquantized (lm_head, or a layer its ignore list / modules_to_not_convert "
                    f"names); expected {prefix}.weight as 16/32-bit floats {shape} ([out, in]) and no other tensors"
                )
        yield name, tensor
