"""Components that ship with the core, registered through the same hooks as plugins."""

from __future__ import annotations

import importlib

from runtime.hookspecs import hookimpl

# Hugging Face architecture name -> "module:Class" (imported when chosen).
BUILTIN_MODELS = {
    "LlamaForCausalLM": "runtime.models.llama:LlamaForCausalLM",
    "MistralForCausalLM": "runtime.models.llama:LlamaForCausalLM",
    "Qwen2ForCausalLM": "runtime.models.qwen2:Qwen2ForCausalLM",
    "Qwen3ForCausalLM": "runtime.models.qwen3:Qwen3ForCausalLM",
    "Gemma3ForCausalLM": "runtime.models.gemma3:Gemma3ForCausalLM",
}


def lazy(target: str):
    """A factory that imports ``module:attr`` when called."""

    def factory():
        module, _, attr = target.partition(":")
        return getattr(importlib.import_module(module), attr)

    factory.target = target
    return factory


@hookimpl
def register_models(register):
    for arch, target in BUILTIN_MODELS.items():
        register(arch, lazy(target))


def lazy_factory(target: str):
    """A factory that imports ``module:attr`` when called and calls it with the factory's arguments."""

    def factory(*args, **kwargs):
        return lazy(target)()(*args, **kwargs)

    factory.target = target
    return factory


@hookimpl
def register_executors(register):
    register("uniproc", lazy_factory("runtime.executor.uniproc:UniProcExecutor"))
    register("multiproc", lazy_factory("runtime.executor.multiproc:MultiprocExecutor"))
    # vLLM's names for the same two (--distributed-executor-backend uni / mp)
    register("uni", lazy_factory("runtime.executor.uniproc:UniProcExecutor"))
    register("mp", lazy_factory("runtime.executor.multiproc:MultiprocExecutor"))


@hookimpl
def register_attention_backends(register):
    def sdpa():
        from runtime.attention.sdpa import SdpaAttentionBackend

        return SdpaAttentionBackend()

    # The reference paged attention in plain torch: no platforms option, so it runs on every platform.
    register("sdpa", sdpa)
