"""The cpu and disk tiers and their eviction policies, on real memory and real files."""

from __future__ import annotations

import errno
import os

import pytest
import torch

from runtime.kv_transfer import KVTier
from runtime_kv_offload import disk_tier
from runtime_kv_offload.cpu_tier import CpuTier
from runtime_kv_offload.disk_tier import HEADER, DiskTier
from runtime_kv_offload.policy import ARCPolicy, LRUPolicy

BLOCK_BYTES = 64


def block(i: int) -> torch.Tensor:
    return torch.full((BLOCK_BYTES,), i, dtype=torch.uint8)


def h(i: int) -> bytes:
    return i.to_bytes(32, "little")


def test_lru_evicts_least_recent_and_skips_busy_keys():
    lru = LRUPolicy(3)
    for key in "abc":
        lru.insert(key)
    lru.touch("a")
    assert lru.evict(lambda k: True) == "b"
    assert lru.evict(lambda k: k != "c") == "a"
    assert lru.evict(lambda k: False) is None and "c" in lru


def test_arc_keeps_frequent_keys_through_a_scan():
    arc = ARCPolicy(4)
    resident = []

    def access(key):
        if key in arc:
            arc.touch(key)
            return
        if len(arc) >= 4:
            resident.remove(arc.evict(lambda k: True, incoming=key))
        arc.insert(key)
        resident.append(key)

    for key in ["hot1", "hot2", "hot1", "hot2"]:
        access(key)
    for i in range(10):  # a scan of keys seen once
        access(f"scan{i}")
    assert "hot1" in arc and "hot2" in arc  # LRU would have evicted them
    lru = LRUPolicy(4)
    for key in ["hot1", "hot2"] + [f"scan{i}" for i in range(10)]:
        if len(lru) >= 4:
            lru.evict(lambda k: True)
        lru.insert(key)
    assert "hot1" not in lru


@pytest.mark.parametrize("policy", ["lru", "arc"])
def test_cpu_tier_round_trip_capacity_and_pins(policy):
    tier = CpuTier(3 * BLOCK_BYTES + 10, policy)
    tier.bind(BLOCK_BYTES)
    assert isinstance(tier, KVTier) and tier.num_slots == 3
    for i in range(3):
        tier.store(h(i), block(i))
    assert torch.equal(tier.load(h(1)), block(1))
    busy = {h(0), h(1), h(2)}
    assert tier.reserve(h(3), lambda k: k not in busy) is None  # every block is busy: nothing evicted
    busy.discard(h(2))
    slot = tier.reserve(h(3), lambda k: k not in busy)
    assert slot is not None and not tier.contains(h(2)) and tier.contains(h(3))
    assert tier.reserve(h(3), lambda k: True) is None  # already there


def test_cpu_tier_sized_in_blocks_and_too_small():
    tier = CpuTier(-5)
    tier.bind(BLOCK_BYTES)
    assert tier.num_slots == 5
    with pytest.raises(ValueError, match="holds no block; one block takes 64 bytes"):
        CpuTier(10).bind(BLOCK_BYTES)


def bound_disk(path, num_blocks: int) -> DiskTier:
    tier = DiskTier(str(path), num_blocks * (HEADER.size + BLOCK_BYTES))
    tier.bind(BLOCK_BYTES, "layout")
    return tier


def test_disk_tier_files_survive_a_restart(tmp_path):
    tier = bound_disk(tmp_path, 8)
    assert isinstance(tier, KVTier)
    for i in range(4):
        tier.store(h(i), block(i))
    files = [f for _, _, names in os.walk(tmp_path / "layout") for f in names]
    assert len(files) == 4 and all(f.endswith(".kvb") for f in files)
    again = bound_disk(tmp_path, 8)
    assert len(again) == 4 and all(torch.equal(again.load(h(i)), block(i)) for i in range(4))
    assert not bound_disk(tmp_path / "other", 8).contains(h(0))


def test_corrupted_file_fails_its_checksum_and_is_deleted(tmp_path):
    tier = bound_disk(tmp_path, 8)
    tier.store(h(7), block(7))
    path = tier._path(h(7))
    data = bytearray(open(path, "rb").read())
    data[-1] ^= 0xFF
    open(path, "wb").write(bytes(data))
    assert tier.load(h(7)) is None and tier.num_checksum_failures == 1
    assert not os.path.exists(path) and not tier.contains(h(7))
    tier.store(h(8), block(8))
    open(tier._path(h(8)), "r+b").truncate(HEADER.size + 3)  # a torn write
    assert tier.load(h(8)) is None and tier.num_checksum_failures == 2


def test_full_disk_tier_evicts_least_recently_used(tmp_path):
    tier = bound_disk(tmp_path, 3)
    for i in range(3):
        tier.store(h(i), block(i))
    tier.load(h(0))  # recently used
    tier.store(h(3), block(3))
    assert [tier.contains(h(i)) for i in range(4)] == [True, False, True, True]
    assert tier.total_bytes <= tier.size_bytes
    on_disk = sum(os.path.getsize(os.path.join(d, f)) for d, _, names in os.walk(tmp_path) for f in names)
    assert on_disk == tier.total_bytes
    with pytest.raises(ValueError, match="holds no block"):
        DiskTier(str(tmp_path), 10).bind(BLOCK_BYTES, "layout")


def test_disk_full_before_the_cap_evicts_and_retries(tmp_path, monkeypatch):
    tier = bound_disk(tmp_path, 100)
    for i in range(6):
        tier.store(h(i), block(i))
    real_open, failures = open, []

    def full_once(path, mode="r", *a, **k):
        if "w" in mode and not failures:
            failures.append(path)
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_open(path, mode, *a, **k)

    monkeypatch.setattr(disk_tier, "open", full_once, raising=False)
    tier.store(h(9), block(9))  # no exception: old files make room
    assert failures and tier.contains(h(9)) and torch.equal(tier.load(h(9)), block(9))
    assert not tier.contains(h(0))
