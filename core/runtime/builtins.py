"""Components that ship with the core, registered through the same hooks as plugins."""

from __future__ import annotations

import importlib

import pluggy

hookimpl = pluggy.HookimplMarker("runtime")

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


@hookimpl
def register_executors(register):
    register("uniproc", lazy("runtime.executor.uniproc:UniProcExecutor"))
