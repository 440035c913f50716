"""Build a model's linear layers through a checkpoint's quantization config.

The model is first built as usual (on the meta device); then every :class:`Linear` asks the
:class:`runtime.quantization.QuantConfig` for its :class:`runtime.quantization.LinearMethod`
by its checkpoint name. A fused layer (``qkv_proj``) asks once per projection it holds
(``q_proj``, ``k_proj``, ``v_proj``), so ignore lists written with the checkpoint's names
apply; all its projections must agree. A layer that gets a method gives up its plain
``weight`` and the method registers what it stores instead (packed weights, scales ...).
Layers that get None, and every layer when there is no config, stay exactly as built.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import nn

from runtime.models.layers import Linear, MergedLinear
from runtime.quantization import LinearMethod, QuantConfig


def checkpoint_prefixes(module_path: str, module: Linear, stacked: Mapping[str, tuple[str, str]]) -> list[str]:
    """The checkpoint names of the projections a layer holds, in row order.

    ``stacked`` maps a checkpoint module name to ``(fused module name, shard)`` (the model's
    ``stacked_params``); ``model.layers.0.mlp.gate_up_proj`` -> ``[...gate_proj, ...up_proj]``.
    """
    if not isinstance(module, MergedLinear):
        return [module_path]
    parent, _, fused_name = module_path.rpartition(".")
    by_shard = {shard: name for name, (fused, shard) in stacked.items() if fused == fused_name}
    missing = [shard for shard in module.shard_offsets if shard not in by_shard]
    if missing:
        raise ValueError(f"{module_path}: no checkpoint name for shard(s) {missing} in the model's stacked_params")
    return [f"{parent}.{by_shard[shard]}" if parent else by_shard[shard] for shard in module.shard_offsets]


def layer_linear_method(quant_config: QuantConfig, module_path: str, prefixes: list[str]) -> LinearMethod | None:
    """The one method for a layer whose projections are ``prefixes``; they must all agree."""
    methods = [quant_config.linear_method(prefix) for prefix in prefixes]
    if all(m is None for m in methods):
        return None
    if any(m is None for m in methods) or any(m != methods[0] for m in methods[1:]):
        described = ", ".join(f"{p}: {type(m).__name__ if m is not None else 'unquantized'}" for p, m in zip(prefixes, methods))
        raise ValueError(
            f"the projections fused into {module_path} must share one quantization scheme, got {described}"
        )
    return methods[0]


def quantize_linears(model: nn.Module, quant_config: QuantConfig | None, params_dtype: torch.dtype) -> int:
    """Hand each linear layer of ``model`` to its linear method; return how many got one.

    Call on the meta device, after the model is cast to ``params_dtype`` and before
    ``to_empty``: methods register their parameters there like the model's own.
    """
    if quant_config is None:
        return 0
    stacked = getattr(model, "stacked_params", {})
    count = 0
    for module_path, module in list(model.named_modules()):
        if not isinstance(module, Linear):
            continue
        method = layer_linear_method(quant_config, module_path, checkpoint_prefixes(module_path, module, stacked))
        if method is None:
            continue
        output_sizes = module.output_sizes
        del module.weight  # the method decides what the layer stores
        module.quant_method = method
        method.create_weights(module, module.in_features, output_sizes, params_dtype)
        count += 1
    return count


def quantized_layers(model: nn.Module) -> dict[str, Linear]:
    """``{module path: layer}`` of the layers that have a linear method."""
    return {name: m for name, m in model.named_modules() if getattr(m, "quant_method", None) is not None}


def process_quantized(model: nn.Module) -> None:
    """Let each linear method repack its layer once all weights are in; a ValueError (tensors
    that do not fit together) is raised again naming the layer."""
    for module_path, layer in quantized_layers(model).items():
        try:
            layer.quant_method.process_weights_after_loading(layer)
        except ValueError as exc:
            raise ValueError(f"{module_path}: {exc}") from None


def quantize_tied_head(model: nn.Module, quant_config) -> bool:
    """Give a model whose logits come from its tied embedding a quantized output layer of its
    own, where ``quant_config`` asks for one (optional ``tied_head_method() -> LinearMethod |
    None``): the method receives the embedding's weight as the layer's ``weight`` once loading
    is done. The embedding itself stays as loaded. Returns True when a head was made."""
    make = getattr(quant_config, "tied_head_method", None)
    if make is None or getattr(model, "lm_head", True) is not None or not getattr(model, "tie_word_embeddings", False):
        return False
    method = make()
    if method is None:
        return False
    from runtime.models.linear import ParallelLMHead

    embedding = model.model.embed_tokens.weight
    head = ParallelLMHead(embedding.shape[1], model.config.vocab_size)
    del head.weight
    head.quant_method = method
    method.create_weights(head, embedding.shape[1], [embedding.shape[0]], embedding.dtype)
    method.load(head, "weight", embedding.data, None)
    method.process_weights_after_loading(head)
    model.lm_head = head.to(embedding.device)
    return True

