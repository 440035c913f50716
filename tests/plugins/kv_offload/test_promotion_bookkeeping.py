"""The scheduler half's bookkeeping of promoted blocks (cpu and disk tiers, driven step by step):
a request aborted while its blocks are read from disk, or one that got no device blocks, leaves
no entry behind, and a later load of such a block counts as the cpu hit it is."""

from __future__ import annotations

import torch

from offload_halves import BLOCK, request, step
from offload_halves import halves as disk_halves


def halves(tmp_path, hashes: list[bytes]):
    """Both halves over a cpu tier of 4 slots and a disk tier holding ``hashes`` (block i filled with i + 1)."""
    return disk_halves(tmp_path, hashes, tiers=("cpu", "disk"), sizes=(-4, 1 << 20))


def test_a_request_aborted_mid_promotion_leaves_no_origin(tmp_path):
    hashes = [bytes([i]) * 8 for i in range(3)]
    scheduler, worker, cache = halves(tmp_path, hashes)
    aborted = request("a", hashes)
    assert scheduler.get_num_new_matched_tokens(aborted, 0) == (3 * BLOCK, True)
    metadata = scheduler.build_connector_meta(None)
    worker.start_load_kv(metadata)  # the blocks are being read from disk into cpu slots ...
    scheduler.request_finished(aborted, [])  # ... when the request is aborted
    worker.wait_for_save()
    scheduler.update_connector_output([worker.get_connector_output()])
    assert scheduler.index.origin == {}  # kept for good before: one entry per block of every such abort
    assert all(scheduler.index.cpu.contains(h) for h in hashes)  # promoted all the same: cpu blocks now
    assert scheduler.get_finished_recving() == {}

    later = request("b", hashes[:2])  # found in the cpu tier: cpu hits, not disk ones
    assert scheduler.get_num_new_matched_tokens(later, 0) == (2 * BLOCK, False)
    scheduler.update_state_after_alloc(later, [5, 6, 7], 2 * BLOCK)
    step(scheduler, worker)
    assert torch.equal(cache[:, 5], torch.full_like(cache[:, 5], 1.0))
    assert torch.equal(cache[:, 6], torch.full_like(cache[:, 6], 2.0))
    assert scheduler.get_stats()["kv_offload_hits_cpu"] == 2 and "kv_offload_hits_disk" not in scheduler.get_stats()
    assert scheduler.index.origin == {} and not scheduler.index.pins
    worker.shutdown()


def test_a_promoted_request_that_gets_no_blocks_then_aborts_leaves_no_origin(tmp_path):
    hashes = [bytes([i]) * 8 for i in range(2)]
    scheduler, worker, _ = halves(tmp_path, hashes)
    waiting = request("a", hashes)
    scheduler.get_num_new_matched_tokens(waiting, 0)
    step(scheduler, worker)
    assert scheduler.get_finished_recving() == {"a": None}
    assert scheduler.get_num_new_matched_tokens(waiting, 0) == (2 * BLOCK, False)
    scheduler.update_state_after_alloc(waiting, [], 0)  # the device pool had no room this step
    scheduler.request_finished(waiting, [])  # then it is aborted
    step(scheduler, worker)
    assert scheduler.index.origin == {} and not scheduler.index.pins and not scheduler.lookups
    worker.shutdown()
