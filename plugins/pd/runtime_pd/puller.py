"""The decode side's pulls: a thread fetches a prefill instance's blocks into host memory, then
tells it (a :class:`runtime_pd.wire.Pulled` notice) that it may free them."""

from __future__ import annotations

import collections
import functools
import logging
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import torch
import zmq

from runtime_pd.wire import Pulled, PullRequest, TransferError, decode_reply, encode, unpack_blocks

logger = logging.getLogger(__name__)

NOTICE_LINGER_MS = 1000  # how long a "pulled" notice may wait for a prefill instance that is going away


@dataclass
class Staged:
    """Pulled blocks waiting in host memory for the request's admission."""

    tensors: list[torch.Tensor]  # per layer [num blocks, ...]
    num_tokens: int
    released_at_pull = True  # the prefill instance was told it may free the blocks when the pull ended

    def load_entry(self, block_ids: list[int], first: int, num_blocks: int):
        """The worker's load of blocks ``first:num_blocks`` into ``block_ids`` (the admitted request's)."""
        return block_ids[first:num_blocks], [t[first:num_blocks] for t in self.tensors]

    def stale_reason(self) -> str | None:
        """Why the staged blocks may no longer be loaded (None: they may)."""
        return None


class Puller:
    def __init__(self, layout: str, timeout_s: float, checksum: bool):
        self.layout = layout
        self.timeout_s = timeout_s
        self.checksum = checksum
        self.context = zmq.Context()
        self.pool = ThreadPoolExecutor(2, thread_name_prefix="pd-pull")
        self.ended: collections.deque[tuple[str, Staged | str]] = collections.deque()  # (request id, blocks or why)
        self.cancelled: set[str] = set()
        self.num_pulled_blocks = 0
        self.pull_seconds = 0.0

    def start(self, request_id: str, params: dict) -> None:
        """Pull in the background; the result lands in ``ended``."""
        self.pool.submit(self._run, request_id, params)

    def _run(self, request_id: str, params: dict) -> None:
        started = time.perf_counter()
        try:
            result = self.pull(params)
            self.num_pulled_blocks += len(params["remote_block_ids"])
            self.pull_seconds += time.perf_counter() - started
        except TransferError as exc:
            result = f"KV transfer from the prefill instance at {params.get('remote_host')}:{params.get('remote_port')} failed: {exc}"
        except Exception as exc:  # noqa: BLE001 - any failure becomes the request's fallback
            logger.exception("KV pull of request %s failed", request_id)
            result = f"KV transfer failed: {type(exc).__name__}: {exc}"
        if isinstance(result, str):
            logger.warning("request %s: %s", request_id, result)
        if not isinstance(result, Staged) or result.released_at_pull:
            self.notify_pulled(params)  # on failure too: the prefill instance may free the blocks
        self.ended.append((request_id, result))

    def pull(self, params: dict) -> Staged:
        header, frames = self.exchange(params)
        reply = decode_reply(header.buffer)
        if reply.error:
            raise TransferError(reply.error)
        tensors = unpack_blocks(reply, frames, len(params["remote_block_ids"]))
        if _pin_staged():  # here, in the pull's thread: the worker's copy to the GPU then runs beside the steps
            tensors = [t.pin_memory() for t in tensors]
        return Staged(tensors, int(params["num_remote_tokens"]))

    def exchange(self, params: dict) -> tuple:
        """Send the pull of ``params``' blocks to the prefill instance: its answer (header, further frames)."""
        block_ids = list(params["remote_block_ids"])
        address = f"tcp://{params['remote_host']}:{int(params['remote_port'])}"
        socket = self.context.socket(zmq.DEALER)
        socket.linger = 0
        try:
            socket.connect(address)
            socket.send(encode(PullRequest(params["remote_request_id"], block_ids, self.layout)))
            if not socket.poll(int(self.timeout_s * 1000)):
                raise TransferError(f"no answer within {self.timeout_s:g} s")
            header, *frames = socket.recv_multipart(copy=False)
        finally:
            socket.close()
        return header, frames

    def notify_pulled(self, params: dict) -> None:
        """Tell the prefill instance it may free the request's blocks (best effort)."""
        send_pulled(self.context, params)

    def cancel(self, params: dict) -> None:
        """A request that never pulled ended (aborted): free its blocks on the prefill instance."""
        self.pool.submit(self.notify_pulled, params)

    def close(self) -> None:
        self.pool.shutdown(wait=False, cancel_futures=True)


@functools.cache
def _pin_staged() -> bool:
    """Staged blocks go to page-locked memory where a GPU may take them (a copy from pageable
    memory would hold the worker's thread until it is done)."""
    return torch.cuda.is_available()


def send_pulled(context: zmq.Context, params: dict) -> None:
    """Tell the prefill instance named by ``params`` (a request's kv_transfer_params) that it may free
    the request's blocks (best effort)."""
    socket = context.socket(zmq.PUSH)
    socket.linger = NOTICE_LINGER_MS
    try:
        socket.connect(f"tcp://{params['remote_host']}:{int(params['remote_port']) + 1}")
        socket.send(encode(Pulled(str(params["remote_engine_id"]), str(params["remote_request_id"]))), zmq.NOBLOCK)
    except zmq.ZMQError as exc:
        logger.warning("could not tell the prefill instance that request %s was pulled: %s", params["remote_request_id"], exc)
    finally:
        socket.close()
