"""Physical KV cache blocks, their free queue and the prefix-cache index."""

from __future__ import annotations

from collections import OrderedDict

from runtime.scheduler.block_hash import BlockHash


class KVCacheBlock:
    __slots__ = ("block_id", "ref_cnt", "block_hash")

    def __init__(self, block_id: int):
        self.block_id = block_id
        self.ref_cnt = 0
        self.block_hash: BlockHash | None = None  # set once the block is full and cached

    def __repr__(self) -> str:
        short_hash = self.block_hash.hex()[:12] if self.block_hash is not None else None
        return f"KVCacheBlock({self.block_id}, ref={self.ref_cnt}, hash={short_hash})"


class BlockPool:
    """Owns every block. Free blocks wait in eviction order (least recently freed first).

    A free block keeps its hash, so a later request with the same prefix can take it
    back out of the free queue (a prefix-cache hit) until it is evicted for reuse.

    Blocks never used yet come first in that order, by id, and exist only as a count:
    a default CPU cache of a tiny model has half a million blocks, whose objects took
    1.3 s to make at every engine start. ``blocks`` holds the blocks handed out so far
    (ids 0 .. len - 1), and ``free_queue`` the freed ones behind the never-used ones.
    """

    def __init__(self, num_blocks: int, enable_caching: bool):
        if num_blocks < 1:
            raise ValueError(f"the KV cache needs at least one block, got {num_blocks}")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.blocks: list[KVCacheBlock] = []  # block i for i < len: every block allocated at least once
        self.free_queue: OrderedDict[int, KVCacheBlock] = OrderedDict()  # freed blocks, after the never-used ones
        self.cached: dict[BlockHash, KVCacheBlock] = {}  # block hash -> block
        # Called as on_evict(block_id, block_hash) when a cached block is taken for reuse
        # (a KV connector stores it to an offload tier first); None: nothing to tell.
        self.on_evict = None

    @property
    def num_free_blocks(self) -> int:
        return self.num_blocks - len(self.blocks) + len(self.free_queue)

    def free_block_ids(self) -> list[int]:
        """Every free block's id in eviction order (the never-used ones first)."""
        return [*range(len(self.blocks), self.num_blocks), *self.free_queue]

    def usage(self) -> float:
        return 1.0 - self.num_free_blocks / self.num_blocks

    def allocate(self, count: int) -> list[KVCacheBlock]:
        """Take ``count`` blocks from the head of the free queue, evicting their hashes."""
        assert count <= self.num_free_blocks, "caller must check num_free_blocks"
        fresh = min(count, self.num_blocks - len(self.blocks))
        taken = [KVCacheBlock(i) for i in range(len(self.blocks), len(self.blocks) + fresh)]
        self.blocks.extend(taken)
        for _ in range(count - fresh):
            _, block = self.free_queue.popitem(last=False)
            if block.block_hash is not None:
                if self.cached.get(block.block_hash) is block:
                    del self.cached[block.block_hash]
                if self.on_evict is not None:
                    self.on_evict(block.block_id, block.block_hash)
                block.block_hash = None
            taken.append(block)
        for block in taken:
            block.ref_cnt = 1
        return taken

    def touch(self, blocks: list[KVCacheBlock]) -> None:
        """Add a reference to cached blocks a new request reuses."""
        for block in blocks:
            if block.ref_cnt == 0:
                del self.free_queue[block.block_id]
            block.ref_cnt += 1

    def free(self, blocks) -> None:
        """Drop one reference from each block; unreferenced ones join the queue's tail.

        Callers pass a request's blocks last-first, so a sequence's tail is evicted
        before the prefix that other requests are more likely to share.
        """
        for block in blocks:
            block.ref_cnt -= 1
            assert block.ref_cnt >= 0, block
            if block.ref_cnt == 0:
                self.free_queue[block.block_id] = block

    def lookup(self, block_hash: BlockHash) -> KVCacheBlock | None:
        return self.cached.get(block_hash)

    def cache_block(self, block: KVCacheBlock, block_hash: BlockHash) -> None:
        if block.block_hash is not None:
            return
        block.block_hash = block_hash
        # Keep the first block cached under a hash; an identical later block stays private.
        self.cached.setdefault(block_hash, block)

    def reset_prefix_cache(self) -> bool:
        """Forget every cached hash; only possible when no block is in use."""
        if self.num_free_blocks != self.num_blocks:
            return False
        self.cached.clear()
        for block in self.blocks:
            block.block_hash = None
        return True
