"""The disk tier through the engine: a restarted engine finds the long shared prompt on
disk; a corrupted block file fails its checksum and is recomputed (never wrong tokens);
a full disk tier evicts instead of failing."""

from __future__ import annotations

import random

from offload_conversations import NUM_NEW_TOKENS, close, make_llm, random_tokens, run_turns

from runtime import SamplingParams
from runtime.scheduler.block_hash import hash_block
from runtime.testing.reference import check_outputs_equal, reference_outputs

BLOCK = 4


def generate(llm, prompts):
    params = SamplingParams(temperature=0.0, max_tokens=NUM_NEW_TOKENS, ignore_eos=True)
    return [list(o.outputs[0].token_ids) for o in llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)]


def corrupt(path) -> None:
    """Flip bits in the middle of a block file (its payload)."""
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x55
    path.write_bytes(bytes(data))


def generate_with_stats(model_path, prompts, **settings):
    """A new engine's tokens for ``prompts`` and its scheduler stats; the engine is stopped."""
    llm = make_llm(model_path, **settings)
    outputs = generate(llm, prompts)
    stats = llm.llm_engine.engine_core.scheduler.stats()
    close(llm)
    return outputs, stats


def block_hashes(tokens: list[int]) -> list[bytes]:
    hashes: list[bytes] = []
    for start in range(0, len(tokens) - BLOCK + 1, BLOCK):
        hashes.append(hash_block(hashes[-1] if hashes else None, tokens[start : start + BLOCK]))
    return hashes


def test_restart_hits_the_shared_prompt_on_disk_and_recomputes_a_corrupted_block(model_path, tmp_path):
    rng = random.Random(7)
    system = random_tokens(rng, 64)  # 16 blocks
    tiers = dict(kv_offload="cpu,disk", kv_offload_size="1MiB,4MiB", kv_offload_dir=str(tmp_path))
    first = make_llm(model_path, **tiers)
    generate(first, [system + random_tokens(rng, 5)])
    close(first)  # the engine stops: its last blocks are written
    files = {p.name.removesuffix(".kvb"): p for p in tmp_path.rglob("*.kvb")}
    hashes = block_hashes(system)
    assert all(h.hex() in files for h in hashes), "the shared prompt's blocks are not all on disk"

    prompts = [system + random_tokens(rng, 7), system[:40] + random_tokens(rng, 9)]
    reference = [tokens for tokens, _ in reference_outputs(model_path, prompts, NUM_NEW_TOKENS)]
    outputs, stats = generate_with_stats(model_path, prompts[:1], **tiers)
    check_outputs_equal(reference[:1], outputs, "after a restart")
    assert stats["kv_offload_hits_disk"] == 16 and stats["kv_offload_hit_tokens"] == 64

    corrupt(files[hashes[5].hex()])
    outputs, stats = generate_with_stats(model_path, prompts[1:], **tiers)
    check_outputs_equal(reference[1:], outputs, "with a corrupted block file")
    assert stats["kv_offload_checksum_failures"] == 1
    assert stats["kv_offload_hits_disk"] == 5  # the blocks before the corrupted one; the rest is recomputed


def test_full_disk_tier_evicts_and_tokens_stay_right(model_path, baseline, tmp_path):
    base_turns, _, reference = baseline
    cap = 24 * (20 + 2048)  # 24 block files of the tiny llama (header + 2 layers x 2 x 4 x 2 x 16 float32)
    llm = make_llm(model_path, kv_offload="disk", kv_offload_size=f"{cap}B", kv_offload_dir=str(tmp_path))
    turns, stats = run_turns(llm)
    close(llm)
    tokens = [output for turn in turns for _, output, _ in turn]
    check_outputs_equal(reference, tokens, "full disk tier vs transformers")
    files = list(tmp_path.rglob("*.kvb"))
    assert stats[-1]["kv_offload_blocks_stored"] > len(files)  # older blocks were evicted
    assert sum(f.stat().st_size for f in files) <= cap
    assert stats[-1].get("kv_offload_hits_disk", 0) > 0


def test_a_backend_block_order_keeps_its_own_disk_folder(model_path, tmp_path, monkeypatch):
    """A backend that orders a block's bytes its own way (``kv_block_layout``, as the triton backend does for an
    8-bit cache's values) saves to a folder of its own: a restart in the other order finds no block to misread."""
    from runtime_cpu.attention import CPUPagedAttentionBackend

    rng = random.Random(3)
    prompt = random_tokens(rng, 24)
    tiers = dict(kv_offload="cpu,disk", kv_offload_size="1MiB,4MiB", kv_offload_dir=str(tmp_path))
    _, stats = generate_with_stats(model_path, [prompt], **tiers)
    usual = {p.name for p in tmp_path.iterdir()}
    assert len(usual) == 1

    monkeypatch.setattr(CPUPagedAttentionBackend, "kv_block_layout", lambda self, dtype: "test-order", raising=False)
    reference = [tokens for tokens, _ in reference_outputs(model_path, [prompt], NUM_NEW_TOKENS)]
    outputs, stats = generate_with_stats(model_path, [prompt], **tiers)
    check_outputs_equal(reference, outputs, "in the other block order")
    assert stats.get("kv_offload_hits_disk", 0) == 0  # the usual order's blocks are not read
    folders = {p.name for p in tmp_path.iterdir()}
    (new,) = folders - usual
    assert list((tmp_path / new).rglob("*.kvb"))


def test_a_checkpoint_replaced_in_place_does_not_read_the_old_ones_blocks(tmp_path):
    """The disk folder names the checkpoint's files, not only its path: new weights written over the
    old ones (a retrained model, the same folder) recompute every block. Before, the old model's KV
    was loaded from disk and the new model's greedy tokens were wrong."""
    from runtime.testing.models import build_untokenized_model

    model = str(tmp_path / "model")
    prompt = random_tokens(random.Random(11), 40)
    tiers = dict(kv_offload="cpu,disk", kv_offload_size="1MiB,4MiB", kv_offload_dir=str(tmp_path / "kv"))
    build_untokenized_model("llama", model, seed=0)
    generate_with_stats(model, [prompt], **tiers)
    _, stats = generate_with_stats(model, [prompt], **tiers)
    assert stats["kv_offload_hits_disk"] == 9  # the same checkpoint finds its blocks again

    build_untokenized_model("llama", model, seed=1)
    reference = [tokens for tokens, _ in reference_outputs(model, [prompt], NUM_NEW_TOKENS)]
    outputs, stats = generate_with_stats(model, [prompt], **tiers)
    check_outputs_equal(reference, outputs, "new weights in the same folder")
    assert stats.get("kv_offload_hits_disk", 0) == 0
