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


@pytest.fixture(scope="module")
def llama_path(tmp_path_factory):
    """4 attention heads, 2 KV heads, an MLP of 128, 2 decoder layers."""
    from runtime.testing.models import build_untokenized_model

    return build_untokenized_model("llama", tmp_path_factory.mktemp("support_llama"))


@pytest.mark.parametrize(("settings", "message"), [
    (dict(tensor_parallel_size=3), r"tensor_parallel_size 3 does not split the model's 4 attention heads \(2 KV heads\)"
                                   r" and an MLP of 128 evenly; valid: 1, 2, 4$"),
    (dict(tensor_parallel_size=8), r"tensor_parallel_size 8 does not split .*; valid: 1, 2, 4$"),
    (dict(pipeline_parallel_size=3), r"pipeline_parallel_size 3 is more than the model's 2 decoder layers .*; valid: 1 to 2$"),
    (dict(tensor_parallel_size=2, executor="uni"), r"executor 'uni' runs one worker, but tensor_parallel_size 2 x "
                                                   r"pipeline_parallel_size 1 needs 2; choose one of: .*\bmultiproc\b"),
], ids=["tp3", "tp8", "pp3", "uni-tp2"])
def test_a_layout_the_model_cannot_take_is_refused_before_any_worker_starts(llama_path, settings, message):
    """A size that does not split the heads, more stages than layers, or a one-worker executor for
    several workers: a ValueError naming the value and the valid ones, not a worker's traceback."""
    import multiprocessing

    from runtime import LLM

    with pytest.raises(ValueError, match=message):
        LLM(llama_path, dtype="float32", skip_tokenizer_init=True, **settings)
    assert not multiprocessing.active_children()


def test_valid_tensor_parallel_sizes_follow_the_heads_and_the_mlp():
    from runtime.distributed.layout import valid_tensor_parallel_sizes

    def shape(heads, kv_heads, intermediate=None):
        return SimpleNamespace(num_attention_heads=heads, num_key_value_heads=kv_heads, intermediate_size=intermediate)

    assert valid_tensor_parallel_sizes(shape(8, 2, 64)) == [1, 2, 4, 8]  # 4 and 8 replicate each KV head
    assert valid_tensor_parallel_sizes(shape(12, 4, 96)) == [1, 2, 4, 12]  # 3 splits no KV head, 6 replicates none evenly
    assert valid_tensor_parallel_sizes(shape(8, 8, 12)) == [1, 2, 4]  # 8 does not split the MLP
    assert valid_tensor_parallel_sizes(SimpleNamespace()) is None  # not a shape it knows: not checked
