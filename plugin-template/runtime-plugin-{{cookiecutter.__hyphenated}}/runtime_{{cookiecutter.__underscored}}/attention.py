"""The ``{{ cookiecutter.__underscored }}_sdpa`` attention backend.

It builds on runtime-plugin-cpu's paged attention when that is installed and on the
plain-torch :class:`TorchPagedAttention` otherwise; both keep the KV cache of a layer
as ``[2, num_blocks, block_size, num_kv_heads, head_size]``. Replace ``forward`` with
your own kernel. ``forward_calls`` counts forward passes, so that tests can tell
this backend really ran.
"""

from __future__ import annotations

import torch

from runtime.attention.backend import AttentionLayerSpec, AttentionMetadata
from runtime_{{ cookiecutter.__underscored }}.torch_paged import TorchPagedAttention

try:
    from runtime_cpu.attention import CPUPagedAttentionBackend as BaseBackend
except ImportError:  # runtime-plugin-cpu is not installed
    BaseBackend = TorchPagedAttention


class {{ cookiecutter.__class_prefix }}AttentionBackend(BaseBackend):
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
