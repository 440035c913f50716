"""The CPU platform's KV cache starts as zeros whatever memory the C allocator hands it, and a large
one commits no memory up front. Attention reads whole blocks and masks the unused slots: a NaN left
there by an earlier tensor turned a fresh engine's decode into token 0 over and over (seen in CI)."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest
import torch

from runtime_cpu.platform import CpuPlatform

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc options and /proc")

REUSED_HEAP = textwrap.dedent(
    """
    import ctypes, torch
    libc = ctypes.CDLL("libc.so.6")
    assert libc.mallopt(-4, 0) == 1  # M_MMAP_MAX: no fresh mappings, every block from the heap
    import runtime_cpu.platform as cpu
    shape = (2, 1024, 16, 8, 64)  # 128 MiB of float32
    # The C allocator hands out freed memory as it is: here it held NaNs.
    cpu.torch.empty = lambda shape, dtype=None, device=None: torch.full(shape, float("nan"), dtype=dtype)
    cache = cpu.CpuPlatform().allocate_kv_cache(shape, torch.float32, torch.device("cpu"))
    print(int(torch.count_nonzero(cache)), cache.shape == shape)
    """
)


def test_a_cache_on_reused_heap_memory_is_all_zeros():
    result = subprocess.run([sys.executable, "-c", REUSED_HEAP], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["0", "True"]


def resident_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096


@pytest.mark.parametrize("shape", [(2, 4096, 16, 8, 64), (2, 333, 7, 3, 5)], ids=["256MiB", "odd-sized"])
def test_a_cache_is_zeros_and_a_large_one_commits_no_memory(shape):
    before = resident_bytes()
    cache = CpuPlatform().allocate_kv_cache(shape, torch.float32, torch.device("cpu"))
    grown = resident_bytes() - before
    assert cache.shape == shape and cache.dtype == torch.float32 and cache.is_contiguous()
    assert int(torch.count_nonzero(cache)) == 0
    if cache.numel() * 4 >= 256 << 20:
        assert grown < 16 << 20  # reading zero pages maps the shared zero page, not new memory
    cache[0, 5] = 1.0  # an ordinary writable tensor
    assert int(torch.count_nonzero(cache)) == shape[2] * shape[3] * shape[4]  # one block's keys


def test_zeroing_a_cache_again_drops_its_pages():
    cache = torch.full((64, 1 << 20), float("nan"))  # 256 MiB, every page written
    before = resident_bytes()
    assert CpuPlatform().zero_kv_cache(cache) is cache
    assert int(torch.count_nonzero(cache)) == 0
    assert before - resident_bytes() > 200 << 20  # handed back, not written over with zeros
