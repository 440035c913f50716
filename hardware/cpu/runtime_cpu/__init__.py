"""runtime-plugin-cpu: the CPU platform and its paged attention backend."""

from __future__ import annotations

import pluggy

hookimpl = pluggy.HookimplMarker("runtime")


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
