"""compressed-tensors configs the plugin cannot run: refused when the config is read, naming the
setting and what is supported (not a KeyError / IndexError, nor accepted to load wrong weights)."""

from __future__ import annotations

import re

import pytest

from runtime_quant.compressed_tensors import CompressedTensorsMethod

FP8_CHANNEL = {"num_bits": 8, "type": "float", "strategy": "channel", "symmetric": True, "dynamic": False}
FP8_TOKEN = {"num_bits": 8, "type": "float", "strategy": "token", "symmetric": True, "dynamic": True}


def config(weights: dict, activations: dict | None = None, **top) -> dict:
    return {"quant_method": "compressed-tensors", "format": "float-quantized", **top,
            "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights, "input_activations": activations}}}


@pytest.mark.parametrize("block", [None, [128], [0, 128], "128x128", [128.0, 128]], ids=str)
def test_block_weights_without_a_two_integer_block_structure(block):
    """Was a KeyError (missing), an IndexError ([128]), a ZeroDivisionError later ([0, 128]) or a tuple of
    characters ('128x128')."""
    weights = {**FP8_CHANNEL, "strategy": "block"}
    if block is not None:
        weights["block_structure"] = block
    acts = {**FP8_TOKEN, "strategy": "group", "group_size": 128}
    with pytest.raises(ValueError, match=r"config group 'group_0': block weights need block_structure \[rows, columns\] "
                                         r"\(two positive integers\), got " + re.escape(repr(block))):
        CompressedTensorsMethod().get_config(config(weights, acts), None)


def test_block_weights_with_a_block_structure_load():
    weights = {**FP8_CHANNEL, "strategy": "block", "block_structure": [128, 128]}
    acts = {**FP8_TOKEN, "strategy": "group", "group_size": 128}
    scheme = CompressedTensorsMethod().get_config(config(weights, acts), None).groups[0][1]
    assert scheme.block_size == (128, 128)


def test_sparse_weights_are_refused():
    """A 2:4 sparse checkpoint stores its weights compressed (values and bitmasks): refused by its format."""
    sparsity = {"format": "sparse-24-bitmask", "sparsity_structure": "2:4", "targets": ["Linear"], "ignore": ["lm_head"]}
    with pytest.raises(ValueError, match=r"sparsity_config format 'sparse-24-bitmask' \(sparse weights\) is not "
                                         r"supported; supported: dense"):
        CompressedTensorsMethod().get_config(config(FP8_CHANNEL, FP8_TOKEN, sparsity_config=sparsity), None)
    for dense in ({}, None, {"format": "dense", "sparsity_structure": "unstructured"}):  # what ModelCompressor writes
        assert CompressedTensorsMethod().get_config(config(FP8_CHANNEL, FP8_TOKEN, sparsity_config=dense), None)


def test_transformed_weights_are_refused():
    """Weights rotated by a transform (QuIP / SpinQuant) give wrong outputs unless the model applies the
    transform too: refused, not loaded as plain weights."""
    transform = {"config_groups": {"u": {"type": "hadamard", "apply": [
        {"targets": ["Linear"], "location": "weight_input", "inverse": True}]}}}
    with pytest.raises(ValueError, match=r"compressed-tensors transform_config .* is not supported"):
        CompressedTensorsMethod().get_config(config(FP8_CHANNEL, FP8_TOKEN, transform_config=transform), None)
    assert CompressedTensorsMethod().get_config(config(FP8_CHANNEL, FP8_TOKEN, transform_config={}), None)
