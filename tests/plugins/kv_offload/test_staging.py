"""The connector's two halves driven step by step over a disk-only tier, where every promoted block
lands in a staging buffer (there is no cpu slot for it): buffers of aborted requests are freed, and
a block freed and promoted again in one step is still there when it is loaded."""

from __future__ import annotations

from types import SimpleNamespace as NS

import torch

from runtime_kv_offload.disk_tier import DiskTier
from runtime_kv_offload.scheduler_half import OffloadingConnectorScheduler
from runtime_kv_offload.worker_half import OffloadingConnectorWorker

BLOCK = 4
NUM_BLOCKS = 8


def config(directory: str):
    cache = NS(block_size=BLOCK, kv_offload=("disk",), kv_offload_size=(1 << 20,), kv_offload_dir=directory,
               kv_offload_policy="lru", kv_block_layout="")
    model = NS(model=directory, quantization=None, dtype=torch.float32, seed=0)
    return NS(cache_config=cache, parallel_config=NS(world_size=1), model_config=model, load_config=NS(load_format="auto"))


def halves(tmp_path, hashes: list[bytes]):
    """A scheduler half and a worker half whose disk tier holds ``hashes`` (block i filled with i + 1)."""
    worker = OffloadingConnectorWorker(config(str(tmp_path)))
    cache = torch.zeros(2, NUM_BLOCKS, BLOCK, 2, dtype=torch.float32)  # [k/v, blocks, tokens, head dim]
    worker.register_kv_caches([cache])
    disk = worker.lower[0][1]
    assert isinstance(disk, DiskTier)
    for i, block_hash in enumerate(hashes):
        disk.store(block_hash, torch.full((worker.copier.block_bytes // 4,), float(i + 1)))
    scheduler = OffloadingConnectorScheduler(worker.config)
    scheduler.set_handshake_metadata([worker.get_handshake_metadata()])
    return scheduler, worker, cache


def step(scheduler, worker) -> None:
    metadata = scheduler.build_connector_meta(None)
    worker.start_load_kv(metadata)
    worker.wait_for_save()
    scheduler.update_connector_output([worker.get_connector_output()])


def request(request_id: str, hashes: list[bytes]):
    return NS(request_id=request_id, num_tokens=len(hashes) * BLOCK + 1, block_hashes=hashes, num_computed_tokens=0)


def test_an_aborted_requests_promoted_blocks_free_their_staging_buffers(tmp_path):
    hashes = [bytes([i]) * 8 for i in range(3)]
    scheduler, worker, _ = halves(tmp_path, hashes)
    aborted = request("a", hashes)
    assert scheduler.get_num_new_matched_tokens(aborted, 0) == (3 * BLOCK, True)  # it waits for the promotions
    metadata = scheduler.build_connector_meta(None)
    worker.start_load_kv(metadata)
    scheduler.request_finished(aborted, [])  # aborted while its promotions are in flight
    worker.wait_for_save()
    scheduler.update_connector_output([worker.get_connector_output()])
    assert set(worker.staged) == set(hashes)
    step(scheduler, worker)
    # Nothing holds them: the buffers are freed (they were kept for good, outside any tier's size).
    assert worker.staged == {} and scheduler.index.staged == set()
    assert not any(scheduler.index.in_memory(h) for h in hashes)
    shared = request("b", hashes[:2])  # a later request promotes them again from disk
    assert scheduler.get_num_new_matched_tokens(shared, 0) == (2 * BLOCK, True)
    worker.shutdown()


class RacingStaged(dict):
    """Staging buffers whose ``pop`` runs only once the background thread is idle: the promotion
    submitted before it (if any) has written its buffer, as it may in a real step."""

    def __init__(self, worker):
        super().__init__()
        self.worker = worker

    def pop(self, *args):
        self.worker.thread.submit(lambda: None).result()
        return super().pop(*args)


def test_a_block_freed_and_promoted_again_in_one_step_is_loaded(tmp_path):
    hashes = [bytes([i]) * 8 for i in range(2)]
    scheduler, worker, cache = halves(tmp_path, hashes)
    worker.staged = RacingStaged(worker)
    first = request("a", hashes)
    scheduler.get_num_new_matched_tokens(first, 0)
    step(scheduler, worker)  # promoted into staging buffers
    assert scheduler.get_finished_recving() == {"a": None}
    assert scheduler.get_num_new_matched_tokens(first, 0) == (2 * BLOCK, False)
    scheduler.request_finished(first, [])  # aborted before it got blocks: its buffers are freed ...
    second = request("b", hashes)
    assert scheduler.get_num_new_matched_tokens(second, 0) == (2 * BLOCK, True)  # ... and promoted again
    step(scheduler, worker)  # one step frees and promotes them
    assert scheduler.get_finished_recving() == {"b": None}
    assert scheduler.get_num_new_matched_tokens(second, 0) == (2 * BLOCK, False)
    scheduler.update_state_after_alloc(second, [5, 6, 7], 2 * BLOCK)
    step(scheduler, worker)  # the load reads the staging buffers (a KeyError when the step's drop won)
    assert torch.equal(cache[:, 5], torch.full_like(cache[:, 5], 1.0))
    assert torch.equal(cache[:, 6], torch.full_like(cache[:, 6], 2.0))
    assert worker.staged == {} and scheduler.index.staged == set()
    worker.shutdown()
