"""Joining a Ray cluster and reserving one bundle of resources per rank."""

from __future__ import annotations

import logging
import os
import time

logger = logging.getLogger(__name__)

PLACEMENT_TIMEOUT_ENV = "RUNTIME_RAY_PLACEMENT_TIMEOUT_S"
DEFAULT_PLACEMENT_TIMEOUT_S = 120.0
# Variables the actors need as the engine's process has them (the cluster's nodes were
# started with their own environment).
FORWARDED_ENV_PREFIXES = ("RUNTIME_",)
FORWARDED_ENV = ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME")


def bundle_for(platform) -> dict[str, float]:
    """One rank's resources: a GPU (and a CPU to drive it) on a GPU platform, a CPU on the CPU platform.

    Ray names every accelerator that torch reaches as a device module (NVIDIA, AMD, Intel) ``GPU``.
    """
    if platform.device_type == "cpu":
        return {"CPU": 1.0}
    return {"CPU": 1.0, "GPU": 1.0}


def connect(world_size: int, bundle: dict[str, float]) -> bool:
    """Join the cluster ``RAY_ADDRESS`` names, or one ``ray start`` left running on this host,
    or (neither) start a local one large enough for ``world_size`` bundles; True if started here."""
    import ray

    if ray.is_initialized():
        logger.info("ray executor: using the Ray session of this process (%s)", describe(ray))
        return False
    try:
        ray.init(address="auto")
    except ConnectionError:
        num_cpus = max(os.cpu_count() or 1, int(world_size * bundle.get("CPU", 0)))
        logger.info("ray executor: no Ray cluster running (RAY_ADDRESS unset); starting a local one with %d CPUs", num_cpus)
        ray.init(num_cpus=num_cpus, include_dashboard=False)
        logger.info("ray executor: started a local Ray cluster (%s)", describe(ray))
        return True
    address = ray.get_runtime_context().gcs_address
    logger.info("ray executor: connected to the Ray cluster at %s (%s)", address, describe(ray))
    return False


def forwarded_runtime_env() -> dict:
    env = {k: v for k, v in os.environ.items() if k.startswith(FORWARDED_ENV_PREFIXES) or k in FORWARDED_ENV}
    return {"env_vars": env} if env else {}


def describe(ray) -> str:
    nodes = [n for n in ray.nodes() if n.get("Alive")]
    resources = ray.cluster_resources()
    return f"{len(nodes)} node(s), {resources.get('CPU', 0):g} CPUs, {resources.get('GPU', 0):g} GPUs"


def reserve(world_size: int, bundle: dict[str, float]):
    """A ready placement group of ``world_size`` bundles (ranks packed onto as few nodes as fit),
    or ``RuntimeError`` naming what was asked and what the cluster has."""
    import ray
    from ray.util.placement_group import placement_group, remove_placement_group

    timeout_s = float(os.environ.get(PLACEMENT_TIMEOUT_ENV, DEFAULT_PLACEMENT_TIMEOUT_S))
    wanted = ", ".join(f"{v:g} {k}" for k, v in bundle.items())
    logger.info("ray executor: reserving %d bundles of {%s} (placement group, PACK)", world_size, wanted)
    group = placement_group([dict(bundle) for _ in range(world_size)], strategy="PACK", name=f"runtime-{os.getpid()}")
    started = time.monotonic()
    ready, _ = ray.wait([group.ready()], timeout=timeout_s)
    if not ready:
        remove_placement_group(group)
        raise RuntimeError(
            f"the Ray cluster cannot place {world_size} workers of {{{wanted}}} each within {timeout_s:.0f} s "
            f"(it has {describe(ray)}, available now: {ray.available_resources()}); "
            f"add nodes, lower tensor_parallel_size x pipeline_parallel_size, or raise {PLACEMENT_TIMEOUT_ENV}"
        )
    logger.info("ray executor: placement group ready in %.1f s", time.monotonic() - started)
    return group
