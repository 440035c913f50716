"""What cannot be split across workers yet is refused before any worker starts, naming the combination."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from runtime.config import ParallelConfig
from runtime.executor.multiproc import check_parallel_support


def config(tp: int = 1, pp: int = 1, quantization: str | None = None, speculative: dict | None = None):
    return SimpleNamespace(
        parallel_config=ParallelConfig(tensor_parallel_size=tp, executor="multiproc", pipeline_parallel_size=pp),
        model_config=SimpleNamespace(quantization=quantization),
        plugin_options={"speculative_config": speculative} if speculative else {},
    )


def test_quant_methods_that_cannot_split_their_layers_are_refused_at_tensor_parallel():
    """The quant plugin's methods split their layers over ranks (tests/plugins/quant/test_quant_tensor_parallel.py);
    a method that does not say so (``supports_tensor_parallel``: the CPU plugin's int4_weight_only) is
    refused, naming it."""
    from runtime.quantization import supports_tensor_parallel

    for name in ("fp8", "int8", "gptq", "awq", "compressed-tensors", "gguf"):
        assert supports_tensor_parallel(name), name
        check_parallel_support(config(tp=2, quantization=name))
    assert not supports_tensor_parallel("int4_weight_only")
    with pytest.raises(ValueError, match="quantization 'int4_weight_only' with tensor_parallel_size 2 is not supported"):
        check_parallel_support(config(tp=2, quantization="int4_weight_only"))
    check_parallel_support(config(pp=2, quantization="int4_weight_only"))  # whole layers per stage: fine


def test_speculative_decoding_is_refused_with_pipeline_stages():
    ngram = {"method": "ngram", "num_speculative_tokens": 2}
    with pytest.raises(ValueError, match="speculative decoding with pipeline_parallel_size 2 is not supported"):
        check_parallel_support(config(pp=2, speculative=ngram))
    check_parallel_support(config(tp=2, speculative=ngram))
