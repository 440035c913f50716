"""One-shot all-reduce for small messages on the GPUs of one host, over CUDA IPC buffers.

Each rank allocates one workspace (``cudaMalloc`` through CuPy) at start-up, shares its IPC
handle over the tensor-parallel process group and maps its peers'. A call is one kernel
(:file:`one_shot.cu`): copy the message into the workspace, meet the peers at per-block flags in
their workspaces, sum every rank's copy in rank order, write the sum over the message. It runs
on the current stream, needs no host synchronization and records into CUDA graphs (its epochs
live in device memory); the kernel is compiled and loaded at start-up, outside any capture.

Building one is collective: every rank of the group calls :meth:`OneShotAllReduce.create`, and
either all of them get one or none does (a rank that cannot map a peer's memory turns it off for
everyone, since a rank that chose NCCL for a message its peers reduce here would hang them).
"""

from __future__ import annotations

import logging
from importlib.resources import files
from typing import Any

import numpy as np
import torch

logger = logging.getLogger(__name__)

THREADS = 512  # per block (the kernel's __launch_bounds__)
VECTOR_BYTES = 16  # the kernel moves 16-byte vectors
HEADER_BYTES = 4096  # flags and epoch counters, ahead of the data (kHeaderBytes)
MAX_BLOCKS_LIMIT = 64  # kMaxBlocks: the flags have a row per block index
MAX_RANKS = 8  # kMaxRanks
DEFAULT_MAX_BLOCKS = 36  # blocks of the largest messages (small ones take one block per 8 KiB)
DEFAULT_PUSH = True  # each rank stores its message in every workspace (the sum reads local memory), else pull
KERNEL_TYPES = {torch.float32: "float", torch.float16: "one_shot::f16", torch.bfloat16: "one_shot::bf16"}


