"""runtime-plugin-cpu: the CPU platform, its paged attention backend and weight-only int8 and int4 (``int8_weight_only``, ``int4_weight_only``)."""

from __future__ import annotations

from runtime import hookimpl


@hookimpl
def register_platforms(register):
    from runtime_cpu.platform import CpuPlatform

    register(CpuPlatform())


@hookimpl
def register_attention_backends(register):
    def factory():
        from runtime_cpu.attention import CPUPagedAttentionBackend

        return CPUPagedAttentionBackend()

    register("cpu_paged", factory, platforms=["cpu"])


@hookimpl
def register_quant_methods(register):
    def int8_weight_only():
        from runtime_cpu.weight_only import Int8WeightOnlyMethod

        return Int8WeightOnlyMethod()

    def int4_weight_only():
        from runtime_cpu.weight_only import Int4WeightOnlyMethod

        return Int4WeightOnlyMethod()

    register("int8_weight_only", int8_weight_only)
    register("int4_weight_only", int4_weight_only)
