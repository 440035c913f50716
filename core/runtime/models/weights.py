"""Copy checkpoint tensors (Hugging Face names) into a model's parameters.

Models fuse some projections (q/k/v into ``qkv_proj``, gate/up into ``gate_up_proj``);
``stacked`` maps each Hugging Face module name to ``(fused module name, shard)`` so
that ``model.layers.0.self_attn.k_proj.weight`` lands in rows of
``model.layers.0.self_attn.qkv_proj.weight``.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

import torch
from torch import nn

from runtime.models.layers import Attention, Linear, MergedLinear
from runtime.models.pipeline import missing_layer_prefixes
from runtime.models.quantize import quantized_layers

# Tensors some checkpoints carry that hold no learned weights.
IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


def load_hf_weights(
    model: nn.Module,
    weights: Iterable[tuple[str, torch.Tensor]],
    stacked: Mapping[str, tuple[str, str]],
    tie_word_embeddings: bool,
) -> set[str]:
    """Load ``(name, tensor)`` pairs; return the model parameter names fully loaded, and the
    checkpoint names of the fused projections' tensors that arrived (``...q_proj.weight``).

    A fused parameter counts as loaded once all its shards arrived. With tied word
    embeddings a checkpoint's ``lm_head.*`` tensors (if any: a copy of the embedding, or a
    quantized head that a GPTQ ``lm_head: true`` export writes) are skipped, as vLLM does: the
    logits come from the embedding. KV cache scales
    (``self_attn.k_scale`` ...) go to the attention layers. A tensor that matches no
    parameter, or has the wrong shape, is a ``ValueError``.
    """
    params = dict(model.named_parameters())
    quantized = quantized_layers(model)
    other_stages = missing_layer_prefixes(model)  # layers that other pipeline stages hold
    loaded: set[str] = set()
    shards_seen: dict[str, set[str]] = {}
    for name, tensor in weights:
        if name.endswith(IGNORED_SUFFIXES) or (tie_word_embeddings and name.startswith("lm_head.")):
            continue
        if other_stages and name.startswith(other_stages):
            continue
        if _load_kv_scale(model, name, tensor):
            continue
        fused = fused_target(name, stacked)
        if _load_quantized(quantized, name, fused, tensor, shards_seen, loaded):
            continue
        if fused is None:
            _copy_param(model, params, name, tensor)
            loaded.add(name)
            continue
        module_path, shard, param_name = fused
        target = f"{module_path}.{param_name}"
        if target not in params:  # a layer the config lacks, a bias the layer has not ...
            raise _no_parameter(model, name)
        module = model.get_submodule(module_path)
        assert isinstance(module, MergedLinear), f"{module_path} is not a MergedLinear"
        try:
            module.load_shard(param_name, shard, tensor)
        except ValueError as exc:  # the layer gives the expected shape; name the tensor
            raise ValueError(f"checkpoint tensor {name!r} {exc}") from None
        shards_seen.setdefault(target, set()).add(shard)
        loaded.add(name)
        if shards_seen[target] == set(module.shard_offsets):
            loaded.add(target)
    return loaded


# A checkpoint's per-tensor KV cache scales (vLLM's names; compressed-tensors' older ones), and
# which of the attention layer's scales each sets.
KV_SCALE_SUFFIXES = {".k_scale": "k", ".v_scale": "v", ".kv_scale": "kv", ".k_proj.output_scale": "k",
                     ".v_proj.output_scale": "v"}


def _load_kv_scale(model: nn.Module, name: str, tensor: torch.Tensor) -> bool:
    """Give ``self_attn.k_scale`` (and the like) to the attention layer; False if ``name`` is none."""
    for suffix, which in KV_SCALE_SUFFIXES.items():
        if not name.endswith(suffix):
            continue
        attn = _attention_layer(model, name[: -len(suffix)])
        if attn is None:
            return False
        if tensor.numel() != 1:
            raise ValueError(f"checkpoint tensor {name!r} has shape {list(tensor.shape)}: a KV cache scale is one "
                             "value per layer (per-tensor scales)")
        value = float(tensor.float().reshape(()))
        if not (value > 0 and value != float("inf")):
            raise ValueError(f"checkpoint tensor {name!r} is {value}: a KV cache scale must be positive and finite")
        attn.set_kv_scale(which, value)
        return True
    return False


def _attention_layer(model: nn.Module, path: str) -> Attention | None:
    try:
        module = model.get_submodule(path)
    except AttributeError:
        return None
    if isinstance(module, Attention):
        return module
    child = getattr(module, "attn", None)
    return child if isinstance(child, Attention) else None


def _load_quantized(
    quantized: Mapping[str, Linear],
    name: str,
    fused: tuple[str, str, str] | None,
    tensor: torch.Tensor,
    shards_seen: dict[str, set[str]],
    loaded: set[str],
) -> bool:
    """Hand a tensor of a quantized layer (all but its bias) to the layer's linear method.

    Returns False when ``name`` belongs to no quantized layer. A fused layer's tensor counts
    as loaded once every projection delivered it.
    """
    module_path, _, param_name = name.rpartition(".")
    shard = None
    if fused is not None:
        module_path, shard, param_name = fused
    layer = quantized.get(module_path)
    if layer is None or param_name == "bias":
        return False
    shard_names = list(layer.shard_offsets) if isinstance(layer, MergedLinear) else [None]
    try:
        layer.quant_method.load(layer, param_name, tensor, None if shard is None else shard_names.index(shard))
    except ValueError as exc:  # the method gives the expected layout; name the tensor
        raise ValueError(f"checkpoint tensor {name!r} {exc}") from None
    target = f"{module_path}.{param_name}"
    shards_seen.setdefault(target, set()).add(shard)
    if shards_seen[target] == set(shard_names):
        loaded.add(target)
    return True


def fused_target(name: str, stacked: Mapping[str, tuple[str, str]]) -> tuple[str, str, str] | None:
    """``(fused module path, shard, param name)`` for a name of a fused projection, else None."""
    module_path, _, param_name = name.rpartition(".")
    parent, _, module_name = module_path.rpartition(".")
    if module_name not in stacked:
        return None
    fused_name, shard = stacked[module_name]
    return f"{parent}.{fused_name}" if parent else fused_name, shard, param_name


def _copy_param(model: nn.Module, params: dict[str, nn.Parameter], name: str, tensor: torch.Tensor) -> None:
    """Copy a whole checkpoint tensor in; a layer with ``load_param`` takes its rank's part of it."""
    param = params.get(name)
    if param is None:
        raise _no_parameter(model, name)
    module_path, _, param_name = name.rpartition(".")
    load_param = getattr(model.get_submodule(module_path), "load_param", None)
    if load_param is None:
        if param.shape != tensor.shape:
            raise ValueError(f"checkpoint tensor {name!r} has shape {tuple(tensor.shape)}, expected {tuple(param.shape)}")
        param.data.copy_(tensor)
        return
    try:
        load_param(param_name, tensor)
    except ValueError as exc:  # the layer gives the expected (whole) shape; name the tensor
        raise ValueError(f"checkpoint tensor {name!r} {exc}") from None


def _no_parameter(model: nn.Module, name: str) -> ValueError:
    return ValueError(
        f"checkpoint tensor {name!r} matches no parameter of {type(model).__name__} "
        f"(is the checkpoint for another architecture?)"
    )
