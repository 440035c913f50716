"""Resolving local model paths, refusing what cannot be loaded, and dummy weights."""

from __future__ import annotations

import json
import os

import pytest
import torch
from runtime.testing.models import build_tiny_model, smollm2_tokenizer

from runtime.model_loader import get_tokenizer, load_model, resolve_model


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory) -> str:
    return build_tiny_model("llama", tmp_path_factory.mktemp("llama"))


def copy_config(src: str, dst, **changes) -> str:
    with open(os.path.join(src, "config.json")) as f:
        config = json.load(f)
    config.update(changes)
    os.makedirs(dst, exist_ok=True)
    with open(os.path.join(dst, "config.json"), "w") as f:
        json.dump(config, f)
    return str(dst)


def test_missing_path_names_it_and_what_is_supported(tmp_path):
    missing = str(tmp_path / "no-such-model")
    with pytest.raises(ValueError, match="no-such-model.*does not exist.*local Hugging Face folders.*gguf"):
        resolve_model(missing)


def test_hub_id_is_not_downloaded():
    with pytest.raises(ValueError, match="HuggingFaceTB/SmolLM2-135M.*does not exist"):
        resolve_model("HuggingFaceTB/SmolLM2-135M")


def test_folder_without_config_or_gguf(tmp_path):
    with pytest.raises(ValueError, match="no config.json and no .gguf"):
        resolve_model(str(tmp_path))


def test_unknown_architecture_lists_supported(tiny_llama, tmp_path):
    folder = copy_config(tiny_llama, tmp_path / "foo", architectures=["FooForCausalLM"])
    with pytest.raises(ValueError, match="FooForCausalLM.*supported:.*Gemma3ForCausalLM.*LlamaForCausalLM"):
        resolve_model(folder)


def test_resolves_hf_folder(tiny_llama):
    resolved = resolve_model(tiny_llama)
    assert resolved.architecture == "LlamaForCausalLM"
    assert resolved.gguf_file is None
    assert resolved.path == tiny_llama and resolved.tokenizer_path == tiny_llama
    assert resolved.hf_config.hidden_size == 64
    assert resolved.generation_config is not None


def test_pickle_checkpoint_is_refused(tiny_llama, tmp_path):
    folder = copy_config(tiny_llama, tmp_path / "pickled")
    (tmp_path / "pickled" / "pytorch_model.bin").write_bytes(b"not loaded")
    resolved = resolve_model(folder)
    with pytest.raises(ValueError, match="pytorch_model.bin.*refused.*arbitrary code.*safetensors"):
        load_model(resolved)


def test_load_format_must_match_checkpoint(tiny_llama):
    resolved = resolve_model(tiny_llama)
    with pytest.raises(ValueError, match="load_format 'gguf' does not match"):
        load_model(resolved, load_format="gguf")
    with pytest.raises(ValueError, match="unknown load_format 'pt'.*auto, safetensors, gguf, dummy"):
        load_model(resolved, load_format="pt")


def test_missing_tensor_is_reported(tiny_llama, tmp_path):
    from safetensors.torch import load_file, save_file

    folder = copy_config(tiny_llama, tmp_path / "partial")
    tensors = load_file(os.path.join(tiny_llama, "model.safetensors"))
    del tensors["model.layers.1.self_attn.k_proj.weight"]
    save_file(tensors, os.path.join(folder, "model.safetensors"))
    with pytest.raises(ValueError, match="lacks weights.*model.layers.1.self_attn.qkv_proj.weight"):
        load_model(resolve_model(folder))


def test_safetensors_weights_equal_checkpoint(tiny_llama):
    from safetensors.torch import load_file

    model = load_model(resolve_model(tiny_llama), dtype=torch.float32)
    tensors = load_file(os.path.join(tiny_llama, "model.safetensors"))
    attn = model.model.layers[1].self_attn
    q, k, v = attn.qkv_proj.weight.split(attn.split_sizes)
    torch.testing.assert_close(k, tensors["model.layers.1.self_attn.k_proj.weight"], atol=0, rtol=0)
    torch.testing.assert_close(model.lm_head.weight, tensors["lm_head.weight"], atol=0, rtol=0)
    assert not model.training and not any(p.requires_grad for p in model.parameters())


def test_dummy_weights_need_only_config(tiny_llama, tmp_path):
    folder = copy_config(tiny_llama, tmp_path / "config-only")
    resolved = resolve_model(folder)
    first = load_model(resolved, load_format="dummy", dtype=torch.bfloat16, seed=7)
    again = load_model(resolved, load_format="dummy", dtype=torch.bfloat16, seed=7)
    other = load_model(resolved, load_format="dummy", dtype=torch.bfloat16, seed=8)
    assert all(p.dtype == torch.bfloat16 for p in first.parameters())
    name = "model.layers.0.mlp.down_proj.weight"
    weights = dict(first.named_parameters())[name]
    assert 0.01 < weights.float().std() < 0.03
    assert torch.equal(weights, dict(again.named_parameters())[name])
    assert not torch.equal(weights, dict(other.named_parameters())[name])
    assert torch.equal(first.model.norm.weight, torch.ones_like(first.model.norm.weight))


def test_tokenizer_from_folder_matches_smollm2(tiny_llama):
    tokenizer = get_tokenizer(resolve_model(tiny_llama))
    text = "The capital of France is Paris."
    assert tokenizer(text).input_ids == smollm2_tokenizer()(text).input_ids


def test_separate_tokenizer_path_must_exist(tiny_llama, tmp_path):
    with pytest.raises(ValueError, match="tokenizer path .*nope.*does not exist"):
        resolve_model(tiny_llama, tokenizer=str(tmp_path / "nope"))
