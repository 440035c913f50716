"""The disk tier across a restart, on real files: the temporaries of a write that a killed engine
never finished are deleted at the next start (never those of a write in flight), and the restarted
tier evicts its least recently used files, not its oldest written ones."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

import torch

from runtime_kv_offload import disk_tier
from runtime_kv_offload.disk_tier import HEADER, DiskTier

BLOCK_BYTES = 64


def h(i: int) -> bytes:
    return i.to_bytes(32, "little")


def bound(path, num_blocks: int = 8) -> DiskTier:
    tier = DiskTier(str(path), num_blocks * (HEADER.size + BLOCK_BYTES))
    tier.bind(BLOCK_BYTES, "layout")
    return tier


def temporaries(path) -> list[str]:
    return sorted(p.name for p in path.rglob("*.tmp"))


# A writer killed in the middle of a block's write: the temporary is written, the rename never comes.
WRITER = textwrap.dedent("""
    import os, sys, time, torch
    from runtime_kv_offload.disk_tier import DiskTier
    tier = DiskTier(sys.argv[1], 1 << 20)
    tier.bind(64, "layout")
    def stuck(src, dst):
        print("writing", flush=True)
        time.sleep(600)
    os.replace = stuck
    tier.store((5).to_bytes(32, "little"), torch.full((64,), 5, dtype=torch.uint8))
""")


def test_a_killed_writers_temporary_is_deleted_at_the_next_start_but_not_while_it_writes(tmp_path):
    bound(tmp_path).store(h(1), torch.full((BLOCK_BYTES,), 1, dtype=torch.uint8))
    writer = subprocess.Popen([sys.executable, "-c", WRITER, str(tmp_path)], stdout=subprocess.PIPE, text=True)
    try:
        assert writer.stdout.readline() == "writing\n"
        (in_flight,) = temporaries(tmp_path)
        assert f".{writer.pid}." in in_flight
        during = bound(tmp_path)  # an engine starting while the other one writes
        assert temporaries(tmp_path) == [in_flight] and during.hashes() == [h(1)]
    finally:
        writer.send_signal(signal.SIGKILL)
        writer.wait()
    restarted = bound(tmp_path)
    assert temporaries(tmp_path) == []  # it stayed for good before, in no tier's size
    assert restarted.hashes() == [h(1)] and not restarted.contains(h(5))
    assert torch.equal(restarted.load(h(1)), torch.full((BLOCK_BYTES,), 1, dtype=torch.uint8))


def test_which_temporaries_a_start_deletes(tmp_path):
    folder = tmp_path / "layout" / "ab"
    folder.mkdir(parents=True)
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    alive = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    host, me = disk_tier.HOST, os.getpid()
    names = {
        "dead": f"{'ab' * 32}.kvb.{host}.{gone.pid}.7.tmp",  # its process is gone
        "alive": f"{'ab' * 32}.kvb.{host}.{alive.pid}.7.tmp",  # another engine's write in flight
        "mine": f"{'ab' * 31}cd.kvb.{host}.{me}.7.tmp",  # an earlier process with this pid (a container's)
        "mine_writing": f"{'ab' * 31}ef.kvb.{host}.{me}.8.tmp",  # another tier of this process, writing
        "elsewhere": f"{'ab' * 32}.kvb.otherhost.example.{gone.pid}.7.tmp",  # another host's write
        "old_elsewhere": f"{'ab' * 31}aa.kvb.otherhost.example.1.7.tmp",  # another host's, hours old
        "old_format": f"{'ab' * 31}bb.kvb.{gone.pid}.7.tmp",  # no host in the name: judged by age
    }
    for name in names.values():
        (folder / name).write_bytes(b"x" * 10)
    hours_ago = time.time() - 3 * 3600
    os.utime(folder / names["old_elsewhere"], (hours_ago, hours_ago))
    disk_tier._writing.add(str(folder / names["mine_writing"]))
    try:
        bound(tmp_path)
    finally:
        disk_tier._writing.discard(str(folder / names["mine_writing"]))
        alive.kill()
        alive.wait()
    kept = {key for key, name in names.items() if (folder / name).exists()}
    assert kept == {"alive", "mine_writing", "elsewhere", "old_format"}


def test_a_restarted_tier_evicts_by_last_use_not_by_write_time(tmp_path):
    tier = bound(tmp_path, 3)
    for i in range(3):
        tier.store(h(i), torch.full((BLOCK_BYTES,), i, dtype=torch.uint8))
    assert tier.load(h(0)) is not None  # the first written is the last used
    tier.store(h(1), torch.full((BLOCK_BYTES,), 1, dtype=torch.uint8))  # saved again: a use too
    restarted = bound(tmp_path, 3)
    assert restarted.hashes() == [h(2), h(0), h(1)]  # it was [0, 1, 2]: the order the files were written
    restarted.store(h(3), torch.full((BLOCK_BYTES,), 3, dtype=torch.uint8))
    assert [restarted.contains(h(i)) for i in range(4)] == [True, True, False, True]
    again = bound(tmp_path, 3)
    assert again.hashes() == [h(0), h(1), h(3)]
