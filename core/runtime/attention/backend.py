"""The interface between models and attention backends.

The model runner flattens every scheduled token of a step into one batch with no
padding and describes it with :class:`AttentionMetadata`. Each attention layer
asks the current forward context for its KV cache and the backend, then calls
``backend.forward``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np
import torch


@dataclass(slots=True)
class AttentionMetadata:
    """One step's batch layout, shared by all layers.

    Requests are ordered so that ``query_start_loc`` is increasing. Tensors live on
    the model's device; the ``*_cpu`` fields are host copies for backends that
    need Python-side sizes.
    """

    num_reqs: int
    num_tokens: int
    max_query_len: int
    max_seq_len: int
    query_start_loc: torch.Tensor  # [num_reqs + 1] int32, token offsets of each request
    seq_lens: torch.Tensor  # [num_reqs] int32, KV length of each request after this step
    block_table: torch.Tensor  # [num_reqs, width] int32, physical block ids (width: see block_table_width_multiple)
    slot_mapping: torch.Tensor  # [num_tokens] int64, flat KV slot of each new token
    query_start_loc_cpu: np.ndarray  # [num_reqs + 1] int32
    seq_lens_cpu: np.ndarray  # [num_reqs] int32
    block_size: int
    backend_data: Any = None  # whatever the backend's build_metadata added
    traced: Any = None  # a compiled decode step's inputs for the backend's traced_decode (runtime.models.attention_op)


@dataclass(frozen=True, slots=True)
class AttentionLayerSpec:
    """What a backend needs to know about one attention layer."""

    layer_idx: int
    num_heads: int
    num_kv_heads: int
    head_size: int
    scale: float
    sliding_window: int | None = None  # attend to at most this many previous tokens
    logits_soft_cap: float | None = None


class AttentionBackend(Protocol):
    """Paged attention over a KV cache, for mixed prefill + decode batches.

    Optional flags (read with ``getattr``, default False): ``supports_graphs`` (safe to
    capture in a CUDA graph) and ``supports_fp8_kv_cache`` (reads and writes caches of
    ``torch.float8_e4m3fn``, ``--kv-cache-dtype fp8``; keys and values are stored as
    given and attended in the query's dtype: a checkpoint's per-tensor k/v scales are
    applied around the backend by :class:`runtime.models.layers.Attention`).

    ``fuses_rotary``: ``forward`` also takes ``rotation``, a
    :class:`runtime.models.rotary.FusedRotation` (positions and a cos/sin cache), and
    rotates the queries (in place) and the keys (into the cache) as it stores them, with
    the results of ``rotation.apply(query, key)`` before a plain ``forward``; the ``key``
    tensor itself is then left unrotated.

    ``kv_block_layout(cache_dtype) -> str``, optional: a name for the order of each block's
    bytes when the backend stores them otherwise than ``kv_cache_shape`` reads ("" or absent:
    as it reads). The shape and the bytes a block owns stay the same, so block copies work
    unchanged; the name keeps blocks of different orders apart where they outlive the
    process (the KV offload disk tier).

    ``block_table_width_multiple`` (int, default 1): ``metadata.block_table`` has a whole
    multiple of this many columns (those past a request's blocks hold any valid id). A
    backend whose kernels are compiled per class of their integer arguments (Triton's, by
    divisibility by 16) asks for 16, so that the table's row stride does not compile them
    again whenever the step's longest request changes.

    Optional methods for platforms that compile decode steps (``compiles_graphs``): a
    backend with ``traced_decode_inputs(metadata)`` and ``traced_decode(layer, query, key,
    value, kv_cache, inputs)`` has its decode attention traced into the compiled step
    instead of called as an opaque op (:mod:`runtime.models.attention_op`).
    """

    name: str

    def kv_cache_shape(
        self, num_blocks: int, block_size: int, num_kv_heads: int, head_size: int
    ) -> tuple[int, ...]:
        """Shape of one layer's KV cache tensor."""

    def build_metadata(self, metadata: AttentionMetadata) -> AttentionMetadata:
        """Add backend-specific data to the step's metadata (once per step)."""

    def forward(
        self,
        layer: AttentionLayerSpec,
        query: torch.Tensor,  # [num_tokens, num_heads, head_size]
        key: torch.Tensor,  # [num_tokens, num_kv_heads, head_size]
        value: torch.Tensor,  # [num_tokens, num_kv_heads, head_size]
        kv_cache: torch.Tensor,  # kv_cache_shape(...)
        metadata: AttentionMetadata,
    ) -> torch.Tensor:
        """Write key/value into the cache at ``slot_mapping``, then attend.

        Each request's queries are its last ``q_len`` positions, causal among
        themselves, over all of its ``seq_len`` cached keys. Returns
        ``[num_tokens, num_heads, head_size]``.
        """


def select_attention_backend(name: str | None, platform, dtype: torch.dtype, head_size: int):
    """Instantiate the named backend (or the platform's default), checking it fits."""
    from runtime.plugins import get_registry

    registry = get_registry("attention_backend")
    name = name or platform.default_attention_backend
    comp = registry.component(name)
    platforms = comp.options.get("platforms")
    if platforms and platform.name not in platforms:
        fitting = [c.name for c in registry if platform.name in (c.options.get("platforms") or [platform.name])]
        raise ValueError(
            f"attention backend {name!r} does not run on platform {platform.name!r} "
            f"(it supports {', '.join(platforms)}); backends for {platform.name}: {', '.join(fitting) or 'none'}"
        )
    dtypes = comp.options.get("dtypes")
    if dtypes and dtype not in dtypes:
        raise ValueError(f"attention backend {name!r} does not support dtype {dtype}; supported: {dtypes}")
    head_sizes = comp.options.get("head_sizes")
    if head_sizes and head_size not in head_sizes:
        raise ValueError(f"attention backend {name!r} does not support head size {head_size}; supported: {head_sizes}")
    return registry.create(name)


def kv_block_layout(backend, cache_dtype: torch.dtype) -> str:
    """The backend's name for its order of a block's bytes in caches of ``cache_dtype`` ("": the usual)."""
    method = getattr(backend, "kv_block_layout", None)
    return method(cache_dtype) if method is not None else ""


def as_cached(kv_cache: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``key`` and ``value`` as the cache gives them back: rounded through its dtype when it
    is narrower (8-bit floats), unchanged otherwise. Backends that attend a fresh prompt's
    keys without reading the cache use this, so every query sees the same stored keys."""
    if kv_cache.dtype == key.dtype or kv_cache.element_size() >= key.element_size():
        return key, value
    return key.to(kv_cache.dtype).to(key.dtype), value.to(kv_cache.dtype).to(value.dtype)


def write_kv_cache(
    kv_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_size]
    key: torch.Tensor,  # [num_tokens, num_kv_heads, head_size]
    value: torch.Tensor,  # [num_tokens, num_kv_heads, head_size]
    slot_mapping: torch.Tensor,  # [num_tokens] int64
) -> tuple[torch.Tensor, torch.Tensor]:
    """Write a step's keys and values into the standard paged layout (plain torch).

    Returns the key and value caches viewed as ``[num_slots, num_kv_heads, head_size]``.
    """
    num_kv_heads, head_size = key.shape[1], key.shape[2]
    key_cache = kv_cache[0].view(-1, num_kv_heads, head_size)
    value_cache = kv_cache[1].view(-1, num_kv_heads, head_size)
    for cache, new in ((key_cache, key), (value_cache, value)):
        new = new.to(cache.dtype)
        if cache.element_size() == 1:  # 8-bit floats have no index_copy_ on the CPU: copy their bytes
            cache, new = cache.view(torch.uint8), new.view(torch.uint8)
        cache.index_copy_(0, slot_mapping, new)
    return key_cache, value_cache
