"""CUDA IPC for the CudaIpcConnector: a prefill instance's KV cache layers exported once as IPC
handles (with its GPU's UUID), opened once per prefill instance by a decode instance on the same
host, and the checks that a decode instance can reach a prefill instance's GPU at all.

A decode instance opens the handles on its *own* device: the driver maps the prefill GPU's memory
into the decode GPU's address space with peer access (``cudaIpcMemLazyEnablePeerAccess``), so the
copy kernels run on the decode GPU and read the blocks over NVLink, with no host copy. That needs
the prefill GPU to be visible in the decode process (``CUDA_VISIBLE_DEVICES``) and peer access
between the two GPUs.
"""

from __future__ import annotations

import hashlib
import logging
import os

import msgspec
import torch

logger = logging.getLogger(__name__)

NAME = "CudaIpcConnector"


class LayerHandle(msgspec.Struct):
    """One KV cache layer (``[num_blocks, ...]`` view) as ``UntypedStorage._share_cuda_`` exports it."""

    dtype: str
    size: list[int]
    stride: list[int]
    offset: int  # the view's storage offset, in elements
    handle: bytes  # cudaIpcMemHandle of the allocation holding the storage
    storage_size_bytes: int
    storage_offset_bytes: int  # where the storage starts in that allocation
    ref_counter_handle: bytes
    ref_counter_offset: int
    event_handle: bytes


class PeerExport(msgspec.Struct):
    """What a prefill instance tells a decode instance once: its GPU and its layers."""

    device_uuid: str
    layers: list[LayerHandle]

    @property
    def key(self) -> str:
        """Names this export (a restarted prefill instance exports new handles, even with the same engine id)."""
        return hashlib.sha256(b"".join(layer.handle for layer in self.layers) + self.device_uuid.encode()).hexdigest()[:16]


class ClaimReply(msgspec.Struct):
    """The answer to a pull: the blocks stay leased for ``lease_left_s`` more seconds (or an error)."""

    error: str = ""
    lease_left_s: float = 0.0
    export: PeerExport | None = None


decode_claim = msgspec.msgpack.Decoder(ClaimReply).decode


def export_layers(layers: list[torch.Tensor], device_uuid: str) -> PeerExport:
    """IPC handles of every layer's storage (``layers`` are CUDA tensors, views included)."""
    handles = []
    for layer in layers:
        (_device, handle, size_bytes, offset_bytes, ref_handle, ref_offset, event_handle,
         _sync) = layer.untyped_storage()._share_cuda_()
        handles.append(LayerHandle(
            dtype=str(layer.dtype).removeprefix("torch."), size=list(layer.shape), stride=list(layer.stride()),
            offset=layer.storage_offset(), handle=bytes(handle), storage_size_bytes=int(size_bytes),
            storage_offset_bytes=int(offset_bytes), ref_counter_handle=bytes(ref_handle),
            ref_counter_offset=int(ref_offset), event_handle=bytes(event_handle or b""),
        ))
    return PeerExport(device_uuid, handles)


def open_layers(export: PeerExport, device: torch.device) -> list[torch.Tensor]:
    """The exported layers as tensors on ``device`` (this process's GPU), backed by the prefill GPU's
    memory through peer access. The producer's writes are complete before any lease is announced, so
    its IPC event is not waited on."""
    tensors = []
    for layer in export.layers:
        storage = torch.UntypedStorage._new_shared_cuda(
            device.index, layer.handle, layer.storage_size_bytes, layer.storage_offset_bytes,
            layer.ref_counter_handle, layer.ref_counter_offset, layer.event_handle, False,
        )
        dtype = getattr(torch, layer.dtype)
        tensors.append(torch.empty(0, dtype=dtype, device=device).set_(storage, layer.offset, layer.size, layer.stride))
    return tensors


def layer_layout(layers: list[torch.Tensor]) -> list[list]:
    """Each layer's dtype and one block's shape: what must match between the two instances."""
    return [[str(t.dtype).removeprefix("torch."), list(t.shape[1:])] for t in layers]


def export_layout(export: PeerExport) -> list[list]:
    return [[layer.dtype, list(layer.size[1:])] for layer in export.layers]


# ---------------------------------------------------------------- which GPUs a decode instance reaches
def device_uuids() -> list[str]:
    """The UUID of every visible CUDA device, by index."""
    return [str(torch.cuda.get_device_properties(i).uuid) for i in range(torch.cuda.device_count())]


def peer_access(own_index: int, uuids: list[str]) -> dict[str, bool]:
    """Visible device UUID -> whether this process's device can read its memory."""
    return {uuid: i == own_index or torch.cuda.can_device_access_peer(own_index, i) for i, uuid in enumerate(uuids)}


def host_gpu_count() -> int:
    """GPUs of this host whatever CUDA_VISIBLE_DEVICES says (NVML), or -1 when unknown."""
    count = getattr(torch.cuda, "_raw_device_count_nvml", None)
    try:
        return int(count()) if count is not None else -1
    except Exception:  # noqa: BLE001 - NVML missing: the check is skipped
        return -1


def startup_problem(own_uuid: str, access: dict[str, bool], num_host_gpus: int) -> str | None:
    """Why a decode instance on ``own_uuid`` could never read another GPU of this host (None: it can).

    ``access``: every visible GPU's UUID -> peer access from ``own_uuid``; ``num_host_gpus``: the
    host's GPUs (-1: unknown)."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    shown = f" (CUDA_VISIBLE_DEVICES={visible})" if visible is not None else ""
    if len(access) == 1 and num_host_gpus > 1:
        return (f"{NAME} (kv_consumer): this decode instance sees 1 of the host's {num_host_gpus} GPUs{shown}, so it "
                "cannot read a prefill instance's KV cache on another GPU. Make the prefill GPU visible too, this "
                "instance's own GPU first (the engine runs on the first visible GPU), e.g. CUDA_VISIBLE_DEVICES=1,0 for "
                "a decode instance on GPU 1 and a prefill instance on GPU 0")
    others = {uuid: ok for uuid, ok in access.items() if uuid != own_uuid}
    if others and not any(others.values()):
        return (f"{NAME} (kv_consumer): GPU {own_uuid} has no peer access to any other visible GPU "
                f"({', '.join(others)}){shown}; CUDA IPC between them is impossible: use TcpConnector")
    blocked = [uuid for uuid, ok in others.items() if not ok]
    if blocked:
        logger.warning("%s: GPU %s has no peer access to %s; prefill instances there cannot be read", NAME, own_uuid,
                       ", ".join(blocked))
    return None


def peer_problem(peer_uuid: str, own_uuid: str, access: dict[str, bool]) -> str | None:
    """Why a decode instance on ``own_uuid`` cannot read the KV cache of a prefill instance on GPU
    ``peer_uuid`` (None: it can)."""
    if peer_uuid == own_uuid or access.get(peer_uuid):
        return None
    if peer_uuid not in access:
        return (f"the prefill instance's GPU {peer_uuid} is not visible to this decode instance (visible: "
                f"{', '.join(access) or 'none'}): make it visible (CUDA_VISIBLE_DEVICES lists this instance's GPU "
                f"first, then the prefill GPU); across hosts, use TcpConnector")
    return f"this decode instance's GPU {own_uuid} has no peer access to the prefill instance's GPU {peer_uuid}"
