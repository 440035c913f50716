"""Multi-turn conversations over a small device pool, for the offload tests."""

from __future__ import annotations

import gc
import random

from runtime import LLM, SamplingParams
from runtime.testing.models import UNTOKENIZED_VOCAB_SIZE

NUM_NEW_TOKENS = 6
# A device pool of 32 blocks x 4 tokens: four conversations of ~80 tokens do not fit, so
# their prefixes are evicted between turns (and requests are preempted).
SMALL_POOL = dict(block_size=4, num_gpu_blocks_override=32, max_model_len=128)


def random_tokens(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(3, UNTOKENIZED_VOCAB_SIZE) for _ in range(n)]


def conversations(num: int = 4, system_len: int = 40, seed: int = 0) -> tuple[list[list[int]], list[list[list[int]]]]:
    """(first prompts: a shared system prompt + a user turn each, the later user turns of each)."""
    rng = random.Random(seed)
    system = random_tokens(rng, system_len)
    firsts = [system + random_tokens(rng, 6 + i) for i in range(num)]
    later = [[random_tokens(rng, 4) for _ in range(3)] for _ in range(num)]
    return firsts, later


def make_llm(model_path: str, **kwargs) -> LLM:
    return LLM(model_path, dtype="float32", skip_tokenizer_init=True, **{**SMALL_POOL, **kwargs})


def run_turns(llm: LLM, num_turns: int = 3, num: int = 4):
    """Every conversation turn by turn (the next prompt = history + answer + user turn).

    Returns (per turn: [(prompt, output tokens, cached tokens)], scheduler stats after each turn)."""
    firsts, later = conversations(num)
    histories = [list(p) for p in firsts]
    params = SamplingParams(temperature=0.0, max_tokens=NUM_NEW_TOKENS, ignore_eos=True)
    turns, stats = [], []
    for turn in range(num_turns):
        outputs = llm.generate([{"prompt_token_ids": h} for h in histories], params, use_tqdm=False)
        turns.append([(list(h), list(o.outputs[0].token_ids), o.num_cached_tokens) for h, o in zip(histories, outputs)])
        stats.append(dict(llm.llm_engine.engine_core.scheduler.stats()))
        for history, output, user in zip(histories, outputs, later):
            history += list(output.outputs[0].token_ids) + user[turn]
    return turns, stats


def close(llm: LLM) -> None:
    """Stop the engine the way a server does (the offload tiers get their last blocks)."""
    llm.llm_engine.engine_core.shutdown()
    del llm
    gc.collect()
