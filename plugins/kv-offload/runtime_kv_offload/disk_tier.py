"""The disk tier: one file per block under a directory, with a size cap (LRU) and a checksum.

Files live in ``DIR/<layout>/<hh>/<block hash>.kvb``, where ``<layout>`` names the model and
KV cache layout, so a directory shared by several models never mixes them; with tensor
parallelism each rank has its own (``<layout>-tp2-rank1``: its shard of the KV heads). Block hashes
are stable across processes (:mod:`runtime.scheduler.block_hash`), so a restarted engine
finds the blocks its predecessor wrote. A file is ``MAGIC | crc32 | payload length |
payload``; one that fails the check is deleted and reported as a miss (the tokens are then
recomputed). A full tier (its cap, or the disk itself) evicts its least recently used files.

A file's modification time is its last use (set when it is written and again on every read),
so a restarted engine evicts by last use, not by write time. A block is written to a
temporary file (``<name>.kvb.<host>.<pid>.<thread>.tmp``) renamed into place; the temporaries a
killed engine left behind are deleted at start-up: those of a process of this host that is
gone (or of this very process, which writes none yet) and any older than an hour (another
host's). A write in flight is never touched.
"""

from __future__ import annotations

import errno
import logging
import os
import socket
import struct
import threading
import time
import zlib
from collections import OrderedDict

import torch

logger = logging.getLogger(__name__)

MAGIC = b"RTKVBLK1"
HEADER = struct.Struct("<8sIQ")  # magic, crc32 of the payload, payload length
SUFFIX = ".kvb"
TMP_SUFFIX = ".tmp"
STALE_TMP_S = 3600  # a temporary file this old belongs to no write in flight, whoever wrote it
HOST = socket.gethostname()
_writing: set[str] = set()  # this process's temporary files being written (every DiskTier's)


