"""The KV connector contract: KV blocks that live outside the device pool.

KV offload tiers (CPU memory, disk) and prefill/decode transfer between engines both
move KV blocks in and out of the engine's paged cache, so they implement one connector
with two halves (the engine builds each half in its own process, by role):

* :class:`KVConnectorScheduler`, in the scheduler: how many further prompt tokens the
  connector holds beyond the device prefix cache, which blocks to load or save this
  step (its metadata), and whether a finished request's blocks must outlive it;
* :class:`KVConnectorWorker`, in every worker: the KV cache tensors, loads started
  before the forward pass, saves awaited after it, and the requests whose transfers ended.

Offload tiers are storage behind a connector (:class:`KVTier`): blocks addressed by their
stable prefix-cache hash (``runtime.scheduler.block_hash.hash_block``).
"""

from __future__ import annotations

import enum
from typing import Any, Protocol, runtime_checkable

import torch


class RequestInputError(str):
    """A reason a connector fails a request with (``get_finished_recving`` / ``get_finished_loading``)
    that the request's own input caused, e.g. malformed ``kv_transfer_params``: the client gets a 400.
    A plain ``str`` reason is a failure on the server's side (a transfer that failed): a 500."""


class KVConnectorRole(str, enum.Enum):
    SCHEDULER = "scheduler"
    WORKER = "worker"


class KVConnectorMetadata:
    """What the scheduler half tells the worker half about one step (a connector subclasses it)."""


@runtime_checkable
class KVConnectorScheduler(Protocol):
    """The scheduler's half.

    Optional members (read with ``getattr``): ``request_preempted(request, block_ids)``
    (``--preemption-mode swap``: save what the request computed; its blocks are reused by
    this very step, so the worker reads them before the forward pass),
    ``block_evicted(block_id, block_hash)`` (a cached block is taken for reuse this step),
    ``has_pending_work()`` (a step is still needed to save blocks), ``get_stats()``
    (cumulative counters for the scheduler stats and /metrics), ``get_finished_recving()``
    (requests whose asynchronous loads ended: request id -> None or why it failed: a
    :class:`RequestInputError` when the request's input caused it, else a ``str``),
    ``loads_in_background(request)`` (the tokens this lookup counted are written while steps run
    without the request: it gets blocks for them alone, kept out of the prefix cache, and waits
    holding them), ``get_finished_loading()`` (those background loads that ended: a set of request
    ids done, and a dict of failed ones: id -> why the request fails, or None to compute its prompt
    here), ``set_handshake_metadata(per_rank)`` (once, before the first request: every worker rank's
    ``get_handshake_metadata()``, in rank order), ``update_connector_output(per_rank)`` (after
    each step: every worker rank's ``get_connector_output()`` for that step, in rank order; with
    several ranks the step is back only once every rank has finished it).
    """

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int, bool]:
        """Tokens past ``num_computed_tokens`` (the device prefix hit) that the connector can
        supply for ``request``, and whether they load asynchronously (the request then waits)."""

    def update_state_after_alloc(self, request: Any, block_ids: list[int], num_external_tokens: int) -> None:
        """Blocks were allocated for ``request``; the last ``num_external_tokens`` come from the connector."""

    def build_connector_meta(self, scheduler_output: Any) -> KVConnectorMetadata:
        """The loads and saves of the step ``scheduler_output`` (a :class:`runtime.messages.SchedulerOutput`)."""

    def request_finished(self, request: Any, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        """``request`` finished: (free its blocks only later, once saved or sent; transfer
        parameters returned to the client, e.g. for a remote decode), per request.

        When the first item is True the scheduler keeps the blocks until the step whose
        metadata was built next has come back (``update_from_output``); the worker half must
        have read them by the time a later step's forward pass starts."""


@runtime_checkable
class KVConnectorWorker(Protocol):
    def register_kv_caches(self, kv_caches: list[torch.Tensor], block_dim: int = 1) -> None:
        """The worker's KV cache tensors, one per attention layer (the backend's layout);
        dimension ``block_dim`` of each indexes the blocks."""

    def start_load_kv(self, metadata: KVConnectorMetadata) -> None:
        """Begin this step's loads into the cache, before the forward pass."""

    def wait_for_save(self) -> None:
        """Block until this step's saves have read what they need from the cache."""

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str], set[str]]:
        """(requests whose saves or sends ended, requests whose loads ended) since the last call."""

    # Optional: ``shutdown()`` finishes the saves in flight (called once by the worker);
    # ``get_handshake_metadata()`` what this rank tells the scheduler half once the cache exists
    # (picklable); ``get_connector_output()`` what this rank reports about the step just run
    # (picklable, or None), read after ``wait_for_save``. Each rank of a tensor-parallel engine
    # has its own worker half and cache shard; the engine's one scheduler half hears from all.
    # ``stores_draft_kv = True``: ``register_kv_caches`` also gets the layers of a speculative
    # decoding drafter (draft model, EAGLE head) after the target's; their blocks are the target's
    # block ids, so a connector that keeps blocks for this same engine (an offload tier) saves
    # and loads them too, and a drafter finds its own KV in a block loaded back.


