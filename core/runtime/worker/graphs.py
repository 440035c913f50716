"""Decode steps replayed from captured graphs (CUDA graphs on the ``cuda`` platform).

A decode-only step (one new token per request) spends most of its time launching
small kernels. For each captured batch size the model's forward is recorded once,
reading every input from the persistent step buffers; a step with ``n`` requests
then pads its inputs to the next captured size and replays that graph.

Padding keeps the replay harmless: padded tokens have slot ``-1`` (their keys are not
cached) and padded requests have no queries, so attention skips them.

A platform that ``compiles_graphs`` (the CPU) gets compiled code instead of recordings:
the forward is compiled once (``platform.compile_model``, e.g. ``torch.compile`` with a
symbolic batch size), warmed at batch sizes 1 and 2 so that start-up compiles whatever the
platform specializes, and a decode step of any size up to the largest runs it on exactly
its own tokens (no padding), with the attention backend run eagerly inside it on the
step's host metadata (:mod:`runtime.models.attention_op`).
"""

from __future__ import annotations

import bisect
import logging
import time
from collections import Counter
from collections.abc import Callable

import torch

from runtime.attention.backend import AttentionMetadata
from runtime.forward_context import set_forward_context
from runtime.worker.buffers import StepBuffers

logger = logging.getLogger(__name__)

WARM_UP_PREFILL_TOKENS = 256  # enough queries for the prefill launch shapes of the attention kernel


def can_capture(platform, backend, sizes: tuple[int, ...]) -> str | None:
    """Why this engine runs without graphs, or None when it can capture them."""
    if not sizes:
        return "graphs are off (enforce_eager, or no sizes to capture)"
    if not platform.supports_graphs:
        return f"platform {platform.name!r} cannot capture graphs"
    if not getattr(platform, "compiles_graphs", False) and not getattr(backend, "supports_graphs", False):
        return f"attention backend {backend.name!r} reads host-side metadata and cannot run in a graph"
    return None