class DiskTier:
    name = "disk"

    def __init__(self, directory: str | None, size_bytes: int):
        if not directory:
            raise ValueError("the disk KV offload tier needs a directory: add --kv-offload-dir PATH")
        self.directory = directory
        self.size_bytes = size_bytes
        self.root: str | None = None
        self.files: OrderedDict[bytes, int] = OrderedDict()  # block hash -> file size, least recent first
        self.total_bytes = 0
        self.block_bytes = 0
        self.num_checksum_failures = 0
        self.lock = threading.Lock()

    def bind(self, block_bytes: int, layout_key: str, pin: bool = False) -> None:
        """Open ``DIR/<layout_key>``, delete the temporaries a killed engine left there, and index the
        block files already there (least recently used first)."""
        if self.size_bytes < HEADER.size + block_bytes:
            raise ValueError(
                f"--kv-offload-size for the disk tier ({self.size_bytes} bytes) holds no block; one block file takes "
                f"{HEADER.size + block_bytes} bytes"
            )
        self.block_bytes = block_bytes
        self.root = os.path.join(self.directory, layout_key)
        os.makedirs(self.root, exist_ok=True)
        found = []
        for sub in os.listdir(self.root):
            folder = os.path.join(self.root, sub)
            if not os.path.isdir(folder):
                continue
            for name in os.listdir(folder):
                if name.endswith(TMP_SUFFIX):
                    _remove_if_stale(os.path.join(folder, name))
                    continue
                if not name.endswith(SUFFIX):
                    continue
                try:
                    block_hash = bytes.fromhex(name[: -len(SUFFIX)])
                    stat = os.stat(os.path.join(folder, name))
                except (ValueError, OSError):  # not a block file, or deleted meanwhile (an engine sharing the folder)
                    continue
                found.append((stat.st_mtime_ns, block_hash, stat.st_size))
        for _, block_hash, size in sorted(found):
            self.files[block_hash] = size
            self.total_bytes += size
        with self.lock:
            self._evict_to(self.size_bytes)

    @property
    def capacity_blocks(self) -> int:
        """How many block files fit under the cap (once bound)."""
        return self.size_bytes // (HEADER.size + self.block_bytes)

    def hashes(self) -> list[bytes]:
        """The blocks on disk, least recently used first."""
        with self.lock:
            return list(self.files)

    def _path(self, block_hash: bytes) -> str:
        name = block_hash.hex()
        return os.path.join(self.root, name[:2], name + SUFFIX)

    # ---------------------------------------------------------------- KVTier
    def contains(self, block_hash: bytes) -> bool:
        return block_hash in self.files

    def store(self, block_hash: bytes, data: torch.Tensor) -> None:
        """Write the block (atomically: a temporary file renamed), evicting old files to stay
        under the cap; a full disk evicts and retries once, then drops the block."""
        payload = data.reshape(-1).view(torch.uint8).numpy().tobytes()
        blob = HEADER.pack(MAGIC, zlib.crc32(payload), len(payload)) + payload
        with self.lock:
            if block_hash in self.files:
                self.files.move_to_end(block_hash)
                _mark_used(self._path(block_hash))
                return
            self._evict_to(self.size_bytes - len(blob))
        path = self._path(block_hash)
        tmp = f"{path}.{HOST}.{os.getpid()}.{threading.get_ident()}{TMP_SUFFIX}"
        for attempt in range(2):
            _writing.add(tmp)
            try:
                os.makedirs(os.path.dirname(path), exist_ok=True)
                with open(tmp, "wb") as f:
                    f.write(blob)
                _mark_used(tmp)
                os.replace(tmp, path)
                break
            except OSError as exc:
                _remove(tmp)
                if exc.errno not in (errno.ENOSPC, errno.EDQUOT) or attempt == 1 or not self.files:
                    logger.warning("disk KV tier: could not write block %s (%s); dropped", block_hash.hex()[:12], exc)
                    return
                with self.lock:  # the disk is full before the cap: make room and retry once
                    self._evict_to(max(self.total_bytes - 4 * len(blob), 0))
            finally:
                _writing.discard(tmp)
        with self.lock:
            self.files[block_hash] = len(blob)
            self.total_bytes += len(blob)

    def load(self, block_hash: bytes) -> torch.Tensor | None:
        """The block's payload, or None when the file is gone, truncated or fails its checksum
        (a failing file is deleted)."""
        with self.lock:
            if block_hash not in self.files:
                return None
            self.files.move_to_end(block_hash)
        try:
            with open(self._path(block_hash), "rb") as f:
                blob = f.read()
        except OSError:
            self._forget(block_hash)
            return None
        if len(blob) >= HEADER.size:
            magic, crc, length = HEADER.unpack_from(blob)
            payload = memoryview(blob)[HEADER.size :]
            if magic == MAGIC and length == len(payload) == self.block_bytes and zlib.crc32(payload) == crc:
                _mark_used(self._path(block_hash))  # the order a restarted engine evicts in
                return torch.frombuffer(bytearray(payload), dtype=torch.uint8)
        self.num_checksum_failures += 1
        logger.warning("disk KV tier: block file %s fails its checksum; deleted (it will be recomputed)",
                       self._path(block_hash))
        self._forget(block_hash)
        _remove(self._path(block_hash))
        return None

    # ---------------------------------------------------------------- eviction
    def _forget(self, block_hash: bytes) -> None:
        with self.lock:
            size = self.files.pop(block_hash, None)
            if size is not None:
                self.total_bytes -= size

    def _evict_to(self, limit: int) -> None:
        """Delete least recently used files until the tier holds at most ``limit`` bytes (lock held)."""
        while self.files and self.total_bytes > limit:
            block_hash, size = self.files.popitem(last=False)
            self.total_bytes -= size
            _remove(self._path(block_hash))

    def __len__(self) -> int:
        return len(self.files)


def _mark_used(path: str) -> None:
    """Set the file's modification time to now (its last use; file system timestamps are coarser)."""
    now = time.time_ns()
    try:
        os.utime(path, ns=(now, now))
    except OSError:
        pass


def _remove_if_stale(path: str) -> None:
    """Delete a temporary block file that no write in flight owns: its writer (named in the file
    name, on this host) is gone or is this process before it wrote it, or it is over an hour old."""
    parts = os.path.basename(path)[: -len(TMP_SUFFIX)].split(SUFFIX + ".", 1)[-1].rsplit(".", 2)
    stale = False
    if len(parts) == 3 and parts[0] == HOST and parts[1].isdigit():
        pid = int(parts[1])
        stale = path not in _writing if pid == os.getpid() else not _alive(pid)
    try:
        stale = stale or time.time() - os.stat(path).st_mtime > STALE_TMP_S
    except OSError:  # renamed or deleted meanwhile: its write ended
        return
    if stale:
        logger.info("disk KV tier: deleting %s, left by a write that did not finish", path)
        _remove(path)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # e.g. another user's process
        return True
    return True


def _remove(path: str) -> None:
    try:
        os.remove(path)
    except OSError:
        pass
