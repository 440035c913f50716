"""The ``{{ cookiecutter.__underscored }}_sdpa`` attention backend.

It builds on the runtime's reference paged attention,
:class:`runtime.attention.sdpa.SdpaAttentionBackend` (plain torch, every platform), and
keeps its KV cache layout ``[2, num_blocks, block_size, num_kv_heads, head_size]``.
Replace ``forward`` with your own kernel, or only ``decode`` (the one-token requests of
a step) as runtime-plugin-cpu's ``cpu_paged`` does. ``forward_calls`` counts forward
passes, so that tests can tell this backend really ran.
"""

from __future__ import annotations

import torch

from runtime.attention.backend import AttentionLayerSpec, AttentionMetadata
from runtime.attention.sdpa import SdpaAttentionBackend


class {{ cookiecutter.__class_prefix }}AttentionBackend(SdpaAttentionBackend):
    """Paged attention for the ``cpu`` platform (see the module docstring)."""

    name = "{{ cookiecutter.__underscored }}_sdpa"
    forward_calls = 0  # shared by all instances

    def forward(
        self,
        layer: AttentionLayerSpec,
        query: torch.Tensor,  # [num_tokens, num_heads, head_size]
        key: torch.Tensor,  # [num_tokens, num_kv_heads, head_size]
        value: torch.Tensor,  # [num_tokens, num_kv_heads, head_size]
        kv_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_size]
        metadata: AttentionMetadata,
    ) -> torch.Tensor:
        {{ cookiecutter.__class_prefix }}AttentionBackend.forward_calls += 1
        return super().forward(layer, query, key, value, kv_cache, metadata)
