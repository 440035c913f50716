"""The scheduler's side of a KV connector (offload tiers, prefill/decode transfer): lookups past
the device prefix cache, loads after allocation, saves on finish, preemption and eviction, held
blocks, and requests waiting for a remote load.

The scheduler calls this module at five points and nothing else of the connector:

1. admission: after the device prefix-cache lookup, :meth:`SchedulerConnector.num_external_tokens`
   asks how many further prompt tokens a tier holds; the scheduler allocates blocks for them
   and counts them as computed, and :meth:`after_alloc` tells the connector which blocks to
   load (before the forward pass of this step);
2. freeing: a finished (or aborted) request's blocks go through :meth:`free`: when the
   connector saves them, they are held (not reusable) until the step whose metadata carries
   the saves has come back (:meth:`step_done`);
3. preemption (:meth:`preempt`): with ``--preemption-mode swap`` the connector saves the
   request's computed blocks, which the worker reads before this step's forward pass reuses them;
4. each step: :meth:`attach_metadata` puts the connector's loads and saves on the
   SchedulerOutput; cached blocks evicted from the device pool are reported to the connector
   as they are taken (the block pool's ``on_evict``); when the step is back (from every worker
   rank), :meth:`step_done` hands the connector the ranks' reports (``update_connector_output``);
5. remote loads: a lookup that answers "loads asynchronously" parks the request here, holding
   no blocks (:meth:`wait_remote`), until the connector's ``get_finished_recving`` names it
   (:meth:`take_loaded`); it is then admitted again and asked again. A connector with
   ``get_finished_sending`` holds a finished request's blocks until it names the request
   (a remote decode pulled them, or their lease expired) instead of until the next step.
6. background loads: a connector whose ``loads_in_background(request)`` says so gets the
   request's blocks for its external tokens only, left out of the prefix cache, and the request
   waits holding them (:meth:`start_loading`) while steps run without it, so a long copy holds
   no step; once ``get_finished_loading`` names it (:meth:`take_background_loads`) it is admitted
   with those tokens computed and its blocks are indexed. One aborted meanwhile keeps its blocks
   until then (the copy still writes them); a failed load frees them and the request computes
   its prompt here, or fails with the connector's reason.
"""

from __future__ import annotations

import time
from typing import Any

from runtime.scheduler.kv_cache_manager import KVCacheManager
from runtime.scheduler.request import Request

REMOTE_POLL_S = 0.002  # while only remote loads are pending, a step waits this long for one


