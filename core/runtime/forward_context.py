"""Per-step state that attention layers read while the model runs."""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass

import torch

from runtime.attention.backend import AttentionBackend, AttentionMetadata


@dataclass(slots=True)
class ForwardContext:
    backend: AttentionBackend
    metadata: AttentionMetadata
    kv_caches: list[torch.Tensor]  # one per attention layer, indexed by layer_idx


_context: ForwardContext | None = None


@contextmanager
def set_forward_context(backend: AttentionBackend, metadata: AttentionMetadata, kv_caches: list[torch.Tensor]):
    global _context
    previous = _context
    _context = ForwardContext(backend, metadata, kv_caches)
    try:
        yield _context
    finally:
        _context = previous


def get_forward_context() -> ForwardContext:
    if _context is None:
        raise RuntimeError("attention ran outside set_forward_context(); the model runner sets it for each step")
    return _context
