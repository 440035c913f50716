"""GGUF metadata that transformers' GGUF config reader leaves out changes the model: the loaded model must
be the original one.

Each tiny random model is written as llama.cpp's converter writes it (float32, so the file holds the model
exactly) and loaded back; the reference is the original transformers model, not transformers' reading of
the file (which drops what is checked here: Qwen3's head size, RoPE scaling, Gemma 3's query scale).
"""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch
from support.gguf_files import tiny_config, tiny_model, write_gguf
from support.paged_batch import PagedRunner

from runtime.engine_arg_values import eos_token_ids
from runtime.engine_args import EngineArgs, build_model_config
from runtime.model_loader import load_model, resolve_model
from runtime_cpu.platform import CpuPlatform

PROMPT = list(range(3, 43))  # 40 positions: far enough for RoPE scaling to change the logits
LLAMA3 = {"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0, "low_freq_factor": 1.0,
          "high_freq_factor": 4.0, "original_max_position_embeddings": 64}


def check_original_model(path: str, config) -> None:
    """Our model of ``path`` gives the logits of ``tiny_model(config)``, which was written to it."""
    ours = load_model(resolve_model(path), dtype=torch.float32)
    logits = PagedRunner(ours, num_requests=1, block_size=16, num_blocks=8).step([PROMPT])[0]
    with torch.no_grad():
        expected = tiny_model(config)(torch.tensor([PROMPT])).logits[0]
    torch.testing.assert_close(logits, expected, atol=1e-4, rtol=0)


