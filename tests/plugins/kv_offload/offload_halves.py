"""The offloading connector's two halves over real tiers, driven step by step, for the tests of
promoted blocks (test_staging.py, test_promotion_bookkeeping.py)."""

from __future__ import annotations

from types import SimpleNamespace as NS

import torch

from runtime_kv_offload.disk_tier import DiskTier
from runtime_kv_offload.scheduler_half import OffloadingConnectorScheduler
from runtime_kv_offload.worker_half import OffloadingConnectorWorker

BLOCK = 4
NUM_BLOCKS = 8


def config(directory: str, tiers=("disk",), sizes=(1 << 20,)):
    cache = NS(block_size=BLOCK, kv_offload=tiers, kv_offload_size=sizes, kv_offload_dir=directory,
               kv_offload_policy="lru", kv_block_layout="")
    model = NS(model=directory, quantization=None, dtype=torch.float32, seed=0)
    return NS(cache_config=cache, parallel_config=NS(world_size=1), model_config=model, load_config=NS(load_format="auto"))


def halves(tmp_path, hashes: list[bytes], tiers=("disk",), sizes=(1 << 20,)):
    """A scheduler half and a worker half whose disk tier holds ``hashes`` (block i filled with i + 1),
    and the device cache [k/v, blocks, tokens, head dim]."""
    worker = OffloadingConnectorWorker(config(str(tmp_path), tiers, sizes))
    cache = torch.zeros(2, NUM_BLOCKS, BLOCK, 2, dtype=torch.float32)
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
