"""Attention as one opaque op inside compiled model code (``torch.compile``).

A platform that compiles decode steps (the CPU's analog of CUDA graphs, see
:mod:`runtime.worker.graphs`) compiles everything but the paged attention: the backend
reads host-side metadata, gathers blocks and writes the KV cache, which a compiler
cannot trace. Each :class:`~runtime.models.layers.Attention` layer therefore calls
``torch.ops.runtime.paged_attention`` while being compiled; the op runs the forward
context's backend eagerly at every call, exactly as the uncompiled model does, so the
compiled code fuses the norms, rotary embedding, activations and residual adds around it.

The layer's spec travels as plain arguments (the compiler bakes them into the graph);
the KV cache and the step's metadata come from the forward context at run time.

A backend can do better than an opaque call: one whose ``traced_decode_inputs`` gives a
decode step's metadata as a few tensors (``AttentionMetadata.traced``, sizes marked
dynamic) has its ``traced_decode`` -- plain torch ops writing the cache and attending --
traced into the compiled step, so the compiler fuses the block gathers, the softmax and
the cache writes into its own loops and no Python runs per layer (on the CPU that op's
Python and dispatch were about half of a batch-1 step's attention time). The choice is
made once, when the step is traced: such a backend gives the inputs for every compiled
step of its engine, or for none.
"""

from __future__ import annotations

import functools

import torch

from runtime.attention.backend import AttentionLayerSpec
from runtime.forward_context import get_forward_context


@functools.lru_cache(maxsize=None)
def _spec(layer_idx: int, num_heads: int, num_kv_heads: int, head_size: int, scale: float,
          sliding_window: int | None, logits_soft_cap: float | None) -> AttentionLayerSpec:
    return AttentionLayerSpec(layer_idx, num_heads, num_kv_heads, head_size, scale, sliding_window, logits_soft_cap)


@torch.library.custom_op("runtime::paged_attention", mutates_args=())
def paged_attention(
    query: torch.Tensor,  # [T, num_heads, head_size]
    key: torch.Tensor,  # [T, num_kv_heads, head_size]
    value: torch.Tensor,  # [T, num_kv_heads, head_size]
    cache_index: int,
    layer_idx: int,
    scale: float,
    sliding_window: int | None,
    logits_soft_cap: float | None,
) -> torch.Tensor:
    """The forward context's ``backend.forward`` for one layer: ``[T, num_heads, head_size]``.

    Writes ``key``/``value`` into the layer's KV cache (the cache is not an argument: it is
    the forward context's, invisible to the compiled graph, which must not reorder this op).
    """
    ctx = get_forward_context()
    spec = _spec(layer_idx, query.shape[1], key.shape[1], query.shape[2], scale, sliding_window, logits_soft_cap)
    return ctx.backend.forward(spec, query, key, value, ctx.kv_caches[cache_index], ctx.metadata)


@paged_attention.register_fake
def _(query, key, value, cache_index, layer_idx, scale, sliding_window, logits_soft_cap):
    return torch.empty_like(query)


def compiled_attention(spec: AttentionLayerSpec, cache_index: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Attention of a layer of ``spec`` while compiled (what :class:`Attention` calls): the
    backend's traced decode when the step has its inputs, else the ``paged_attention`` op."""
    ctx = get_forward_context()
    if ctx.metadata.traced is not None:
        return ctx.backend.traced_decode(spec, q, k, v, ctx.kv_caches[cache_index], ctx.metadata.traced)
    return torch.ops.runtime.paged_attention(
        q, k, v, cache_index, spec.layer_idx, spec.scale, spec.sliding_window, spec.logits_soft_cap
    )