@runtime_checkable
class KVTier(Protocol):
    """Storage for KV blocks outside the device (host memory, disk), by block hash.

    Optional: ``bind(block_bytes, layout_key=..., pin=...)`` is called once the worker knows
    the block layout, before the first block: the bytes of one block of every layer, a key
    naming the model and layout (files of different layouts must not mix) and whether host
    memory should be pinned (the cache is on a GPU).
    """

    def contains(self, block_hash: bytes) -> bool: ...

    def store(self, block_hash: bytes, data: torch.Tensor) -> None:
        """Keep ``data`` (one block of every layer); may evict older blocks by the tier's policy."""

    def load(self, block_hash: bytes) -> torch.Tensor | None:
        """The stored block, or None when it is gone or fails its checksum."""


# ---------------------------------------------------------------- offload flags -> config

OFFLOADING_CONNECTOR = "OffloadingConnector"  # vLLM's name for the offload tiers' connector
PREEMPTION_MODES = ("recompute", "swap")
OFFLOAD_EXECUTORS = ("uniproc", "multiproc", "ray", "uni", "mp")  # the executors offload is tested on (and vLLM's names)
EVICTION_POLICIES = ("lru", "arc")
DEFAULT_TIER_SIZES = {"cpu": 4 << 30, "disk": 32 << 30}  # bytes, when --kv-offload-size leaves one out
_UNITS = {"": 1 << 30, "b": 1, "k": 1000, "kb": 1000, "kib": 1 << 10, "m": 1000**2, "mb": 1000**2, "mib": 1 << 20,
          "g": 1000**3, "gb": 1000**3, "gib": 1 << 30, "t": 1000**4, "tb": 1000**4, "tib": 1 << 40}
# kv_transfer_config's kv_connector_extra_config keys for the offloading connector: ours, and
# vLLM's num_cpu_blocks / cpu_bytes_to_use for the cpu tier.
EXTRA_CONFIG_KEYS = ("tiers", "size", "dir", "policy", "num_cpu_blocks", "cpu_bytes_to_use", "block_size", "spec_name")


def parse_size(text: Any) -> int:
    """Bytes in ``8GiB``, ``512MiB``, ``1.5GB``, ``4096B``; a bare number is GiB (the flag's old unit)."""
    import re

    if isinstance(text, (int, float)) and not isinstance(text, bool):
        value, unit = float(text), ""
    else:
        match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([A-Za-z]*)\s*", str(text))
        if match is None or match.group(2).lower() not in _UNITS:
            raise ValueError(
                f"--kv-offload-size: bad size {text!r}; give a number with a unit, e.g. 8GiB, 512MiB, 1.5GB "
                "(units: B, KB, KiB, MB, MiB, GB, GiB, TB, TiB; a bare number is GiB)"
            )
        value, unit = float(match.group(1)), match.group(2).lower()
    size = int(value * _UNITS[unit])
    if size <= 0:
        raise ValueError(f"--kv-offload-size: size {text!r} must be larger than zero")
    return size