CASES = [
    ("qwen3 head size from attention.key_length", "qwen3", {"head_dim": 32}),  # not hidden / heads, nor 128
    ("llama3 RoPE from the rope_freqs tensor", "llama", {"rope_parameters": LLAMA3}),
    ("linear RoPE from rope.scaling keys", "llama", {"rope_parameters": {"rope_type": "linear", "rope_theta": 1e4,
                                                                         "factor": 4.0}}),
    # linear scaling on the global layer only, and the query scale 1 / sqrt(head size) (transformers: 256)
    ("gemma3 global-layer RoPE scaling and query scale", "gemma3", {"rope_parameters": {
        "full_attention": {"rope_type": "linear", "rope_theta": 1e6, "factor": 8.0},
        "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}}}),
    ("no head_count_kv key: one KV head per query head", "llama", {"num_key_value_heads": 4}),
]


@pytest.mark.parametrize("name, arch, overrides", CASES, ids=[case[0] for case in CASES])
def test_the_file_loads_as_the_original_model(name, arch, overrides, tmp_path):
    config = tiny_config(arch, **overrides)
    skip = ("head_count_kv",) if "head_count_kv" in name else ()
    check_original_model(write_gguf(tmp_path / "m.gguf", arch, config=config, skip_keys=skip), config)


def test_config_values(tmp_path):
    """The values behind the test above, and the older keys: ``rope.scale_linear``, Gemma 3's
    ``rope.freq_base_swa``, the 27B's query scale (hidden / heads), a vocabulary size without a tokenizer."""
    resolved = resolve_model(write_gguf(tmp_path / "l3.gguf", "llama", config=tiny_config("llama", rope_parameters=LLAMA3)))
    assert resolved.hf_config.rope_parameters == LLAMA3
    old = write_gguf(tmp_path / "old.gguf", "qwen2", skip_keys=("vocab_size",), extra=lambda w: w.add_float32(
        "qwen2.rope.scale_linear", 2.0))
    config = resolve_model(old).hf_config
    assert config.rope_parameters == {"rope_type": "linear", "rope_theta": 10000.0, "factor": 2.0}
    assert config.vocab_size == 512  # from token_embd.weight: no qwen2.vocab_size, no tokenizer.ggml.tokens
    big = tiny_config("gemma3", num_hidden_layers=62, layer_types=None, hidden_size=64, intermediate_size=64, head_dim=32)
    swa = write_gguf(tmp_path / "g.gguf", "gemma3", config=big, extra=lambda w: w.add_rope_freq_base_swa(5000.0))
    config = resolve_model(swa).hf_config
    assert config.rope_parameters["sliding_attention"]["rope_theta"] == 5000.0
    assert config.query_pre_attn_scalar == 64 // 4 and config.head_dim == 32  # 62 layers: hidden / heads


def test_unsupported_rope_settings_are_refused_by_name(tmp_path):
    def yarn(writer):
        writer.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        writer.add_rope_scaling_factor(4.0)
        writer.add_rope_scaling_orig_ctx_len(128)

    resolved = resolve_model(write_gguf(tmp_path / "yarn.gguf", "qwen2", extra=yarn))
    assert resolved.hf_config.rope_parameters["original_max_position_embeddings"] == 128
    with pytest.raises(ValueError, match=r"unsupported rope_type 'yarn'; supported: default, linear, llama3"):
        load_model(resolved, dtype=torch.float32)
    odd = {"rope_freqs.weight": np.linspace(1.0, 3.0, 32, dtype=np.float32)}  # no llama3 scaling gives these
    with pytest.raises(ValueError, match=r"could not read the config of GGUF file .*odd\.gguf.*: GGUF tensor "
                       r"'rope_freqs\.weight' holds RoPE frequency factors \(from 1 to 3\) that no llama3 RoPE scaling"):
        resolve_model(write_gguf(tmp_path / "odd.gguf", "llama", tensors_extra=odd))


def test_per_layer_head_counts_are_a_clear_error(tmp_path):
    path = write_gguf(tmp_path / "kv.gguf", "llama", skip_keys=("head_count_kv",),
                      extra=lambda w: w.add_head_count_kv([2, 2]))
    with pytest.raises(ValueError, match=r"could not read the config of GGUF file .*kv\.gguf.*num_key_value_heads"):
        resolve_model(path)


def test_a_part_of_a_split_model_is_refused(tmp_path):
    write_gguf(tmp_path / "m.gguf", "qwen2", split_max_tensors=10)
    with pytest.raises(ValueError, match=r"m-00001-of-00003\.gguf': it is part 1 of a model split into 3 files; merge "
                       r"them into one first \(llama\.cpp: llama-gguf-split --merge"):
        resolve_model(str(tmp_path / "m-00001-of-00003.gguf"))


def test_max_model_len_comes_from_the_context_length(tmp_path):
    path = write_gguf(tmp_path / "ctx.gguf", "qwen2", context_length=384)
    cpu = CpuPlatform()
    assert build_model_config(EngineArgs(model=path, skip_tokenizer_init=True), cpu).max_model_len == 384
    assert build_model_config(EngineArgs(model=path, max_model_len=128), cpu).max_model_len == 128
    with pytest.raises(ValueError, match=r"max_model_len 1000 is larger than the model's maximum 384 "
                                         r"\(the GGUF file's context_length \(max_position_embeddings\)\)"):
        build_model_config(EngineArgs(model=path, max_model_len=1000), cpu)


def test_the_length_limit_names_its_source_for_a_config_folder(tmp_path):
    from runtime.testing.models import build_tiny_model
    from transformers import AutoConfig

    tiny_llama = build_tiny_model("llama", tmp_path)
    limit = AutoConfig.from_pretrained(tiny_llama).max_position_embeddings
    with pytest.raises(ValueError, match=rf"larger than the model's maximum {limit} \(the config's max_position_embeddings\)"):
        build_model_config(EngineArgs(model=tiny_llama, max_model_len=limit + 1), CpuPlatform())


def test_end_of_generation_tokens(tmp_path):
    """llama.cpp stops at the EOS, EOT and EOM ids and at tokens spelled as an end of turn (Gemma's files
    name ``<eos>`` as EOS, its chat turns end with ``<end_of_turn>``)."""
    tokens = ["<pad>", "<eos>", "<bos>", "<start_of_turn>", "<end_of_turn>", "hello", "<|eom_id|>", "<|eot|>"]

    def vocabulary(writer):
        writer.add_tokenizer_model("llama")
        writer.add_token_list(tokens)
        writer.add_eot_token_id(7)

    config = tiny_config("gemma3", vocab_size=len(tokens) * 64, eos_token_id=1)
    resolved = resolve_model(write_gguf(tmp_path / "eog.gguf", "gemma3", config=config, extra=vocabulary))
    assert eos_token_ids(resolved) == (1, 7, 4, 6)  # the file's EOS first (SmolLM2's: test_gguf_tokenizer.py)