class DecodeGraphs:
    """Captured decode steps, one per batch size, sharing one memory pool."""

    def __init__(self, sizes: tuple[int, ...], platform, model, backend, kv_caches, buffers: StepBuffers, block_size: int, max_model_len: int):
        self.sizes = tuple(sorted(sizes))
        self.platform = platform
        self.model = model
        self.backend = backend
        self.kv_caches = kv_caches
        self.buffers = buffers
        self.block_size = block_size
        self.max_model_len = max_model_len
        self.replays: dict[int, Callable[[], torch.Tensor]] = {}
        self.replay_counts: Counter[int] = Counter()  # steps run per captured size
        self.compiles = getattr(platform, "compiles_graphs", False)  # compiled code instead of recorded graphs
        self.compiled: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None  # set by capture() if compiles

    def batch_size(self, num_reqs: int, num_tokens: int) -> int | None:
        """The captured size a step pads to, or None if it must run eagerly."""
        if num_tokens != num_reqs or num_reqs > self.sizes[-1]:
            return None
        if self.compiles:
            return num_reqs if self.compiled is not None else None  # compiled code runs any size: no padding
        return self.sizes[bisect.bisect_left(self.sizes, num_reqs)]

    @torch.inference_mode()
    def capture(self, prefill_tokens: int = WARM_UP_PREFILL_TOKENS) -> None:
        start = time.perf_counter()
        if self.compiles:
            self._compile()
            if self.compiled is not None:
                logger.info("compiled decode steps (batch sizes 1..%d) in %.1f s", self.sizes[-1], time.perf_counter() - start)
            return
        self.warm_up_prefill(prefill_tokens)
        self._fill_dummy_inputs()
        pool = self.platform.graph_pool()
        for size in reversed(self.sizes):  # largest first: the smaller graphs reuse its pool memory
            step = self._step(size)
            step()  # compile kernels and create lazy state outside the capture
            self.replays[size] = self.platform.capture_graph(step, pool)
        logger.info("captured %d decode graphs (batch sizes %d..%d) in %.1f s", len(self.sizes), self.sizes[0], self.sizes[-1], time.perf_counter() - start)

    def _compile(self) -> None:
        """``platform.compile_model``, warmed at batch 1 and 2; a model it cannot compile runs eagerly."""
        self.compiled = self.platform.compile_model(self.model)
        if self.compiled is None:  # the platform chose to run this model eagerly
            return
        self._warm_up_compiled(1, self.model)  # lazy state (e.g. rotary tables) created eagerly, not traced
        try:
            for size in sorted({1, min(2, self.sizes[-1])}):
                self._warm_up_compiled(size, self.compiled)
        except Exception as exc:  # an op the compiler cannot handle (e.g. a plugin's kernel): stay correct
            logger.warning("decode steps run eagerly: compiling them failed (%s: %s)", type(exc).__name__, exc)
            self.compiled = None

    def warm_up_prefill(self, num_tokens: int) -> None:
        """One eager step with a prefill chunk and a decode, caching nothing.

        Compiles the kernel variants of mixed batches now rather than inside the first
        timed requests (decode variants are compiled by the graph warm-ups).
        """
        b = self.buffers
        num_tokens = max(2, min(num_tokens, b.input_ids.host.shape[0] - 1, self.max_model_len - 1))
        total = num_tokens + 1
        b.input_ids.host[:total] = 0
        b.positions.host[:num_tokens] = torch.arange(num_tokens)
        b.positions.host[num_tokens] = 0
        b.slot_mapping.host[:total] = -1
        b.query_start_loc.host[:3] = torch.tensor([0, num_tokens, total], dtype=torch.int32)
        b.seq_lens.host[:2] = torch.tensor([num_tokens, 1], dtype=torch.int32)
        b.block_table.zero_()
        metadata = AttentionMetadata(
            num_reqs=2,
            num_tokens=total,
            max_query_len=num_tokens,
            max_seq_len=num_tokens,
            query_start_loc=b.query_start_loc.upload(3),
            seq_lens=b.seq_lens.upload(2),
            block_table=b.block_table[:2],
            slot_mapping=b.slot_mapping.upload(total),
            query_start_loc_cpu=b.query_start_loc.np[:3].copy(),
            seq_lens_cpu=b.seq_lens.np[:2].copy(),
            block_size=self.block_size,
        )
        metadata = self.backend.build_metadata(metadata)
        with set_forward_context(self.backend, metadata, self.kv_caches):
            self.model(b.input_ids.upload(total), b.positions.upload(total))
        self.platform.synchronize()

    def run(self, size: int) -> torch.Tensor:
        """Replay the graph of ``size`` on the buffers' current contents: hidden states ``[size, hidden]``."""
        self.replay_counts[size] += 1
        if self.compiled is not None:
            return self._run_compiled(size)
        return self.replays[size]()

    def _run_compiled(self, size: int, forward: Callable | None = None) -> torch.Tensor:
        """The compiled forward (or ``forward``) over the first ``size`` decode rows of the buffers,
        metadata built as eager steps build it."""
        b = self.buffers
        seq_lens = b.seq_lens.host[:size]
        max_seq_len = int(seq_lens.max())
        width = -(-max_seq_len // self.block_size)
        metadata = AttentionMetadata(
            num_reqs=size,
            num_tokens=size,
            max_query_len=1,
            max_seq_len=max_seq_len,
            query_start_loc=b.query_start_loc.dev[: size + 1],
            seq_lens=b.seq_lens.dev[:size],
            block_table=b.block_table[:size, :width],
            slot_mapping=b.slot_mapping.dev[:size],
            query_start_loc_cpu=b.query_start_loc.np[: size + 1],
            seq_lens_cpu=b.seq_lens.np[:size],
            block_size=self.block_size,
        )
        metadata = self.backend.build_metadata(metadata)
        with set_forward_context(self.backend, metadata, self.kv_caches):
            return (forward or self.compiled)(b.input_ids.dev[:size], b.positions.dev[:size])

    def _warm_up_compiled(self, size: int, forward: Callable) -> None:
        """Compile (or load from the compiler's cache) the code of ``size`` by running ``forward``:
        one token per row at position 0, written to slots 0..size-1 (no request owns a block yet)."""
        b = self.buffers
        for buffer, values in (
            (b.input_ids, torch.zeros(size, dtype=torch.int64)),
            (b.positions, torch.zeros(size, dtype=torch.int64)),
            (b.slot_mapping, torch.arange(size, dtype=torch.int64)),
            (b.query_start_loc, torch.arange(size + 1, dtype=torch.int32)),
            (b.seq_lens, torch.ones(size, dtype=torch.int32)),
        ):
            buffer.host[: len(values)] = values
            buffer.upload(len(values))
        b.block_table.zero_()
        b.block_table[:size, 0] = torch.arange(size, dtype=torch.int32) // self.block_size
        start = time.perf_counter()
        self._run_compiled(size, forward)
        if forward is self.compiled:
            logger.info("decode step of batch size %d compiled in %.1f s", size, time.perf_counter() - start)

    def _step(self, size: int) -> Callable[[], torch.Tensor]:
        b = self.buffers
        metadata = AttentionMetadata(
            num_reqs=size,
            num_tokens=size,
            max_query_len=1,
            # Launch shapes must suit any context length the replay may see.
            max_seq_len=self.max_model_len,
            query_start_loc=b.query_start_loc.dev[: size + 1],
            seq_lens=b.seq_lens.dev[:size],
            block_table=b.block_table[:size],
            slot_mapping=b.slot_mapping.dev[:size],
            query_start_loc_cpu=None,  # host values are not part of a graph
            seq_lens_cpu=None,
            block_size=self.block_size,
        )
        metadata = self.backend.build_metadata(metadata)
        input_ids, positions = b.input_ids.dev[:size], b.positions.dev[:size]

        def step() -> torch.Tensor:
            with set_forward_context(self.backend, metadata, self.kv_caches):
                return self.model(input_ids, positions)

        return step

    def _fill_dummy_inputs(self) -> None:
        """One query per request over one (uncached) key, so warm-up runs touch no real cache slot."""
        b, n = self.buffers, self.sizes[-1]
        for buffer, values in (
            (b.input_ids, torch.zeros(n, dtype=torch.int64)),
            (b.positions, torch.zeros(n, dtype=torch.int64)),
            (b.slot_mapping, torch.full((n,), -1, dtype=torch.int64)),
            (b.query_start_loc, torch.arange(n + 1, dtype=torch.int32)),
            (b.seq_lens, torch.ones(n, dtype=torch.int32)),
        ):
            buffer.host[: len(values)] = values
            buffer.upload(len(values))
        b.block_table.zero_()
