"""The P/D connectors' settings, read from ``--kv-transfer-config`` (vLLM's JSON spelling)."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

from runtime.kv_transfer import DEFAULT_KV_PORT, check_extra_keys
FAILURE_MODES = ("recompute", "fail")
EXTRA_KEYS = ("lease_s", "pull_timeout_s", "on_transfer_failure", "checksum")
# the kv_connector_extra_config keys each connector reads (the CudaIpcConnector's copies stay on the GPUs: no checksum)
CONNECTOR_EXTRA_KEYS = {"TcpConnector": EXTRA_KEYS, "CudaIpcConnector": ("lease_s", "pull_timeout_s", "on_transfer_failure")}


@dataclass(frozen=True)
class PDSettings:
    role: str  # kv_producer, kv_consumer or kv_both
    host: str  # where this instance serves its blocks (and what it tells decode instances)
    port: int  # blocks are served here; "pulled" notices arrive at port + 1
    lease_s: float = 120.0  # a finished prefill's blocks are freed this long after it, if nobody pulled them
    pull_timeout_s: float = 10.0  # a pull that gets no answer this long has failed
    on_transfer_failure: str = "recompute"  # or "fail": the request ends with the transfer's error
    checksum: bool = True  # crc32 of every layer's bytes, checked on arrival

    @property
    def is_producer(self) -> bool:
        return self.role in ("kv_producer", "kv_both")

    @property
    def is_consumer(self) -> bool:
        return self.role in ("kv_consumer", "kv_both")

    @property
    def control_port(self) -> int:
        return self.port + 1


def settings_of(config) -> PDSettings:
    """The settings of ``config`` (an EngineConfig); errors name the bad key or value."""
    raw = config.cache_config.kv_transfer_config or {}
    name = str(raw.get("kv_connector") or "TcpConnector")
    extra = dict(raw.get("kv_connector_extra_config") or {})
    check_extra_keys(name, extra, CONNECTOR_EXTRA_KEYS.get(name, EXTRA_KEYS))
    mode = extra.get("on_transfer_failure", "recompute")
    if mode not in FAILURE_MODES:
        raise ValueError(f"{name}: on_transfer_failure {mode!r} is not valid; choose one of: {', '.join(FAILURE_MODES)}")
    port = int(raw.get("kv_port") or DEFAULT_KV_PORT)
    if not 0 < port < 65535:
        raise ValueError(f"{name}: kv_port {port} is not a valid TCP port (it also uses kv_port + 1)")
    settings = PDSettings(
        role=raw.get("kv_role", "kv_both"), host=str(raw.get("kv_ip") or "127.0.0.1"), port=port,
        lease_s=float(extra.get("lease_s", 120.0)), pull_timeout_s=float(extra.get("pull_timeout_s", 10.0)),
        on_transfer_failure=mode, checksum=bool(extra.get("checksum", True)),
    )
    if settings.lease_s <= 0 or settings.pull_timeout_s <= 0:
        raise ValueError(f"{name}: lease_s and pull_timeout_s must be > 0, got {settings.lease_s}, {settings.pull_timeout_s}")
    return settings


def layout_key(config) -> str:
    """Names what must match between a prefill and a decode instance for their blocks to mean the
    same: model architecture and depth, dtypes, block size, and the attention backend's order of a
    block's bytes (``CacheConfig.kv_block_layout``, which only the worker knows: the scheduler half
    takes the worker's key from the connector handshake). The workers also check each layer's shape."""
    hf = config.model_config.hf_config
    cache = config.cache_config
    text = repr((config.model_config.architecture, getattr(hf, "num_hidden_layers", None), str(config.model_config.dtype),
                 cache.cache_dtype, cache.block_size) + ((cache.kv_block_layout,) if cache.kv_block_layout else ()))
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def prompt_digest(token_ids) -> str:
    """Names the tokens whose KV a prefill instance hands over (a decode instance checks its prompt)."""
    return hashlib.sha256(repr(list(token_ids)).encode()).hexdigest()[:32]


def transfer_params(request) -> dict | None:
    """The request's ``kv_transfer_params`` (``SamplingParams.extra_args``), or None."""
    extra = request.sampling_params.extra_args
    params = extra.get("kv_transfer_params") if extra else None
    return params if isinstance(params, dict) else None


# kv_transfer_params a decode instance reads (a prefill response's), and the JSON type each must have
_REMOTE_FIELDS = (("remote_host", str), ("remote_port", int), ("remote_engine_id", str), ("remote_request_id", str),
                  ("remote_block_ids", list), ("num_remote_tokens", int), ("block_size", int))


def malformed_reason(params: dict) -> str | None:
    """Why ``params`` (a ``do_remote_prefill`` request's kv_transfer_params) cannot name a prefill
    instance's blocks at all (a client error: the message starts with the request field), or None."""
    missing = [name for name, _ in _REMOTE_FIELDS if name not in params]
    if missing:
        return f"kv_transfer_params lacks {', '.join(missing)} (pass on the prefill response's kv_transfer_params)"
    for name, kind in _REMOTE_FIELDS:
        value = params[name]
        if not isinstance(value, kind) or isinstance(value, bool):
            return f"kv_transfer_params: {name} must be {_JSON_NAMES[kind]}, got {value!r:.80}"
    if not 0 < params["remote_port"] < 65535:
        return f"kv_transfer_params: remote_port {params['remote_port']} is not a valid TCP port"
    if params["num_remote_tokens"] < 0 or params["block_size"] <= 0:
        return (f"kv_transfer_params: num_remote_tokens ({params['num_remote_tokens']}) must be >= 0 and "
                f"block_size ({params['block_size']}) > 0")
    ids = params["remote_block_ids"]
    if not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in ids):
        return f"kv_transfer_params: remote_block_ids must be block numbers >= 0, got {ids!r:.80}"
    if not isinstance(params.get("remote_instance", ""), str) or not isinstance(params.get("prompt_digest", ""), str):
        return "kv_transfer_params: remote_instance and prompt_digest must be strings"
    return None


_JSON_NAMES = {str: "a string", int: "an integer", list: "a list"}
