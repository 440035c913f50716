"""The Platform interface that hardware plugins implement."""

from __future__ import annotations

from abc import abstractmethod
from collections.abc import Callable
from typing import Any

import torch

CPUINFO = "/proc/cpuinfo"


def cpu_flags() -> frozenset[str]:
    """This CPU's feature flags as Linux lists them (x86 ``flags``, Arm ``Features``); empty where
    it cannot be read."""
    try:
        with open(CPUINFO) as f:
            for line in f:
                if line.startswith(("flags", "Features")):
                    return frozenset(line.split(":", 1)[-1].split())
    except OSError:
        pass
    return frozenset()


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

    # is_available() and kv_cache_memory_bytes() have no default: a subclass that does not
    # define them is refused when registered (runtime.registration checks the marker).
    @abstractmethod
    def is_available(self) -> bool:
        """True when this machine has the device (without starting its runtime; see above)."""
        raise NotImplementedError

    def device(self, local_rank: int = 0) -> torch.device:
        return torch.device(self.device_type)

    def total_memory_bytes(self) -> int:
        """The device's memory (informational; platforms size the KV cache in kv_cache_memory_bytes)."""
        raise NotImplementedError

    @abstractmethod
    def kv_cache_memory_bytes(self, cache_config, model_memory_bytes: int) -> int:
        """Bytes to give to the KV cache once the model is loaded."""
        raise NotImplementedError

    def allocate_kv_cache(self, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """One layer's KV cache tensor, all zeros: attention reads whole blocks and masks the unused
        slots, so they must hold finite values."""
        return self.zero_kv_cache(torch.empty(shape, dtype=dtype, device=device))

    def zero_kv_cache(self, tensor: torch.Tensor) -> torch.Tensor:
        """Fill a (contiguous) KV cache tensor with zeros: a new one, or one brought back by ``wake_up``."""
        return tensor.zero_()

    def default_dtype(self, config_dtype: torch.dtype | None) -> torch.dtype:
        """The dtype ``--dtype auto`` runs: the checkpoint's ``config_dtype``, float32 where it
        names none (a GGUF file's quantized blocks)."""
        return config_dtype or torch.float32

    def set_threads(self, num_threads: int | None) -> None:
        """Apply thread settings before the model runs (``--cpu-num-threads``; CPU platforms)."""

    def synchronize(self) -> None:
        pass

    # Collectives of tensor-parallel models, over a process group of ``dist_backend``
    # (runtime.distributed). A platform with a faster path for some sizes overrides them.
    def all_reduce(self, tensor: torch.Tensor, group: Any) -> torch.Tensor:
        """The elementwise sum of ``tensor`` over ``group``'s ranks (may reuse ``tensor``)."""
        import torch.distributed as dist

        dist.all_reduce(tensor, group=group)
        return tensor

    def prepare_collectives(self, group: Any) -> str:
        """Set up this platform's own collectives for the tensor-parallel process ``group``; returns
        one line that says which collectives its all-reduce takes (logged, and kept in the
        worker's ``ParallelState.collectives``).

        Called once on every rank of ``group`` by ``runtime.distributed.init_distributed``,
        after the group exists and before the model is built (so before any graph capture):
        collectives run here have every rank with them. Nothing to set up by default.
        """
        return f"torch.distributed ({self.dist_backend})"

    def destroy_collectives(self) -> None:
        """Release what :meth:`prepare_collectives` set up; the process group goes next."""

    def all_gather(self, tensor: torch.Tensor, group: Any, dim: int = -1) -> torch.Tensor:
        """The ranks' ``tensor`` (same shape on each) concatenated along ``dim`` in rank order."""
        import torch.distributed as dist

        parts = [torch.empty_like(tensor) for _ in range(dist.get_world_size(group))]
        dist.all_gather(parts, tensor.contiguous(), group=group)
        return torch.cat(parts, dim=dim)

    def custom_ops(self) -> dict[str, Callable]:
        """Fused kernels the models use instead of plain torch ops, by name (none by default).

        The model runner builds the model inside
        ``runtime.models.ops.custom_ops_scope(platform.custom_ops())``; each module
        picks up its op while it is constructed and otherwise runs plain torch. The
        names the models look up (``runtime.models.ops.CUSTOM_OPS``; others are ignored):

        * ``rms_norm(x, weight, eps, gemma=False) -> out``
        * ``fused_add_rms_norm(x, residual, weight, eps, gemma=False) -> (out, x + residual)``
        * ``rotary_embedding(positions, query, key, cos_sin_cache) -> (query, key)``, in place;
          the cache is ``[max_position, head_size]`` float32, cos | sin
        * ``silu_and_mul(x) -> out``, ``x`` = ``[gate | up]``
        * ``gemv(x, weight, bias=None) -> out``, one-row ``F.linear``
        * ``silu_and_mul_gemv(x, weight, bias=None, scale=None) -> out`` and ``rms_norm_gemv(x,
          residual, norm_weight, eps, gemma, weight, bias=None, scale=None) -> (out, x + residual)``:
          one-row ``gemv`` with the activation or the norm before it computed on the fly
        * ``top_k_top_p(logits, top_k, top_p, max_top_k) -> logits``, the sampler's filters
          when top-k bounds every row, and ``argmax(logits) -> token_ids``, its greedy rows'
          tokens (the sampler looks these up too)

        They must match the plain modules' numerics (``runtime.models.ops`` says how)
        and be safe to capture in a graph: no host syncs, no data-dependent control flow.
        """
        return {}

    # Graph capture: platforms that can record a model step once and replay it (CUDA
    # graphs) override these three; the model runner pads decode batches to the
    # captured sizes and keeps every input in persistent buffers.
    supports_graphs: bool = False

    def graph_pool(self) -> Any:
        """A memory pool the captured graphs share (captured largest first)."""
        return None

    def capture_graph(self, fn: Callable[[], torch.Tensor], pool: Any) -> Callable[[], torch.Tensor]:
        """Record ``fn`` (already run once, so kernels are compiled) and return a replay.

        The replay reruns the recorded work on whatever the persistent inputs now
        hold and returns the same output tensor each time.
        """
        raise NotImplementedError(f"platform {self.name!r} cannot capture graphs")

    # Compiled decode steps, the analog of graphs on a platform without them (the CPU): the
    # model's forward is compiled once (``compile_model``) and every decode step runs that code
    # directly on the step's buffers, any batch size up to the largest "captured" one, no padding.
    # The attention backend runs eagerly inside it (``runtime.models.attention_op``) with the
    # step's host metadata, so any backend works. Needs ``supports_graphs`` too; ``capture_graph``
    # and ``graph_pool`` are not used.
    compiles_graphs: bool = False

    def compile_model(self, model: Any) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
        """``model``'s forward ``(input_ids [T], positions [T]) -> hidden [T, hidden]`` compiled,
        or None to run this model eagerly after all (the platform's choice, e.g. an opt-in setting).

        Called once, before the warm-up steps that trigger the compilation itself.
        """
        raise NotImplementedError(f"platform {self.name!r} does not compile decode steps")

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
