"""A bound ZMQ socket served by a daemon thread (the block server and the notice receiver)."""

from __future__ import annotations

import threading

import zmq


class SocketThread:
    """Binds a socket of ``kind`` at ``address`` and calls :meth:`handle` for each message."""

    POLL_MS = 200  # how often the thread looks at its stop flag

    def __init__(self, kind: int, address: str, what: str):
        self.context = zmq.Context()
        self.socket = self.context.socket(kind)
        self.socket.linger = 0
        try:
            self.socket.bind(address)
        except zmq.ZMQError as exc:
            self.context.destroy(linger=0)
            raise ValueError(f"TcpConnector: cannot take {what} at {address} ({exc}); pick another kv_port") from None
        self.running = True
        self.thread = threading.Thread(target=self._run, name=f"pd-{what.replace(' ', '-')}", daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while self.running:
            if self.socket.poll(self.poll_ms()):
                self.handle(self.socket.recv_multipart(copy=False))
            else:
                self.tick()

    def poll_ms(self) -> int:
        """How long to wait for the next message before :meth:`tick`."""
        return self.POLL_MS

    def handle(self, frames: list) -> None:
        raise NotImplementedError

    def tick(self) -> None:
        """Called when no message came within :meth:`poll_ms`."""

    def stop(self) -> None:
        self.running = False
        self.thread.join(timeout=1.0)
        self.socket.close()
        self.context.term()
