"""KV offload on the ``ray`` executor (runtime-plugin-ray, a local Ray cluster of 2 CPUs, one
per worker actor): with TP=2 and with PP=2 every actor keeps its part of each block in its own
tiers and reports every step, as the multiproc executor's processes do: greedy tokens equal one
worker's without offload and transformers', the tier counters equal one worker's; the disk
tier's files are found again by a new engine on the same directory."""

from __future__ import annotations

import random

import pytest
from distributed.test_ray import ray_cluster  # noqa: F401 - the module's fixture
from offload_conversations import NUM_NEW_TOKENS, close, make_llm, random_tokens, run_turns
from test_disk_tier_engine import block_hashes, generate, generate_with_stats
from test_offload_pp import check_offload_like_one_worker, one_worker  # noqa: F401 - one_worker: a fixture
from test_offload_tp import CPU_SWAP

from runtime.testing.reference import check_outputs_equal, reference_outputs

LAYOUTS = {"tp2": dict(tensor_parallel_size=2), "pp2": dict(pipeline_parallel_size=2)}


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_ray_cpu_tier_and_swap_equal_one_worker_and_transformers(ray_cluster, model_path, baseline, one_worker, layout):  # noqa: F811
    llm = make_llm(model_path, executor="ray", **LAYOUTS[layout], **CPU_SWAP)
    executor = llm.llm_engine.engine_core.executor
    assert type(executor).__name__ == "RayExecutor" and executor.step_ranks == [0, 1]
    turns, stats = run_turns(llm)
    close(llm)
    check_offload_like_one_worker(f"ray {layout}", turns, stats, one_worker, baseline)


def test_ray_pp2_disk_tier_found_again_by_a_new_engine(ray_cluster, model_path, tmp_path):  # noqa: F811
    rng = random.Random(13)
    system = random_tokens(rng, 64)  # 16 blocks
    tiers = dict(kv_offload="cpu,disk", kv_offload_size="1MiB,4MiB", kv_offload_dir=str(tmp_path), executor="ray",
                 pipeline_parallel_size=2)
    prompts = [system + random_tokens(rng, 5), system + random_tokens(rng, 7)]
    reference = [tokens for tokens, _ in reference_outputs(model_path, prompts, NUM_NEW_TOKENS)]
    first = make_llm(model_path, **tiers)
    check_outputs_equal(reference[:1], generate(first, prompts[:1]), "ray pp=2 first engine")
    close(first)
    folders = sorted(p.name.split("-", 1)[1] for p in tmp_path.iterdir() if p.is_dir())
    assert folders == ["pp2-stage0", "pp2-stage1"]
    assert all(len(list(folder.rglob("*.kvb"))) >= len(block_hashes(system)) for folder in tmp_path.iterdir())

    outputs, stats = generate_with_stats(model_path, prompts[1:], **tiers)
    check_outputs_equal(reference[1:], outputs, "ray pp=2 after a restart")
    assert stats["kv_offload_hits_disk"] == 16 and stats["kv_offload_hit_tokens"] == 64  # the whole shared prompt
