"""Pipeline-parallel stages of a decoder: which layers a rank holds, and the hand-over between stages.

A stage builds only its own decoder layers; the others are :class:`MissingLayer` placeholders,
so parameter names (``model.layers.5...``) stay those of the checkpoint. The first stage embeds
the tokens; every later one receives ``hidden`` and ``residual`` from the stage before, and every
stage but the last sends its own on. With one stage nothing is sent and every layer is held.
"""

from __future__ import annotations

import torch
from torch import nn

from runtime.distributed import get_parallel_state, pp_recv, pp_send


class MissingLayer(nn.Identity):
    """A decoder layer held by another pipeline stage: no parameters, never run."""


def layer_range(num_layers: int) -> tuple[int, int]:
    """``[start, end)`` of the decoder layers of this rank's pipeline stage (an even split)."""
    state = get_parallel_state()
    if num_layers < state.pp_size:
        raise ValueError(f"{num_layers} decoder layers cannot be split over {state.pp_size} pipeline stages")
    return state.pp_rank * num_layers // state.pp_size, (state.pp_rank + 1) * num_layers // state.pp_size


def stage_layers(num_layers: int, build) -> tuple[nn.ModuleList, list[nn.Module]]:
    """The layer list (``build(i)`` for the held ones, placeholders for the rest) and the held ones.

    Each held layer's attention reads the KV cache at its position among the held layers.
    """
    from runtime.models.layers import Attention

    start, end = layer_range(num_layers)
    layers = nn.ModuleList(build(i) if start <= i < end else MissingLayer() for i in range(num_layers))
    for module in layers.modules():
        if isinstance(module, Attention):
            module.cache_index = module.spec.layer_idx - start
    return layers, list(layers)[start:end]


def stage_input(embed, input_ids: torch.Tensor, hidden_size: int, dtype: torch.dtype):
    """``(hidden, residual)`` entering this stage: ``embed(input_ids)`` and None on the first."""
    if get_parallel_state().is_first_stage:
        return embed(input_ids), None
    both = pp_recv((2, input_ids.shape[0], hidden_size), dtype, input_ids.device)  # [2, T, hidden]
    return both[0], both[1]


def is_last_stage(hidden: torch.Tensor, residual: torch.Tensor) -> bool:
    """True on the last stage; any other sends ``hidden`` and ``residual`` to the next stage."""
    if get_parallel_state().is_last_stage:
        return True
    pp_send(torch.stack([hidden, residual]))
    return False


def missing_layer_prefixes(model: nn.Module) -> tuple[str, ...]:
    """Parameter name prefixes of the layers other stages hold (their checkpoint tensors are skipped)."""
    return tuple(f"{name}." for name, module in model.named_modules() if isinstance(module, MissingLayer))
