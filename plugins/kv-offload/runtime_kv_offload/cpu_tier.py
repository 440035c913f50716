"""The cpu tier: a host-memory pool of block slots (pinned when a GPU is present), indexed by
block hash, evicting by LRU or ARC."""

from __future__ import annotations

import threading
from collections.abc import Callable

import torch

from runtime_kv_offload.policy import POLICIES


class CpuTier:
    """Blocks in one host tensor ``[num_slots, block_bytes]`` (uint8); :meth:`bind` sizes it.

    ``size_bytes`` below zero means ``-size_bytes`` blocks (vLLM's ``num_cpu_blocks``).
    The connector splits it: each worker rank holds a pool (``bind``), the scheduler half
    holds the index alone (``bind(..., allocate=False)``: which hash is in which slot, the
    policy) and tells the ranks which slot to write or read. Not thread-safe.
    """

    name = "cpu"

    def __init__(self, size_bytes: int, policy: str = "lru"):
        if policy not in POLICIES:
            raise ValueError(f"cpu tier eviction policy {policy!r} is not valid; choose one of: {', '.join(POLICIES)}")
        self.size_bytes = size_bytes
        self.policy_name = policy
        self.pool: torch.Tensor | None = None
        self.num_slots = 0
        self.slot_of: dict[bytes, int] = {}
        self.free_slots: list[int] = []
        self.lock = threading.Lock()

    def bind(self, block_bytes: int, layout_key: str = "", pin: bool = False, allocate: bool = True) -> None:
        """Size the tier for blocks of ``block_bytes`` and allocate its pool (pinned memory when
        ``pin``); ``allocate=False``: the index alone."""
        num_slots = -self.size_bytes if self.size_bytes < 0 else self.size_bytes // block_bytes
        if num_slots < 1:
            raise ValueError(
                f"--kv-offload-size for the cpu tier ({self.size_bytes} bytes) holds no block; one block takes {block_bytes} bytes"
            )
        if allocate:
            try:
                self.pool = torch.empty((num_slots, block_bytes), dtype=torch.uint8, pin_memory=pin)
            except RuntimeError as exc:  # torch's allocator errors (pinned memory too) name no flag
                raise ValueError(
                    f"--kv-offload-size for the cpu tier: its pool of {num_slots} blocks ({num_slots * block_bytes} "
                    f"bytes{' of pinned memory' if pin else ''}) cannot be allocated on this host; give a smaller size "
                    f"({str(exc).strip().splitlines()[-1]})"
                ) from None
        self.num_slots = num_slots
        self.policy = POLICIES[self.policy_name](num_slots)
        self.free_slots = list(range(num_slots - 1, -1, -1))

    # ---------------------------------------------------------------- KVTier
    def contains(self, block_hash: bytes) -> bool:
        return block_hash in self.slot_of

    def store(self, block_hash: bytes, data: torch.Tensor) -> None:
        slot = self.reserve(block_hash, lambda h: True)
        if slot is not None:
            slot.copy_(data.reshape(-1).view(torch.uint8))

    def load(self, block_hash: bytes) -> torch.Tensor | None:
        slot = self.slot_of.get(block_hash)
        if slot is None:
            return None
        self.policy.touch(block_hash)
        return self.pool[slot]

    # ---------------------------------------------------------------- slots
    def reserve(self, block_hash: bytes, can_evict: Callable[[bytes], bool]) -> torch.Tensor | None:
        """The slot (a ``[block_bytes]`` view) to write ``block_hash`` into, evicting the policy's
        victim when full; None when it is already stored or every block is busy."""
        slot = self.reserve_slot(block_hash, can_evict)
        return None if slot is None else self.pool[slot]

    def reserve_slot(self, block_hash: bytes, can_evict: Callable[[bytes], bool]) -> int | None:
        """:meth:`reserve` by slot number (the index alone)."""
        if block_hash in self.slot_of:
            self.policy.touch(block_hash)
            return None
        if not self.free_slots:
            victim = self.policy.evict(can_evict, incoming=block_hash)
            if victim is None:
                return None
            self.free_slots.append(self.slot_of.pop(victim))
        slot = self.free_slots.pop()
        self.slot_of[block_hash] = slot
        self.policy.insert(block_hash)
        return slot

    def touch(self, block_hash: bytes) -> int:
        """A hit: the block's slot (the policy notes the use)."""
        self.policy.touch(block_hash)
        return self.slot_of[block_hash]

    def remove(self, block_hash: bytes) -> None:
        """Free the block's slot (a read into it failed)."""
        slot = self.slot_of.pop(block_hash, None)
        if slot is not None:
            self.policy.remove(block_hash)
            self.free_slots.append(slot)

    def __len__(self) -> int:
        return len(self.slot_of)
