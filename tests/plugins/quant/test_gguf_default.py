"""GGUF files load packed without ``--quantization`` where the packed path is the faster one: a
bfloat16 model on a CPU with AVX-512 BF16 whose linear weights are all Q4_0 / Q4_1 / Q4_K
(benchmarks/RESULTS.md, issue 18); elsewhere they are dequantized at load, as before."""

from __future__ import annotations

import torch

from runtime.engine_args import EngineArgs, build_model_config
from runtime.quantization import GGUF_DEQUANTIZE_ENV
from runtime.testing.models import smollm2_gguf_path
from runtime_cpu.platform import CpuPlatform
from runtime_quant.gguf import GgufMethod, packed_linear_types
from runtime_quant.gguf_cpu_panels import cpu_has_avx512_bf16


class FakeGpu:
    device_type = "cuda"


def test_the_default_model_is_read_packed_on_avx512_bf16_cpus():
    method, cpu, path = GgufMethod(), CpuPlatform(), smollm2_gguf_path()
    assert packed_linear_types(path) == {"Q4_1"}
    why = method.packs_gguf_by_default(path, torch.bfloat16, cpu, 1, 1)
    assert (why is not None) == cpu_has_avx512_bf16()
    if why is not None:
        assert "Q4_1" in why and "AVX-512 BF16" in why
    for dtype, platform, tp, pp in ((torch.float32, cpu, 1, 1), (torch.float16, cpu, 1, 1),
                                    (torch.bfloat16, FakeGpu(), 1, 1), (torch.bfloat16, cpu, 2, 1),
                                    (torch.bfloat16, cpu, 1, 2)):
        assert method.packs_gguf_by_default(path, dtype, platform, tp, pp) is None, (dtype, platform, tp, pp)


def test_a_file_with_other_types_stays_dequantized(tmp_path):
    """Q4_K_M files mix Q5_0 / Q8_0 / Q6_K layers in, which the panel kernel does not read."""
    import gguf
    import numpy as np

    path = str(tmp_path / "mixed.gguf")
    writer = gguf.GGUFWriter(path, "llama")
    weights = np.random.default_rng(0).standard_normal((64, 64), dtype=np.float32)
    for name, kind in (("blk.0.attn_q.weight", gguf.GGMLQuantizationType.Q4_1),
                       ("blk.0.ffn_down.weight", gguf.GGMLQuantizationType.Q8_0)):
        writer.add_tensor(name, gguf.quants.quantize(weights, kind), raw_dtype=kind)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    assert packed_linear_types(path) == {"Q4_1", "Q8_0"}
    assert GgufMethod().packs_gguf_by_default(path, torch.bfloat16, CpuPlatform(), 1, 1) is None


def test_engine_config_follows_it_and_the_env_opts_out(monkeypatch):
    path, cpu = smollm2_gguf_path(), CpuPlatform()
    config = build_model_config(EngineArgs(model=path, dtype="bfloat16", max_model_len=256), cpu)
    assert config.quantization == ("gguf" if cpu_has_avx512_bf16() else None)
    assert build_model_config(EngineArgs(model=path, dtype="float32", max_model_len=256), cpu).quantization is None
    dummy = EngineArgs(model=path, dtype="bfloat16", max_model_len=256, load_format="dummy")  # random weights, no blocks
    assert build_model_config(dummy, cpu).quantization is None
    monkeypatch.setenv(GGUF_DEQUANTIZE_ENV, "1")
    assert build_model_config(EngineArgs(model=path, dtype="bfloat16", max_model_len=256), cpu).quantization is None
