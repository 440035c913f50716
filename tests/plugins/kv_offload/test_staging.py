"""The connector's two halves driven step by step over a disk-only tier, where every promoted block
lands in a staging buffer (there is no cpu slot for it): buffers of aborted requests are freed, and
a block freed and promoted again in one step is still there when it is loaded."""

from __future__ import annotations

import torch

from offload_halves import BLOCK, halves, request, step


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
