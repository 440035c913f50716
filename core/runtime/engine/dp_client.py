"""Data parallel (``--data-parallel-size N``): N engine core processes behind one front end.

``DPEngineCoreClient`` has the interface of ``EngineCoreClient`` over N of them (one per
replica, each with its own sockets and process, placed by runtime.engine.dp_placement). It
sends each new request to the replica with the fewest unfinished requests of this front end
(``choose_replica``: ties go round-robin), remembers where each request went so that aborts
reach that replica, and merges the replicas' outputs into one stream, each message tagged with
its replica's index (``get_indexed_output``; /metrics labels per-engine series with it).

With ``--api-server-count`` each API process holds one such client attached to every replica
and balances its own requests. Startup waits for every replica's READY; the death of any
replica is the death of the whole engine (EngineDeadError naming the rank): its requests can
not finish, and the server reports unhealthy and exits as with one engine.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor

from runtime.config import EngineConfig
from runtime.engine.core_client import (
    DeathState, EngineCoreClient, EngineDeadError, EngineStartupError, RequestFailure, UtilityResult,
)
from runtime.engine_args import EngineArgs
from runtime.messages import EngineCoreOutputs, EngineCoreRequest

logger = logging.getLogger(__name__)


def choose_replica(num_unfinished: Sequence[int], start: int) -> int:
    """The replica with the fewest unfinished requests; among ties, the first at or after ``start``
    (cyclically), so that equal replicas take turns."""
    fewest = min(num_unfinished)
    size = len(num_unfinished)
    for step in range(size):
        index = (start + step) % size
        if num_unfinished[index] == fewest:
            return index
    raise AssertionError("unreachable")


def make_engine_client(engine_args: EngineArgs, config: EngineConfig):
    """One engine process, or with ``data_parallel_size`` > 1 a DPEngineCoreClient over that many."""
    if config.parallel_config.data_parallel_size == 1:
        return EngineCoreClient(engine_args)
    from runtime.engine.dp_placement import replica_placements

    clients: list[EngineCoreClient] = []
    try:
        for args, placement in replica_placements(engine_args, config):
            clients.append(EngineCoreClient(args, placement=placement))
    except BaseException:
        for client in clients:
            client.shutdown()
        raise
    return DPEngineCoreClient(clients)


class DPEngineCoreClient(DeathState):
    """Balances requests over several EngineCoreClients and merges their outputs. One event loop."""

    def __init__(self, clients: list[EngineCoreClient]):
        self.clients = clients
        self._num_unfinished = [0] * len(clients)  # requests sent to each replica and not yet finished
        self._engine_of: dict[str, int] = {}  # request id -> replica index
        self._next = 0  # where the round-robin among equally loaded replicas goes on
        self._queue: asyncio.Queue | None = None  # (index, message or EngineDeadError) from the readers
        self._readers: list[asyncio.Task] = []
        self._dead_message: str | None = None
        self.ready_info: dict = {}

    # ------------------------------------------------------------------ state
    @property
    def process(self):
        """Replica 0's process (``engine_pids`` has them all)."""
        return self.clients[0].process

    @property
    def engine_pids(self) -> list[int]:
        return [client.process.pid for client in self.clients]

    @property
    def num_unfinished(self) -> list[int]:
        return list(self._num_unfinished)

    # ---------------------------------------------------------------- startup
    async def wait_ready(self, timeout_s: float) -> dict:
        """Wait for every replica's READY; EngineStartupError naming the rank if one fails first."""
        waits = [asyncio.ensure_future(client.wait_ready(timeout_s)) for client in self.clients]
        try:
            await asyncio.wait(waits, return_when=asyncio.FIRST_EXCEPTION)  # one failure need not wait for the rest
            for rank, wait in enumerate(waits):
                if wait.done() and wait.exception() is not None:
                    raise EngineStartupError(f"data-parallel rank {rank}: {wait.exception()}")
            infos = [wait.result() for wait in waits]
        finally:
            for wait in waits:
                wait.cancel()
            await asyncio.gather(*waits, return_exceptions=True)
        self.ready_info = {**infos[0], "engines": infos}
        self._queue = asyncio.Queue()
        self._readers = [
            asyncio.create_task(self._read(index, client), name=f"DPEngineCoreClient.read{index}")
            for index, client in enumerate(self.clients)
        ]
        return self.ready_info

    async def _read(self, index: int, client: EngineCoreClient) -> None:
        try:
            while True:
                self._queue.put_nowait((index, await client.get_output()))
        except EngineDeadError as exc:
            self._queue.put_nowait((index, exc))
        except Exception as exc:  # a bug here must not leave this replica's requests hanging
            logger.exception("reading the outputs of data-parallel rank %d failed", index)
            self._queue.put_nowait((index, EngineDeadError(f"reading its outputs failed: {type(exc).__name__}: {exc}")))

    # ---------------------------------------------------------------- outputs
    async def get_indexed_output(self) -> tuple[int, EngineCoreOutputs | RequestFailure]:
        """The next message of any replica with its index; EngineDeadError once any replica is gone."""
        if self._dead_message is not None:
            raise EngineDeadError(self._dead_message)
        index, message = await self._queue.get()
        if isinstance(message, EngineDeadError):
            self._mark_dead(f"data-parallel rank {index}: {message}")
            raise EngineDeadError(self._dead_message)
        if isinstance(message, RequestFailure):
            self._forget(message.request_id)
        elif not isinstance(message, UtilityResult):
            for output in message.outputs:
                if output.finish_reason is not None:
                    self._forget(output.request_id)
        return index, message

    async def get_output(self) -> EngineCoreOutputs | RequestFailure:
        return (await self.get_indexed_output())[1]

    def probe_death(self) -> str | None:
        """As EngineCoreClient.probe_death, for the first replica found gone (named by its rank)."""
        for rank, client in enumerate(self.clients):
            if self._dead_message is None and client.probe_death() is not None:
                self._mark_dead(f"data-parallel rank {rank}: {client.dead_message}")
        return self._dead_message

    def _forget(self, request_id: str) -> int | None:
        index = self._engine_of.pop(request_id, None)
        if index is not None:
            self._num_unfinished[index] -= 1
        return index

    # --------------------------------------------------------------- requests
    def add_request(self, request: EngineCoreRequest) -> int:
        """Send ``request`` to the least loaded replica; returns its index (data-parallel rank)."""
        if self._dead_message is not None:
            raise EngineDeadError(self._dead_message)
        index = choose_replica(self._num_unfinished, self._next)
        self._next = (index + 1) % len(self.clients)
        self.clients[index].add_request(request)
        self._engine_of[request.request_id] = index
        self._num_unfinished[index] += 1
        return index

    def send_utility(self, call_id: int, method: str, args: list) -> int:
        """A control call (sleep, wake_up, profiling) to every replica; each answers with its UtilityResult."""
        if self._dead_message is not None:
            raise EngineDeadError(self._dead_message)
        for client in self.clients:
            client.send_utility(call_id, method, args)
        return len(self.clients)

    def abort_requests(self, request_ids: list[str]) -> None:
        """Each abort goes to the replica that has the request; unknown (finished) ids are dropped."""
        by_engine: dict[int, list[str]] = {}
        for request_id in request_ids:
            index = self._forget(request_id)
            if index is not None:
                by_engine.setdefault(index, []).append(request_id)
        for index, ids in by_engine.items():
            self.clients[index].abort_requests(ids)

    # ---------------------------------------------------------------- shutdown
    async def stop_reading(self) -> None:
        """Stop the readers (on the event loop, before ``shutdown`` closes their sockets)."""
        for reader in self._readers:
            reader.cancel()
        await asyncio.gather(*self._readers, return_exceptions=True)
        self._readers = []

    def shutdown(self) -> None:
        """Stop every replica, all at once (each may wait seconds for its step); idempotent.
        ``stop_reading`` first where an event loop runs."""
        with ThreadPoolExecutor(len(self.clients), thread_name_prefix="dp-shutdown") as pool:
            list(pool.map(lambda client: client.shutdown(), self.clients))
