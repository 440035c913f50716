"""The TcpConnector's worker half: serves leased blocks to decode instances (producer) and
writes pulled blocks into the cache (consumer) in the background: on a GPU on a side stream that
first waits for the step stream (the blocks may have been read by steps still queued), which the
step stream never waits for; each step's report names the requests whose writes are done (the
scheduler admits them only then) and those whose writes failed.

The scheduler half tells this half, through each step's metadata, which blocks are leased to
which request (and when a lease ends): the server answers only pulls of leased blocks, so a
decode instance never reads a block that was freed and reused. A lease ends in
``start_load_kv``, under the server's lock, before the step's forward pass may write the block.
"""

from __future__ import annotations

import collections
import logging
import threading
import time

import torch
import zmq

from runtime_pd.settings import layout_key, settings_of
from runtime_pd.socket_thread import SocketThread
from runtime_pd.wire import PullReply, decode_request, encode, gather_blocks

logger = logging.getLogger(__name__)

LEASE_WAIT_S = 5.0  # a pull may arrive before the step that registers its lease: wait this long for it
ENDED_LEASES = 65536  # leases that ended (pulled or expired), remembered so that a late pull of one is refused at once


class TcpConnectorWorker:
    def __init__(self, config):
        self.settings = settings_of(config)
        self.layout = layout_key(config)
        self.layers: list[torch.Tensor] = []  # [num_blocks, ...] view of each layer's cache
        self.leases: dict[str, list[int]] = {}  # request id -> leased block ids
        self.ended: collections.OrderedDict[str, None] = collections.OrderedDict()  # leases that ended, oldest first
        self.closing = False  # set at shutdown: a pull waiting for its lease gives up
        self.lock = threading.Condition()
        self.server: BlockServer | None = None
        self.stream: torch.cuda.Stream | None = None  # background writes on a GPU
        self.writes: dict[str, tuple] = {}  # request id -> (the CUDA event of its background write, its sources)
        self.written: list[str] = []  # writes done since the last report
        self.failed: dict[str, str] = {}  # request id -> why its write failed, since the last report

    def get_handshake_metadata(self) -> dict:
        """For the scheduler half: this worker's layout key, which includes what only the worker knows."""
        return {"layout": self.layout}

    def register_kv_caches(self, kv_caches: list[torch.Tensor], block_dim: int = 1) -> None:
        self.layers = [cache.movedim(block_dim, 0) for cache in kv_caches]
        if self.settings.is_consumer and self.layers[0].device.type == "cuda" and self.stream is None:
            self.stream = torch.cuda.Stream(self.layers[0].device)
        if self.settings.is_producer:
            self.server = BlockServer(self, f"tcp://{self.settings.host}:{self.settings.port}")

    # ---------------------------------------------------------------- steps
    def start_load_kv(self, metadata) -> None:
        if metadata.leases or metadata.unleases:
            with self.lock:  # waits for a pull being served
                for req_id in metadata.unleases:
                    self.leases.pop(req_id, None)
                    self.ended[req_id] = None
                while len(self.ended) > ENDED_LEASES:
                    self.ended.popitem(last=False)
                self.leases.update(metadata.leases)
                self.lock.notify_all()
        for request_id, entry in metadata.loads:
            try:
                self.load(request_id, entry)
            except Exception as exc:  # noqa: BLE001 - the request falls back (or fails), the engine goes on
                logger.exception("writing the pulled KV blocks of request %s failed", request_id)
                self.failed[request_id] = f"KV transfer failed: {exc}"

    def load(self, request_id: str, entry) -> None:
        """Start writing one load of the step's metadata (a ``Staged.load_entry``) into the cache."""
        block_ids, tensors = entry
        self.check_layers([(t.dtype, tuple(t.shape[1:])) for t in tensors], "sent")
        self.in_background(request_id, lambda ids: [
            layer.index_copy_(0, ids, blocks.to(layer.device, non_blocking=True)) for layer, blocks in zip(self.layers, tensors)
        ], block_ids, keep=tensors)

    def check_layers(self, layers: list[tuple], verb: str) -> None:
        """The prefill instance's layers (dtype, block shape) match this cache's; else a clear error."""
        if len(layers) != len(self.layers):
            raise ValueError(f"the prefill instance {verb} {len(layers)} layers, this cache has {len(self.layers)}")
        for i, ((dtype, shape), layer) in enumerate(zip(layers, self.layers)):
            if dtype != layer.dtype or tuple(shape) != tuple(layer.shape[1:]):
                raise ValueError(
                    f"layer {i} blocks of the prefill instance are {dtype} {tuple(shape)}, this cache's are "
                    f"{layer.dtype} {tuple(layer.shape[1:])}: run both instances with the same model, dtype, block size "
                    "and attention backend"
                )

    def in_background(self, request_id: str, write, block_ids: list[int], keep=None) -> None:
        """Run ``write(ids)`` (``ids``: ``block_ids`` on the cache's device); on a GPU on the side
        stream, done once its event is (see the module docstring). ``keep`` (the write's host
        sources, pinned: copied asynchronously) is held until then."""
        device = self.layers[0].device
        if self.stream is None:
            write(torch.tensor(block_ids, dtype=torch.int64, device=device))
            self.written.append(request_id)
            return
        self.stream.wait_stream(torch.cuda.current_stream(device))  # earlier steps' reads of these blocks come first
        with torch.cuda.stream(self.stream):
            ids = torch.tensor(block_ids, dtype=torch.int64, device=device)
            write(ids)
            done = torch.cuda.Event()
            done.record(self.stream)
        self.writes[request_id] = (done, keep)

    def get_connector_output(self) -> dict | None:
        """This step's report: background writes done, and failed ones (None when neither)."""
        for request_id, (done, _) in list(self.writes.items()):
            if done.query():
                del self.writes[request_id]
                self.written.append(request_id)
        if not self.written and not self.failed:
            return None
        report = {"written": self.written, "failed": self.failed}
        self.written, self.failed = [], {}
        return report

    def wait_for_save(self) -> None:
        pass  # blocks leave through the server, not through steps

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str], set[str]]:
        return set(), set()  # sends: the scheduler half hears of pulls itself; loads: get_connector_output reports them

    def serve_pull(self, request_id: str, block_ids: list[int], layout: str) -> tuple[PullReply, list]:
        """The reply to one pull: the leased blocks, or an error naming why not (waits up to LEASE_WAIT_S for
        a lease not registered yet; the block server waits without blocking other pulls, see ``try_serve``)."""
        with self.lock:
            if layout == self.layout:
                self.lock.wait_for(lambda: request_id in self.leases or request_id in self.ended or self.closing, LEASE_WAIT_S)
            return self.try_serve(request_id, block_ids, layout, final=True)

    def try_serve(self, request_id: str, block_ids: list[int], layout: str, final: bool) -> tuple | None:
        """The reply to one pull, or None (unless ``final``) while its lease is not registered: its step
        may still be on the way. A lease that ended, and a shutdown, are answered at once."""
        if layout != self.layout:
            return self.refuse("the decode instance runs a different model layout (architecture, dtype, block size or "
                               "the attention backend's order of a block's bytes)")
        with self.lock:
            if request_id not in self.leases:
                if self.closing:
                    return self.refuse("the prefill instance is shutting down")
                if request_id in self.ended:
                    return self.refuse(f"the lease of request {request_id!r} has ended (its blocks were pulled "
                                       "already, or the lease expired)")
                if not final:
                    return None
                return self.refuse(f"no blocks are leased to request {request_id!r} (lease expired or never made)")
            leased = self.leases[request_id]
            if block_ids != leased[: len(block_ids)]:
                return self.refuse(f"blocks {block_ids} are not the ones leased to request {request_id!r}")
            return self.answer(request_id, block_ids)

    def answer(self, request_id: str, block_ids: list[int]) -> tuple:
        """The reply to a pull of leased blocks (called under the lock: the lease holds meanwhile)."""
        return gather_blocks(self.layers, block_ids, self.settings.checksum)

    def refuse(self, error: str) -> tuple:
        """The reply to a pull that cannot be served."""
        return PullReply(error=error), []

    def shutdown(self) -> None:
        with self.lock:  # a pull waiting for its lease returns, so that the server thread stops before its socket closes
            self.closing = True
            self.lock.notify_all()
        if self.server is not None:
            self.server.stop()