def _size_texts(value: Any) -> list[str]:
    """One size text a tier, in order; an empty item keeps that tier's default (``,64GiB``)."""
    if value is None:
        return []
    items = list(value) if isinstance(value, (list, tuple)) else str(value).split(",")
    texts = ["" if item is None else str(item).strip() for item in items]
    while texts and not texts[-1]:
        texts.pop()
    return texts


def _count(key: str, value: Any) -> int:
    """A positive integer of kv_connector_extra_config, or an error naming the key and the value."""
    from runtime.engine_arg_checks import invalid

    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise invalid(f"kv_connector_extra_config {key}", value, "a positive integer")
    return value


def _split(value: Any) -> list[str]:
    if value is None:
        return []
    items = value if isinstance(value, (list, tuple)) else str(value).split(",")
    return [str(item).strip() for item in items if str(item).strip()]


KV_ROLES = ("kv_producer", "kv_consumer", "kv_both")
DEFAULT_KV_PORT = 14579  # vLLM's KVTransferConfig.kv_port: a transfer connector's port when none is given
# vLLM's top-level --kv-transfer-config keys a transfer connector reads (the offloading connector
# reads only kv_connector_extra_config).
TRANSFER_CONFIG_KEYS = ("kv_connector", "kv_role", "kv_ip", "kv_port", "engine_id", "kv_connector_extra_config",
                        "kv_rank", "kv_parallel_size", "kv_buffer_device", "kv_buffer_size")


def parse_transfer_config(raw: Any) -> dict[str, Any]:
    """``--kv-transfer-config`` (vLLM's JSON, or a dict) checked: the connector is installed, the
    role and keys are known. Returns the dict, ``kv_connector_extra_config`` always present."""
    import json

    if isinstance(raw, str):
        try:
            raw = json.loads(raw)
        except json.JSONDecodeError as exc:
            raise ValueError(f"--kv-transfer-config must be a JSON object, got {raw!r} ({exc})") from None
    if not isinstance(raw, dict):
        raise ValueError(f"--kv-transfer-config must be a JSON object, got {raw!r}")
    name = raw.get("kv_connector")
    from runtime.plugins import get_registry

    registry = get_registry("kv_connector")
    if not isinstance(name, str) or name not in registry:
        installed = ", ".join(sorted(registry.names())) or "none installed"
        hint = registry.unknown_message(str(name)).partition(" (")[2]
        raise ValueError(f"--kv-transfer-config: kv_connector {name!r} is not supported; supported: {installed}"
                         + (f" ({hint}" if hint else ""))
    unknown = sorted(set(raw) - set(TRANSFER_CONFIG_KEYS))
    if unknown:
        raise ValueError(f"--kv-transfer-config: unknown key(s) {', '.join(map(repr, unknown))}; "
                         f"valid keys: {', '.join(TRANSFER_CONFIG_KEYS)}")
    role = raw.get("kv_role", "kv_both")
    if role not in KV_ROLES:
        raise ValueError(f"--kv-transfer-config: kv_role {role!r} is not valid; choose one of: {', '.join(KV_ROLES)}")
    extra = raw.get("kv_connector_extra_config") or {}
    if not isinstance(extra, dict):
        raise ValueError(f"--kv-transfer-config: kv_connector_extra_config must be a JSON object, got {extra!r}")
    return {**raw, "kv_role": role, "kv_connector_extra_config": dict(extra)}


def _offload_extra(config: dict[str, Any]) -> dict[str, Any]:
    """The offloading connector's settings (tiers, size, dir, policy) of a parsed transfer config."""
    extra = config["kv_connector_extra_config"]
    check_extra_keys("--kv-transfer-config", extra, EXTRA_CONFIG_KEYS)
    return extra


