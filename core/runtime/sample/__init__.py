"""The sampler: batched sampling parameters, logit processing, sampling, logprobs."""

from runtime.sample.logprobs import LogprobsTensors, compute_prompt_logprobs, gather_logprobs, to_lists
from runtime.sample.metadata import SamplingMetadata, build_sampling_metadata
from runtime.sample.sampler import Sampler, SamplerOutput

__all__ = [
    "LogprobsTensors",
    "Sampler",
    "SamplerOutput",
    "SamplingMetadata",
    "build_sampling_metadata",
    "compute_prompt_logprobs",
    "gather_logprobs",
    "to_lists",
]
