"""The CudaIpcConnector's worker half: the TcpConnector's, with a GPU-to-GPU data path.

Producer: exports its layers' CUDA IPC handles once (:func:`runtime_pd.cuda_ipc.export_layers`)
and answers a pull of leased blocks with them and the time the lease still holds, instead of
the blocks' bytes. Consumer: opens a prefill instance's handles once (cached by export), and per
:class:`runtime_pd.ipc_scheduler.PeerLoad` copies the blocks in the background as the
TcpConnector writes its pulled ones (a side stream the step stream never waits for; the request
runs once a step's report names its copy done) and, once the copy is done, tells the prefill
instance it may free them.
"""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import torch
import zmq

from runtime_pd.cuda_ipc import (NAME, ClaimReply, PeerExport, device_uuids, export_layers, host_gpu_count, layer_layout,
                                 open_layers, peer_access, startup_problem)
from runtime_pd.ipc_scheduler import PeerLoad
from runtime_pd.puller import send_pulled
from runtime_pd.worker_half import TcpConnectorWorker


class CudaIpcConnectorWorker(TcpConnectorWorker):
    def __init__(self, config):
        super().__init__(config)
        self.lease_deadlines: dict[str, float] = {}  # request id -> time.monotonic() its lease ends
        self.export: PeerExport | None = None
        self.peers: dict[str, list[torch.Tensor]] = {}  # export key -> the prefill instance's layers, opened here
        self.device_uuid = ""
        self.access: dict[str, bool] = {}

    def register_kv_caches(self, kv_caches: list[torch.Tensor], block_dim: int = 1) -> None:
        device = kv_caches[0].device
        if device.type != "cuda":
            raise ValueError(f"{NAME} copies KV blocks between CUDA GPUs of one host; this instance's KV cache is on "
                             f"{device.type}: use TcpConnector")
        self.device = device
        uuids = device_uuids()
        self.device_uuid = uuids[device.index]
        self.access = peer_access(device.index, uuids)
        if self.settings.is_consumer:
            why = startup_problem(self.device_uuid, self.access, host_gpu_count())
            if why is not None:
                raise ValueError(why)
            self.context = zmq.Context()
            self.notifier = ThreadPoolExecutor(1, thread_name_prefix="pd-ipc-notice")
        if self.settings.is_producer:  # before the block server starts answering pulls
            self.export = export_layers([cache.movedim(block_dim, 0) for cache in kv_caches], self.device_uuid)
        super().register_kv_caches(kv_caches, block_dim)

    def get_handshake_metadata(self) -> dict:
        return {**super().get_handshake_metadata(), "device_uuid": self.device_uuid, "access": self.access,
                "layers": layer_layout(self.layers)}

    # ---------------------------------------------------------------- producer
    def start_load_kv(self, metadata) -> None:
        if metadata.lease_deadlines or metadata.unleases:
            with self.lock:
                for request_id in metadata.unleases:
                    self.lease_deadlines.pop(request_id, None)
                self.lease_deadlines.update(metadata.lease_deadlines)
        super().start_load_kv(metadata)

    def answer(self, request_id: str, block_ids: list[int]) -> tuple:
        left = self.lease_deadlines.get(request_id, 0.0) - time.monotonic()
        if left <= 0:
            return self.refuse(f"the lease of request {request_id!r} has ended")
        return ClaimReply(lease_left_s=left, export=self.export), []

    def refuse(self, error: str) -> tuple:
        return ClaimReply(error=error), []

    # ---------------------------------------------------------------- consumer
    def load(self, request_id: str, entry) -> None:
        if not isinstance(entry, PeerLoad):
            raise TypeError(f"{NAME}: unexpected load {type(entry).__name__}")
        sources = self.peers.get(entry.export.key)
        if sources is None:
            try:
                sources = self.peers[entry.export.key] = open_layers(entry.export, self.device)
            except RuntimeError as exc:
                send_pulled(self.context, entry.params)  # nothing was copied: the prefill instance may free them
                raise RuntimeError(f"{NAME}: cannot open the KV cache of the prefill instance on GPU "
                                   f"{entry.export.device_uuid} ({exc})") from exc
        src = entry.remote_block_ids
        self.in_background(request_id, lambda ids: self._copy(sources, ids, src), entry.block_ids)
        self.notifier.submit(self._notify_when_done, self.writes[request_id][0], entry.params)

    def _copy(self, sources: list[torch.Tensor], dst: torch.Tensor, remote_block_ids: list[int]) -> None:
        src = torch.tensor(remote_block_ids, dtype=torch.int64, device=self.device)
        for layer, source in zip(self.layers, sources):
            layer.index_copy_(0, dst, source.index_select(0, src))  # the reads cross NVLink

    def _notify_when_done(self, done: torch.cuda.Event, params: dict) -> None:
        done.synchronize()
        send_pulled(self.context, params)

    def shutdown(self) -> None:
        super().shutdown()
        if self.settings.is_consumer and hasattr(self, "notifier"):
            self.notifier.shutdown(wait=True)
            self.context.term()