class SchedulerConnector:
    def __init__(self, connector: Any, kv_cache_manager: KVCacheManager, preemption_mode: str = "recompute"):
        self.connector = connector
        self.kv = kv_cache_manager
        self.swap = preemption_mode == "swap"
        self.num_external_hit_tokens = 0  # prompt tokens loaded from a tier instead of computed
        self.unsent: list = []  # blocks held for saves not yet in a step's metadata
        self.in_flight: list[tuple[object, list]] = []  # (metadata, blocks held until that step is back)
        kv_cache_manager.pool.on_evict = getattr(connector, "block_evicted", None)
        self._pending_work = getattr(connector, "has_pending_work", None)
        self._stats = getattr(connector, "get_stats", None)
        self._finished_recving = getattr(connector, "get_finished_recving", None)
        self._finished_sending = getattr(connector, "get_finished_sending", None)
        self._update_output = getattr(connector, "update_connector_output", None)
        self._in_background = getattr(connector, "loads_in_background", None)
        self._finished_loading = getattr(connector, "get_finished_loading", None)
        self.waiting_remote: dict[str, Request] = {}  # request id -> request whose KV loads from afar
        self.held: dict[str, list] = {}  # request id -> blocks held until get_finished_sending names it
        self.loading: dict[str, Request] = {}  # request id -> request whose blocks a background load writes
        self.loaded: set[str] = set()  # background loads done: admitted next (their blocks already allocated)
        self.held_loading: dict[str, list] = {}  # aborted while loading: blocks held until the load ends

    # ---------------------------------------------------------------- admission
    def num_external_tokens(self, request: Request, num_device_cached: int) -> int | None:
        """Prompt tokens past the device prefix hit that the connector will load; None: the
        request must wait for an asynchronous (remote) load first (:meth:`wait_remote`)."""
        if request.sampling_params.prompt_logprobs is not None:
            return 0  # every position's logits are needed: nothing may be skipped
        num_tokens, load_async = self.connector.get_num_new_matched_tokens(request, num_device_cached)
        if load_async and self._finished_recving is not None:
            return None
        return num_tokens

    def wait_remote(self, request: Request, num_device_cached: int) -> None:
        self.waiting_remote[request.request_id] = request
        self.kv.uncount_lookup(request, num_device_cached)  # the prefix lookup counts once: when it is admitted

    def take_loaded(self, idle: bool) -> tuple[list[Request], list[tuple[Request, str]]]:
        """Requests whose remote loads ended: (ready to be admitted again, (failed, why)). When the
        scheduler has nothing else to run (``idle``), wait a moment for one instead of spinning."""
        ended = self._finished_recving()
        if not ended and idle:
            time.sleep(REMOTE_POLL_S)
            ended = self._finished_recving()
        ready, failed = [], []
        for req_id, error in ended.items():
            request = self.waiting_remote.pop(req_id, None)
            if request is not None:
                (ready.append(request) if error is None else failed.append((request, error)))
        return ready, failed

    def loads_in_background(self, request: Request, num_external: int) -> bool:
        """Whether the connector writes ``request``'s external tokens while steps run without it."""
        if not num_external or self._in_background is None or self._finished_loading is None:
            return False  # a background load needs get_finished_loading to end
        return bool(self._in_background(request))

    def start_loading(self, request: Request, computed_blocks: list, num_device_cached: int, num_external: int) -> bool:
        """Blocks for ``request``'s external tokens alone, kept out of the prefix cache, and the
        connector told to load them: the request then holds them and waits for the load
        (:meth:`take_background_loads`). False (nothing changed) when the pool cannot supply them."""
        if self.kv.allocate_slots(request, num_external, computed_blocks, cache=False) is None:
            self.alloc_failed(request)
            return False
        self.after_alloc(request, num_external)  # its load runs while steps go on
        request.num_computed_tokens = num_device_cached + num_external
        self.loading[request.request_id] = request
        return True

    def admit_loaded(self, request: Request, budget: int, chunked_prefill: bool) -> tuple[list[int], int, int] | None:
        """A request whose background load ended, admitted: (all its block ids, tokens computed, tokens
        to schedule), with blocks for the rest of its prompt (the loaded ones join the prefix cache
        now); None when the budget or the pool cannot take it this step."""
        num_cached = request.num_computed_tokens
        num_new = request.num_tokens - num_cached
        if not chunked_prefill and num_new > budget:
            return None
        num_new = min(num_new, budget)
        if self.kv.allocate_slots(request, num_new) is None:
            return None
        self.loaded.discard(request.request_id)
        return self.kv.block_ids(request.request_id), num_cached, num_new

    def poll(self, idle: bool) -> tuple[list[Request], list[Request], list[tuple[Request, str]]]:
        """Free the blocks the connector is done sending; the requests whose loads ended: (to admit
        first: they hold their blocks already, to admit after the others, (to fail, why)). When the
        scheduler has nothing else to run (``idle``), wait a moment for one."""
        self.release_sent()
        first, last, failed = [], [], []
        if self.loading or self.held_loading:
            first, last, failed = self.take_background_loads(idle)
        if self.waiting_remote:
            ready, failed_remote = self.take_loaded(idle and not (first or last or self.loading))
            last += ready
            failed += failed_remote
        return first, last, failed

    def take_background_loads(self, idle: bool) -> tuple[list[Request], list[Request], list[tuple[Request, str]]]:
        """Background loads that ended: (loaded: admit them, failed: compute their prompt here,
        (failed, why): fail them). When nothing else runs (``idle``), wait a moment for one."""
        loaded, failed = self._finished_loading()
        if not loaded and not failed and idle:
            time.sleep(REMOTE_POLL_S)
            loaded, failed = self._finished_loading()
        ready, recompute, fail = [], [], []
        for req_id in loaded | set(failed):
            if req_id in self.held_loading:
                self._release([self.held_loading.pop(req_id)])
                continue
            request = self.loading.pop(req_id, None)
            if request is None:
                continue
            if req_id in loaded:
                self.loaded.add(req_id)
                ready.append(request)
                continue
            self.kv.free(request)  # its external blocks were never indexed: nobody else reads them
            request.num_computed_tokens = 0
            (recompute.append(request) if failed[req_id] is None else fail.append((request, failed[req_id])))
        return ready, recompute, fail

    def after_alloc(self, request: Request, num_external: int) -> None:
        self.connector.update_state_after_alloc(request, self.kv.block_ids(request.request_id), num_external)
        self.num_external_hit_tokens += num_external

    def alloc_failed(self, request: Request) -> None:
        """No blocks for the request this step: the connector drops what its lookup reserved."""
        self.connector.update_state_after_alloc(request, [], 0)

    # ---------------------------------------------------------------- freeing
    def free(self, request: Request) -> dict | None:
        """Free a finished request's blocks, or hold them while the connector saves or sends them;
        returns the connector's transfer parameters for the client (or None)."""
        self.waiting_remote.pop(request.request_id, None)
        self.loaded.discard(request.request_id)
        delay, params = self.connector.request_finished(request, self.kv.block_ids(request.request_id))
        if self.loading.pop(request.request_id, None) is not None:
            self.kv.num_cached_blocks.pop(request.request_id, None)  # the load still writes its blocks
            self.held_loading[request.request_id] = self.kv.req_blocks.pop(request.request_id, [])
            return params
        if not delay:
            self.kv.free(request)
            return params
        self.kv.num_cached_blocks.pop(request.request_id, None)
        blocks = self.kv.req_blocks.pop(request.request_id, [])
        if self._finished_sending is not None:
            self.held[request.request_id] = blocks
        else:
            self.unsent.append(blocks)
        return params

    def release_sent(self) -> None:
        """Free the held blocks of the requests the connector is done sending."""
        if self._finished_sending is not None:
            self._release([self.held.pop(req_id) for req_id in self._finished_sending() if req_id in self.held])

    def preempt(self, request: Request) -> None:
        saved = getattr(self.connector, "request_preempted", None)
        if self.swap and saved is not None:
            saved(request, self.kv.block_ids(request.request_id))
        self.kv.free(request)

    # ---------------------------------------------------------------- steps
    def attach_metadata(self, output) -> None:
        """The connector's loads and saves of this step, onto ``output`` (None when there are none)."""
        metadata = self.connector.build_connector_meta(output)
        if metadata is not None and getattr(metadata, "is_empty", False):
            metadata = None
        output.kv_connector_metadata = metadata
        if self.unsent:
            if metadata is None:  # nothing was saved after all: free now
                self._release(self.unsent)
            else:
                self.in_flight.append((metadata, self.unsent))
            self.unsent = []

    def step_done(self, output, runner_output=None) -> None:
        """A step came back (from every worker rank): hand the connector its ranks' reports,
        free the blocks whose saves its metadata carried."""
        reports = getattr(runner_output, "kv_connector_outputs", None)
        if reports and self._update_output is not None:
            self._update_output(reports)
        metadata = output.kv_connector_metadata
        if metadata is None or not self.in_flight:
            return
        keep = []
        for entry in self.in_flight:
            if entry[0] is metadata:
                self._release(entry[1])
            else:
                keep.append(entry)
        self.in_flight = keep

    def _release(self, held: list) -> None:
        for blocks in held:
            self.kv.pool.free(reversed(blocks))

    def has_pending_work(self) -> bool:
        """Blocks are held for a step, requests wait for remote loads, or the connector has work
        for a step (saves, released or expired leases)."""
        return bool(self.unsent or self.in_flight or self.waiting_remote or self.loading or self.held_loading) or bool(
            self._pending_work and self._pending_work())

    def stats(self) -> dict:
        stats = {"kv_offload_hit_tokens": self.num_external_hit_tokens}
        if self._finished_recving is not None:
            stats["num_waiting_for_remote_kv"] = len(self.waiting_remote) + len(self.loading)
        if self._stats is not None:
            stats.update(self._stats())
        return stats
