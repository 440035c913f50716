"""runtime: a plugin-based LLM inference and serving engine."""

from runtime.hookspecs import hookimpl
from runtime.sampling_params import RequestOutputKind, SamplingParams, StructuredOutputsParams

__all__ = ["LLM", "SamplingParams", "StructuredOutputsParams", "RequestOutputKind", "RequestOutput", "CompletionOutput", "EngineArgs", "hookimpl"]


def __getattr__(name):
    # Defer torch-heavy imports until they are used.
    if name == "LLM":
        from runtime.entrypoints.llm import LLM

        return LLM
    if name in ("RequestOutput", "CompletionOutput"):
        import runtime.outputs as outputs

        return getattr(outputs, name)
    if name == "EngineArgs":
        from runtime.engine_args import EngineArgs

        return EngineArgs
    raise AttributeError(name)
