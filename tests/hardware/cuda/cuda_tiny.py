"""Tiny random checkpoints without a tokenizer, and their transformers reference, for engine parity tests.

The GPU machine lacks the package that ships the test tokenizer, so these models are
written with a small vocabulary and the engine runs with ``skip_tokenizer_init``.
"""

from __future__ import annotations

import os
import random
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "engine"))  # hf_reference

from hf_reference import (  # noqa: E402
    check_logprobs_close,
    check_logprobs_close_until_divergence,
    check_outputs_equal,
    hf_greedy,
)
from tiny_models import build_untokenized_model as _build  # noqa: E402

VOCAB_SIZE = 512
PROMPT_LENS = [5, 17, 33, 9, 41]
SHARED_PREFIX = 24

__all__ = [
    "build_untokenized_model",
    "make_prompts",
    "reference_outputs",
    "check_outputs_equal",
    "check_logprobs_close",
    "check_logprobs_close_until_divergence",
    "hf_greedy",
]


def build_untokenized_model(arch: str, path, seed: int = 0) -> str:
    """A tiny random float32 ``arch`` checkpoint (config + safetensors only) at ``path``."""
    return _build(arch, path, seed, vocab_size=VOCAB_SIZE)


def make_prompts(seed: int = 0) -> list[list[int]]:
    """Distinct prompts and prompts sharing a prefix (for prefix caching)."""
    rng = random.Random(seed)
    prefix = [rng.randrange(3, VOCAB_SIZE) for _ in range(SHARED_PREFIX)]
    distinct = [[rng.randrange(3, VOCAB_SIZE) for _ in range(n)] for n in PROMPT_LENS]
    return distinct + [prefix + [rng.randrange(3, VOCAB_SIZE) for _ in range(n % 7 + 1)] for n in PROMPT_LENS[:3]]


def reference_outputs(path: str, prompts: list[list[int]], num_new_tokens: int):
    """transformers' greedy tokens and top-5 logprobs per step, on the CPU in float32."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    return hf_greedy(hf, prompts, num_new_tokens)
