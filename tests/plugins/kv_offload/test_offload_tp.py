"""KV offload with tensor parallelism (two worker processes, gloo on the CPU): each rank keeps
its shard of the KV heads in its own cpu pool and disk files, the one scheduler half decides
for both, and every step waits for both ranks. Greedy tokens equal one worker's without
offload and transformers'; the tier counters equal one rank's with the same settings."""

from __future__ import annotations

import random

from offload_conversations import NUM_NEW_TOKENS, close, make_llm, random_tokens, run_turns
from test_disk_tier_engine import block_hashes, corrupt, generate, generate_with_stats

from runtime.testing.reference import check_outputs_equal, reference_outputs

CPU_SWAP = dict(kv_offload="cpu", kv_offload_size="1MiB", preemption_mode="swap")
# The tier counters that depend on what was scheduled only (not on bytes or time).
SCHEDULING_COUNTERS = ("kv_offload_hits_cpu", "kv_offload_hit_tokens", "kv_offload_blocks_stored",
                       "kv_offload_blocks_loaded", "num_preemptions", "prefix_cache_hits")


def tokens_of(turns):
    return [output for turn in turns for _, output, _ in turn]


def test_tp2_cpu_tier_and_swap_equal_one_worker_and_transformers(model_path, baseline):
    base_turns, _, reference = baseline
    one = make_llm(model_path, **CPU_SWAP)
    one_turns, one_stats = run_turns(one)
    close(one)

    llm = make_llm(model_path, tensor_parallel_size=2, **CPU_SWAP)
    executor = llm.llm_engine.engine_core.executor
    assert type(executor).__name__ == "MultiprocExecutor" and executor.step_ranks == [0, 1]
    turns, stats = run_turns(llm)
    close(llm)
    check_outputs_equal(tokens_of(base_turns), tokens_of(turns), "tp=2 cpu tier + swap vs tp=1 without offload")
    check_outputs_equal(reference, tokens_of(turns), "tp=2 cpu tier + swap vs transformers")
    check_outputs_equal(tokens_of(one_turns), tokens_of(turns), "tp=2 vs tp=1, both with the cpu tier + swap")
    assert stats[-1]["num_preemptions"] > 0 and stats[-1]["kv_offload_hits_cpu"] > 0
    assert stats[-1]["kv_offload_load_seconds"] > 0
    # The one scheduler half decides as for one rank: the same blocks stored, loaded and hit.
    for key in SCHEDULING_COUNTERS:
        assert [s.get(key, 0) for s in stats] == [s.get(key, 0) for s in one_stats], key
    # Both ranks' shards move: twice the bytes of one rank's half of the heads = one rank's whole block.
    assert stats[-1]["kv_offload_bytes_stored"] == one_stats[-1]["kv_offload_bytes_stored"]


def test_tp2_disk_tier_per_rank_files_restart_and_a_rank_with_a_corrupted_file(model_path, tmp_path):
    rng = random.Random(11)
    system = random_tokens(rng, 64)  # 16 blocks
    tiers = dict(kv_offload="cpu,disk", kv_offload_size="1MiB,4MiB", kv_offload_dir=str(tmp_path), tensor_parallel_size=2,
                 async_scheduling=True)  # a promotion's step is still in flight when the next one is scheduled
    prompts = [system + random_tokens(rng, 5), system + random_tokens(rng, 7)]
    reference = [tokens for tokens, _ in reference_outputs(model_path, prompts, NUM_NEW_TOKENS)]
    first = make_llm(model_path, **tiers)
    check_outputs_equal(reference[:1], generate(first, prompts[:1]), "tp=2 first engine")
    close(first)

    folders = sorted(p for p in tmp_path.iterdir() if p.is_dir())
    assert [p.name.rsplit("-", 2)[1:] for p in folders] == [["tp2", "rank0"], ["tp2", "rank1"]]
    files = [{p.name: p for p in folder.rglob("*.kvb")} for folder in folders]
    hashes = [h.hex() + ".kvb" for h in block_hashes(system)]
    assert all(name in rank_files for rank_files in files for name in hashes), "a rank lacks the shared prompt"
    assert files[0][hashes[0]].stat().st_size == files[1][hashes[0]].stat().st_size  # one KV head each

    corrupt(files[1][hashes[9]])  # rank 1's shard of block 9; rank 0's copy is fine
    outputs, stats = generate_with_stats(model_path, prompts[1:], **tiers)
    check_outputs_equal(reference[1:], outputs, "tp=2 after a restart, one rank's block file corrupted")
    assert stats["kv_offload_checksum_failures"] == 1
    assert stats["kv_offload_hits_disk"] == 9 and stats["kv_offload_hit_tokens"] == 36  # blocks 0-8; 9 on is recomputed
