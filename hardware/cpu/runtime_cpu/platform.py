"""The CPU platform: always available, KV cache sized from a memory setting."""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import mmap
import os
import sys

import torch

from runtime.platforms import Platform, cpu_flags

DEFAULT_KV_CACHE_BYTES = 4 << 30  # 4 GiB, like vLLM's CPU default KV space
DROP_PAGES_MIN_BYTES = 1 << 20  # smaller caches are zeroed by writing them
MADV_DONTNEED = 4  # Linux: the pages are dropped; private anonymous memory then reads as zeros
KV_CACHE_ENV = "RUNTIME_CPU_KVCACHE_SPACE"  # GiB, an alternative to kv_cache_memory_bytes
BF16_FLAGS = {"avx512_bf16", "amx_bf16", "bf16"}  # x86 flags; Arm's Features


def cpu_has_native_bf16() -> bool:
    """Whether this CPU has bfloat16 dot-product instructions (x86 AVX-512 BF16 or AMX, Arm BF16)."""
    return bool(BF16_FLAGS & cpu_flags())


class CpuPlatform(Platform):
    name = "cpu"
    device_type = "cpu"
    priority = 0  # any accelerator platform wins auto-detection
    dist_backend = "gloo"
    default_attention_backend = "cpu_paged"
    supported_dtypes = (torch.float32, torch.bfloat16)

    def is_available(self) -> bool:
        return True

    def total_memory_bytes(self) -> int:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")

    def kv_cache_memory_bytes(self, cache_config, model_memory_bytes: int) -> int:
        if cache_config.kv_cache_memory_bytes:
            return cache_config.kv_cache_memory_bytes
        env = os.environ.get(KV_CACHE_ENV)
        if env:
            try:
                return int(float(env) * (1 << 30))
            except ValueError:
                raise ValueError(f"{KV_CACHE_ENV} must be a number of GiB, got {env!r}") from None
        return min(DEFAULT_KV_CACHE_BYTES, self.total_memory_bytes() // 4)

    def zero_kv_cache(self, tensor: torch.Tensor) -> torch.Tensor:
        # A big default cache should not cost its size in memory up front (nor again at
        # wake_up): its pages are dropped rather than written (see zeroed_lazily).
        return zeroed_lazily(tensor)

    def default_dtype(self, config_dtype: torch.dtype | None) -> torch.dtype:
        # float16 matmuls are slow on CPUs; bfloat16 keeps the range of the checkpoint. Weights
        # that name no dtype (a GGUF file's blocks) run in bfloat16 where the CPU computes it
        # natively, as vLLM's auto takes a lower precision for them; a float32 checkpoint stays
        # float32 (the precision the correctness suites compare in).
        if config_dtype == torch.float16:
            return torch.bfloat16
        if config_dtype is None:
            return torch.bfloat16 if cpu_has_native_bf16() else torch.float32
        return config_dtype

    def set_threads(self, num_threads: int | None) -> None:
        if num_threads:
            torch.set_num_threads(num_threads)

    # Decode steps run compiled (runtime_cpu.compile) unless RUNTIME_CPU_COMPILE=0 or --enforce-eager.
    supports_graphs = True
    compiles_graphs = True

    def compile_model(self, model):
        from runtime_cpu.compile import compile_model

        return compile_model(model)


def zeroed_lazily(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` (contiguous, on the host) filled with zeros, committing no memory for its whole pages.

    A large allocation is not always fresh memory: the C allocator hands out freed heap
    memory, whatever it held (NaNs from an earlier tensor made a fresh engine's decode
    produce token 0 over and over). Its whole pages are dropped with ``madvise``
    (private anonymous memory, heap or mapping, then reads as zeros until written) and
    the partial pages at either end are written.
    """
    nbytes = tensor.numel() * tensor.element_size()
    libc = _libc()
    if nbytes < DROP_PAGES_MIN_BYTES or libc is None:
        return tensor.zero_()
    flat = tensor.view(-1).view(torch.uint8)
    address, page = tensor.data_ptr(), mmap.PAGESIZE
    first = -address % page  # bytes before the first whole page
    last = (address + nbytes) // page * page - address  # byte offset where the last partial page starts
    if libc.madvise(ctypes.c_void_p(address + first), ctypes.c_size_t(last - first), MADV_DONTNEED) != 0:
        return tensor.zero_()
    flat[:first].zero_()
    flat[last:].zero_()
    return tensor


@functools.cache
def _libc():
    """The C library, where it has Linux's ``madvise`` semantics; None elsewhere."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
    except OSError:
        return None
