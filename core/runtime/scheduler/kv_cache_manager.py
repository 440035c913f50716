"""Per-request block tables over the block pool, with prefix caching."""

from __future__ import annotations

from dataclasses import dataclass

from runtime.scheduler.block_hash import first_block_extra_keys, hash_block
from runtime.scheduler.block_pool import BlockPool, KVCacheBlock
from runtime.scheduler.request import Request


@dataclass(slots=True)
class PrefixCacheStats:
    queries: int = 0  # prompt tokens looked up
    hits: int = 0  # prompt tokens found cached

    @property
    def hit_rate(self) -> float:
        return self.hits / self.queries if self.queries else 0.0


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool):
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.pool = BlockPool(num_blocks, enable_caching)
        self.req_blocks: dict[str, list[KVCacheBlock]] = {}
        self.num_cached_blocks: dict[str, int] = {}  # leading blocks of a request already indexed
        self.stats = PrefixCacheStats()
        # A running request holds ceil(num_computed_tokens / block_size) blocks. When
        # num_computed_tokens % block_size is in this range, its next token lands in the
        # last block without filling it (or, without caching, may fill it: nothing is
        # indexed then), so allocate_slots(request, 1) would change nothing and return [].
        self.no_op_decode_offsets = range(1, block_size - 1 if enable_caching else block_size)

    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    def usage(self) -> float:
        return self.pool.usage()

    def _update_block_hashes(self, request: Request) -> None:
        """Extend ``request.block_hashes`` over every full block of known tokens.

        Each block is hashed once, when it is full; the first carries the cache salt.
        """
        hashes, bs = request.block_hashes, self.block_size
        tokens = request.all_token_ids
        if not hashes and len(tokens) >= bs:
            salt = first_block_extra_keys(request.sampling_params.cache_salt)
            hashes.append(hash_block(None, tokens[:bs], salt))
        while (len(hashes) + 1) * bs <= len(tokens):
            start = len(hashes) * bs
            hashes.append(hash_block(hashes[-1], tokens[start : start + bs]))

    def get_computed_blocks(self, request: Request) -> tuple[list[KVCacheBlock], int]:
        """Longest cached prefix of the request: (blocks, number of tokens they hold).

        At least one token is always left to compute, so the step yields logits.
        Requests that want prompt logprobs skip the cache (they need every position).
        The lookup counts in the stats; a request not admitted after all takes it back
        (:meth:`uncount_lookup`), so that a request looked up every step it waits counts once.
        """
        if not self._may_hit(request):
            return [], 0
        self._update_block_hashes(request)
        max_blocks = (request.num_tokens - 1) // self.block_size
        blocks = []
        for block_hash in request.block_hashes[:max_blocks]:
            block = self.pool.lookup(block_hash)
            if block is None:
                break
            blocks.append(block)
        num_tokens = len(blocks) * self.block_size
        self.stats.queries += request.num_tokens
        self.stats.hits += num_tokens
        return blocks, num_tokens

    def _may_hit(self, request: Request) -> bool:
        return self.enable_caching and request.sampling_params.prompt_logprobs is None

    def uncount_lookup(self, request: Request, num_hit_tokens: int) -> None:
        """Take back a lookup of :meth:`get_computed_blocks` (``num_hit_tokens`` found) of a request not admitted."""
        if self._may_hit(request):
            self.stats.queries -= request.num_tokens
            self.stats.hits -= num_hit_tokens

    def allocate_slots(
        self, request: Request, num_new_tokens: int, computed_blocks: list[KVCacheBlock] | None = None,
        cache: bool = True,
    ) -> list[int] | None:
        """Make room for ``num_new_tokens`` more tokens; returns the new block ids, or
        None (changing nothing) when the pool cannot supply them.

        ``cache=False`` leaves the new blocks out of the prefix cache (their contents arrive
        later, e.g. a KV load in the background); a later call for the request indexes them."""
        blocks = self.req_blocks.get(request.request_id)
        if blocks is not None and not computed_blocks:
            # A running request (usually one decode token): often no new block at all.
            total = request.num_computed_tokens + num_new_tokens
            num_needed = -(-total // self.block_size) - len(blocks)
            if num_needed > self.pool.num_free_blocks:
                return None
            new_blocks = self.pool.allocate(num_needed) if num_needed > 0 else []
            blocks.extend(new_blocks)
            if self.enable_caching and total >= (self.num_cached_blocks.get(request.request_id, 0) + 1) * self.block_size:
                self._cache_full_blocks(request, blocks, total)
            return [b.block_id for b in new_blocks]
        computed_blocks = computed_blocks or []
        blocks = blocks or []
        num_computed = request.num_computed_tokens + len(computed_blocks) * self.block_size
        total = num_computed + num_new_tokens
        num_needed = -(-total // self.block_size) - len(blocks) - len(computed_blocks)
        # Reused blocks that sit in the free queue stop being free once touched.
        num_evictable_reused = sum(1 for b in computed_blocks if b.ref_cnt == 0)
        if num_needed > self.pool.num_free_blocks - num_evictable_reused:
            return None
        if computed_blocks:
            self.pool.touch(computed_blocks)
        new_blocks = self.pool.allocate(max(num_needed, 0))
        blocks = self.req_blocks.setdefault(request.request_id, blocks)
        blocks.extend(computed_blocks)
        blocks.extend(new_blocks)
        if self.enable_caching and cache:
            self._cache_full_blocks(request, blocks, total)
        return [b.block_id for b in computed_blocks + new_blocks]

    def _cache_full_blocks(self, request: Request, blocks: list[KVCacheBlock], num_tokens: int) -> None:
        """Index the blocks that will be full of known tokens after this step."""
        self._update_block_hashes(request)
        num_full = min(num_tokens, request.num_tokens) // self.block_size
        for i in range(self.num_cached_blocks.get(request.request_id, 0), num_full):
            if blocks[i].block_hash is None:
                self.pool.cache_block(blocks[i], request.block_hashes[i])
        self.num_cached_blocks[request.request_id] = max(num_full, self.num_cached_blocks.get(request.request_id, 0))

    def free(self, request: Request) -> None:
        blocks = self.req_blocks.pop(request.request_id, [])
        self.num_cached_blocks.pop(request.request_id, None)
        self.pool.free(reversed(blocks))

    def block_ids(self, request_id: str) -> list[int]:
        return [b.block_id for b in self.req_blocks.get(request_id, [])]

    def reset_prefix_cache(self) -> bool:
        return self.pool.reset_prefix_cache()
