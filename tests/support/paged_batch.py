"""Drive a model step by step over a paged KV cache, as the model runner would.

Each step schedules some new tokens per request; the helper allocates KV blocks
(in a shuffled order, so block tables are not contiguous), builds the flat batch and
its ``AttentionMetadata``, and runs the model under the forward context.
"""

from __future__ import annotations

import random

import numpy as np
import torch

from runtime.attention.backend import AttentionMetadata
from runtime.forward_context import set_forward_context
from runtime_cpu.attention import CPUPagedAttentionBackend


def make_metadata(
    q_lens: list[int], seq_lens: list[int], block_tables: list[list[int]], block_size: int, device="cpu"
) -> AttentionMetadata:
    """Metadata for requests whose new tokens are the last ``q_lens[i]`` of ``seq_lens[i]``."""
    qsl = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
    width = max(len(t) for t in block_tables)
    table = torch.tensor([t + [0] * (width - len(t)) for t in block_tables], dtype=torch.int32)
    slots = []
    for q_len, seq_len, blocks in zip(q_lens, seq_lens, block_tables):
        for pos in range(seq_len - q_len, seq_len):
            slots.append(blocks[pos // block_size] * block_size + pos % block_size)
    return AttentionMetadata(
        num_reqs=len(q_lens),
        num_tokens=int(qsl[-1]),
        max_query_len=max(q_lens),
        max_seq_len=max(seq_lens),
        query_start_loc=torch.from_numpy(qsl).to(device),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
        block_table=table.to(device),
        slot_mapping=torch.tensor(slots, dtype=torch.int64, device=device),
        query_start_loc_cpu=qsl,
        seq_lens_cpu=np.asarray(seq_lens, dtype=np.int32),
        block_size=block_size,
    )


class PagedRunner:
    """Runs ``model`` over a growing batch of requests with a paged KV cache."""

    def __init__(self, model, num_requests: int, block_size: int = 4, num_blocks: int = 64, seed: int = 0, backend=None,
                 cache_dtype: torch.dtype | None = None):
        self.model = model
        self.backend = backend if backend is not None else CPUPagedAttentionBackend()
        self.block_size = block_size
        param = next(model.parameters())
        self.device = param.device
        self.kv_caches = [
            torch.zeros(
                self.backend.kv_cache_shape(num_blocks, block_size, s.num_kv_heads, s.head_size),
                dtype=cache_dtype or param.dtype,
                device=self.device,
            )
            for s in model.attention_specs()
        ]
        self.free_blocks = list(range(num_blocks))
        random.Random(seed).shuffle(self.free_blocks)
        self.tokens: list[list[int]] = [[] for _ in range(num_requests)]
        self.block_tables: list[list[int]] = [[] for _ in range(num_requests)]

    def step(self, new_tokens: list[list[int]]) -> list[torch.Tensor]:
        """Feed ``new_tokens[i]`` to request i; return each request's logits ``[len(new), vocab]``."""
        hidden = self.step_hidden(new_tokens)  # [num_tokens, hidden]
        with torch.inference_mode():
            logits = self.model.compute_logits(hidden)  # [num_tokens, vocab]
        return list(logits.split([len(t) for t in new_tokens]))

    def step_hidden(self, new_tokens: list[list[int]]) -> torch.Tensor:
        """Feed ``new_tokens[i]`` to request i; return the final hidden states ``[num_tokens, hidden]``."""
        for i, toks in enumerate(new_tokens):
            self.tokens[i].extend(toks)
            needed = -(-len(self.tokens[i]) // self.block_size)
            while len(self.block_tables[i]) < needed:
                self.block_tables[i].append(self.free_blocks.pop())
        q_lens = [len(t) for t in new_tokens]
        seq_lens = [len(t) for t in self.tokens]
        metadata = make_metadata(q_lens, seq_lens, self.block_tables, self.block_size, self.device)
        metadata = self.backend.build_metadata(metadata)
        input_ids = torch.tensor([t for toks in new_tokens for t in toks], dtype=torch.int64, device=self.device)
        positions = [p for q, s in zip(q_lens, seq_lens) for p in range(s - q, s)]
        positions = torch.tensor(positions, dtype=torch.int64, device=self.device)
        with torch.inference_mode(), set_forward_context(self.backend, metadata, self.kv_caches):
            return self.model(input_ids, positions)  # [num_tokens, hidden]
