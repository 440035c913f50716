"""Tensor (and pipeline) parallel workers on one host: one process per rank.

The workers are forkserver processes (:mod:`runtime.executor.worker_proc`) whose DEALER
sockets connect over IPC to the executor's ROUTER; the calls, replies and failure
watching are :class:`~runtime.executor.broadcast.BroadcastExecutor`'s. A worker process
that exits is named by rank, pid and exit code or signal.
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import shutil
import tempfile
import time

from runtime.config import EngineConfig
from runtime.distributed.layout import check_parallel_layout
from runtime.executor import worker_proc
from runtime.executor.broadcast import BroadcastExecutor, WorkerSocket
from runtime.quantization import supports_tensor_parallel

logger = logging.getLogger(__name__)

SHUTDOWN_WAIT_S = 5.0

# Imported once by the fork server, so that each worker starts in a fraction of a second.
PRELOAD = ["runtime.executor.worker_proc", "runtime.worker.worker", "transformers.configuration_utils"]


def worker_context():
    """Workers fork from a fresh server process (no device runtime started in it), or are spawned."""
    if "forkserver" not in multiprocessing.get_all_start_methods():
        return multiprocessing.get_context("spawn")
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)
    return ctx


def check_parallel_support(config: EngineConfig) -> None:
    """Refuse what cannot be split across workers yet, naming the combination."""
    parallel = config.parallel_config
    resolved = getattr(config.model_config, "resolved", None)  # a model's shape: its heads and layers
    check_parallel_layout(getattr(resolved, "hf_config", None), parallel.tensor_parallel_size, parallel.pipeline_parallel_size)
    spec = config.plugin_options.get("speculative_config")
    if parallel.pipeline_parallel_size > 1 and spec:
        raise ValueError(
            f"speculative decoding with pipeline_parallel_size {parallel.pipeline_parallel_size} is not supported: "
            "the stages hand over one sampled token per request; use tensor_parallel_size instead"
        )
    if spec:
        # The proposer's factory checks its own checkpoint (vocabulary, heads split across the
        # ranks): here, before any worker starts, rather than inside every worker.
        from runtime.plugins import get_registry

        get_registry("proposer").create(spec["method"], config)
    quantization = config.model_config.quantization
    if quantization and parallel.tensor_parallel_size > 1 and not supports_tensor_parallel(quantization):
        raise ValueError(
            f"quantization {quantization!r} with tensor_parallel_size {parallel.tensor_parallel_size} is not supported: "
            "its quantized linear layers are not split across ranks; use tensor_parallel_size 1, another "
            "quantization, or an unquantized checkpoint"
        )


class WorkerProcesses:
    """The worker processes and the socket to them; ``close()`` stops them (once)."""

    def __init__(self, config: EngineConfig, world_size: int):
        self.closed = False
        self.dir = tempfile.mkdtemp(prefix="runtime-mp-")
        self.socket = WorkerSocket(f"ipc://{self.dir}/workers")
        init_method = f"file://{self.dir}/dist-store"
        context = worker_context()
        self.processes = []
        try:
            for rank in range(world_size):
                process = context.Process(
                    target=worker_proc.run_worker,
                    args=(config, rank, init_method, self.socket.address, os.getpid(), dict(os.environ)),
                    name=f"Worker-{rank}", daemon=True,
                )
                process.start()
                logger.info("worker rank %d started (pid %d)", rank, process.pid)
                self.processes.append(process)
        except BaseException:
            # The ranks started so far would wait for the missing one (they are not serving yet,
            # so no shutdown call reaches them) and the socket and folder would stay behind.
            for process in self.processes:
                process.kill()
            self.close()
            raise

    def dead_worker(self) -> str | None:
        for rank, process in enumerate(self.processes):
            if not process.is_alive():
                code = process.exitcode
                how = f"killed by signal {-code}" if code is not None and code < 0 else f"exit code {code}"
                return f"worker rank {rank} (pid {process.pid}) died unexpectedly ({how})"
        return None

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        self.socket.send_shutdown(rank for rank, process in enumerate(self.processes) if process.is_alive())
        deadline = time.monotonic() + SHUTDOWN_WAIT_S
        for process in self.processes:
            process.join(max(0.0, deadline - time.monotonic()))
        for process in self.processes:
            if process.is_alive():  # stuck in a collective with a dead peer
                process.kill()
                process.join(SHUTDOWN_WAIT_S)
        self.socket.close()
        shutil.rmtree(self.dir, ignore_errors=True)


class MultiprocExecutor(BroadcastExecutor):
    name = "multiproc"

    def __init__(self, config: EngineConfig):
        check_parallel_support(config)
        super().__init__(config)
        workers = WorkerProcesses(config, self.world_size)
        self.processes = workers.processes
        self.start(workers)
