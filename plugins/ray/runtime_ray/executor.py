"""The ``ray`` executor: one Ray actor per rank, driven like the multiproc executor's processes.

The calls, replies and failure watching are core's
:class:`~runtime.executor.broadcast.BroadcastExecutor` (one pickled broadcast per step over
ZMQ, here on TCP so that actors on other nodes reach it, every message signed with a
secret the actors get at start, so that no other host can have the engine unpickle its
bytes); this module starts the actors
in a placement group, gives the ranks out node by node (this node first), and watches
each actor's ``run`` call: it resolves when the actor dies, which names the rank.
"""

from __future__ import annotations

import logging
import time

from runtime.config import EngineConfig
from runtime.executor.broadcast import BroadcastExecutor, WorkerSocket
from runtime.executor.multiproc import check_parallel_support
from runtime.executor.signing import new_secret
from runtime_ray import cluster
from runtime_ray.actor import WorkerActor

logger = logging.getLogger(__name__)

SHUTDOWN_WAIT_S = 5.0
DEATH_CHECK_INTERVAL_S = 0.05  # a step's waits ask Ray about the actors at most this often


class RayWorkers:
    """The actors of one engine and the socket to them; ``close()`` stops them (once)."""

    def __init__(self, config: EngineConfig, world_size: int):
        import ray
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        from runtime.platforms import select_platform

        self.closed = False
        self.actors: list = []
        self.run_refs: list = []
        self.group = None
        bundle = cluster.bundle_for(select_platform(config.device_config.platform))
        self.started_cluster = cluster.connect(world_size, bundle)
        # Reachable from the other nodes (and any host that reaches this one): signed both ways.
        secret = new_secret()
        self.socket = WorkerSocket(f"tcp://{ray.util.get_node_ip_address()}:0", secret)
        try:
            self.group = cluster.reserve(world_size, bundle)
            remote = ray.remote(num_cpus=bundle.get("CPU", 0), num_gpus=bundle.get("GPU", 0), max_restarts=0)(WorkerActor)
            runtime_env = cluster.forwarded_runtime_env()
            actors = [
                remote.options(
                    scheduling_strategy=PlacementGroupSchedulingStrategy(self.group, placement_group_bundle_index=i),
                    runtime_env=runtime_env or None,
                ).remote()
                for i in range(world_size)
            ]
            self.actors = actors
            infos = ray.get([a.node_info.remote() for a in actors])
            order = rank_order(infos, ray.util.get_node_ip_address())
            self.actors = [actors[i] for i in order]
            self.infos = [infos[i] for i in order]
            for rank, info in enumerate(self.infos):
                gpus = f", GPU {','.join(info['gpu_ids'])}" if info["gpu_ids"] else ""
                logger.info("ray executor: worker rank %d placed on node %s (pid %d%s)", rank, info["ip"], info["pid"], gpus)
            master_port = ray.get(self.actors[0].free_port.remote())
            init_method = f"tcp://{self.infos[0]['ip']}:{master_port}"
            self.run_refs = [
                actor.run.remote(config, rank, init_method, self.socket.address, secret)
                for rank, actor in enumerate(self.actors)
            ]
        except BaseException:
            self.close()
            raise
        self._checked_at = 0.0
        self._dead: str | None = None

    def dead_worker(self) -> str | None:
        if self._dead is not None or time.monotonic() - self._checked_at < DEATH_CHECK_INTERVAL_S:
            return self._dead
        import ray

        self._checked_at = time.monotonic()
        done, _ = ray.wait(self.run_refs, num_returns=len(self.run_refs), timeout=0)
        if done:
            rank = self.run_refs.index(done[0])
            info = self.infos[rank]
            self._dead = f"worker rank {rank} (Ray actor on node {info['ip']}, pid {info['pid']}) {ended(done[0])}"
        return self._dead

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        try:
            import ray

            if ray.is_initialized():
                self._stop_actors(ray)
        finally:
            self.socket.close()

    def _stop_actors(self, ray) -> None:
        if self.run_refs:
            done, running = ray.wait(self.run_refs, num_returns=len(self.run_refs), timeout=0)
            self.socket.send_shutdown(rank for rank, ref in enumerate(self.run_refs) if ref not in done)
            if running and not done:  # with a rank dead, the others may wait in a collective for it: killed now
                ray.wait(running, num_returns=len(running), timeout=SHUTDOWN_WAIT_S)
        for actor in self.actors:  # idle after run, or stuck in a collective with a dead peer
            ray.kill(actor, no_restart=True)
        if self.group is not None:
            from ray.util.placement_group import remove_placement_group

            remove_placement_group(self.group)
        if self.started_cluster:
            logger.info("ray executor: stopping the local Ray cluster it started")
            ray.shutdown()


def rank_order(infos: list[dict], here: str) -> list[int]:
    """The actors (indexes into ``infos``) in rank order: node by node (``here`` first), by device
    number within a node (2 before 10), so that a stage's tensor-parallel ranks share a node
    when the cluster allows it."""

    def device_numbers(gpu_ids: list[str]) -> list[tuple[int, str]]:
        return [(int(g), "") if g.isdigit() else (-1, g) for g in gpu_ids]  # ids that are no number: as text

    return sorted(
        range(len(infos)), key=lambda i: (infos[i]["ip"] != here, infos[i]["ip"], device_numbers(infos[i]["gpu_ids"]), i)
    )


def ended(ref) -> str:
    """How an actor's ``run`` call ended, for the error that names its rank."""
    import ray

    try:
        code = ray.get(ref, timeout=0)
    except ray.exceptions.RayActorError as exc:
        reason = str(exc).strip().splitlines()
        return f"died unexpectedly ({reason[0] if reason else type(exc).__name__})"
    except Exception as exc:  # noqa: BLE001 - any other failure of the call is reported as it is
        return f"died unexpectedly ({type(exc).__name__}: {exc})"
    return f"exited unexpectedly (exit code {code})"


class RayExecutor(BroadcastExecutor):
    name = "ray"

    def __init__(self, config: EngineConfig):
        check_parallel_support(config)
        super().__init__(config)
        started = time.monotonic()
        self.start(RayWorkers(config, self.world_size))
        logger.info("ray executor: %d workers ready in %.1f s", self.world_size, time.monotonic() - started)

    @property
    def actors(self) -> list:
        return self.workers.actors
