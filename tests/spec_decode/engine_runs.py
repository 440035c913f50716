"""Helpers of the worker-proposer tests (draft model, EAGLE, Medusa)."""

from __future__ import annotations

import random

from runtime import LLM


def repetitive_prompts(vocab_size: int, seed: int = 0) -> list[list[int]]:
    """Four prompts, one long enough for several chunks under a tiny token budget."""
    rng = random.Random(seed)

    def seq(n):
        return [rng.randrange(3, vocab_size) for _ in range(n)]

    a, d = seq(8), seq(11)
    return [a + seq(3) + a + a[:4], seq(13), d + seq(2) + d + seq(9) + d[:5], seq(5)]


def generate(llm: LLM, prompts, params):
    return llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)


def spec_counts(llm: LLM) -> tuple[int, int]:
    """(draft tokens verified, draft tokens accepted) so far."""
    stats = llm.llm_engine.last_stats or {}
    return stats.get("spec_decode_num_draft_tokens", 0), stats.get("spec_decode_num_accepted_tokens", 0)
