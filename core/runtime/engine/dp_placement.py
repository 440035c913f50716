"""Where each data-parallel replica runs: its devices, or its share of the CPU (``--data-parallel-size``).

Replica ``r`` of ``N`` owns ``world_size`` (tensor x pipeline) consecutive devices: on a GPU
platform its engine process (and the workers it starts) sees only those, through the
platform's visible-devices variable (``CUDA_VISIBLE_DEVICES`` ...), so each replica counts its
devices from 0. On the CPU each replica gets ``cores // N`` cores: its torch threads
(unless ``--cpu-num-threads`` is given) and, where the OS allows, its CPU affinity.
The parent computes a :class:`ReplicaPlacement` and starts the engine process inside its
environment; the engine process applies it again (and its CPU affinity) first thing.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
from collections.abc import Iterator
from dataclasses import dataclass

from runtime.config import EngineConfig
from runtime.engine_args import EngineArgs
from runtime.kv_transfer import DEFAULT_KV_PORT


@dataclass(frozen=True)
class ReplicaPlacement:
    rank: int  # the data-parallel rank, 0 .. N-1
    env: tuple[tuple[str, str], ...] = ()  # variables set in the engine process before any device starts
    cpu_cores: tuple[int, ...] = ()  # the CPU affinity of the engine process (empty: inherit)

    @contextlib.contextmanager
    def environment(self) -> Iterator[None]:
        """``env`` set in this process meanwhile: around the start of the engine process, which then has it
        from its first instruction (before anything it imports could start a device)."""
        saved = {name: os.environ.get(name) for name, _ in self.env}
        os.environ.update(dict(self.env))
        try:
            yield
        finally:
            for name, value in saved.items():
                if value is None:
                    os.environ.pop(name, None)
                else:
                    os.environ[name] = value

    def apply(self) -> None:
        """In the replica's engine process, before the engine config is built."""
        os.environ.update(dict(self.env))
        if self.cpu_cores and hasattr(os, "sched_setaffinity"):
            try:
                os.sched_setaffinity(0, self.cpu_cores)
            except OSError:
                pass  # a restricted container: the thread count still shares the cores


def visible_devices(env_names: tuple[str, ...], num_needed: int, device_count: int) -> tuple[str, list[str]]:
    """The variable that selects devices, and the ``num_needed`` device ids the parent may hand out
    (those it sees itself: its own list if the variable is set, else 0 .. count-1)."""
    name = next((n for n in env_names if os.environ.get(n)), env_names[0])
    current = os.environ.get(name)
    ids = [d.strip() for d in current.split(",") if d.strip()] if current else [str(i) for i in range(device_count)]
    if num_needed > len(ids):
        seen = f" ({name}={current})" if current else ""
        raise ValueError(
            f"data_parallel_size x tensor_parallel_size x pipeline_parallel_size needs {num_needed} devices; "
            f"{len(ids)} visible{seen}"
        )
    return name, ids


def replica_placements(engine_args: EngineArgs, config: EngineConfig) -> list[tuple[EngineArgs, ReplicaPlacement]]:
    """Each replica's engine arguments and placement, in rank order (one entry without data parallelism)."""
    placements = _placements(engine_args, config)
    return [(_with_own_kv_port(args, placement.rank), placement) for args, placement in placements]


def _with_own_kv_port(engine_args: EngineArgs, rank: int) -> EngineArgs:
    """Replica ``rank``'s arguments with its own ``kv_port`` (as vLLM offsets its KV side channel by the data
    parallel rank): a P/D connector of each replica binds ``kv_port`` and ``kv_port + 1``, so rank r takes
    ``kv_port + 2 r``. Its kv_transfer_params name that port, so decode instances pull from the right replica."""
    raw = engine_args.kv_transfer_config
    if rank == 0 or not raw:
        return engine_args
    if isinstance(raw, str):
        try:
            raw = json.loads(raw)
        except json.JSONDecodeError:
            return engine_args  # reported by name when the engine config is built
    if not isinstance(raw, dict):
        return engine_args
    try:
        base = int(raw.get("kv_port") or DEFAULT_KV_PORT)
    except (TypeError, ValueError):
        return engine_args  # reported by the connector, which reads it
    return dataclasses.replace(engine_args, kv_transfer_config={**raw, "kv_port": base + 2 * rank})


def _placements(engine_args: EngineArgs, config: EngineConfig) -> list[tuple[EngineArgs, ReplicaPlacement]]:
    from runtime.platforms import select_platform

    parallel = config.parallel_config
    num_replicas, world_size = parallel.data_parallel_size, parallel.world_size
    if num_replicas == 1:
        return [(engine_args, ReplicaPlacement(0))]
    platform = select_platform(config.device_config.platform)
    env_names = tuple(getattr(platform, "visible_devices_envs", ()))
    if platform.device_type != "cpu":
        if not env_names:
            raise ValueError(
                f"data_parallel_size={num_replicas}: platform {platform.name!r} names no visible-devices variable "
                "(Platform.visible_devices_envs) to give each replica its own devices; use data_parallel_size 1"
            )
        name, ids = visible_devices(env_names, num_replicas * world_size, platform.device_count())
        return [
            (engine_args, ReplicaPlacement(r, env=((name, ",".join(ids[r * world_size:(r + 1) * world_size])),)))
            for r in range(num_replicas)
        ]
    cores = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else list(range(os.cpu_count() or 1))
    share = max(len(cores) // num_replicas, 1)
    placements = []
    for r in range(num_replicas):
        mine = tuple(cores[r * share:(r + 1) * share]) if (r + 1) * share <= len(cores) else ()
        args = engine_args
        if engine_args.cpu_num_threads is None:
            args = dataclasses.replace(engine_args, cpu_num_threads=max(share // world_size, 1))
        placements.append((args, ReplicaPlacement(r, cpu_cores=mine)))
    return placements
