"""The Platform interface that hardware plugins implement."""

from __future__ import annotations

import torch


class Platform:
    """A kind of device the engine can run on.

    Subclasses set the class attributes and override the queries. Detection
    (``is_available``) must not initialize a device runtime in a way that breaks a
    later ``fork``.
    """

    name: str = ""
    device_type: str = "cpu"
    priority: int = 0  # higher wins in auto-detection
    dist_backend: str = "gloo"
    default_attention_backend: str = ""
    supported_dtypes: tuple[torch.dtype, ...] = (torch.float32, torch.bfloat16, torch.float16)

    def is_available(self) -> bool:
        raise NotImplementedError

    def device(self, local_rank: int = 0) -> torch.device:
        return torch.device(self.device_type)

    def total_memory_bytes(self) -> int:
        raise NotImplementedError

    def kv_cache_memory_bytes(self, cache_config, model_memory_bytes: int) -> int:
        """Bytes to give to the KV cache once the model is loaded."""
        raise NotImplementedError

    def allocate_kv_cache(self, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """One layer's KV cache tensor."""
        return torch.zeros(shape, dtype=dtype, device=device)

    def default_dtype(self, config_dtype: torch.dtype) -> torch.dtype:
        return config_dtype

    def set_threads(self, num_threads: int | None) -> None:
        """Apply thread settings before the model runs (``--cpu-num-threads``; CPU platforms)."""

    def synchronize(self) -> None:
        pass

    def __repr__(self) -> str:
        return f"{type(self).__name__}(name={self.name!r})"


def select_platform(name: str | None = None) -> Platform:
    """The platform named ``name``, or the available one with the highest priority."""
    from runtime.plugins import get_registry

    registry = get_registry("platform")
    if name:
        platform = registry.get(name)
        if not platform.is_available():
            available = [c.name for c in registry if c.obj.is_available()]
            raise ValueError(
                f"platform {name!r} is installed but not available on this machine; "
                f"available: {', '.join(available) or 'none'}"
            )
        return platform
    candidates = sorted((c.obj for c in registry), key=lambda p: -p.priority)
    for platform in candidates:
        if platform.is_available():
            return platform
    raise ValueError(
        "no platform is available; installed: "
        f"{', '.join(registry.names()) or 'none'} (runtime-plugin-cpu provides 'cpu')"
    )
