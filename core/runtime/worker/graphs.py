"""Decode and verification steps replayed from captured graphs (CUDA graphs on ``cuda``).

A decode-only step (one new token per request) spends most of its time launching
small kernels. For each captured batch size the model's forward is recorded once,
reading every input from the persistent step buffers; a step with ``n`` requests
then pads its inputs to the next captured size and replays that graph.

With speculative decoding a verification step feeds each request its token and up to
``k`` drafts. Such steps get graphs of their own, captured for ``1 + k`` query tokens per
request (:class:`GraphShape` ``query_len``): a step whose requests have at most ``1 + k``
tokens each (some may have fewer drafts, or none) pads to the next captured size, its
requests keeping their own query lengths (the attention kernel reads them on the device).

Padding keeps the replay harmless: padded tokens have slot ``-1`` (their keys are not
cached) and belong to no request, and padded requests have no queries, so attention
skips them.

A platform that ``compiles_graphs`` (the CPU) gets compiled code instead of recordings:
the forward is compiled once (``platform.compile_model``, e.g. ``torch.compile`` with a
symbolic batch size), warmed at batch sizes 1 and 2 so that start-up compiles whatever the
platform specializes, and a decode step of any size up to the largest runs it on exactly
its own tokens (no padding), with the attention backend run eagerly inside it on the
step's host metadata, or traced into it (:mod:`runtime.models.attention_op`).
"""

from __future__ import annotations

import bisect
import logging
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass

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


@dataclass(frozen=True, slots=True)
class GraphShape:
    """A captured step: ``num_reqs`` requests of up to ``query_len`` tokens each (1: decode;
    1 + k: speculative verification), its inputs padded to ``num_reqs * query_len`` tokens."""

    num_reqs: int
    query_len: int = 1

    @property
    def num_tokens(self) -> int:
        return self.num_reqs * self.query_len