class BlockServer(SocketThread):
    """A ROUTER socket that answers pulls with :meth:`TcpConnectorWorker.try_serve`. A pull whose lease is
    not registered yet waits in ``pending`` (up to LEASE_WAIT_S), asked again every RETRY_MS: the one
    thread goes on answering the other pulls meanwhile."""

    RETRY_MS = 5

    def __init__(self, worker: TcpConnectorWorker, address: str):
        self.worker = worker
        self.pending: list[tuple[float, bytes, object]] = []  # (give up at, client identity, pull)
        super().__init__(zmq.ROUTER, address, "KV pulls")

    def poll_ms(self) -> int:
        return self.RETRY_MS if self.pending else self.POLL_MS

    def handle(self, frames: list) -> None:
        identity, payload = frames
        try:
            pull = decode_request(payload.buffer)
        except Exception as exc:  # noqa: BLE001 - a bad pull is answered, never kills the server
            logger.exception("decoding a KV pull failed")
            return self.reply(identity, self.worker.refuse(f"the prefill instance failed to serve the pull: {exc}"))
        self.pending.append((time.monotonic() + LEASE_WAIT_S, identity, pull))
        self.tick()

    def tick(self) -> None:
        """Answer each pending pull that can be answered now (or has waited long enough)."""
        now, waiting = time.monotonic(), []
        for give_up_at, identity, pull in self.pending:
            try:
                reply = self.worker.try_serve(pull.request_id, pull.block_ids, pull.layout, final=now >= give_up_at)
            except Exception as exc:  # noqa: BLE001 - a bad pull is answered, never kills the server
                logger.exception("serving a KV pull failed")
                reply = self.worker.refuse(f"the prefill instance failed to serve the pull: {exc}")
            if reply is None:
                waiting.append((give_up_at, identity, pull))
            else:
                self.reply(identity, reply)
        self.pending = waiting

    def reply(self, identity, answer: tuple) -> None:
        reply, layers = answer
        self.socket.send_multipart([identity, encode(reply), *layers], copy=False)
