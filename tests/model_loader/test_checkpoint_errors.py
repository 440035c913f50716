"""A checkpoint that does not fit the model is a ValueError naming the tensor (or file) at fault;
sharded safetensors folders load through their index."""

from __future__ import annotations

import json
import os
import shutil

import pytest
import torch
from runtime.testing.models import build_untokenized_model
from safetensors.torch import load_file, save_file

from runtime.model_loader import load_model, resolve_model


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> dict[str, str]:
    return {arch: build_untokenized_model(arch, tmp_path_factory.mktemp(arch)) for arch in ("llama", "qwen2")}


def edited_copy(src: str, dst, edit) -> str:
    """A copy of the checkpoint folder ``src`` with ``edit(tensors)`` applied to its weights."""
    shutil.copytree(src, dst)
    file = os.path.join(dst, "model.safetensors")
    tensors = load_file(file)
    edit(tensors)
    save_file(tensors, file, metadata={"format": "pt"})
    return str(dst)


def load(path: str):
    return load_model(resolve_model(path), dtype=torch.float32)


@pytest.mark.parametrize("arch, name, shape, expected", [
    ("llama", "model.layers.0.self_attn.q_proj.weight", (32, 64), (64, 64)),
    ("llama", "model.layers.1.self_attn.k_proj.weight", (64, 64), (32, 64)),
    ("llama", "model.layers.0.mlp.gate_proj.weight", (128, 32), (128, 64)),
    ("qwen2", "model.layers.0.self_attn.v_proj.bias", (64,), (32,)),
])
def test_fused_projection_of_the_wrong_shape_names_the_tensor(tiny, tmp_path, arch, name, shape, expected):
    def edit(tensors):
        tensors[name] = torch.zeros(shape)

    path = edited_copy(tiny[arch], tmp_path / "bad", edit)
    with pytest.raises(ValueError, match=rf"checkpoint tensor '{name}' has shape \({', '.join(map(str, shape))},?\), "
                       rf"expected \({', '.join(map(str, expected))},?\)"):
        load(path)


@pytest.mark.parametrize("name, shape", [
    ("model.layers.2.self_attn.q_proj.weight", (64, 64)),  # a layer the config does not have
    ("model.layers.0.self_attn.q_proj.bias", (64,)),  # a bias the layer does not have
    ("model.layers.0.mlp.up_proj.weight_scale", (1,)),  # a quantized layout's tensor in a plain model
])
def test_extra_tensor_of_a_fused_projection_names_it(tiny, tmp_path, name, shape):
    def edit(tensors):
        tensors[name] = torch.ones(shape)

    path = edited_copy(tiny["llama"], tmp_path / "extra", edit)
    with pytest.raises(ValueError, match=rf"checkpoint tensor '{name}' matches no parameter of LlamaForCausalLM"):
        load(path)


@pytest.fixture(scope="module")
def sharded(tmp_path_factory) -> tuple[str, dict[str, torch.Tensor]]:
    from transformers import AutoModelForCausalLM

    src = build_untokenized_model("llama", tmp_path_factory.mktemp("whole"))
    model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32)
    path = str(tmp_path_factory.mktemp("sharded"))
    model.save_pretrained(path, max_shard_size="100KB")
    return path, model.state_dict()


def test_sharded_checkpoint_loads_through_its_index(sharded):
    path, state = sharded
    with open(os.path.join(path, "model.safetensors.index.json")) as f:
        assert len(set(json.load(f)["weight_map"].values())) > 2
    ours = load(path)
    assert torch.equal(ours.model.embed_tokens.weight, state["model.embed_tokens.weight"])
    assert torch.equal(ours.lm_head.weight, state["lm_head.weight"])
    q, k, v = (state[f"model.layers.1.self_attn.{p}_proj.weight"] for p in "qkv")
    assert torch.equal(ours.model.layers[1].self_attn.qkv_proj.weight, torch.cat([q, k, v]))


def test_index_naming_a_missing_file_is_an_error_naming_both(sharded, tmp_path):
    path = str(tmp_path / "copy")
    shutil.copytree(sharded[0], path)
    os.remove(os.path.join(path, "model-00002-of-00006.safetensors"))
    with pytest.raises(ValueError, match=r"model.safetensors.index.json' names weight files that .* lacks: "
                       r"model-00002-of-00006.safetensors"):
        load(path)


@pytest.mark.parametrize("content", ["{", '{"metadata": {}}', '{"weight_map": ["a"]}'])
def test_broken_index_is_an_error_naming_it(sharded, tmp_path, content):
    path = str(tmp_path / "copy")
    shutil.copytree(sharded[0], path)
    with open(os.path.join(path, "model.safetensors.index.json"), "w") as f:
        f.write(content)
    with pytest.raises(ValueError, match=r"model.safetensors.index.json' is not a safetensors index"):
        load(path)


def test_gguf_cut_short_in_its_header_is_an_error_naming_it(tmp_path):
    from gguf import GGUFWriter

    whole = str(tmp_path / "whole.gguf")
    writer = GGUFWriter(whole, "llama")
    writer.add_name("tiny")
    writer.add_context_length(512)
    writer.add_block_count(1)
    for write in (writer.write_header_to_file, writer.write_kv_data_to_file, writer.write_tensors_to_file):
        write()
    writer.close()
    with open(whole, "rb") as f:
        data = f.read()
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(data[:40])  # the counts, then part of the first key
    with pytest.raises(ValueError, match=r"could not read the config of GGUF file '.*cut.gguf'"):
        resolve_model(str(cut))


def test_missing_projection_of_a_fused_layer_is_named(tiny, tmp_path):
    def edit(tensors):
        del tensors["model.layers.1.self_attn.v_proj.weight"], tensors["model.layers.0.mlp.up_proj.weight"]

    path = edited_copy(tiny["llama"], tmp_path / "missing", edit)
    with pytest.raises(ValueError, match=r"lacks weights for LlamaForCausalLM: "
                       r"model.layers.0.mlp.gate_up_proj.weight \(no model.layers.0.mlp.up_proj.weight\), "
                       r"model.layers.1.self_attn.qkv_proj.weight \(no model.layers.1.self_attn.v_proj.weight\)"):
        load(path)