class DecodeGraphs:
    """Captured decode (and verification) steps, one per batch size, sharing one memory pool.

    ``verify_len`` (1 + k with speculative decoding, else 0) adds graphs of that many query
    tokens per request, for the captured sizes whose tokens fit ``max_num_tokens``.
    """

    def __init__(self, sizes: tuple[int, ...], platform, model, backend, kv_caches, buffers: StepBuffers, block_size: int,
                 max_model_len: int, verify_len: int = 0, max_num_tokens: int = 0):
        self.sizes = tuple(sorted(sizes))
        self.platform = platform
        self.model = model
        self.backend = backend
        self.kv_caches = kv_caches
        self.buffers = buffers
        self.block_size = block_size
        self.max_model_len = max_model_len
        self.compiles = getattr(platform, "compiles_graphs", False)  # compiled code instead of recorded graphs
        self.compiled: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None  # set by capture() if compiles
        # Verification steps are recorded only: compiled code runs decode steps alone.
        self.verify_len = verify_len if verify_len > 1 and not self.compiles else 0
        self.verify_sizes = tuple(s for s in self.sizes if s * verify_len <= max_num_tokens) if self.verify_len else ()
        self.replays: dict[GraphShape, Callable[[], torch.Tensor]] = {}
        self.replay_counts: Counter[int] = Counter()  # decode steps run per captured size
        self.verify_replay_counts: Counter[int] = Counter()  # verification steps run per captured size

    def shape(self, num_reqs: int, num_tokens: int, max_query_len: int) -> GraphShape | None:
        """The captured shape a step pads to, or None if it must run eagerly."""
        if num_tokens == num_reqs:  # a decode step
            if num_reqs > self.sizes[-1]:
                return None
            if self.compiles:
                return GraphShape(num_reqs) if self.compiled is not None else None  # any size: no padding
            return GraphShape(self.sizes[bisect.bisect_left(self.sizes, num_reqs)])
        if max_query_len > self.verify_len or not self.verify_sizes or num_reqs > self.verify_sizes[-1]:
            return None  # a prefill chunk, or more drafts than captured
        return GraphShape(self.verify_sizes[bisect.bisect_left(self.verify_sizes, num_reqs)], self.verify_len)

    @torch.inference_mode()
    def capture(self, prefill_tokens: int = WARM_UP_PREFILL_TOKENS) -> None:
        start = time.perf_counter()
        if self.compiles:
            self._compile()
            if self.compiled is not None:
                logger.info("compiled decode steps (batch sizes 1..%d) in %.1f s", self.sizes[-1], time.perf_counter() - start)
            return
        self.warm_up_prefill(prefill_tokens)
        pool = self.platform.graph_pool()
        shapes = [GraphShape(s) for s in self.sizes] + [GraphShape(s, self.verify_len) for s in self.verify_sizes]
        for shape in sorted(shapes, key=lambda g: -g.num_tokens):  # largest first: the smaller graphs reuse its pool memory
            self._fill_dummy_inputs(shape)
            step = self._step(shape)
            step()  # compile kernels and create lazy state outside the capture
            self.replays[shape] = self.platform.capture_graph(step, pool)
        logger.info("captured %d decode graphs (batch sizes %d..%d) in %.1f s", len(self.sizes), self.sizes[0], self.sizes[-1], time.perf_counter() - start)
        if self.verify_sizes:
            logger.info("captured %d verification graphs of %d tokens per request (batch sizes %d..%d)",
                        len(self.verify_sizes), self.verify_len, self.verify_sizes[0], self.verify_sizes[-1])

    def _compile(self) -> None:
        """``platform.compile_model``, warmed at batch 1 and 2; a model it cannot compile runs eagerly."""
        self.compiled = self.platform.compile_model(self.model)
        if self.compiled is None:  # the platform chose to run this model eagerly
            return
        self._warm_up_compiled(1, self.model)  # lazy state (e.g. rotary tables) created eagerly, not traced
        logger.info("compiling decode steps (the first start of a model takes longest; later ones reuse the compiler's cache)")
        try:
            for size in sorted({1, min(2, self.sizes[-1])}):
                self._warm_up_compiled(size, self.compiled)
        except Exception as exc:  # an op the compiler cannot handle (e.g. a plugin's kernel): stay correct
            logger.warning("decode steps run eagerly: compiling them failed (%s: %s)", type(exc).__name__, exc)
            self.compiled = None

    def warm_up_prefill(self, num_tokens: int) -> None:
        """Eager steps with a decode and a prefill chunk, in the order a mixed step has them (the chunk
        alone when the buffers hold one request, ``--max-num-seqs 1``), caching nothing: chunks of 2, 4,
        8, ... queries up to ``num_tokens``.

        Compiles the kernel variants of mixed batches now rather than inside the first requests,
        including a backend's own launches for the decodes that lead a mixed step (decode-only
        variants are compiled by the graph warm-ups). Backends pick their launch shapes from the
        longest query in powers of two (the Triton attention's score rows), so doubling the chunk
        meets every shape a step of at most ``num_tokens`` queries can take.
        """
        num_tokens = max(2, min(num_tokens, self.buffers.input_ids.host.shape[0] - 1, self.max_model_len - 1))
        query_len = 2
        while query_len < num_tokens:
            self._warm_up_mixed_step(query_len)
            query_len *= 2
        self._warm_up_mixed_step(num_tokens)

    def _warm_up_mixed_step(self, num_tokens: int) -> None:
        b = self.buffers
        num_reqs = min(2, b.query_start_loc.host.shape[0] - 1)
        decodes = num_reqs - 1  # 0 or 1
        total = num_tokens + decodes
        b.input_ids.host[:total] = 0
        b.positions.host[:decodes] = 0
        b.positions.host[decodes:total] = torch.arange(num_tokens)
        b.slot_mapping.host[:total] = -1
        b.query_start_loc.host[: num_reqs + 1] = torch.tensor([0, 1, total] if decodes else [0, total], dtype=torch.int32)
        b.seq_lens.host[:num_reqs] = torch.tensor([1, num_tokens] if decodes else [num_tokens], dtype=torch.int32)
        b.block_table.zero_()
        metadata = AttentionMetadata(
            num_reqs=num_reqs,
            num_tokens=total,
            max_query_len=num_tokens,
            max_seq_len=num_tokens,
            query_start_loc=b.query_start_loc.upload(num_reqs + 1),
            seq_lens=b.seq_lens.upload(num_reqs),
            block_table=b.block_table[:num_reqs],
            slot_mapping=b.slot_mapping.upload(total),
            query_start_loc_cpu=b.query_start_loc.np[: num_reqs + 1].copy(),
            seq_lens_cpu=b.seq_lens.np[:num_reqs].copy(),
            block_size=self.block_size,
        )
        metadata = self.backend.build_metadata(metadata)
        with set_forward_context(self.backend, metadata, self.kv_caches):
            self.model(b.input_ids.upload(total), b.positions.upload(total))
        self.platform.synchronize()

    def run(self, shape: GraphShape) -> torch.Tensor:
        """Replay the graph of ``shape`` on the buffers' current contents: hidden states ``[shape.num_tokens, hidden]``."""
        (self.replay_counts if shape.query_len == 1 else self.verify_replay_counts)[shape.num_reqs] += 1
        if self.compiled is not None:
            return self._run_compiled(shape.num_reqs)
        return self.replays[shape]()

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
        traced_inputs = getattr(self.backend, "traced_decode_inputs", None)  # runtime.models.attention_op
        if traced_inputs is not None:
            metadata.traced = traced_inputs(metadata)
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

    def _step(self, shape: GraphShape) -> Callable[[], torch.Tensor]:
        b, size, num_tokens = self.buffers, shape.num_reqs, shape.num_tokens
        metadata = AttentionMetadata(
            num_reqs=size,
            num_tokens=num_tokens,
            max_query_len=shape.query_len,
            # Launch shapes must suit any context length the replay may see.
            max_seq_len=self.max_model_len,
            query_start_loc=b.query_start_loc.dev[: size + 1],
            seq_lens=b.seq_lens.dev[:size],
            block_table=b.block_table[:size],
            slot_mapping=b.slot_mapping.dev[:num_tokens],
            query_start_loc_cpu=None,  # host values are not part of a graph
            seq_lens_cpu=None,
            block_size=self.block_size,
        )
        metadata = self.backend.build_metadata(metadata)
        input_ids, positions = b.input_ids.dev[:num_tokens], b.positions.dev[:num_tokens]

        def step() -> torch.Tensor:
            with set_forward_context(self.backend, metadata, self.kv_caches):
                return self.model(input_ids, positions)

        return step

    def _fill_dummy_inputs(self, shape: GraphShape) -> None:
        """``query_len`` queries per request over as many (uncached) keys, so warm-up runs touch
        no real cache slot."""
        b, n, q = self.buffers, shape.num_reqs, shape.query_len
        for buffer, values in (
            (b.input_ids, torch.zeros(n * q, dtype=torch.int64)),
            (b.positions, torch.arange(q, dtype=torch.int64).repeat(n)),
            (b.slot_mapping, torch.full((n * q,), -1, dtype=torch.int64)),
            (b.query_start_loc, torch.arange(n + 1, dtype=torch.int32) * q),
            (b.seq_lens, torch.full((n,), q, dtype=torch.int32)),
        ):
            buffer.host[: len(values)] = values
            buffer.upload(len(values))
        b.block_table.zero_()
