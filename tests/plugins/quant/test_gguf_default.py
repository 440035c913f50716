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


def test_auto_dtype_takes_bfloat16_for_gguf_files_where_the_cpu_computes_it(monkeypatch):
    """``--dtype auto`` (the README's ``runtime serve``): the default model names no dtype, so it runs in
    bfloat16 on a CPU with bfloat16 instructions, packed where the panel kernel reads it, and in
    float32 elsewhere; a checkpoint's own dtype is kept (float16 becomes bfloat16 on CPUs)."""
    from runtime_cpu import platform as cpu_platform

    path, cpu = smollm2_gguf_path(), CpuPlatform()
    auto = EngineArgs(model=path, max_model_len=256)
    monkeypatch.setattr(cpu_platform, "cpu_has_native_bf16", lambda: True)
    config = build_model_config(auto, cpu)
    assert config.dtype == torch.bfloat16
    assert config.quantization == ("gguf" if cpu_has_avx512_bf16() else None)
    monkeypatch.setattr(cpu_platform, "cpu_has_native_bf16", lambda: False)
    config = build_model_config(auto, cpu)
    assert (config.dtype, config.quantization) == (torch.float32, None)
    assert [cpu.default_dtype(d) for d in (torch.float32, torch.float16, torch.bfloat16)] == [
        torch.float32, torch.bfloat16, torch.bfloat16]


def test_bfloat16_instructions_are_read_from_cpuinfo(monkeypatch, tmp_path):
    from runtime import platforms
    from runtime_cpu import platform as cpu_platform

    for flags, expected in (("flags\t\t: fpu sse2 avx2 avx512f", False), ("flags\t\t: fpu avx512f avx512_bf16", True),
                            ("flags\t\t: fpu amx_bf16 amx_tile", True), ("Features\t: fp asimd bf16 i8mm", True),
                            ("Features\t: fp asimd", False)):
        info = tmp_path / "cpuinfo"
        info.write_text(f"processor\t: 0\n{flags}\n")
        monkeypatch.setattr(platforms, "CPUINFO", str(info))
        assert cpu_platform.cpu_has_native_bf16() is expected, flags
    monkeypatch.setattr(platforms, "CPUINFO", str(tmp_path / "missing"))
    assert cpu_platform.cpu_has_native_bf16() is False
