"""The Ray actor that hosts one rank's worker.

Created unranked inside a placement group bundle; the executor reads where each actor
landed (:meth:`WorkerActor.node_info`), gives the ranks out node by node, asks rank 0's
actor for a free port for ``torch.distributed``, then calls :meth:`WorkerActor.run`, which
serves the executor's calls (:func:`runtime.executor.worker_proc.build_and_serve`) until
shutdown: its object ref resolves when the worker ends and raises if the actor died.
"""

from __future__ import annotations

import logging
import os
import socket


class WorkerActor:
    """Plain class; the executor makes it a Ray actor with ``ray.remote(...)`` and the bundle's resources."""

    def node_info(self) -> dict:
        import ray

        return {
            "ip": ray.util.get_node_ip_address(),
            "node_id": ray.get_runtime_context().get_node_id(),
            "pid": os.getpid(),
            "gpu_ids": [str(i) for i in ray.get_gpu_ids()],
        }

    def free_port(self) -> int:
        """A TCP port free on this actor's node, for the process group's store (rank 0 listens there)."""
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            sock.bind(("", 0))
            return sock.getsockname()[1]

    def run(self, config, rank: int, init_method: str, address: str, secret: bytes) -> int:
        """Build rank ``rank``'s worker and serve the executor at ``address`` (messages signed
        with ``secret``, the executor's); the exit code (0: shut down)."""
        from runtime.executor.worker_proc import build_and_serve

        logging.basicConfig(
            level=logging.INFO, format=f"%(levelname)s %(asctime)s [worker {rank}] %(message)s", force=True
        )
        # Ray gives the actor its bundle's devices only (CUDA_VISIBLE_DEVICES and the like),
        # so the worker's device is the first visible one.
        return build_and_serve(config, rank, init_method, address, parent_pid=None, local_rank=0, secret=secret)
