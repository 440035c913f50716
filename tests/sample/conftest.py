"""Shared helper: build metadata for some rows and run the sampler on their logits."""

from __future__ import annotations

import pytest
import torch

from runtime.sample import Sampler, SamplerOutput, build_sampling_metadata
from runtime.sampling_params import SamplingParams


def _run_sampler(
    logits: torch.Tensor,
    params: list[SamplingParams],
    prompts: list[list[int]] | None = None,
    outputs: list[list[int]] | None = None,
    generators: list[torch.Generator | None] | None = None,
) -> SamplerOutput:
    num_rows, vocab_size = logits.shape
    metadata = build_sampling_metadata(
        params,
        prompts if prompts is not None else [[0, 1]] * num_rows,
        outputs if outputs is not None else [[]] * num_rows,
        generators if generators is not None else [None] * num_rows,
        vocab_size,
        logits.device,
    )
    return Sampler()(logits, metadata)


@pytest.fixture
def run_sampler():
    """``run_sampler(logits [N, V], params, prompts=, outputs=, generators=) -> SamplerOutput``."""
    torch.manual_seed(0)
    return _run_sampler
