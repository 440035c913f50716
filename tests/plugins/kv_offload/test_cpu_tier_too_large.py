"""A cpu tier larger than the host can allocate stops the engine with an error that names
--kv-offload-size (torch's allocator error named no flag)."""

from __future__ import annotations

import pytest

from runtime_kv_offload.cpu_tier import CpuTier

TOO_LARGE = "100000TiB"  # no host has it, whatever its overcommit setting


def test_a_pool_the_host_cannot_allocate_names_the_flag():
    tier = CpuTier(100_000 << 40)
    with pytest.raises(ValueError, match=r"--kv-offload-size for the cpu tier: its pool of \d+ blocks .* cannot be "
                                         r"allocated on this host; give a smaller size"):
        tier.bind(4096)


def test_engine_start_up_with_a_cpu_tier_too_large(model_path):
    from runtime import LLM

    with pytest.raises(ValueError, match=r"--kv-offload-size for the cpu tier: .* cannot be allocated on this host"):
        LLM(model_path, skip_tokenizer_init=True, dtype="float32", block_size=4, kv_offload="cpu",
            kv_offload_size=TOO_LARGE)
