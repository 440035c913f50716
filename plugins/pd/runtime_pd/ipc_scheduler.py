"""The CudaIpcConnector's scheduler half: the TcpConnector's, with a pull that claims instead of copies.

The pull asks the prefill instance's block server for the leased blocks as the TcpConnector's
does; the answer is no bytes but how long the lease still holds and the IPC handles of the
prefill instance's layers (the worker opens them once per prefill instance). The request then waits as a :class:`Claimed` pull; the
step that admits it hands the worker a :class:`PeerLoad`, and the worker copies the blocks GPU to
GPU and tells the prefill instance "pulled" once the copy is done. A claim not loaded in time (its
lease would end first), a request aborted meanwhile or served by the local prefix cache releases
the blocks without a copy and, in the first case, computes the prompt here.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from runtime_pd.cuda_ipc import PeerExport, decode_claim, export_layout, peer_problem
from runtime_pd.puller import Puller, Staged
from runtime_pd.scheduler_half import TcpConnectorScheduler
from runtime_pd.wire import TransferError

CLAIM_MARGIN_S = 1.0  # a claim is not loaded this close to its lease's end (the copy starts a step later)


@dataclass
class PeerLoad:
    """A worker's copy: the prefill instance's ``remote_block_ids`` into this cache's ``block_ids``."""

    block_ids: list[int]
    remote_block_ids: list[int]
    export: PeerExport
    params: dict  # the request's kv_transfer_params: where to send the "pulled" notice


@dataclass
class Claimed(Staged):
    """Blocks still in the prefill instance's GPU memory, leased to this request until ``expires_at``."""

    remote_block_ids: list[int] = None
    export: PeerExport = None
    params: dict = None
    expires_at: float = 0.0  # time.monotonic()
    released_at_pull = False  # the worker tells the prefill instance after its copy

    def load_entry(self, block_ids: list[int], first: int, num_blocks: int) -> PeerLoad:
        return PeerLoad(block_ids[first:num_blocks], self.remote_block_ids[first:num_blocks], self.export, self.params)

    def stale_reason(self) -> str | None:
        if time.monotonic() < self.expires_at:
            return None
        return "its KV lease on the prefill instance ends before the blocks could be copied"


class Claimer(Puller):
    """Claims leased blocks (see the module docstring); the worker's handshake says which GPUs it reaches."""

    def __init__(self, layout: str, timeout_s: float):
        super().__init__(layout, timeout_s, checksum=False)
        self.device_uuid = ""
        self.access: dict[str, bool] = {}  # visible GPU uuid -> peer access from this instance's GPU
        self.layers: list[list] = []  # this cache's layer dtypes and block shapes

    def pull(self, params: dict) -> Claimed:
        started = time.monotonic()  # before the producer measured the lease's time left: errs early
        header, _ = self.exchange(params)
        reply = decode_claim(header.buffer)
        if reply.error:
            raise TransferError(reply.error)
        export = reply.export
        if export is None:
            raise TransferError("the prefill instance sent no IPC handles")
        why = peer_problem(export.device_uuid, self.device_uuid, self.access)
        if why is None and export_layout(export) != self.layers:
            why = (f"the prefill instance's layers {export_layout(export)[:1]}... differ from this cache's "
                   f"{self.layers[:1]}...: run both instances with the same model, dtype, block size and attention backend")
        if why is not None:
            raise TransferError(why)
        return Claimed([], int(params["num_remote_tokens"]), remote_block_ids=list(params["remote_block_ids"]),
                       export=export, params=params, expires_at=started + reply.lease_left_s - CLAIM_MARGIN_S)


class CudaIpcConnectorScheduler(TcpConnectorScheduler):
    def make_puller(self) -> Claimer:
        return Claimer(self.layout, self.settings.pull_timeout_s)

    def set_handshake_metadata(self, per_rank: list) -> None:
        """The worker's layout key, its GPU, the GPUs it reaches and its layers (one rank: the connector runs uniproc)."""
        super().set_handshake_metadata(per_rank)
        if self.puller is not None and per_rank and per_rank[0]:
            info = per_rank[0]
            self.puller.device_uuid, self.puller.access, self.puller.layers = info["device_uuid"], info["access"], info["layers"]
