"""``--quantization gguf`` on bad input: errors name the tensor, the expected layout and what runs.

A tiny llama is built with the gguf method's layers and fed loader-style tensors (``qweight_type``
then ``qweight`` per projection): a ggml type the method does not run, blocks of the wrong shape,
blocks that arrive before their type. A type the method does not keep packed but gguf-py can read
reaches the layer dequantized (the loader's job, logged by name) and runs as a dense part.
"""

from __future__ import annotations

import logging

import numpy as np
import pytest
import torch

from runtime.model_loader import resolve_model
from runtime.model_loader.loader import build_empty_model
from runtime.testing.models import build_untokenized_model
from runtime_quant.gguf import GgufConfig, GgufMethod
from runtime_quant.gguf_blocks import BY_NAME


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    resolved = resolve_model(build_untokenized_model("llama", tmp_path_factory.mktemp("gguf-bad")))
    return build_empty_model(resolved, torch.float32, torch.device("cpu"), GgufConfig())


def q_proj(model):
    layer = model.get_submodule("model.layers.0.self_attn.qkv_proj")
    return layer, layer.in_features, layer.quant_output_sizes[0]


def test_unsupported_ggml_type_names_the_tensor(tiny_model):
    with pytest.raises(ValueError, match=r"'model\.layers\.0\.self_attn\.q_proj\.qweight_type' has ggml type Q2_K, which "
                       r"--quantization gguf does not run; supported: Q4_0, Q4_1, Q5_0, Q8_0, Q4_K, Q5_K, Q6_K"):
        tiny_model.load_weights([("model.layers.0.self_attn.q_proj.qweight_type", torch.tensor(10))])


def test_mismatched_blocks_name_the_tensor_and_the_expected_layout(tiny_model):
    layer, size, rows = q_proj(tiny_model)
    q8 = BY_NAME["Q8_0"]
    wrong = torch.zeros(rows + 1, q8.row_bytes(size), dtype=torch.uint8)
    with pytest.raises(ValueError, match=rf"'model\.layers\.0\.self_attn\.q_proj\.qweight' has shape \[{rows + 1}, "
                       rf"{q8.row_bytes(size)}\] and dtype uint8, expected Q8_0 uint8 \[{rows}, {q8.row_bytes(size)}\]"):
        tiny_model.load_weights([("model.layers.0.self_attn.q_proj.qweight_type", torch.tensor(q8.ggml)),
                                 ("model.layers.0.self_attn.q_proj.qweight", wrong)])
    with pytest.raises(ValueError, match=r"'model\.layers\.0\.self_attn\.k_proj\.qweight' arrived before its qweight_type"):
        tiny_model.load_weights([("model.layers.0.self_attn.k_proj.qweight", wrong)])
    with pytest.raises(ValueError, match=r"'model\.layers\.0\.self_attn\.q_proj\.weight' is not part of a GGUF layer"):
        tiny_model.load_weights([("model.layers.0.self_attn.q_proj.weight", torch.zeros(rows, size))])


def test_not_a_gguf_checkpoint():
    class Config:
        gguf_file = None
        model = "some/folder"

    with pytest.raises(ValueError, match=r"'some/folder' is not a GGUF checkpoint"):
        GgufMethod().get_config(None, Config())
    with pytest.raises(ValueError, match=r"this checkpoint is quantized with 'gptq'"):
        GgufMethod().get_config({"quant_method": "gptq"}, Config())


def test_other_types_arrive_dequantized_with_a_log_line(tmp_path, caplog):
    """A Q5_1 projection (not kept packed) in a GGUF file: the loader dequantizes and names it."""
    from gguf import GGMLQuantizationType, GGUFWriter, quantize

    from runtime.model_loader.gguf_weights import gguf_weights

    class Config:
        num_hidden_layers = 1

        def to_dict(self):
            return {}

    weights = np.random.default_rng(0).standard_normal((64, 64)).astype(np.float32)
    writer = GGUFWriter(str(tmp_path / "t.gguf"), "llama")
    writer.add_tensor("blk.0.attn_q.weight", quantize(weights, GGMLQuantizationType.Q5_1), raw_dtype=GGMLQuantizationType.Q5_1)
    writer.add_tensor("blk.0.attn_k.weight", quantize(weights, GGMLQuantizationType.Q8_0), raw_dtype=GGMLQuantizationType.Q8_0)
    for write in (writer.write_header_to_file, writer.write_kv_data_to_file, writer.write_tensors_to_file):
        write()
    writer.close()
    names = {"blk.0.attn_q.weight": "q.weight", "blk.0.attn_k.weight": "k.weight"}
    import runtime.model_loader.gguf_weights as module

    original = module.gguf_to_hf_names
    module.gguf_to_hf_names = lambda arch, config, processor: names
    try:
        with caplog.at_level(logging.WARNING):
            out = dict(gguf_weights(str(tmp_path / "t.gguf"), Config(), packed={"q.weight", "k.weight"},
                                    packed_types=GgufConfig().gguf_packed_types))
    finally:
        module.gguf_to_hf_names = original
    assert "q.weight: ggml type Q5_1 is not kept packed; dequantized at load" in caplog.text
    assert int(out["q.qweight_type"]) == 0 and out["q.qweight"].dtype == torch.float32 and out["q.qweight"].shape == (64, 64)
    assert int(out["k.qweight_type"]) == BY_NAME["Q8_0"].ggml and out["k.qweight"].dtype == torch.uint8
    assert out["k.qweight"].shape == (64, BY_NAME["Q8_0"].row_bytes(64))
    assert "k.weight" not in caplog.text


def test_dummy_weights_have_no_blocks():
    """``--load-format dummy`` makes random weights, not blocks: a clear error for ``--quantization gguf``
    (the file's own default, dequantize-at-load, runs on dummy weights)."""
    from runtime import LLM
    from runtime.testing.models import smollm2_gguf_path

    with pytest.raises(ValueError, match=r"qkv_proj: --quantization gguf keeps a GGUF file's blocks, but a linear layer "
                       r"received none \(--load-format dummy"):
        LLM(smollm2_gguf_path(), quantization="gguf", load_format="dummy", enforce_eager=True, max_model_len=128)
