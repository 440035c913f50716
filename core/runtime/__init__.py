"""runtime: a plugin-based LLM inference and serving engine."""

from runtime.sampling_params import RequestOutputKind, SamplingParams

__all__ = ["LLM", "SamplingParams", "RequestOutputKind", "RequestOutput", "CompletionOutput", "EngineArgs"]


def __getattr__(name):
    # Defer torch-heavy imports until they are used.
    if name == "LLM":
        from runtime.entrypoints.llm import LLM

        return LLM
    if name in ("RequestOutput", "CompletionOutput"):
        import runtime.outputs as outputs

        return getattr(outputs, name)
    if name == "EngineArgs":
        from runtime.config import EngineArgs

        return EngineArgs
    raise AttributeError(name)
