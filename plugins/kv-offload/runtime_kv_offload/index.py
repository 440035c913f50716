"""The scheduler half's index of the tiers: which block hash is where, on every worker rank.

The worker ranks hold the bytes, each its own shard of the KV heads (a cpu pool, its own
disk files); the engine's one scheduler half holds one index for all of them and tells
every rank which cpu slot to write or read, so the ranks never disagree about the cpu tier.
A lower tier (disk) keeps its own files and evicts by its own cap: the index mirrors it (the
same capacity, the same LRU order) and may be wrong about a block; that shows when the ranks
read it into memory (a promotion): a rank that cannot (file gone, checksum failed) says so,
and the block counts as missing (its tokens are recomputed).
"""

from __future__ import annotations

from collections import Counter, OrderedDict

from runtime_kv_offload.cpu_tier import CpuTier


class LowerMirror:
    """What the index believes a lower tier holds, least recently used first."""

    def __init__(self, name: str, capacity: int | None, hashes: list[bytes]):
        self.name = name
        self.capacity = capacity  # in blocks; None: unbounded (the tier does not say)
        self.hashes: OrderedDict[bytes, None] = OrderedDict.fromkeys(hashes)

    def __contains__(self, block_hash: bytes) -> bool:
        return block_hash in self.hashes

    def add(self, block_hash: bytes) -> None:
        self.hashes[block_hash] = None
        self.hashes.move_to_end(block_hash)
        while self.capacity is not None and len(self.hashes) > self.capacity:
            self.hashes.popitem(last=False)  # the tier evicts its least recently used file too

    def touch(self, block_hash: bytes) -> None:
        if block_hash in self.hashes:
            self.hashes.move_to_end(block_hash)

    def discard(self, block_hash: bytes) -> None:
        self.hashes.pop(block_hash, None)


def mirrors_of(per_rank: list[dict]) -> list[LowerMirror]:
    """Each lower tier as every rank holds it: the blocks found on all ranks (in rank 0's
    order) and the smallest capacity."""
    mirrors = []
    for i, (name, _, hashes) in enumerate(per_rank[0]["lower"]):
        everywhere = set(hashes).intersection(*(set(rank["lower"][i][2]) for rank in per_rank[1:]))
        capacities = [rank["lower"][i][1] for rank in per_rank if rank["lower"][i][1] is not None]
        mirrors.append(LowerMirror(name, min(capacities) if capacities else None, [h for h in hashes if h in everywhere]))
    return mirrors


class OffloadIndex:
    def __init__(self, cpu: CpuTier | None, lower: list[LowerMirror]):
        self.cpu = cpu  # bound without a pool: slots and the eviction policy
        self.lower = lower
        self.pins: Counter[bytes] = Counter()  # blocks a lookup, a save or a load holds
        self.unready: set[bytes] = set()  # promotions in flight: a slot or staging reserved, bytes not there yet
        self.staged: set[bytes] = set()  # promoted into the ranks' staging buffers (no cpu slot was free)
        self.origin: dict[bytes, str] = {}  # promoted blocks not yet loaded: the tier they came from

    def can_evict(self, block_hash: bytes) -> bool:
        return not self.pins[block_hash] and block_hash not in self.unready

    def in_memory(self, block_hash: bytes) -> bool:
        """In a cpu slot or staged (perhaps still on its way: see ``unready``)."""
        return block_hash in self.staged or (self.cpu is not None and self.cpu.contains(block_hash))

    def lower_holding(self, block_hash: bytes) -> int | None:
        return next((i for i, mirror in enumerate(self.lower) if block_hash in mirror), None)

    def slot(self, block_hash: bytes) -> int | None:
        """The block's cpu slot (a use, for the policy), or None when it is staged."""
        return self.cpu.touch(block_hash) if self.cpu is not None and self.cpu.contains(block_hash) else None

    def reserve_slot(self, block_hash: bytes) -> int | None:
        return self.cpu.reserve_slot(block_hash, self.can_evict) if self.cpu is not None else None

    def pin(self, block_hash: bytes) -> None:
        self.pins[block_hash] += 1

    def release(self, block_hash: bytes) -> bool:
        """Drop one hold; True when the block was staged and nothing holds it any more (the
        ranks free its staging buffer)."""
        self.pins[block_hash] -= 1
        if self.pins[block_hash] > 0:
            return False
        del self.pins[block_hash]
        self.origin.pop(block_hash, None)  # nobody is left to load it as a promoted block
        if block_hash in self.staged and block_hash not in self.unready:
            self.staged.discard(block_hash)
            return True
        return False

    def promoted(self, block_hash: bytes, tier_index: int, ok: bool) -> bool:
        """A promotion came back from every rank: ``ok`` when all of them read the block.
        Returns True when the ranks must free its staging buffer: it failed, or nothing holds it."""
        self.unready.discard(block_hash)
        if ok:
            self.lower[tier_index].touch(block_hash)
            if not self.pins[block_hash]:
                # Nobody waits for it any more (its requests were aborted meanwhile): a staging
                # buffer has no eviction, so it is freed now rather than kept for good; a block
                # in a cpu slot stays there, a cpu block like any other (no origin to remember).
                if block_hash in self.staged:
                    self.staged.discard(block_hash)
                    return True
                return False
            self.origin[block_hash] = self.lower[tier_index].name
            return False
        for mirror in self.lower:
            mirror.discard(block_hash)
        if block_hash in self.staged:
            self.staged.discard(block_hash)
            return True
        self.cpu.remove(block_hash)
        return False
