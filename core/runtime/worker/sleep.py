"""Sleep mode in a worker (vLLM's ``enable_sleep_mode``): free the device memory of the weights and the KV cache.

Level 1 copies the weights to host memory (pinned where the device is an accelerator) and frees them; level 2
frees them and, at ``wake_up``, reloads them from the checkpoint (a speculative draft model's weights go to host
memory at both levels). Both levels discard the KV cache, which comes back zeroed. On the CPU platform the
"host copy" is a second buffer in the same memory: the model's own tensors are still freed and restored.

Memory is freed per storage (``untyped_storage().resize_(0)``) and given back at the same size, so every tensor
and view over it (a KV connector's, a compiled graph's inputs) stays the same object. Graphs recorded on a device
(CUDA graphs) read fixed addresses: they are dropped at sleep and captured again once everything is awake.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable

import torch

logger = logging.getLogger(__name__)

SLEEP_TAGS = ("weights", "kv_cache")
GiB = 1 << 30


def unique_storages(tensors: Iterable[torch.Tensor]) -> list[torch.UntypedStorage]:
    """The distinct storages behind ``tensors`` (tied weights and views counted once), in first-seen order;
    tensors without a plain storage (sparse, opaque layouts) are left out and keep their memory."""
    seen: set[int] = set()
    storages = []
    for tensor in tensors:
        if tensor.layout != torch.strided or tensor.is_meta:
            continue
        storage = tensor.untyped_storage()
        if storage.nbytes() == 0 or storage.data_ptr() in seen or not storage.resizable():
            continue
        seen.add(storage.data_ptr())
        storages.append(storage)
    return storages


def module_tensors(module: torch.nn.Module | None) -> list[torch.Tensor]:
    if module is None:
        return []
    return [*module.parameters(), *module.buffers()]


def as_bytes(storage: torch.UntypedStorage) -> torch.Tensor:
    """A flat uint8 tensor over all of ``storage``."""
    return torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage)


def to_host(storage: torch.UntypedStorage) -> torch.Tensor:
    """A host copy of ``storage`` (pinned for an accelerator's fast copy back)."""
    pin = storage.device.type != "cpu"
    try:
        host = torch.empty(storage.nbytes(), dtype=torch.uint8, pin_memory=pin)
    except RuntimeError:  # no pinned memory on this build: a plain host buffer
        host = torch.empty(storage.nbytes(), dtype=torch.uint8)
    host.copy_(as_bytes(storage))
    return host


def release_cached_memory(device: torch.device) -> None:
    """Hand the allocator's cached blocks back to the device (an accelerator's caching allocator)."""
    if device.type == "cpu":
        return
    module = getattr(torch, device.type, None)
    empty_cache = getattr(module, "empty_cache", None)
    if empty_cache is not None:
        empty_cache()


class WorkerSleep:
    """The freed storages of one worker's model runner, and how to bring each back."""

    def __init__(self, runner):
        self.runner = runner
        self.level = 0
        self.asleep: set[str] = set()
        self.host_copies: list[tuple[torch.UntypedStorage, torch.Tensor]] = []  # (freed storage, its bytes on host)
        self.reload_sizes: list[tuple[torch.UntypedStorage, int]] = []  # level 2: (freed storage, its size)
        self.kv_sizes: list[tuple[torch.UntypedStorage, int]] = []
        self.graphs_dropped = False

    def sleep(self, level: int) -> dict:
        """Free the weights (level 1: to host; level 2: discarded) and the KV cache; returns the bytes freed."""
        if self.asleep:
            raise RuntimeError(f"the worker is already asleep ({', '.join(sorted(self.asleep))})")
        runner = self.runner
        spec = runner.spec_runner
        draft = getattr(spec, "module", None) if spec is not None else None
        target = unique_storages(module_tensors(runner.model))
        kv = unique_storages([*runner.kv_caches, *(spec.kv_caches if spec is not None else [])])
        kv_ptrs = {s.data_ptr() for s in kv}
        target = [s for s in target if s.data_ptr() not in kv_ptrs]
        target_ptrs = {s.data_ptr() for s in target}
        drafts = [s for s in unique_storages(module_tensors(draft)) if s.data_ptr() not in target_ptrs | kv_ptrs]
        runner.platform.synchronize()
        offloaded = drafts if level == 2 else target + drafts
        self.host_copies = [(s, to_host(s)) for s in offloaded]
        self.reload_sizes = [(s, s.nbytes()) for s in target] if level == 2 else []
        self.kv_sizes = [(s, s.nbytes()) for s in kv]
        freed = {"weights": sum(s.nbytes() for s in target + drafts), "kv_cache": sum(s.nbytes() for s in kv)}
        if runner.graphs is not None and not runner.graphs.compiles:  # recorded graphs hold old addresses and a pool
            runner.graphs = None
            self.graphs_dropped = True
        for storage in target + drafts + kv:
            storage.resize_(0)
        release_cached_memory(runner.device)
        self.level = level
        self.asleep = set(SLEEP_TAGS)
        logger.info("sleep level %d: freed %.2f GiB of weights (%s) and %.2f GiB of KV cache", level,
                    freed["weights"] / GiB, "to host memory" if level == 1 else "reloaded at wake-up",
                    freed["kv_cache"] / GiB)
        return freed

    def wake_up(self, tags: Iterable[str]) -> None:
        """Bring back the parts named in ``tags`` that are asleep; once all are, capture dropped graphs again."""
        tags = set(tags) & self.asleep
        if "weights" in tags:
            self._restore_weights()
            self.asleep.discard("weights")
        if "kv_cache" in tags:
            for storage, nbytes in self.kv_sizes:
                storage.resize_(nbytes)
                # attention may read unused slots: they must hold finite values
                self.runner.platform.zero_kv_cache(as_bytes(storage))
            self.kv_sizes = []
            self.asleep.discard("kv_cache")
        self.runner.platform.synchronize()
        if not self.asleep:
            self.level = 0
            if self.graphs_dropped:
                self.graphs_dropped = False
                self.runner.capture_graphs()
        if tags:
            logger.info("woke up: %s", ", ".join(t for t in SLEEP_TAGS if t in tags))

    def _restore_weights(self) -> None:
        for storage, host in self.host_copies:
            storage.resize_(host.numel())
            as_bytes(storage).copy_(host)
        self.host_copies = []
        if self.reload_sizes:
            self._reload_from_checkpoint()
        self.reload_sizes = []

    def _reload_from_checkpoint(self) -> None:
        """Level 2: load the model again and move its bytes into the freed storages, one at a time (the
        fresh model's storage freed as each is moved, so the weights are held about once)."""
        from runtime.model_loader import load_model
        from runtime.models.ops import custom_ops_scope

        runner = self.runner
        mc = runner.model_config
        with custom_ops_scope(runner.platform.custom_ops()):
            fresh = load_model(mc.resolved, load_format=runner.config.load_config.load_format, dtype=mc.dtype,
                               device=runner.device, seed=mc.seed)
        sources = unique_storages(module_tensors(fresh))
        sizes = [nbytes for _, nbytes in self.reload_sizes]
        if [s.nbytes() for s in sources] != sizes:
            raise RuntimeError(
                f"reloading {mc.model!r} gave {len(sources)} weight buffers ({sum(s.nbytes() for s in sources)} bytes), "
                f"not the {len(sizes)} ({sum(sizes)} bytes) that were freed; the checkpoint changed since the engine started"
            )
        for (storage, nbytes), source in zip(self.reload_sizes, sources):
            storage.resize_(nbytes)
            as_bytes(storage).copy_(as_bytes(source))
            source.resize_(0)
        del fresh
        release_cached_memory(runner.device)
