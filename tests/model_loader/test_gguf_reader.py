"""A GGUF file is parsed once per process: config, tokenizer and weights share one reader."""

from __future__ import annotations

import gguf
import gguf.gguf_reader
import pytest
from runtime.testing.models import smollm2_gguf_path

from runtime.model_loader import get_tokenizer, resolve_model
from runtime.model_loader import gguf_reader as shared
from runtime.model_loader import resolve, tokenizer
from runtime.model_loader.gguf_weights import gguf_weights


@pytest.fixture
def opened(monkeypatch) -> list[str]:
    """Paths the real GGUFReader class opens, with every per-process cache emptied first."""
    paths: list[str] = []
    real = gguf.gguf_reader.GGUFReader

    class Counting(real):
        def __init__(self, path, *args, **kwargs):
            paths.append(str(path))
            super().__init__(path, *args, **kwargs)

    monkeypatch.setattr(gguf.gguf_reader, "GGUFReader", Counting)
    monkeypatch.setattr(gguf, "GGUFReader", Counting)
    for cache in (shared.gguf_reader, resolve._cached_gguf_config, tokenizer._gguf_tokenizer):
        cache.cache_clear()
    yield paths
    for cache in (shared.gguf_reader, resolve._cached_gguf_config, tokenizer._gguf_tokenizer):
        cache.cache_clear()


def test_config_tokenizer_and_weights_parse_the_file_once(opened):
    path = smollm2_gguf_path()
    resolved = resolve_model(path)
    assert get_tokenizer(resolved).encode("Hello world")
    name, tensor = next(gguf_weights(path, resolved.hf_config))
    assert name and tensor.numel() > 0
    assert opened == [path]
    assert gguf.GGUFReader is gguf.gguf_reader.GGUFReader  # transformers sees the class again


def test_a_changed_file_is_parsed_again(opened, tmp_path):
    import os
    import shutil

    copy = tmp_path / "model.gguf"
    shutil.copyfile(smollm2_gguf_path(), copy)
    first = shared.gguf_reader(copy)
    assert shared.gguf_reader(copy) is first
    stat = os.stat(copy)
    os.utime(copy, ns=(stat.st_atime_ns, stat.st_mtime_ns + 10**9))  # modified: the cached reader is stale
    assert shared.gguf_reader(copy) is not first
    assert opened == [str(copy), str(copy)]


def full_transformers_config(path: str):
    """transformers' config of a GGUF file from every field, the vocabulary's included."""
    import os

    from transformers import AutoConfig

    with shared.shared_gguf_readers():
        config = AutoConfig.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path))
    return config.get_text_config() if hasattr(config, "get_text_config") else config


def test_the_config_is_read_without_converting_the_vocabulary(opened, monkeypatch):
    import transformers.modeling_gguf_pytorch_utils as gguf_utils

    from runtime.model_loader.gguf_config import apply_gguf_metadata

    path = smollm2_gguf_path()
    expected = full_transformers_config(path)
    real, calls = gguf_utils._gguf_parse_value, []
    monkeypatch.setattr(gguf_utils, "_gguf_parse_value", lambda *args: calls.append(1) or real(*args))
    config = resolve._cached_gguf_config(path)
    assert len(calls) < 1000  # the 49,152 tokens, their types and 48,900 merges were converted one by one
    assert config.vocab_size == expected.vocab_size == 49152
    assert config.to_dict() == apply_gguf_metadata(expected, path).to_dict()  # the same config in every other key


def test_a_file_without_vocab_size_takes_its_vocabularys_length(tmp_path):
    from support.gguf_files import spm_vocabulary, write_gguf

    path = write_gguf(tmp_path / "m.gguf", "llama", skip_keys=("vocab_size",), extra=spm_vocabulary)
    tokens = len(shared.gguf_reader(path).fields["tokenizer.ggml.tokens"].data)
    assert tokens != 512  # not the tiny config's own size: the length is what counts
    assert resolve._cached_gguf_config(path).vocab_size == full_transformers_config(path).vocab_size == tokens