def check_extra_keys(label: str, extra: dict[str, Any], valid: tuple[str, ...]) -> None:
    """A connector's ``kv_connector_extra_config`` holds only ``valid`` keys; else an error naming them."""
    unknown = sorted(set(extra) - set(valid))
    if unknown:
        raise ValueError(f"{label}: unknown kv_connector_extra_config key(s) {', '.join(map(repr, unknown))}; "
                         f"valid keys: {', '.join(valid)}")


def resolve_kv_offload(args: Any) -> dict[str, Any] | None:
    """The offload flags of ``args`` (:class:`runtime.engine_args.EngineArgs`) checked, with
    ``--preemption-mode``: None when offload is off, else ``{"connector", "tiers", "sizes"
    (bytes, one per tier), "dir", "policy"}``; for a transfer connector named by
    ``--kv-transfer-config`` (prefill/decode), ``{"connector", "transfer_config"}``.

    Errors name the bad value and the valid ones: an unknown tier, a bad size, more sizes
    than tiers, an unwritable directory, an unknown policy; offload needs prefix caching
    (block hashes) and the uniproc, multiproc or ray executor, swap preemption needs a cpu tier.
    """
    transfer = parse_transfer_config(args.kv_transfer_config) if args.kv_transfer_config else None
    if transfer is not None and transfer["kv_connector"] != OFFLOADING_CONNECTOR:
        return _resolve_transfer(args, transfer)
    resolved = _resolve_tiers(args.kv_offload, args.kv_offload_size, args.kv_offload_dir, args.kv_offload_policy,
                              transfer)
    if args.preemption_mode == "swap" and (resolved is None or "cpu" not in resolved["tiers"]):
        raise ValueError("--preemption-mode swap moves preempted requests' blocks to the cpu tier: add --kv-offload cpu")
    if resolved is not None and not args.enable_prefix_caching:
        raise ValueError("--kv-offload addresses blocks by their prefix-cache hashes: it needs enable_prefix_caching")
    if resolved is not None and args.executor not in OFFLOAD_EXECUTORS:
        raise ValueError(f"--kv-offload runs with the {', '.join(OFFLOAD_EXECUTORS[:3])} executors only for now, "
                         f"got executor {args.executor!r}")
    return resolved


def _resolve_transfer(args: Any, transfer: dict[str, Any]) -> dict[str, Any]:
    """A transfer connector's (prefill/decode) settings; it cannot be combined with offload tiers yet."""
    if args.kv_offload or args.preemption_mode == "swap":
        raise ValueError(f"--kv-transfer-config: {transfer['kv_connector']} cannot be combined with --kv-offload or "
                         "--preemption-mode swap yet (one KV connector per engine)")
    if args.executor != "uniproc":
        raise ValueError(f"--kv-transfer-config: {transfer['kv_connector']} runs with the uniproc executor only for now, "
                         f"got executor {args.executor!r}")
    return {"connector": transfer["kv_connector"], "transfer_config": transfer}


