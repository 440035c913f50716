"""Builders shared by the scheduler tests: a Scheduler and Requests over token lists."""

from __future__ import annotations

import pytest

from runtime.config import CacheConfig, SchedulerConfig
from runtime.sampling_params import SamplingParams
from runtime.scheduler.request import Request
from runtime.scheduler.scheduler import Scheduler

EOS = 0


@pytest.fixture
def make_scheduler():
    """``make_scheduler(num_blocks=64, block_size=4, budget=64, ...)``: a Scheduler over a fresh KV cache.

    ``fast_decode=False`` switches the decode fast path off (every decode goes through
    ``allocate_slots``), the reference the fast path is compared against.
    """

    def build(num_blocks=64, block_size=4, budget=64, max_seqs=16, policy="fcfs", caching=False, max_len=256,
              fast_decode=True, chunked_prefill=True) -> Scheduler:
        scheduler = Scheduler(
            SchedulerConfig(max_num_seqs=max_seqs, max_num_batched_tokens=budget, max_model_len=max_len, policy=policy,
                            enable_chunked_prefill=chunked_prefill),
            CacheConfig(block_size=block_size, enable_prefix_caching=caching),
            num_blocks,
        )
        if not fast_decode:
            scheduler.kv_cache_manager.no_op_decode_offsets = range(0)
        return scheduler

    return build


@pytest.fixture
def make_request():
    """``make_request(req_id, prompt, max_tokens=4, ...)``: ``prompt`` is a token list or a length
    (tokens 1..n); EOS is token 0; other keywords are SamplingParams."""

    def build(req_id, prompt, max_tokens=4, priority=0, arrival=None, **params) -> Request:
        tokens = list(range(1, prompt + 1)) if isinstance(prompt, int) else list(prompt)
        return Request(
            req_id, tokens, SamplingParams(max_tokens=max_tokens, **params),
            eos_token_ids=frozenset({EOS}), arrival_time=arrival, priority=priority,
        )

    return build
