"""Message authentication between an executor and its workers when the socket is reachable
from other hosts (the ``ray`` executor's TCP socket).

Both sides unpickle what they receive, so anyone able to send to the socket could run code
in the engine or a worker. With a secret (random, one per executor, handed to the workers
when they start) every message carries an HMAC-SHA256 of its frames as its last frame, and
the receiver checks it before unpickling anything; a message that fails is dropped with a
warning. Calls and replies are tagged differently, so one cannot be passed off as the other.
The multiproc executor's ipc socket lives in a private (0700) folder and goes without.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import secrets

logger = logging.getLogger(__name__)

SECRET_BYTES = 32
CALL = b"call"  # executor -> worker: (flag, pickled call)
REPLY = b"reply"  # worker -> executor: (pickled reply,)


def new_secret() -> bytes:
    return secrets.token_bytes(SECRET_BYTES)


def mac(secret: bytes, kind: bytes, *frames) -> bytes:
    """The HMAC of ``frames`` (each length-prefixed, so that bytes cannot move between frames)."""
    digest = hmac.new(secret, kind, hashlib.sha256)
    for frame in frames:
        frame = memoryview(frame)
        digest.update(frame.nbytes.to_bytes(8, "little"))
        digest.update(frame)
    return digest.digest()


def checked(secret: bytes, kind: bytes, frames: list, count: int, where: str) -> list | None:
    """``frames`` without their MAC if there are ``count`` of them plus a valid MAC, else None (warned)."""
    if len(frames) == count + 1 and hmac.compare_digest(mac(secret, kind, *frames[:count]), bytes(frames[count])):
        return frames[:count]
    logger.warning("dropped a message to %s that does not carry this executor's signature (%d frames)", where, len(frames))
    return None


class SignedDealer:
    """A worker's DEALER socket whose replies are signed and whose incoming calls are checked;
    ``recv_multipart`` gives ``[flag, data]``, or None for a message that was dropped."""

    def __init__(self, sock, secret: bytes):
        self.sock = sock
        self.secret = secret

    def poll(self, timeout=None) -> int:
        return self.sock.poll(timeout)

    def send(self, data: bytes) -> None:
        self.sock.send_multipart([data, mac(self.secret, REPLY, data)])

    def recv_multipart(self) -> list | None:
        return checked(self.secret, CALL, self.sock.recv_multipart(), 2, "a worker")

    def close(self) -> None:
        self.sock.close()
