"""The offloading connector's worker half: this rank's tiers and its block copies.

Every rank (one, or each of a tensor- or pipeline-parallel engine's) holds its own part of
each block (its shard of the KV heads of its stage's layers): its own cpu pool, its own disk
files. The scheduler half chooses the slots; each step's metadata is run in order: saves of
blocks this step reuses (``saves_first``), promotions (lower tier -> memory, on the background
thread, awaited and reported), loads, before the forward pass; saves of finished requests'
blocks (held by the scheduler) overlap the forward pass and are awaited by
:meth:`wait_for_save`. Writing through to the disk tier runs on the background thread, in
order with the promotions (a block is read only after it was written), and a cpu slot is not
overwritten before its write has read it.

On a GPU the copies run on a side CUDA stream: it waits for the work queued so far (the
blocks were written by earlier forward passes), the forward pass waits for the loads with
an event, and the next step waits for the overlapped saves; pinned cpu slots make the
copies asynchronous. On the CPU the overlapped saves run on the background thread.
"""

from __future__ import annotations

import os
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor

import torch

from runtime_kv_offload.copier import BlockCopier


def build_tiers(config, block_bytes: int, layout_key: str, pin: bool) -> list[tuple[str, object]]:
    """This rank's tiers (name, tier), bound to its block layout; each holds its share of the
    configured size (the sizes are the engine's, all ranks together)."""
    from runtime.plugins import get_registry

    registry = get_registry("kv_tier")
    cache = config.cache_config
    world_size = config.parallel_config.world_size
    tiers = []
    for name, size in zip(cache.kv_offload, cache.kv_offload_size):
        tier = registry.create(name, config, size // world_size if size > 0 else size)  # < 0: blocks per rank
        bind = getattr(tier, "bind", None)  # optional: learn the block layout before the first block
        if bind is not None:
            bind(block_bytes, layout_key=layout_key, pin=pin)
        tiers.append((name, tier))
    return tiers


WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf")


def model_identity(config) -> str:
    """What a block's KV depends on besides its tokens and the cache layout, for the disk tier's folder
    name: the checkpoint (its absolute folder, and the size and modification time of its config and
    weight files: a checkpoint replaced in place is another model; the GGUF file loaded), the quantization, the model's
    dtype and the load format (dummy weights: their seed). Blocks of another model are never read."""
    model = config.model_config
    resolved = getattr(model, "resolved", None)
    folder = os.path.abspath(getattr(resolved, "path", None) or model.model)
    paths = [os.path.join(folder, name) for name in sorted(os.listdir(folder))
             if name == "config.json" or name.endswith(WEIGHT_SUFFIXES)] if os.path.isdir(folder) else [folder]
    files = [(os.path.basename(path), stat.st_size, stat.st_mtime_ns) for path in paths if (stat := _stat(path))]
    load_format = config.load_config.load_format
    identity = (folder, files, model.quantization, str(model.dtype), load_format,
                model.seed if load_format == "dummy" else None)
    gguf_file = getattr(model, "gguf_file", None)
    if gguf_file:  # a folder may hold several GGUF files (other quantizations of the model): which one is loaded
        identity += (os.path.basename(gguf_file),)
    return repr(identity)


def _stat(path: str):
    try:
        return os.stat(path)
    except OSError:
        return None


def rank_suffix(state) -> str:
    """What tells this rank's tier files from the other ranks': its shard of the KV heads
    (``-tp2-rank1``) and its pipeline stage's layers (``-pp2-stage1``)."""
    suffix = f"-tp{state.tp_size}-rank{state.tp_rank}" if state.tp_size > 1 else ""
    return suffix + (f"-pp{state.pp_size}-stage{state.pp_rank}" if state.pp_size > 1 else "")


class OffloadingConnectorWorker:
    def __init__(self, config):
        from runtime.distributed.parallel_state import get_parallel_state

        self.config = config
        self.world_size = config.parallel_config.world_size
        self.state = get_parallel_state()  # this rank's place: its stage's layers, its shard of their heads
        self.rank = self.state.rank
        self.copier: BlockCopier | None = None
        self.cpu = None  # this rank's cpu tier (its pool; the scheduler half picks the slots)
        self.lower: list[tuple[str, object]] = []  # the other tiers, in chain order
        self.staged: dict[bytes, torch.Tensor] = {}  # promoted blocks that got no cpu slot
        self.thread = ThreadPoolExecutor(1, thread_name_prefix="kv-offload")  # writes and promotions, in order
        self.slot_readers: dict[int, Future] = {}  # the last write that reads a cpu slot
        self.overlapped: Future | None = None  # the CPU's saves that overlap the forward pass
        self.stream = None  # the side CUDA stream
        self.saves_done = None  # CUDA event: the step's overlapped saves have read their blocks
        self.lock = threading.Lock()
        self.promoted: dict[bytes, bool] = {}  # this step's promotions: read and checked?
        self.load_seconds = 0.0
        self.failures_reported = 0

    # A drafter's layers come with the target's (runtime.kv_transfer): a block swapped out or reloaded from a tier
    # brings back the draft model's KV too, which the drafter reads as its own (its acceptance collapsed without).
    stores_draft_kv = True

    def register_kv_caches(self, kv_caches: list[torch.Tensor], block_dim: int = 1) -> None:
        self.copier = BlockCopier(kv_caches, block_dim)
        is_cuda = kv_caches[0].is_cuda
        key = self.copier.layout_key(model_identity(self.config), self.config.cache_config.kv_block_layout)
        key += rank_suffix(self.state)
        tiers = build_tiers(self.config, self.copier.block_bytes, key, pin=is_cuda)
        self.cpu = next((tier for _, tier in tiers if hasattr(tier, "reserve_slot")), None)
        self.lower = [(name, tier) for name, tier in tiers if tier is not self.cpu]
        if is_cuda:
            self.stream = torch.cuda.Stream(device=kv_caches[0].device)

    def get_handshake_metadata(self) -> dict:
        """This rank's block size, cpu slots and lower tiers (name, capacity in blocks or None,
        the blocks already there, least recently used first)."""
        lower = [(name, getattr(tier, "capacity_blocks", None), list(getattr(tier, "hashes", list)()))
                 for name, tier in self.lower]
        return {"rank": self.rank, "block_bytes": self.copier.block_bytes,
                "num_cpu_slots": self.cpu.num_slots if self.cpu is not None else 0, "lower": lower}

    # ---------------------------------------------------------------- steps
    def start_load_kv(self, metadata) -> None:
        loads = [(self.cpu.pool[slot] if slot is not None else self.staged[h], block_id)
                 for block_id, h, slot in metadata.loads]
        # Staging buffers are freed before this step's promotions start: one of them may stage the
        # same block anew (a block dropped and looked up again by another request in one step).
        for block_hash in metadata.drops:
            self.staged.pop(block_hash, None)
        promotions = [(h, self.thread.submit(self._promote, h, tier, slot)) for h, tier, slot in metadata.promotions]
        first = self._buffers(metadata.saves_first)
        later = self._buffers(metadata.saves)
        if self.stream is not None:
            self._start_cuda(first, loads, later)
        else:
            self._start_cpu(first, loads, later)
        for block_hash, future in promotions:
            self.promoted[block_hash] = future.result()

    def _buffers(self, saves) -> list[tuple]:
        """(device block, hash, host buffer, slot, lower tiers) per save: the cpu slot once no
        write reads it any more, else a buffer of its own."""
        out = []
        for block_id, h, slot, write_to in saves:
            if slot is None:
                buffer = torch.empty(self.copier.block_bytes, dtype=torch.uint8, pin_memory=self.stream is not None)
            else:
                reader = self.slot_readers.pop(slot, None)
                if reader is not None:
                    reader.result()
                buffer = self.cpu.pool[slot]
            out.append((block_id, h, buffer, slot, write_to))
        return out

    def _promote(self, block_hash: bytes, tier: int, slot: int | None) -> bool:
        data = self.lower[tier][1].load(block_hash)  # None: gone, or failed its checksum
        if data is None:
            return False
        if slot is None:
            self.staged[block_hash] = data
        else:
            self.cpu.pool[slot].copy_(data)
        return True

    def _copy(self, saves) -> None:
        if saves:
            self.copier.to_host([block_id for block_id, *_ in saves], [buffer for _, _, buffer, _, _ in saves])

    def _load(self, loads) -> None:
        if loads:
            self.copier.to_device([buffer for buffer, _ in loads], [block_id for _, block_id in loads])

    def _write(self, saves, wait_for=None) -> None:
        """Write the saved blocks through to the lower tiers (background thread)."""
        if wait_for is not None:
            wait_for.synchronize()
        for _, h, buffer, _, write_to in saves:
            for i in write_to:
                self.lower[i][1].store(h, buffer)

    def _submit_writes(self, saves, wait_for=None) -> None:
        saves = [save for save in saves if save[4]]
        if saves:
            future = self.thread.submit(self._write, saves, wait_for)
            for save in saves:
                if save[3] is not None:
                    self.slot_readers[save[3]] = future

    def _start_cpu(self, first, loads, later) -> None:
        self._copy(first)
        self._submit_writes(first)
        started = time.perf_counter()
        self._load(loads)
        if loads:
            self._count_load(started)
        if later:
            self.overlapped = self.thread.submit(self._copy, later)
            self._submit_writes(later)  # after the copies: wait_for_save waits only for them

    def _start_cuda(self, first, loads, later) -> None:
        stream = self.stream
        main = torch.cuda.current_stream(stream.device)
        stream.wait_stream(main)  # the blocks to save were written by forward passes queued before
        started = time.perf_counter()
        with torch.cuda.stream(stream):
            self._copy(first)
            self._load(loads)
            ready = torch.cuda.Event()
            ready.record(stream)
            self._copy(later)
            self.saves_done = torch.cuda.Event()
            self.saves_done.record(stream)
        main.wait_event(ready)  # the forward pass reads the loaded blocks and rewrites the saved ones
        self._submit_writes(first, ready)
        if loads:  # also keeps later promotions (same thread) off the slots until the copies read them
            self.thread.submit(self._loads_done, ready, started)
        self._submit_writes(later, self.saves_done)

    def _loads_done(self, ready, started: float) -> None:
        ready.synchronize()
        self._count_load(started)

    def _count_load(self, started: float) -> None:
        with self.lock:
            self.load_seconds += time.perf_counter() - started

    def wait_for_save(self) -> None:
        if self.stream is not None:
            if self.saves_done is not None:
                torch.cuda.current_stream(self.stream.device).wait_event(self.saves_done)
                self.saves_done = None
        elif self.overlapped is not None:
            self.overlapped.result()
            self.overlapped = None

    def get_connector_output(self) -> dict:
        """This rank's report on the step: its promotions, load time, checksum failures (new ones)."""
        failures = sum(getattr(tier, "num_checksum_failures", 0) for _, tier in self.lower)
        with self.lock:
            seconds, self.load_seconds = self.load_seconds, 0.0
        promoted, self.promoted = self.promoted, {}
        report = {"rank": self.rank, "promoted": promoted, "load_seconds": seconds,
                  "checksum_failures": failures - self.failures_reported}
        self.failures_reported = failures
        return report

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str], set[str]]:
        return set(), set()  # saves end within a step (the scheduler frees held blocks when every rank is back)

    def shutdown(self) -> None:
        """Finish the writes in flight (the disk tier's last blocks)."""
        self.wait_for_save()
        self.thread.shutdown(wait=True)
