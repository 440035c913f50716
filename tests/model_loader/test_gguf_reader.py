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
