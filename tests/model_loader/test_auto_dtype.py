"""``--dtype auto``: the checkpoint's dtype from its config, else from its safetensors weights' headers
(as vLLM reads them), else the platform's choice for weights that name none; then the platform's
adjustments (the CPU runs float16 as bfloat16)."""

from __future__ import annotations

import json
import os

import pytest
import torch
from safetensors.torch import save_file

from runtime.bench.step_overhead import tiny_config_folder
from runtime.engine_args import EngineArgs, build_model_config
from runtime_cpu import platform as cpu_platform
from runtime_cpu.platform import CpuPlatform


def _config_dtype(folder: str, dtype: str | None) -> None:
    path = os.path.join(folder, "config.json")
    with open(path) as f:
        config = json.load(f)
    config.pop("dtype", None)
    config.pop("torch_dtype", None)
    if dtype is not None:
        config["dtype"] = dtype
    with open(path, "w") as f:
        json.dump(config, f)


def _auto(folder: str, **kwargs) -> torch.dtype:
    return build_model_config(EngineArgs(model=folder, max_model_len=64, **kwargs), CpuPlatform()).dtype


@pytest.mark.parametrize("native_bf16", [True, False], ids=["bf16-cpu", "plain-cpu"])
def test_auto_follows_config_then_weights_then_the_platform(monkeypatch, native_bf16):
    monkeypatch.setattr(cpu_platform, "cpu_has_native_bf16", lambda: native_bf16)
    folder = tiny_config_folder(hidden=64, layers=1, vocab=128)
    _config_dtype(folder, None)
    # No weights and no dtype in the config: the platform's choice.
    assert _auto(folder, load_format="dummy") == (torch.bfloat16 if native_bf16 else torch.float32)
    # The weights' headers name it: most of the floating tensors (integer ones do not count).
    save_file({"a": torch.zeros(2, dtype=torch.float32), "b": torch.zeros(2, dtype=torch.float32),
               "c": torch.zeros(2, dtype=torch.bfloat16), "d": torch.zeros(2, dtype=torch.int32),
               "e": torch.zeros(2, dtype=torch.int32)}, os.path.join(folder, "model.safetensors"))
    assert _auto(folder, load_format="dummy") == torch.float32
    save_file({"a": torch.zeros(2, dtype=torch.bfloat16)}, os.path.join(folder, "model.safetensors"))
    assert _auto(folder, load_format="dummy") == torch.bfloat16
    # The config's dtype wins over the weights'; float16 runs as bfloat16 on a CPU.
    for named, expected in (("float32", torch.float32), ("bfloat16", torch.bfloat16), ("float16", torch.bfloat16)):
        _config_dtype(folder, named)
        assert _auto(folder, load_format="dummy") == expected, named
    # An explicit --dtype is taken as given.
    assert _auto(folder, load_format="dummy", dtype="float32") == torch.float32
