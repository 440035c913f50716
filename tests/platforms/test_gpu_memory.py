"""The KV cache budget every GPU platform shares (runtime.platforms.gpu_memory)."""

from __future__ import annotations

import pytest

from runtime.platforms.gpu_memory import GIB, MemorySnapshot, activation_headroom, kv_cache_budget

ENV = "RUNTIME_TEST_ACTIVATION_HEADROOM_GIB"


def snapshot(total_gib=80, free_gib=78, reserved_gib=1.5, peak_gib=1.2) -> MemorySnapshot:
    return MemorySnapshot(int(total_gib * GIB), int(free_gib * GIB), int(reserved_gib * GIB), int(peak_gib * GIB))


def test_budget_takes_utilization_minus_model_context_and_activations():
    # 80 GiB card, 0.5 GiB outside torch (80 - 78 - 1.5), model 1.2 GiB, 2 GiB headroom.
    budget = kv_cache_budget(snapshot(), 0.9, model_bytes=int(1.2 * GIB), headroom=2 * GIB)
    assert budget == int(80 * GIB * 0.9) - int(0.5 * GIB) - int(1.2 * GIB) - 2 * GIB


def test_measured_peak_beyond_headroom_is_reserved():
    budget = kv_cache_budget(snapshot(peak_gib=6.2), 0.9, model_bytes=int(1.2 * GIB), headroom=2 * GIB)
    assert budget == int(80 * GIB * 0.9) - int(0.5 * GIB) - int(1.2 * GIB) - 5 * GIB


def test_no_memory_left_is_an_error_with_numbers():
    with pytest.raises(ValueError, match=r"gpu_memory_utilization 0.1 of 80.00 GiB allows 8.00 GiB.*model takes 7.00 GiB"):
        kv_cache_budget(snapshot(), 0.1, model_bytes=7 * GIB, headroom=2 * GIB)
    with pytest.raises(ValueError, match=f"lower {ENV}, or set kv_cache_memory_bytes"):
        kv_cache_budget(snapshot(), 0.1, model_bytes=7 * GIB, headroom=2 * GIB, headroom_env=ENV)


def test_headroom_default_env_and_bad_env(monkeypatch):
    monkeypatch.delenv(ENV, raising=False)
    assert activation_headroom(80 * GIB, ENV) == 2 * GIB
    assert activation_headroom(8 * GIB, ENV) == int(0.8 * GIB)  # small cards: 10%
    monkeypatch.setenv(ENV, "0.5")
    assert activation_headroom(80 * GIB, ENV) == GIB // 2
    monkeypatch.setenv(ENV, "lots")
    with pytest.raises(ValueError, match=f"{ENV} must be a number of GiB, got 'lots'"):
        activation_headroom(80 * GIB, ENV)
