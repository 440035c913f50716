"""On a GPU: the device pool on the GPU, the cpu tier in pinned memory, copies on a side
CUDA stream; tokens stay those of transformers (float32) with the tiers and with swap."""

from __future__ import annotations

import pytest
import torch
from offload_conversations import close, make_llm, run_turns

from runtime.testing.reference import check_outputs_equal

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("extra", [dict(enforce_eager=True), dict(async_scheduling=True)], ids=["eager", "async_graphs"])
def test_multi_turn_cpu_tier_on_the_gpu(model_path, baseline, extra):
    if not torch.cuda.is_available():
        pytest.fail("the gpu marker needs a CUDA GPU")
    _, _, reference = baseline
    llm = make_llm(model_path, platform="cuda", kv_offload="cpu", kv_offload_size="1MiB", **extra)
    runner = llm.llm_engine.engine_core.executor.worker.model_runner
    connector = runner.kv_connector
    assert runner.kv_caches[0].is_cuda and connector.stream is not None and connector.cpu.pool.is_pinned()
    turns, stats = run_turns(llm)
    close(llm)
    check_outputs_equal(reference, [output for turn in turns for _, output, _ in turn], "cuda + cpu tier vs transformers")
    assert stats[-1]["kv_offload_hits_cpu"] > 0 and stats[-1]["kv_offload_blocks_loaded"] > 0


def test_swap_preemption_and_disk_tier_on_the_gpu(model_path, baseline, tmp_path):
    _, _, reference = baseline
    tiers = dict(kv_offload="cpu,disk", kv_offload_size="256KiB,4MiB", kv_offload_dir=str(tmp_path), preemption_mode="swap")
    for run in range(2):  # the second engine starts on the first one's disk tier
        llm = make_llm(model_path, platform="cuda", async_scheduling=True, **tiers)
        turns, stats = run_turns(llm)
        close(llm)
        check_outputs_equal(reference, [output for turn in turns for _, output, _ in turn], f"cuda run {run} vs transformers")
    assert stats[-1]["kv_offload_hits_disk"] > 0


def test_a_drafters_kv_comes_back_from_the_cpu_tier_on_the_gpu(model_path, baseline):
    """The target as its own draft model, in CUDA graphs: conversation turns reload their history from the cpu tier,
    the drafter's layers with the target's, so every greedy draft is kept."""
    _, _, reference = baseline
    spec = {"method": "draft_model", "model": model_path, "num_speculative_tokens": 3}
    llm = make_llm(model_path, platform="cuda", kv_offload="cpu", kv_offload_size="1MiB", speculative_config=spec)
    turns, stats = run_turns(llm)
    close(llm)
    check_outputs_equal(reference, [output for turn in turns for _, output, _ in turn], "cuda + draft model vs transformers")
    last = stats[-1]
    assert last["kv_offload_blocks_loaded"] > 0, last
    assert 0 < last["spec_decode_num_accepted_tokens"] == last["spec_decode_num_draft_tokens"], last
