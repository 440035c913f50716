"""The offloading connector's scheduler half: tier lookups, promotions, loads and saves per step.

One scheduler half serves every worker rank (with tensor or pipeline parallelism each rank
keeps its part of each block, its shard of its stage's layers, in tiers of its own). It
decides by its index (:mod:`runtime_kv_offload.index`) which cpu slot each save writes and
each load reads, on every rank alike. A block found only in a lower tier (disk) is first promoted: every rank
reads it into memory and checks it, the request waiting meanwhile (an asynchronous load, as
for a remote engine); the step's reports say whether all ranks could, and a block that one
rank could not read is a miss, recomputed.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

from runtime.kv_transfer import KVConnectorMetadata

from runtime_kv_offload.cpu_tier import CpuTier
from runtime_kv_offload.index import OffloadIndex, mirrors_of


@dataclass
class OffloadMetadata(KVConnectorMetadata):
    """One step's work for every rank, in the order each rank runs it. A save is ``(device
    block, hash, cpu slot or None, lower tiers to write it to)``, a promotion ``(hash, lower
    tier, cpu slot or None: a staging buffer)``, a load ``(device block, hash, cpu slot or
    None: its staging buffer)``."""

    # Blocks reused by this very step (preempted with swap, evicted from the device pool):
    # read before anything writes the cache.
    saves_first: list[tuple] = field(default_factory=list)
    promotions: list[tuple] = field(default_factory=list)  # read from a lower tier, reported back
    loads: list[tuple] = field(default_factory=list)  # into the cache before the forward pass
    # Blocks of finished requests, held by the scheduler: read while the forward pass runs.
    saves: list[tuple] = field(default_factory=list)
    drops: list[bytes] = field(default_factory=list)  # staging buffers no longer needed

    @property
    def is_empty(self) -> bool:
        return not (self.saves_first or self.promotions or self.loads or self.saves or self.drops)


class OffloadingConnectorScheduler:
    def __init__(self, config):
        self.config = config
        self.block_size = config.cache_config.block_size
        self._index: OffloadIndex | None = None
        self.world_size = 1
        self.block_bytes = 0  # one block of every layer, all ranks together
        self.metadata = OffloadMetadata()
        self.pending: set[bytes] = set()  # saved by the metadata being built: not loadable before it is sent
        self.held: list[bytes] = []  # pins that end once the metadata being built is sent
        self.lookups: dict[str, tuple[int, list[bytes]]] = {}  # request -> (first block, pinned hashes)
        self.waiting: dict[str, set[bytes]] = {}  # request -> its blocks still being promoted
        self.promoting: dict[bytes, int] = {}  # block -> the lower tier it is read from
        self.loaded: set[str] = set()  # requests whose promotions all came back
        self.counters: Counter[str] = Counter()
        self.has_lower = False

    @property
    def index(self) -> OffloadIndex:
        if self._index is None:
            raise RuntimeError("the offloading connector's scheduler half has not heard from the workers yet "
                               "(the engine calls set_handshake_metadata once the KV cache exists)")
        return self._index

    def set_handshake_metadata(self, per_rank: list[dict]) -> None:
        """Every rank's tiers (rank order): the cpu slots all of them have, what the lower tiers hold."""
        self.world_size = len(per_rank)
        self.block_bytes = sum(rank["block_bytes"] for rank in per_rank)
        num_slots = min(rank["num_cpu_slots"] for rank in per_rank)
        cpu = None
        if num_slots:
            cpu = CpuTier(-num_slots, self.config.cache_config.kv_offload_policy)  # sized in blocks
            cpu.bind(1, allocate=False)
        self._index = OffloadIndex(cpu, mirrors_of(per_rank))
        self.has_lower = bool(self._index.lower)

    # ---------------------------------------------------------------- lookups and loads
    def get_num_new_matched_tokens(self, request, num_computed_tokens: int) -> tuple[int, bool]:
        first = num_computed_tokens // self.block_size
        last = (request.num_tokens - 1) // self.block_size  # at least one token is left to compute
        hashes = request.block_hashes[first:last]
        previous = self.lookups.pop(request.request_id, (0, []))[1]  # an earlier attempt's (kept while it waited)
        self.waiting.pop(request.request_id, None)
        found, waits = self._find(hashes) if hashes else (0, set())
        self._release(previous)
        if found:
            self.lookups[request.request_id] = (first, hashes[:found])
        if waits:
            self.waiting[request.request_id] = waits
        return found * self.block_size, bool(waits)

    def _find(self, hashes: list[bytes]) -> tuple[int, set[bytes]]:
        """How many leading blocks the tiers hold (each pinned), and those still to be promoted."""
        index = self.index
        found, waits = 0, set()
        for block_hash in hashes:
            if block_hash in self.pending:
                break
            if index.in_memory(block_hash):
                if block_hash in index.unready:
                    waits.add(block_hash)
            else:
                tier = index.lower_holding(block_hash)
                if tier is None:
                    break
                self._promote(block_hash, tier)
                waits.add(block_hash)
            index.pin(block_hash)
            found += 1
        return found, waits

    def _promote(self, block_hash: bytes, tier: int) -> None:
        index = self.index
        slot = index.reserve_slot(block_hash)
        if slot is None:
            index.staged.add(block_hash)
        index.unready.add(block_hash)
        self.promoting[block_hash] = tier
        self.metadata.promotions.append((block_hash, tier, slot))

    def update_state_after_alloc(self, request, block_ids: list[int], num_external_tokens: int) -> None:
        first, hashes = self.lookups.pop(request.request_id, (0, []))
        if not num_external_tokens:
            self._release(hashes)
            return
        assert num_external_tokens == len(hashes) * self.block_size, (num_external_tokens, len(hashes))
        index = self.index
        for block_id, block_hash in zip(block_ids[first : first + len(hashes)], hashes):
            self.metadata.loads.append((block_id, block_hash, index.slot(block_hash)))
            staged = block_hash in index.staged
            origin = index.origin.get(block_hash) if staged else index.origin.pop(block_hash, None)
            self.counters["hits_" + (origin or "cpu")] += 1
        self.counters["blocks_loaded"] += len(hashes)
        self.counters["bytes_loaded"] += len(hashes) * self.block_bytes
        self.held.extend(hashes)  # the ranks read them in the step this metadata goes with

    def _release(self, hashes) -> None:
        for block_hash in hashes:
            if self.index.release(block_hash):
                self.metadata.drops.append(block_hash)

    def _forget(self, request_id: str) -> None:
        self.waiting.pop(request_id, None)
        self.loaded.discard(request_id)  # its promotions came back, but it ended before it was looked up again
        self._release(self.lookups.pop(request_id, (0, []))[1])

    # ---------------------------------------------------------------- promotions come back
    def update_connector_output(self, per_rank: list[dict]) -> None:
        """Every rank's report on a step: promotions read (or not), load time, checksum failures."""
        results: dict[bytes, list[bool]] = {}
        load_seconds = 0.0
        for report in per_rank:
            for block_hash, ok in report["promoted"].items():
                results.setdefault(block_hash, []).append(ok)
            load_seconds = max(load_seconds, report["load_seconds"])  # the ranks copy at the same time
            if report["checksum_failures"]:
                self.counters["checksum_failures"] += report["checksum_failures"]
        self.counters["load_seconds"] += load_seconds
        for block_hash, oks in results.items():
            tier = self.promoting.pop(block_hash, None)
            if tier is None:
                continue
            if self.index.promoted(block_hash, tier, ok=len(oks) == self.world_size and all(oks)):
                self.metadata.drops.append(block_hash)
            for waits in self.waiting.values():
                waits.discard(block_hash)
        for request_id in [r for r, waits in self.waiting.items() if not waits]:
            del self.waiting[request_id]
            self.loaded.add(request_id)

    def get_finished_recving(self) -> dict[str, str | None]:
        """Requests whose blocks were all promoted (or found missing): looked up again now."""
        loaded, self.loaded = self.loaded, set()
        return dict.fromkeys(loaded)

    # ---------------------------------------------------------------- saves
    def _save(self, block_id: int, block_hash: bytes) -> tuple | None:
        """A save of a block no tier holds yet (its cpu slot and the lower tiers to write it
        to), or None when it is there already or no tier has room."""
        index = self.index
        if block_hash in self.pending or index.in_memory(block_hash):
            return None
        write_to = tuple(i for i, mirror in enumerate(index.lower) if block_hash not in mirror)
        slot = index.reserve_slot(block_hash)
        if slot is None and not write_to:
            return None
        for i in write_to:
            index.lower[i].add(block_hash)
        self.pending.add(block_hash)
        index.pin(block_hash)
        self.held.append(block_hash)
        self.counters["blocks_stored"] += 1
        self.counters["bytes_stored"] += self.block_bytes
        return block_id, block_hash, slot, write_to

    def _saves_of(self, request, block_ids: list[int]) -> list[tuple]:
        """The request's computed full blocks that no tier holds yet."""
        num_full = min(request.num_computed_tokens // self.block_size, len(request.block_hashes), len(block_ids))
        saves = (self._save(b, h) for b, h in zip(block_ids[:num_full], request.block_hashes[:num_full]))
        return [save for save in saves if save is not None]

    def request_finished(self, request, block_ids: list[int]):
        self._forget(request.request_id)
        saves = self._saves_of(request, block_ids)
        self.metadata.saves.extend(saves)
        return bool(saves), None

    def request_preempted(self, request, block_ids: list[int]) -> None:
        self.metadata.saves_first.extend(self._saves_of(request, block_ids))

    def block_evicted(self, block_id: int, block_hash: bytes) -> None:
        save = self._save(block_id, block_hash)
        if save is not None:
            self.metadata.saves_first.append(save)

    # ---------------------------------------------------------------- steps
    def build_connector_meta(self, scheduler_output) -> OffloadMetadata:
        metadata, self.metadata = self.metadata, OffloadMetadata()
        self.pending = set()
        held, self.held = self.held, []
        self._release(held)  # every rank runs this metadata before anything that follows it
        metadata.drops += self.metadata.drops
        self.metadata.drops = []
        return metadata

    def has_pending_work(self) -> bool:
        return not self.metadata.is_empty

    def get_stats(self) -> dict:
        """Cumulative counters, as the scheduler stats' ``kv_offload_*`` keys."""
        counters = dict(self.counters)
        if self.has_lower:
            counters.setdefault("checksum_failures", 0)
        return {"kv_offload_" + key: value for key, value in counters.items()}
