"""Which all-reduce a tensor-parallel message takes on CUDA: one-shot for small ones, NCCL otherwise.

When the workers join their tensor-parallel group (``Platform.prepare_collectives``) the ranks
compare notes once: one host, 2, 4 or 8 ranks, distinct GPUs that can reach each other's
memory, CuPy present, and ``RUNTIME_CUDA_ONE_SHOT_MAX_BYTES`` above 0 (the smallest value of
any rank wins). Then every rank builds the :class:`~runtime_cuda.one_shot.OneShotAllReduce`, or
none does and every message goes to NCCL. Afterwards each message picks its path by its size
and dtype alone, which are the same on every rank, so the ranks always meet in the same
collective.

The default threshold comes from ``hardware/cuda/bench/allreduce.py`` on two H200s: one-shot
below it, NCCL (its ring or tree over NVLink) above.
"""

from __future__ import annotations

import logging
import os
import socket
from dataclasses import dataclass
from typing import Any

import torch

logger = logging.getLogger(__name__)

ONE_SHOT_ENV = "RUNTIME_CUDA_ONE_SHOT_MAX_BYTES"
# Two H100s over NVLink (hardware/cuda/bench/allreduce.py, benchmarks/RESULTS.md): the one-shot kernel
# beat NCCL at every size measured, 4 KiB (4.1 vs 17.0 us) to 8 MiB (41.3 vs 56.6 us).
DEFAULT_ONE_SHOT_MAX_BYTES = 8 << 20
ONE_SHOT_WORLD_SIZES = (2, 4, 8)


def one_shot_max_bytes(environ: dict[str, str] | None = None) -> int:
    """The largest message (bytes) the one-shot all-reduce takes: ``RUNTIME_CUDA_ONE_SHOT_MAX_BYTES``
    (0 turns it off), else the measured default."""
    value = (os.environ if environ is None else environ).get(ONE_SHOT_ENV, "").strip()
    if not value:
        return DEFAULT_ONE_SHOT_MAX_BYTES
    try:
        max_bytes = int(value)
    except ValueError:
        max_bytes = -1
    if max_bytes < 0:
        raise ValueError(f"{ONE_SHOT_ENV}={value!r} is not a byte count; give an integer >= 0 (0: NCCL only)")
    return max_bytes


@dataclass(frozen=True, slots=True)
class RankInfo:
    """What one rank tells the others before they choose."""

    host: str
    device_uuid: str
    max_bytes: int


def local_info(max_bytes: int) -> RankInfo:
    device = torch.cuda.current_device()
    return RankInfo(socket.gethostname(), str(torch.cuda.get_device_properties(device).uuid), max_bytes)


def unavailable_reason(infos: list[RankInfo]) -> str | None:
    """Why the group of ranks described by ``infos`` (in rank order) takes NCCL only, or None."""
    world_size = len(infos)
    if world_size not in ONE_SHOT_WORLD_SIZES:
        return f"{world_size} ranks (the one-shot all-reduce takes {', '.join(map(str, ONE_SHOT_WORLD_SIZES))})"
    if min(info.max_bytes for info in infos) == 0:
        return f"turned off ({ONE_SHOT_ENV}=0)"
    hosts = sorted({info.host for info in infos})
    if len(hosts) > 1:
        return f"the ranks are on {len(hosts)} hosts ({', '.join(hosts)}); CUDA IPC needs one"
    if len({info.device_uuid for info in infos}) < world_size:
        return "several ranks share a GPU"
    return None


def peer_access_error(infos: list[RankInfo], rank: int) -> str | None:
    """Why this rank cannot read some peer's GPU memory, or None."""
    here = torch.cuda.current_device()
    visible = {str(torch.cuda.get_device_properties(i).uuid): i for i in range(torch.cuda.device_count())}
    for peer, info in enumerate(infos):
        if peer == rank:
            continue
        index = visible.get(info.device_uuid)
        if index is None:
            return f"the GPU of rank {peer} is not visible here (CUDA_VISIBLE_DEVICES)"
        if not torch.cuda.can_device_access_peer(here, index):
            return f"GPU {here} has no peer access to GPU {index} (rank {peer})"
    return None


def setup_one_shot(group) -> tuple[Any, str | None]:
    """``(OneShotAllReduce, None)`` on every rank of ``group``, or ``(None, why not)`` on every rank."""
    import torch.distributed as dist

    from runtime_cuda.one_shot import OneShotAllReduce, agree

    infos: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(infos, local_info(one_shot_max_bytes()), group=group)
    reason = unavailable_reason(infos)
    if reason is None:
        reason = agree(group, peer_access_error(infos, dist.get_rank(group)))
    if reason is not None:
        return None, reason
    return OneShotAllReduce.create(group, min(info.max_bytes for info in infos))
