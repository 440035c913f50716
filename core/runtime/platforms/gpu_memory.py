"""How many bytes of a GPU the KV cache may take once the model is loaded.

``gpu_memory_utilization`` is the share of the card's *total* memory that the engine
may fill. From it the engine takes away what is already used outside torch's allocator
(the device runtime's context, collective buffers, other processes), the model's
weights, and headroom for activations: the peak torch allocated beyond the weights so
far, and at least a fixed reserve for the forward pass and the sampler of a step
(logits of ``max_num_seqs`` rows over the vocabulary, prefill activations of
``max_num_batched_tokens``). Memory of other processes therefore counts against the
budget: sharing a card lowers the KV cache rather than failing at the first large batch.

Plain arithmetic over a :class:`MemorySnapshot`, the same for every GPU platform;
:class:`runtime.platforms.gpu.GpuPlatform` takes the snapshot from its torch device module.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

GIB = 1 << 30
DEFAULT_ACTIVATION_HEADROOM = 2 * GIB
MAX_HEADROOM_FRACTION = 0.1  # small cards keep at most this share of memory as headroom


@dataclass(frozen=True, slots=True)
class MemorySnapshot:
    """One device's memory, as torch and the driver see it (bytes)."""

    total: int  # the card's memory
    free: int  # free according to the driver (all processes)
    torch_reserved: int  # held by this process's caching allocator
    torch_peak_allocated: int  # peak of tensors allocated by this process so far


def activation_headroom(total: int, env: str) -> int:
    """The reserve for one step's activations: ``$env`` (GiB) when set, else the default."""
    value = os.environ.get(env)
    if value:
        try:
            return int(float(value) * GIB)
        except ValueError:
            raise ValueError(f"{env} must be a number of GiB, got {value!r}") from None
    return min(DEFAULT_ACTIVATION_HEADROOM, int(total * MAX_HEADROOM_FRACTION))


def kv_cache_budget(
    snapshot: MemorySnapshot, utilization: float, model_bytes: int, headroom: int, headroom_env: str = ""
) -> int:
    """Bytes left for the KV cache (see the module docstring); raises when nothing is left.

    ``headroom_env`` names the variable that sets ``headroom``, for the error message.
    """
    allowed = int(snapshot.total * utilization)
    outside_torch = max(0, snapshot.total - snapshot.free - snapshot.torch_reserved)
    activations = max(headroom, snapshot.torch_peak_allocated - model_bytes)
    budget = allowed - outside_torch - model_bytes - activations
    if budget <= 0:
        lower = f"lower {headroom_env}" if headroom_env else "lower the activation headroom"
        raise ValueError(
            f"no GPU memory is left for the KV cache: gpu_memory_utilization {utilization} of "
            f"{snapshot.total / GIB:.2f} GiB allows {allowed / GIB:.2f} GiB, but the model takes "
            f"{model_bytes / GIB:.2f} GiB, activations {activations / GIB:.2f} GiB and memory outside torch "
            f"(device context, other processes) {outside_torch / GIB:.2f} GiB; raise gpu_memory_utilization, "
            f"{lower}, or set kv_cache_memory_bytes / num_gpu_blocks_override"
        )
    return budget
