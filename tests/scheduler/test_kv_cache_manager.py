"""Block pool and prefix cache."""

import pytest

from runtime.scheduler.block_pool import BlockPool
from runtime.scheduler.kv_cache_manager import KVCacheManager


def test_block_pool_allocates_in_order_and_frees_to_tail():
    pool = BlockPool(4, enable_caching=True)
    a = pool.allocate(2)
    assert [b.block_id for b in a] == [0, 1] and pool.num_free_blocks == 2
    pool.free(reversed(a))
    # freed last-first: block 1 is evicted before block 0
    assert pool.free_block_ids() == [2, 3, 1, 0]
    assert pool.usage() == 0.0


def test_block_pool_rejects_empty_cache():
    with pytest.raises(ValueError, match="at least one block"):
        BlockPool(0, enable_caching=True)


def test_allocate_slots_counts_blocks_and_refuses_when_full(make_request):
    kv = KVCacheManager(num_blocks=4, block_size=4, enable_caching=False)
    req = make_request("a", list(range(10)))
    assert kv.allocate_slots(req, 10) == [0, 1, 2]
    req.num_computed_tokens = 10
    assert kv.allocate_slots(req, 2) == []  # still fits in block 2
    req.num_computed_tokens = 12
    big = make_request("b", list(range(8)))
    assert kv.allocate_slots(big, 8) is None  # only one block left
    assert kv.pool.num_free_blocks == 1
    kv.free(req)
    assert kv.pool.num_free_blocks == 4


def test_prefix_cache_hits_shared_full_blocks(make_request):
    kv = KVCacheManager(num_blocks=16, block_size=4, enable_caching=True)
    first = make_request("a", list(range(10)))
    computed, n = kv.get_computed_blocks(first)
    assert computed == [] and n == 0
    ids_a = kv.allocate_slots(first, 10)
    # same 8-token prefix, different tail
    second = make_request("b", list(range(8)) + [99, 98, 97])
    computed, n = kv.get_computed_blocks(second)
    assert n == 8 and [b.block_id for b in computed] == ids_a[:2]
    ids_b = kv.allocate_slots(second, 3, computed)
    assert ids_b[:2] == ids_a[:2] and ids_b[2] not in ids_a
    assert kv.pool.blocks[ids_a[0]].ref_cnt == 2
    assert kv.stats.hits == 8 and kv.stats.queries == 21


def test_prefix_cache_leaves_one_token_to_compute(make_request):
    kv = KVCacheManager(num_blocks=8, block_size=4, enable_caching=True)
    a = make_request("a", list(range(8)))
    kv.allocate_slots(a, 8)
    b = make_request("b", list(range(8)))
    _, n = kv.get_computed_blocks(b)
    assert n == 4  # the last block is recomputed so the step has logits


def test_freed_blocks_stay_cached_until_evicted(make_request):
    kv = KVCacheManager(num_blocks=4, block_size=4, enable_caching=True)
    a = make_request("a", list(range(9)))
    ids = kv.allocate_slots(a, 9)
    kv.free(a)
    assert kv.pool.num_free_blocks == 4
    b = make_request("b", list(range(9)))
    computed, n = kv.get_computed_blocks(b)
    assert n == 8 and [blk.block_id for blk in computed] == ids[:2]
    assert kv.allocate_slots(b, 1, computed) is not None
    assert kv.pool.num_free_blocks == 1
    # a request that needs every remaining block evicts the cached hash of block ids[2]
    kv.free(b)
    c = make_request("c", [50 + i for i in range(16)])
    assert kv.allocate_slots(c, 16) is not None
    d = make_request("d", list(range(9)))
    assert kv.get_computed_blocks(d)[1] == 0


def test_prompt_logprobs_requests_skip_the_cache(make_request):
    kv = KVCacheManager(num_blocks=8, block_size=4, enable_caching=True)
    kv.allocate_slots(make_request("a", list(range(9))), 9)
    computed, n = kv.get_computed_blocks(make_request("b", list(range(9)), prompt_logprobs=1))
    assert computed == [] and n == 0


def test_reset_prefix_cache_only_when_idle(make_request):
    kv = KVCacheManager(num_blocks=4, block_size=4, enable_caching=True)
    a = make_request("a", list(range(8)))
    kv.allocate_slots(a, 8)
    assert not kv.reset_prefix_cache()
    kv.free(a)
    assert kv.reset_prefix_cache()
    assert kv.get_computed_blocks(make_request("b", list(range(8))))[1] == 0


def test_block_pool_makes_block_objects_only_as_they_are_handed_out():
    pool = BlockPool(10**9, enable_caching=True)  # a billion blocks: only a count until used
    assert pool.blocks == [] and pool.num_free_blocks == 10**9
    a, b = pool.allocate(2)
    assert [x.block_id for x in pool.blocks] == [0, 1] and pool.num_free_blocks == 10**9 - 2
    pool.free([b])
    assert list(pool.free_queue) == [1] and pool.num_free_blocks == 10**9 - 1
    assert [x.block_id for x in pool.allocate(1)] == [2]  # the never-used blocks go first


def test_block_pool_evicts_never_used_blocks_first_then_the_freed_ones_in_order():
    pool = BlockPool(5, enable_caching=True)
    a = pool.allocate(3)
    pool.free([a[1], a[0]])
    assert pool.free_block_ids() == [3, 4, 1, 0]
    assert [x.block_id for x in pool.allocate(4)] == [3, 4, 1, 0]
    assert pool.num_free_blocks == 0 and len(pool.blocks) == 5
