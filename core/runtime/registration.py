"""The typed ``register`` callbacks the ``register_*`` hooks receive, and the contracts checked.

Each registry kind has one callback signature (documented in :mod:`runtime.hookspecs`)
and one contract: the members a registered object must have. An object registered
directly (a platform instance, or a class given as the factory) is checked at
registration; an object a plain factory builds (imported lazily, so that loading plugins
stays cheap) is checked when it is first built. Either way a missing member is a
:class:`runtime.plugins.PluginError` naming the plugin, the component and the member.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True, slots=True)
class Contract:
    """The members (methods) a registered object of one kind must provide."""

    type_name: str  # the Protocol / base class, "module:Name", named in errors and docs
    methods: tuple[str, ...]


CONTRACTS: dict[str, Contract] = {
    "platform": Contract("runtime.platforms:Platform", ("is_available", "device", "kv_cache_memory_bytes")),
    "attention_backend": Contract(
        "runtime.attention.backend:AttentionBackend", ("kv_cache_shape", "build_metadata", "forward")
    ),
    "quant_method": Contract("runtime.quantization:QuantMethod", ("get_config",)),
    "proposer": Contract("runtime.spec_decode:Proposer", ("propose",)),
    "kv_connector_scheduler": Contract(
        "runtime.kv_transfer:KVConnectorScheduler",
        ("get_num_new_matched_tokens", "update_state_after_alloc", "build_connector_meta", "request_finished"),
    ),
    "kv_connector_worker": Contract(
        "runtime.kv_transfer:KVConnectorWorker", ("register_kv_caches", "start_load_kv", "wait_for_save", "get_finished")
    ),
    "kv_tier": Contract("runtime.kv_transfer:KVTier", ("contains", "store", "load")),
    "executor": Contract("runtime.executor.base:Executor", ("initialize", "execute_model", "shutdown")),
    "model": Contract("runtime.models.interface:CausalLM", ("forward", "compute_logits", "load_weights", "attention_specs")),
    "guided_backend": Contract("runtime.structured_output:GuidedBackend", ("compile",)),
}


def missing_members(obj: Any, contract: Contract) -> list[str]:
    """Methods of ``contract`` that ``obj`` (an instance or a class) lacks.

    A method still marked abstract (``abc.abstractmethod`` on a base class) counts as missing.
    """
    missing = []
    for name in contract.methods:
        member = getattr(obj, name, None)
        if member is None or not callable(member) or getattr(member, "__isabstractmethod__", False):
            missing.append(name)
    return missing


def contract_error(plugin: str, kind: str, name: str, obj: Any, missing: list[str]) -> str:
    contract = CONTRACTS[kind]
    what = obj.__name__ if inspect.isclass(obj) else type(obj).__name__
    label = kind.replace("_", " ")
    return (
        f"plugin {plugin!r} registered {label} {name!r} ({what}), which lacks "
        f"{', '.join(m + '()' for m in missing)} required by {contract.type_name.replace(':', '.')}"
    )


# ------------------------------------------------------------------ typed callbacks
# Each builder gets ``add(name, obj, **options)`` (the registry's, bound to the plugin) and
# returns the callback the hook receives. Keyword-only options keep calls readable.

def platform_callback(add: Callable[..., None]):
    def register(platform: Any) -> None:
        """``register(platform)``: a :class:`runtime.platforms.Platform` instance."""
        add(getattr(platform, "name", None), platform)

    return register


def attention_backend_callback(add: Callable[..., None]):
    def register(
        name: str,
        factory: Callable[[], Any],
        *,
        platforms: Sequence[str] | None = None,
        dtypes: Sequence[Any] | None = None,
        head_sizes: Sequence[int] | None = None,
    ) -> None:
        """``factory()`` -> AttentionBackend; ``platforms`` None means every platform."""
        add(name, factory, platforms=list(platforms) if platforms is not None else None,
            dtypes=list(dtypes) if dtypes is not None else None,
            head_sizes=list(head_sizes) if head_sizes is not None else None)

    return register


def quant_method_callback(add: Callable[..., None]):
    def register(name: str, factory: Callable[[], Any], *, detect: Callable[[dict | None], bool] | None = None) -> None:
        """``factory()`` -> QuantMethod; ``detect(quantization_config)`` claims a checkpoint."""
        add(name, factory, detect=detect)

    return register


def named_factory_callback(add: Callable[..., None]):
    def register(name: str, factory: Callable[..., Any]) -> None:
        """``register(name, factory)``; the factory's arguments depend on the kind (see the hookspec)."""
        add(name, factory)

    return register


CALLBACKS = {
    "platform": platform_callback,
    "attention_backend": attention_backend_callback,
    "quant_method": quant_method_callback,
}


def make_callback(kind: str, add: Callable[..., None]):
    return CALLBACKS.get(kind, named_factory_callback)(add)
