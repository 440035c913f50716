"""The prefill side's leases: a finished request's blocks stay until a decode instance says it
pulled them (a :class:`runtime_pd.wire.Pulled` notice on the control port) or the lease expires."""

from __future__ import annotations

import collections
import logging
import time

import zmq

from runtime_pd.socket_thread import SocketThread
from runtime_pd.wire import decode_pulled

logger = logging.getLogger(__name__)


class Leases:
    def __init__(self, engine_id: str, lease_s: float, address: str):
        self.engine_id = engine_id
        self.lease_s = lease_s
        self.deadlines: dict[str, float] = {}  # request id -> monotonic expiry
        self.pulled: collections.deque[str] = collections.deque()  # filled by the receiver thread
        self.num_expired = 0
        self.num_pulled = 0
        self.receiver = NoticeReceiver(self, address)

    def add(self, request_id: str) -> None:
        self.deadlines[request_id] = time.monotonic() + self.lease_s

    def has_due(self) -> bool:
        """A notice arrived or a lease expired: a step should free blocks."""
        if self.pulled:
            return True
        return bool(self.deadlines) and min(self.deadlines.values()) <= time.monotonic()

    def take_ended(self) -> set[str]:
        """Leases ended since the last call: pulled, or expired."""
        ended = set()
        while self.pulled:
            request_id = self.pulled.popleft()
            if self.deadlines.pop(request_id, None) is not None:
                ended.add(request_id)
                self.num_pulled += 1
        now = time.monotonic()
        expired = [r for r, deadline in self.deadlines.items() if deadline <= now]
        for request_id in expired:
            del self.deadlines[request_id]
            logger.warning("the KV lease of request %s expired before a decode instance pulled it; freeing its blocks",
                           request_id)
        self.num_expired += len(expired)
        return ended.union(expired)

    def close(self) -> None:
        self.receiver.stop()


class NoticeReceiver(SocketThread):
    """A PULL socket: each notice of this engine goes into ``leases.pulled``."""

    def __init__(self, leases: Leases, address: str):
        self.leases = leases
        super().__init__(zmq.PULL, address, "KV notices")

    def handle(self, frames: list) -> None:
        try:
            notice = decode_pulled(frames[0].buffer)
        except Exception:  # noqa: BLE001 - a malformed notice is dropped
            logger.exception("dropping a malformed KV notice")
            return
        if notice.engine_id == self.leases.engine_id:
            self.leases.pulled.append(notice.request_id)
