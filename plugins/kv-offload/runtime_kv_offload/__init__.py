"""runtime-plugin-kv-offload: KV cache offload tiers (cpu memory, disk) and their connector.

``--kv-offload cpu,disk --kv-offload-size 8GiB,64GiB --kv-offload-dir PATH
--kv-offload-policy lru|arc`` (or vLLM's ``--kv-transfer-config '{"kv_connector":
"OffloadingConnector", ...}'``) chains device -> cpu -> disk: blocks the device pool evicts,
finished requests' blocks and (``--preemption-mode swap``) preempted requests' blocks are
saved by their stable prefix-cache hash; a later request whose prompt continues past the
device prefix cache loads them back instead of recomputing them.
"""

from __future__ import annotations

from runtime import hookimpl


@hookimpl
def register_kv_tiers(register):
    def cpu(config, size_bytes):
        from runtime_kv_offload.cpu_tier import CpuTier

        return CpuTier(size_bytes, config.cache_config.kv_offload_policy)

    def disk(config, size_bytes):
        from runtime_kv_offload.disk_tier import DiskTier

        return DiskTier(config.cache_config.kv_offload_dir, size_bytes)

    register("cpu", cpu)
    register("disk", disk)


@hookimpl
def register_kv_connectors(register):
    def offloading(config, role):
        from runtime.kv_transfer import KVConnectorRole

        if role == KVConnectorRole.SCHEDULER:
            from runtime_kv_offload.scheduler_half import OffloadingConnectorScheduler

            return OffloadingConnectorScheduler(config)
        from runtime_kv_offload.worker_half import OffloadingConnectorWorker

        return OffloadingConnectorWorker(config)

    register("OffloadingConnector", offloading)
