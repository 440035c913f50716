"""The worker's ranks and process groups (one per process), and the model collectives.

Ranks are laid out as vLLM's: ``rank = pp_rank * tp_size + tp_rank``, so the workers of a
pipeline stage are neighbours and a tensor-parallel group is one stage's workers. The
collectives are the platform's ops (:meth:`runtime.platforms.Platform.all_reduce`), over a
process group of the platform's ``dist_backend`` (gloo on the CPU, nccl on CUDA).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch

logger = logging.getLogger(__name__)

DIST_TIMEOUT = timedelta(minutes=10)  # a stuck collective; a dead peer is caught by the executor first


@dataclass
class ParallelState:
    rank: int = 0
    world_size: int = 1
    tp_rank: int = 0
    tp_size: int = 1
    pp_rank: int = 0
    pp_size: int = 1
    tp_group: Any = None  # torch.distributed ProcessGroup of this rank's pipeline stage
    platform: Any = None  # runtime.platforms.Platform whose collectives run
    collectives: str = ""  # what the tensor-parallel all-reduce takes (Platform.prepare_collectives)

    @property
    def is_first_stage(self) -> bool:
        return self.pp_rank == 0

    @property
    def is_last_stage(self) -> bool:
        return self.pp_rank == self.pp_size - 1

    @property
    def next_rank(self) -> int:
        """The same tensor-parallel rank of the next pipeline stage."""
        return self.rank + self.tp_size

    @property
    def prev_rank(self) -> int:
        return self.rank - self.tp_size


_state = ParallelState()


def get_parallel_state() -> ParallelState:
    return _state


def tp_rank() -> int:
    return _state.tp_rank


def tp_size() -> int:
    return _state.tp_size


def pp_rank() -> int:
    return _state.pp_rank


def pp_size() -> int:
    return _state.pp_size


def init_distributed(platform, rank: int, tp: int, pp: int, init_method: str) -> ParallelState:
    """Join the world of ``tp * pp`` workers as ``rank`` and make this process's parallel state."""
    global _state
    import torch.distributed as dist

    world_size = tp * pp
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is outside a world of {world_size} workers")
    dist.init_process_group(
        backend=platform.dist_backend, init_method=init_method, world_size=world_size, rank=rank, timeout=DIST_TIMEOUT
    )
    tp_group = None
    for stage in range(pp):  # every rank takes part in creating every group
        group = dist.new_group(list(range(stage * tp, (stage + 1) * tp)))
        if stage == rank // tp:
            tp_group = group
    _state = ParallelState(rank, world_size, rank % tp, tp, rank // tp, pp, tp_group, platform)
    if tp > 1:
        _state.collectives = platform.prepare_collectives(tp_group)  # e.g. CUDA's one-shot all-reduce buffers
        logger.info("tensor-parallel all-reduce: %s", _state.collectives)
    return _state


def destroy_distributed() -> None:
    global _state
    import torch.distributed as dist

    if _state.platform is not None and _state.tp_size > 1:
        _state.platform.destroy_collectives()
    if dist.is_initialized():
        dist.destroy_process_group()
    _state = ParallelState()


def tp_all_reduce(x: torch.Tensor) -> torch.Tensor:
    """The sum of ``x`` over the tensor-parallel group (``x`` itself without one)."""
    if _state.tp_size == 1:
        return x
    return _state.platform.all_reduce(x, _state.tp_group)


def tp_all_gather(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """The ranks' ``x`` concatenated along ``dim`` in rank order (``x`` itself without a group)."""
    if _state.tp_size == 1:
        return x
    return _state.platform.all_gather(x, _state.tp_group, dim)


def pp_send(tensor: torch.Tensor) -> None:
    """Send ``tensor`` to the same tensor-parallel rank of the next pipeline stage."""
    import torch.distributed as dist

    dist.send(tensor.contiguous(), dst=_state.next_rank)


def pp_recv(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A tensor of ``shape`` from the same tensor-parallel rank of the previous pipeline stage."""
    import torch.distributed as dist

    tensor = torch.empty(shape, dtype=dtype, device=device)
    dist.recv(tensor, src=_state.prev_rank)
    return tensor


def broadcast_from_last_stage(tensor: torch.Tensor) -> torch.Tensor:
    """Every rank gets the last pipeline stage's ``tensor`` (in place; the others pass a buffer)."""
    import torch.distributed as dist

    dist.broadcast(tensor, src=_state.world_size - _state.tp_size)
    return tensor
