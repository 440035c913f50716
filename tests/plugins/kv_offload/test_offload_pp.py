"""KV offload with pipeline parallelism (worker processes, gloo on the CPU): each stage keeps
its own layers' blocks in its own cpu pool and disk files, the one scheduler half decides for
every rank, and every step waits for every rank's copies. Greedy tokens equal one worker's
without offload and transformers'; the tier counters equal one worker's with the same
settings; a new engine on the same directory loads each stage's files."""

from __future__ import annotations

import random

import pytest
from offload_conversations import NUM_NEW_TOKENS, close, make_llm, random_tokens, run_turns
from test_disk_tier_engine import block_hashes, corrupt, generate, generate_with_stats
from test_offload_tp import CPU_SWAP, SCHEDULING_COUNTERS, tokens_of

from runtime.testing.reference import check_outputs_equal, reference_outputs

LAYOUTS = {"pp2": dict(pipeline_parallel_size=2), "tp2xpp2": dict(tensor_parallel_size=2, pipeline_parallel_size=2)}


@pytest.fixture(scope="module")
def one_worker(model_path):
    """One worker's conversations with the cpu tier and swap preemption: (turns, stats after each turn)."""
    llm = make_llm(model_path, **CPU_SWAP)
    turns, stats = run_turns(llm)
    close(llm)
    return turns, stats


def check_offload_like_one_worker(label, turns, stats, one_worker, baseline) -> None:
    """``turns``/``stats`` of a many-worker engine with ``CPU_SWAP``: the tokens of one worker
    without offload, with it, and transformers'; the same blocks hit, stored and loaded as
    one worker's; swap preemption and the cpu tier used; fewer prefill tokens computed."""
    base_turns, _, reference = baseline
    one_turns, one_stats = one_worker
    check_outputs_equal(tokens_of(base_turns), tokens_of(turns), f"{label} cpu tier + swap vs one worker, recompute, no offload")
    check_outputs_equal(reference, tokens_of(turns), f"{label} cpu tier + swap vs transformers")
    check_outputs_equal(tokens_of(one_turns), tokens_of(turns), f"{label} vs one worker, both with the cpu tier + swap")
    assert stats[-1]["num_preemptions"] > 0 and stats[-1]["kv_offload_hits_cpu"] > stats[0].get("kv_offload_hits_cpu", 0)
    assert stats[-1]["kv_offload_load_seconds"] > 0
    for key in SCHEDULING_COUNTERS:  # the one scheduler half decides as for one worker
        assert [s.get(key, 0) for s in stats] == [s.get(key, 0) for s in one_stats], key
    # Every rank's part moves: the bytes of one worker's whole blocks.
    assert stats[-1]["kv_offload_bytes_stored"] == one_stats[-1]["kv_offload_bytes_stored"]
    cached = sum(c for turn in turns[1:] for _, _, c in turn)
    base_cached = sum(c for turn in base_turns[1:] for _, _, c in turn)
    assert cached > base_cached, (cached, base_cached)  # later turns compute fewer prefill tokens


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_pipeline_stages_cpu_tier_and_swap_equal_one_worker_and_transformers(model_path, baseline, one_worker, layout):
    llm = make_llm(model_path, **LAYOUTS[layout], **CPU_SWAP)
    executor = llm.llm_engine.engine_core.executor
    world_size = executor.world_size
    assert type(executor).__name__ == "MultiprocExecutor" and executor.step_ranks == list(range(world_size))
    turns, stats = run_turns(llm)
    close(llm)
    check_offload_like_one_worker(layout, turns, stats, one_worker, baseline)


# Each rank's folder ends with its shard of the heads (with TP) and its stage.
FOLDER_SUFFIXES = {"pp2": ["pp2-stage0", "pp2-stage1"],
                   "tp2xpp2": ["tp2-rank0-pp2-stage0", "tp2-rank0-pp2-stage1", "tp2-rank1-pp2-stage0", "tp2-rank1-pp2-stage1"]}


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_disk_tier_per_stage_files_restart_and_a_stage_with_a_corrupted_file(model_path, tmp_path, layout):
    rng = random.Random(12)
    system = random_tokens(rng, 64)  # 16 blocks
    tiers = dict(kv_offload="cpu,disk", kv_offload_size="1MiB,4MiB", kv_offload_dir=str(tmp_path), **LAYOUTS[layout],
                 async_scheduling=True)  # a promotion's step is still in flight when the next one is scheduled
    prompts = [system + random_tokens(rng, 5), system + random_tokens(rng, 7)]
    reference = [tokens for tokens, _ in reference_outputs(model_path, prompts, NUM_NEW_TOKENS)]
    first = make_llm(model_path, **tiers)
    check_outputs_equal(reference[:1], generate(first, prompts[:1]), f"{layout} first engine")
    close(first)

    folders = sorted(p for p in tmp_path.iterdir() if p.is_dir())
    suffixes = FOLDER_SUFFIXES[layout]
    assert [p.name.split("-", 1)[1] for p in folders] == suffixes
    files = [{p.name: p for p in folder.rglob("*.kvb")} for folder in folders]
    hashes = [h.hex() + ".kvb" for h in block_hashes(system)]
    assert all(name in rank_files for rank_files in files for name in hashes), "a rank lacks the shared prompt"
    # One layer each: blocks of the same size, but each stage's own layer's keys and values.
    first_stage, last_stage = files[0], files[1]  # (tensor-parallel rank 0 of) each stage
    assert first_stage[hashes[0]].stat().st_size == last_stage[hashes[0]].stat().st_size
    assert first_stage[hashes[0]].read_bytes() != last_stage[hashes[0]].read_bytes()

    corrupt(last_stage[hashes[9]])  # the last stage's part of block 9; the other ranks' parts are fine
    outputs, stats = generate_with_stats(model_path, prompts[1:], **tiers)
    check_outputs_equal(reference[1:], outputs, f"{layout} after a restart, one stage's block file corrupted")
    assert stats["kv_offload_checksum_failures"] == 1
    assert stats["kv_offload_hits_disk"] == 9 and stats["kv_offload_hit_tokens"] == 36  # blocks 0-8; 9 on is recomputed