def _resolve_tiers(tiers: Any, sizes: Any, directory: str | None, policy: str | None, transfer_config: Any) -> dict | None:
    extra = _offload_extra(transfer_config) if transfer_config else {}
    tier_names = _split(tiers) or _split(extra.get("tiers")) or (["cpu"] if transfer_config else [])
    if not tier_names:
        if sizes is not None or directory is not None:
            raise ValueError("--kv-offload-size / --kv-offload-dir need --kv-offload (e.g. --kv-offload cpu,disk)")
        return None
    from runtime.plugins import get_registry

    registry = get_registry("kv_tier")
    for name in tier_names:
        if name not in registry:
            raise ValueError("--kv-offload: " + registry.unknown_message(name))
    if len(set(tier_names)) != len(tier_names):
        raise ValueError(f"--kv-offload: tier listed twice in {','.join(tier_names)!r}")
    size_texts = _size_texts(sizes if sizes is not None else extra.get("size"))
    if len(size_texts) > len(tier_names):
        raise ValueError(
            f"--kv-offload-size: {len(size_texts)} sizes for {len(tier_names)} tier(s) ({','.join(tier_names)}); give one per tier"
        )
    parsed = [parse_size(t) if t else 0 for t in size_texts]  # 0: the tier's default
    num_cpu_blocks = extra.get("num_cpu_blocks")
    cpu_bytes = extra.get("cpu_bytes_to_use")
    if "cpu" in tier_names:
        cpu_index = tier_names.index("cpu")
        given = [what for what, value in (("--kv-offload-size", cpu_index < len(parsed) and parsed[cpu_index]),
                                          ("num_cpu_blocks", num_cpu_blocks), ("cpu_bytes_to_use", cpu_bytes)) if value]
        if len(given) > 1:
            raise ValueError(f"the cpu tier's size is given {len(given)} times ({', '.join(given)}); give it once")
        if cpu_bytes is not None:
            parsed += [0] * (cpu_index + 1 - len(parsed))
            parsed[cpu_index] = _count("cpu_bytes_to_use", cpu_bytes)
        if num_cpu_blocks is not None:
            num_cpu_blocks = _count("num_cpu_blocks", num_cpu_blocks)
    byte_sizes = tuple(parsed[i] if i < len(parsed) and parsed[i] else DEFAULT_TIER_SIZES.get(n, 1 << 30)
                       for i, n in enumerate(tier_names))
    policy = policy or extra.get("policy") or "lru"
    if policy not in EVICTION_POLICIES:
        raise ValueError(f"--kv-offload-policy {policy!r} is not valid; choose one of: {', '.join(EVICTION_POLICIES)}")
    directory = directory or extra.get("dir")
    if directory and set(tier_names) <= {"cpu"}:  # no tier reads it: a forgotten ",disk" would go unnoticed
        raise ValueError(f"--kv-offload-dir {directory!r} is for the disk tier, which --kv-offload {','.join(tier_names)} "
                         f"does not list; add it (e.g. --kv-offload {','.join(tier_names)},disk) or drop --kv-offload-dir")
    if "disk" in tier_names:
        directory = check_writable_dir(directory)
    if num_cpu_blocks is not None and "cpu" in tier_names:
        # vLLM sizes its cpu tier in blocks: negative sizes mean blocks (the tier turns them into bytes).
        byte_sizes = tuple(-int(num_cpu_blocks) if n == "cpu" else b for n, b in zip(tier_names, byte_sizes))
    return {"connector": OFFLOADING_CONNECTOR, "tiers": tuple(tier_names), "sizes": byte_sizes, "dir": directory,
            "policy": policy}


def kv_offload_fields(resolved: dict[str, Any] | None) -> dict[str, Any]:
    """The :class:`runtime.config.CacheConfig` fields of a :func:`resolve_kv_offload` result."""
    if resolved is None:
        return {}
    if "transfer_config" in resolved:
        return {"kv_connector": resolved["connector"], "kv_transfer_config": resolved["transfer_config"]}
    return {"kv_connector": resolved["connector"], "kv_offload": resolved["tiers"], "kv_offload_size": resolved["sizes"],
            "kv_offload_dir": resolved["dir"], "kv_offload_policy": resolved["policy"]}


def check_writable_dir(directory: str | None) -> str:
    """``directory`` made absolute, created and probed with a write; a clear error otherwise."""
    import os
    import tempfile

    if not directory:
        raise ValueError("the disk KV offload tier needs a directory: add --kv-offload-dir PATH")
    path = os.path.abspath(os.path.expanduser(directory))
    try:
        os.makedirs(path, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=path, prefix=".probe-"):
            pass
    except OSError as exc:
        raise ValueError(f"--kv-offload-dir {directory!r} is not a writable directory ({exc.strerror or exc})") from None
    return path


def make_kv_connector(config: Any, role: KVConnectorRole):
    """The configured connector's half for ``role``, or None when no connector is configured."""
    name = config.cache_config.kv_connector
    if not name:
        return None
    from runtime.plugins import get_registry

    contract = "kv_connector_scheduler" if role == KVConnectorRole.SCHEDULER else "kv_connector_worker"
    return get_registry("kv_connector").create(name, config, role, contract=contract)
