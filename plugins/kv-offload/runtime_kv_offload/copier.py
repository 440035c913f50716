"""Block copies between the paged KV cache (any backend layout) and flat host buffers."""

from __future__ import annotations

import hashlib

import torch


class BlockCopier:
    """Copies blocks (one block of every layer each) between the cache and flat ``[block_bytes]``
    uint8 host buffers, a few blocks at a time: one gather or scatter per layer on the cache's
    device, then one host copy per block (not one per block and layer)."""

    def __init__(self, kv_caches: list[torch.Tensor], block_dim: int):
        layers = [cache.movedim(block_dim, 0) for cache in kv_caches]  # [num_blocks, ...] views
        self.segments = []  # (offset, nbytes, dtype, block shape) per layer
        offset = 0
        for layer in layers:
            shape = tuple(layer.shape[1:])
            nbytes = layer[0].numel() * layer.element_size()
            self.segments.append((offset, nbytes, layer.dtype, shape))
            offset += nbytes
        # The gathers and scatters run on a 1-byte cache (``--kv-cache-dtype fp8``) as uint8: the bytes are
        # the same, and torch has no index_copy_ (nor, on some devices, index_select) for the float8 types.
        self.layers = [layer.view(torch.uint8) if layer.element_size() == 1 else layer for layer in layers]
        self.block_bytes = offset
        self.device = kv_caches[0].device
        self.non_blocking = kv_caches[0].is_cuda

    def _layer_views(self, flat: torch.Tensor):
        """Each layer's part of ``flat`` [k, block_bytes] as a [k, *block shape] view of its dtype."""
        for layer, (offset, nbytes, _, shape) in zip(self.layers, self.segments):
            yield layer, flat[:, offset : offset + nbytes].view(layer.dtype).view(flat.shape[0], *shape)

    def _ids(self, block_ids: list[int]) -> torch.Tensor:
        # From pinned memory: a copy from pageable memory would wait for the stream, which
        # waits for the forward passes queued before (the host would stall).
        ids = torch.tensor(block_ids, dtype=torch.int64, pin_memory=self.non_blocking)
        return ids.to(self.device, non_blocking=True) if self.non_blocking else ids

    @torch.inference_mode()  # also on the background thread: buffers made in the step are inference tensors
    def to_host(self, block_ids: list[int], buffers: list[torch.Tensor]) -> None:
        """Copy cache blocks ``block_ids`` into the host ``buffers`` (queued on the current stream on a GPU)."""
        ids = self._ids(block_ids)
        staging = torch.empty((len(block_ids), self.block_bytes), dtype=torch.uint8, device=self.device)
        for layer, view in self._layer_views(staging):
            view.copy_(layer.index_select(0, ids))
        for row, buffer in zip(staging, buffers):
            buffer.copy_(row, non_blocking=self.non_blocking)

    @torch.inference_mode()
    def to_device(self, buffers: list[torch.Tensor], block_ids: list[int]) -> None:
        """Copy the host ``buffers`` into cache blocks ``block_ids``."""
        staging = torch.empty((len(block_ids), self.block_bytes), dtype=torch.uint8, device=self.device)
        for row, buffer in zip(staging, buffers):
            row.copy_(buffer, non_blocking=self.non_blocking)
        ids = self._ids(block_ids)
        for layer, view in self._layer_views(staging):
            layer.index_copy_(0, ids, view)

    def layout_key(self, model: str, block_layout: str = "") -> str:
        """Names the model and the block layout, with the attention backend's order of a block's bytes when it
        is not the usual one (``CacheConfig.kv_block_layout``): disk tier folders never mix layouts."""
        text = repr((model, [(str(dtype), shape) for _, _, dtype, shape in self.segments]))
        if block_layout:
            text += f" {block_layout}"
        return hashlib.sha256(text.encode()).hexdigest()[:16]
