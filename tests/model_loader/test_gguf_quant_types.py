"""Every ggml type the GGUF loader reads, in four architectures, gives transformers' model of the same file.

One tiny random file per architecture (llama with an untied head, qwen2 with q/k/v biases and a tied
head, qwen3 with q/k norms and a head size that is not hidden / heads, gemma3 with sliding layers), its
linear weights in the readable types taken in turn: each projection of a fused qkv / gate_up layer in a
different type, all 25 types over the four files. Both our paths (dequantized at load, and
``--quantization gguf``'s packed blocks) must give transformers' prompt logits and greedy tokens.

The reference is transformers' model class filled by transformers' own GGUF tensor reader
(``load_gguf_checkpoint``: gguf-py's ``dequantize`` plus its Llama q/k un-permute and Gemma norm fix-up),
built from our config: transformers' GGUF config reader drops the head size of Qwen3 and the query
scale of Gemma 3 (checked against the original models in test_gguf_metadata.py).
"""

from __future__ import annotations

import copy

import pytest
import torch
from support.gguf_files import tiny_config, write_gguf
from support.paged_batch import PagedRunner

from runtime.model_loader import load_model, resolve_model
from runtime.model_loader.gguf_weights import readable_types
from runtime_quant.gguf import GgufConfig

# Every type gguf-py dequantizes but F32 (the norms and biases are F32 in every file).
READABLE = [t for t in readable_types() if t != "F32"]
PROMPT = [1, 17, 300, 42, 99, 7, 250, 3, 180, 64]
NUM_STEPS = 4
# arch -> (first type of READABLE its linear weights start from, type of the token embedding / untied head, tied head)
FILES = {"llama": (0, "Q6_K", False), "qwen2": (14, "Q8_0", True), "qwen3": (5, "F16", False), "gemma3": (3, "Q4_K", True)}
# Two sliding layers (llama.cpp's Gemma 3 pattern: the sixth is global); test_gguf_metadata.py runs a global one.
LAYERS = {"gemma3": {"num_hidden_layers": 2, "layer_types": ["sliding_attention"] * 2}}


def reference_model(resolved) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    model = AutoModelForCausalLM.from_config(copy.deepcopy(resolved.hf_config), dtype=torch.float32).eval()
    tensors = load_gguf_checkpoint(resolved.gguf_file, return_tensors=True, model_to_load=model)["tensors"]
    missing, unexpected = model.load_state_dict(tensors, strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}, (missing, unexpected)
    return model


def greedy(model) -> tuple[list[int], torch.Tensor]:
    """Greedy tokens over the paged KV cache, and the logits of the prompt and each decode step."""
    runner = PagedRunner(model, num_requests=1, block_size=16, num_blocks=8)
    logits = [runner.step([PROMPT])[0]]
    tokens = [int(logits[-1][-1].argmax())]
    for _ in range(NUM_STEPS):
        logits.append(runner.step([tokens[-1:]])[0])
        tokens.append(int(logits[-1][-1].argmax()))
    return tokens, torch.cat(logits)


@pytest.mark.parametrize("arch", list(FILES))
def test_every_readable_type_matches_transformers(arch, tmp_path):
    start, embed_type, tied = FILES[arch]
    types = READABLE[start:] + READABLE[:start]
    config = tiny_config(arch, tie_word_embeddings=tied, **LAYERS.get(arch, {}))
    resolved = resolve_model(write_gguf(tmp_path / f"{arch}.gguf", arch, types, embed_type, config=config))
    assert resolved.hf_config.tie_word_embeddings == tied  # no output.weight in the file
    reference = reference_model(resolved)
    for quant_config in (None, GgufConfig()):
        tokens, logits = greedy(load_model(resolved, dtype=torch.float32, quant_config=quant_config))
        # transformers over the whole sequence at once: the same logits at every position, so the same picks
        with torch.no_grad():
            expected = reference(torch.tensor([PROMPT + tokens[:-1]])).logits[0]
        torch.testing.assert_close(logits, expected, atol=1e-4, rtol=0)
        assert tokens == expected[len(PROMPT) - 1 :].argmax(-1).tolist(), quant_config


def test_all_readable_types_are_covered():
    """The four files together hold every readable type, and the packed path's seven among them."""
    covered = set()
    for arch, (start, embed_type, _) in FILES.items():
        covered |= {READABLE[(start + i) % len(READABLE)] for i in range(7 * 2)} | {embed_type}  # 7 linears a layer
    assert covered == set(READABLE)
    assert {"Q4_0", "Q4_1", "Q5_0", "Q8_0", "Q4_K", "Q5_K", "Q6_K", "Q2_K", "IQ4_XS", "BF16"} <= set(READABLE)


@pytest.mark.parametrize("quant_config", [None, GgufConfig()], ids=["dequantized", "packed"])
def test_a_type_nothing_reads_names_the_tensor_and_the_supported_ones(quant_config, tmp_path, monkeypatch):
    """Q8_K (llama.cpp's activation type) has no dequantizer in gguf-py: refused before any weight is read."""
    import numpy as np
    import support.gguf_files as files
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    def zero_blocks(data, type_name, rng):
        if type_name == "F32":
            return data, None
        block, nbytes = GGML_QUANT_SIZES[GGMLQuantizationType[type_name]]
        return np.zeros((data.shape[0], data.shape[1] // block * nbytes), np.uint8), GGMLQuantizationType[type_name]

    monkeypatch.setattr(files, "_encode", zero_blocks)
    path = write_gguf(tmp_path / "q8k.gguf", "llama", ["Q8_0", "Q8_K"])
    with pytest.raises(ValueError, match=r"GGUF tensor 'blk\.0\.attn_k\.weight' \(model\.layers\.0\.self_attn\.k_proj\.weight\) "
                       r"has ggml type Q8_K, which cannot be dequantized; supported types: F32, F16, BF16, .*Q4_0, .*Q6_K"):
        load_model(resolve_model(path), dtype=torch.float32, quant_config=quant_config)
