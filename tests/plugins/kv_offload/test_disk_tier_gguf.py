"""Two GGUF files of one folder (other quantizations, or other weights, of a model) keep their own disk
tier folders: an engine on one never reads the blocks an engine on the other wrote. Before, the folder
named only the checkpoint's directory and its files, which both engines share."""

from __future__ import annotations

import random
import shutil

import numpy as np
import pytest
from offload_conversations import close

from runtime import LLM, SamplingParams

PROMPT = [random.Random(5).randrange(100, 40000) for _ in range(41)]


@pytest.fixture(scope="module")
def two_ggufs(tmp_path_factory):
    """``a.gguf`` (SmolLM2) and ``b.gguf`` (the same with its first attention norm scaled) in one folder."""
    from gguf import GGUFReader

    from runtime.testing.models import smollm2_gguf_path

    folder = tmp_path_factory.mktemp("ggufs")
    shutil.copy(smollm2_gguf_path(), folder / "a.gguf")
    shutil.copy(smollm2_gguf_path(), folder / "b.gguf")
    (norm,) = [t for t in GGUFReader(str(folder / "b.gguf")).tensors if t.name == "blk.0.attn_norm.weight"]
    with open(folder / "b.gguf", "r+b") as f:
        f.seek(norm.data_offset)
        weights = np.frombuffer(f.read(norm.n_bytes), dtype=np.float32)
        f.seek(norm.data_offset)
        f.write((weights * 3.0).astype(np.float32).tobytes())
    return folder


def generate(path, **settings):
    llm = LLM(str(path), skip_tokenizer_init=True, block_size=4, max_model_len=128, **settings)
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    (output,) = llm.generate([{"prompt_token_ids": PROMPT}], params, use_tqdm=False)
    stats = dict(llm.llm_engine.engine_core.scheduler.stats())
    close(llm)
    return list(output.outputs[0].token_ids), stats


def test_an_engine_on_another_gguf_of_the_folder_reads_none_of_its_blocks(two_ggufs, tmp_path):
    tiers = dict(kv_offload="disk", kv_offload_size="64MiB", kv_offload_dir=str(tmp_path))
    expected, _ = generate(two_ggufs / "b.gguf")
    generate(two_ggufs / "a.gguf", **tiers)
    _, stats = generate(two_ggufs / "a.gguf", **tiers)
    assert stats["kv_offload_hits_disk"] == 10  # the same file finds its blocks again
    tokens, stats = generate(two_ggufs / "b.gguf", **tiers)
    assert stats.get("kv_offload_hits_disk", 0) == 0  # 10 before: a.gguf's KV, read as b.gguf's
    assert tokens == expected
