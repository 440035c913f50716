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


def test_quant_methods_that_cannot_split_their_layers_are_refused_at_tensor_parallel(monkeypatch):
    """Every installed method splits its layers over ranks (tests/plugins/quant/test_quant_tensor_parallel.py,
    tests/cpu_fast/test_weight_only.py); one that does not say so (``supports_tensor_parallel``, a
    third party's) is refused, naming it."""
    import runtime.executor.multiproc as multiproc
    from runtime.plugins import get_registry
    from runtime.quantization import supports_tensor_parallel

    names = set(get_registry("quant_method").names())
    assert {"fp8", "int8", "gptq", "awq", "compressed-tensors", "gguf", "int4_weight_only", "int8_weight_only"} <= names
    for name in sorted(names):
        assert supports_tensor_parallel(name), name
        check_parallel_support(config(tp=2, quantization=name))
    monkeypatch.setattr(multiproc, "supports_tensor_parallel", lambda name: name != "gguf")
    with pytest.raises(ValueError, match="quantization 'gguf' with tensor_parallel_size 2 is not supported"):
        check_parallel_support(config(tp=2, quantization="gguf"))
    check_parallel_support(config(pp=2, quantization="gguf"))  # whole layers per stage: fine


def test_speculative_decoding_is_refused_with_pipeline_stages():
    ngram = {"method": "ngram", "num_speculative_tokens": 2}
    with pytest.raises(ValueError, match="speculative decoding with pipeline_parallel_size 2 is not supported"):
        check_parallel_support(config(pp=2, speculative=ngram))
    check_parallel_support(config(tp=2, speculative=ngram))
