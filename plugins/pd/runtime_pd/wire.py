"""What crosses the wire between instances (msgspec over ZMQ), and the block copies on both ends.

A pull is one DEALER -> ROUTER exchange: a :class:`PullRequest`, answered by a
:class:`PullReply` header frame followed by one frame per layer (that layer's blocks, in the
order asked, as raw bytes). A :class:`Pulled` notice (PUSH -> PULL) tells the prefill
instance's scheduler it may free the blocks.
"""

from __future__ import annotations

import zlib

import msgspec
import torch


class PullRequest(msgspec.Struct):
    request_id: str  # the prefill instance's request id
    block_ids: list[int]
    layout: str  # runtime_pd.settings.layout_key of the puller


class PullReply(msgspec.Struct):
    error: str = ""  # empty: the layer frames follow
    dtypes: list[str] = []  # per layer, e.g. "float32"
    shapes: list[list[int]] = []  # per layer: [num blocks, *one block's shape]
    checksums: list[int] = []  # per layer: crc32 of its bytes (empty: not computed)


class Pulled(msgspec.Struct):
    engine_id: str
    request_id: str


encode = msgspec.msgpack.Encoder().encode
decode_request = msgspec.msgpack.Decoder(PullRequest).decode
decode_reply = msgspec.msgpack.Decoder(PullReply).decode
decode_pulled = msgspec.msgpack.Decoder(Pulled).decode


class TransferError(RuntimeError):
    """A pull failed: no answer, an error answer, a corrupt or mismatched payload."""


def gather_blocks(layers: list[torch.Tensor], block_ids: list[int], checksum: bool) -> tuple[PullReply, list]:
    """Copy blocks ``block_ids`` of every layer (``[num_blocks, ...]`` views) to host memory:
    the reply header and one contiguous uint8 array per layer."""
    ids = torch.tensor(block_ids, dtype=torch.int64, device=layers[0].device)
    reply, frames = PullReply(), []
    for layer in layers:
        blocks = layer.index_select(0, ids).contiguous().cpu()  # [k, *block shape]
        raw = blocks.view(-1).view(torch.uint8).numpy()
        reply.dtypes.append(str(blocks.dtype).removeprefix("torch."))
        reply.shapes.append(list(blocks.shape))
        if checksum:
            reply.checksums.append(zlib.crc32(raw))
        frames.append(raw)
    return reply, frames


def unpack_blocks(reply: PullReply, frames: list, num_blocks: int) -> list[torch.Tensor]:
    """The layer tensors ``[num_blocks, ...]`` of a reply's frames; TransferError when they do
    not add up or fail their checksums."""
    if len(frames) != len(reply.dtypes) or len(reply.shapes) != len(frames):
        raise TransferError(f"the reply has {len(frames)} layer frames for {len(reply.dtypes)} layers")
    tensors = []
    for i, (frame, dtype_name, shape) in enumerate(zip(frames, reply.dtypes, reply.shapes)):
        buffer = bytearray(frame.buffer if hasattr(frame, "buffer") else frame)
        if reply.checksums and zlib.crc32(buffer) != reply.checksums[i]:
            raise TransferError(f"layer {i}: checksum mismatch (corrupt transfer)")
        dtype = getattr(torch, dtype_name, None)
        if not isinstance(dtype, torch.dtype) or shape[0] != num_blocks:
            raise TransferError(f"layer {i}: unexpected dtype {dtype_name!r} or shape {shape}")
        tensor = torch.frombuffer(buffer, dtype=torch.uint8) if buffer else torch.empty(0, dtype=torch.uint8)
        if tensor.numel() != dtype.itemsize * int(torch.Size(shape).numel()):
            raise TransferError(f"layer {i}: {tensor.numel()} bytes for shape {shape} of {dtype_name}")
        tensors.append(tensor.view(dtype).view(*shape))
    return tensors