def workspace_layout(max_bytes: int, max_blocks: int, world_size: int) -> tuple[int, int]:
    """``(region_vecs, workspace bytes)`` for messages up to ``max_bytes``: each of the two halves
    holds a slot per rank of ``max_blocks`` regions of ``region_vecs`` vectors, enough for a block's
    run of any message that fits (a block runs at most ``THREADS`` vectors until all ``max_blocks``
    blocks are used)."""
    if not 0 < max_blocks <= MAX_BLOCKS_LIMIT:
        raise ValueError(f"max_blocks {max_blocks} is outside 1..{MAX_BLOCKS_LIMIT}")
    max_vecs = -(-max_bytes // VECTOR_BYTES)
    region_vecs = max(THREADS, -(-max_vecs // max_blocks))
    return region_vecs, HEADER_BYTES + 2 * world_size * max_blocks * region_vecs * VECTOR_BYTES


def num_blocks(num_vecs: int, max_blocks: int) -> int:
    """The grid of a message of ``num_vecs`` vectors: one block per ``THREADS`` vectors, at most ``max_blocks``."""
    return max(1, min(max_blocks, -(-num_vecs // THREADS)))


def agree(group, error: str | None) -> str | None:
    """Every rank's ``error`` (None: fine) gathered: the first rank's error, or None when all are fine."""
    import torch.distributed as dist

    errors: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(errors, error, group=group)
    return next((f"rank {r}: {e}" for r, e in enumerate(errors) if e is not None), None)


class _Stream:
    """What CuPy's kernel launch reads of a stream: its handle, ``ptr``."""

    __slots__ = ("ptr",)

    def __init__(self, ptr: int = 0):
        self.ptr = ptr


class OneShotAllReduce:
    """The one-shot all-reduce of this rank's group; build it with :meth:`create`.

    ``can_reduce(tensor)`` says whether a message goes here (it depends only on the message's
    size and dtype, the same on every rank); calling the object reduces it in place and returns it.
    """

    def __init__(self, rank: int, world_size: int, max_bytes: int, max_blocks: int = DEFAULT_MAX_BLOCKS,
                 device: int | None = None, push: bool = DEFAULT_PUSH):
        if world_size not in (2, 4, 8):
            raise ValueError(f"the one-shot all-reduce takes 2, 4 or 8 ranks, not {world_size}")
        self.rank, self.world_size = rank, world_size
        self.max_bytes, self.max_blocks, self.push = max_bytes, max_blocks, push
        self.region_vecs, self.workspace_bytes = workspace_layout(max_bytes, max_blocks, world_size)
        self.device = device  # the GPU index (create() takes the current one)
        self.own_workspace = 0  # device pointer of this rank's workspace (cudaMalloc)
        self.peer_workspaces: list[int] = []  # every rank's, mapped here, in rank order
        self.workspaces: torch.Tensor | None = None  # the same pointers on the device, for the kernel
        self.kernels: dict[torch.dtype, Any] = {}  # cupy.cuda.function.Function by dtype
        self._stream = _Stream()
        self._opened: list[int] = []  # peers' pointers opened through IPC, to close

    # ---------------------------------------------------------------- building (collective)
    @classmethod
    def create(cls, group, max_bytes: int, max_blocks: int = DEFAULT_MAX_BLOCKS,
               push: bool = DEFAULT_PUSH) -> tuple[OneShotAllReduce | None, str | None]:
        """``(all-reduce, None)`` on every rank of ``group``, or ``(None, why not)`` on every rank."""
        import torch.distributed as dist

        rank, world_size = dist.get_rank(group), dist.get_world_size(group)
        self = cls(rank, world_size, max_bytes, max_blocks, torch.cuda.current_device(), push)
        handle, error = self._allocate()
        handles: list[Any] = [None] * self.world_size
        dist.all_gather_object(handles, (handle, error), group=group)
        reason = next((f"rank {r}: {e}" for r, (_, e) in enumerate(handles) if e is not None), None)
        if reason is None:
            reason = agree(group, self._open([h for h, _ in handles]))
        if reason is not None:
            self.close()
            return None, reason
        return self, None

    def _allocate(self) -> tuple[bytes | None, str | None]:
        """This rank's zeroed workspace and its IPC handle, or why it could not be made."""
        try:
            import cupy

            with cupy.cuda.Device(self.device):
                self.own_workspace = cupy.cuda.runtime.malloc(self.workspace_bytes)
                cupy.cuda.runtime.memset(self.own_workspace, 0, self.workspace_bytes)
                cupy.cuda.runtime.deviceSynchronize()  # zeros in place before any peer signals
                return cupy.cuda.runtime.ipcGetMemHandle(self.own_workspace), None
        except Exception as exc:  # noqa: BLE001 - no CuPy, no memory: every rank falls back together
            return None, f"{type(exc).__name__}: {exc}"

    def _open(self, handles: list[bytes]) -> str | None:
        """Map the peers' workspaces and load the kernels; None, or why not."""
        try:
            import cupy

            with cupy.cuda.Device(self.device):
                for rank, handle in enumerate(handles):
                    if rank == self.rank:
                        self.peer_workspaces.append(self.own_workspace)
                        continue
                    ptr = cupy.cuda.runtime.ipcOpenMemHandle(handle, cupy.cuda.runtime.cudaIpcMemLazyEnablePeerAccess)
                    self._opened.append(ptr)
                    self.peer_workspaces.append(ptr)
                self.kernels = self._load_kernels(cupy)
            self.workspaces = torch.tensor(self.peer_workspaces, dtype=torch.int64, device=f"cuda:{self.device}")
            torch.cuda.synchronize(self.device)
            return None
        except Exception as exc:  # noqa: BLE001
            return f"{type(exc).__name__}: {exc}"

    def _load_kernels(self, cupy) -> dict[torch.dtype, Any]:
        """The kernel for each dtype and this world size, compiled and loaded now (never inside a capture)."""
        push = "true" if self.push else "false"
        names = {dtype: f"one_shot::all_reduce<{name}, {self.world_size}, {push}>" for dtype, name in KERNEL_TYPES.items()}
        source = (files("runtime_cuda") / "one_shot.cu").read_text()
        module = cupy.RawModule(code=source, options=("-std=c++17",), name_expressions=list(names.values()))
        return {dtype: module.get_function(name).kernel for dtype, name in names.items()}

    def close(self) -> None:
        """Unmap the peers' workspaces and free this rank's (after the device is idle)."""
        if not self.own_workspace and not self._opened:
            return
        import cupy

        with cupy.cuda.Device(self.device):
            cupy.cuda.runtime.deviceSynchronize()
            for ptr in self._opened:
                cupy.cuda.runtime.ipcCloseMemHandle(ptr)
            if self.own_workspace:
                cupy.cuda.runtime.free(self.own_workspace)
        self._opened, self.peer_workspaces, self.own_workspace, self.kernels = [], [], 0, {}

    # ---------------------------------------------------------------- reducing
    def can_reduce(self, tensor: torch.Tensor) -> bool:
        """Whether ``tensor`` is a message for this all-reduce: a float dtype of the kernels, whole
        16-byte vectors, at most ``max_bytes``. The same answer on every rank (size and dtype only)."""
        nbytes = tensor.numel() * tensor.element_size()
        return tensor.dtype in KERNEL_TYPES and 0 < nbytes <= self.max_bytes and nbytes % VECTOR_BYTES == 0

    def __call__(self, tensor: torch.Tensor) -> torch.Tensor:
        """The sum of ``tensor`` over the ranks, in place when it is contiguous and 16-byte aligned
        (else in a contiguous copy, returned)."""
        if not tensor.is_contiguous() or tensor.data_ptr() % VECTOR_BYTES:
            tensor = torch.empty_like(tensor, memory_format=torch.contiguous_format).copy_(tensor)
        num_vecs = tensor.numel() * tensor.element_size() // VECTOR_BYTES
        self._stream.ptr = torch.cuda.current_stream(tensor.device).cuda_stream
        args = (
            tensor.data_ptr(), self.workspaces.data_ptr(), np.int32(self.rank), np.int32(num_vecs),
            np.int32(self.max_blocks), np.int32(self.region_vecs),
        )
        grid = (num_blocks(num_vecs, self.max_blocks),)
        if torch.cuda.current_device() == self.device:
            self.kernels[tensor.dtype](grid, (THREADS,), args, shared_mem=0, stream=self._stream)
        else:  # a thread whose current device is another: launch in this GPU's context
            with torch.cuda.device(self.device):
                self.kernels[tensor.dtype](grid, (THREADS,), args, shared_mem=0, stream=self._stream)
        return tensor
