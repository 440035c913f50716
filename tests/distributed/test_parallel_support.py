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


def test_quantized_linears_are_not_split_across_tensor_parallel_ranks():
    with pytest.raises(ValueError, match="quantization 'fp8' with tensor_parallel_size 2 is not supported"):
        check_parallel_support(config(tp=2, quantization="fp8"))
    check_parallel_support(config(pp=2, quantization="fp8"))  # whole layers per stage: fine


def test_speculative_decoding_is_refused_with_pipeline_stages():
    ngram = {"method": "ngram", "num_speculative_tokens": 2}
    with pytest.raises(ValueError, match="speculative decoding with pipeline_parallel_size 2 is not supported"):
        check_parallel_support(config(pp=2, speculative=ngram))
    check_parallel_support(config(tp=2, speculative=ngram))
