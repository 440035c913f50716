"""Persistent per-request state on the worker, and flattening a step into tensors.

Each request owns a row of two host buffers (its tokens and its block table) for
as long as it runs, so building a step's inputs is a handful of vectorized numpy
gathers, with no Python loop over tokens. The step's flat batch goes into persistent
buffers (:mod:`runtime.worker.buffers`), padded when a captured graph will run it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import torch

from runtime.sample.metadata import is_plain_greedy
from runtime.sampling_params import SamplingParams
from runtime.messages import SchedulerOutput
from runtime.worker.buffers import StepBuffers
from runtime.worker.graphs import GraphShape

# Triton compiles a kernel again for each class of an integer argument it meets (divisible by 16, equal to 1,
# neither), and the block table's row stride is an argument of the attention kernels. So the tables have rows of
# a multiple of TABLE_WIDTH_MULTIPLE blocks: the full-width one the decode graphs read always, a step's compact one
# when the attention backend asks (``block_table_width_multiple``). Widths that followed each step's longest request
# compiled the kernel inside W2's first mixed steps, ~2 s a time on an H200 (benchmarks/RESULTS.md, session 31).
TABLE_WIDTH_MULTIPLE = 16


def table_width(max_seq_len: int, block_size: int, multiple: int = 1) -> int:
    """Columns of a block table covering ``max_seq_len`` tokens: whole blocks, rounded up to ``multiple``."""
    blocks = -(-max_seq_len // block_size)
    return -(-blocks // multiple) * multiple


@dataclass(slots=True)
class CachedRequestState:
    """What does not change while a request runs; its counts live in the InputBatch's row arrays."""

    req_id: str
    row: int
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    plain_greedy: bool = False  # sampling needs only the argmax (runtime.sample.metadata.is_plain_greedy)


@dataclass(slots=True)
class StepInputs:
    """A step's flat batch, on the host (numpy) and on the device (torch)."""

    states: list[CachedRequestState]
    req_ids: list[str]
    rows: np.ndarray  # [num_reqs] the requests' rows in the InputBatch
    plain_greedy: bool  # every request samples by argmax alone (runtime.sample.metadata.is_plain_greedy)
    num_scheduled: np.ndarray  # [num_reqs]
    num_computed: np.ndarray  # [num_reqs] before this step
    num_tokens: np.ndarray  # [num_reqs] prompt + outputs, including a token still on the device, before this step
    num_known: np.ndarray  # [num_reqs] prompt + outputs whose ids the host has
    query_start_loc: np.ndarray  # [num_reqs + 1]
    seq_lens: np.ndarray  # [num_reqs]
    positions: np.ndarray  # [num_tokens]
    input_ids: torch.Tensor  # [num_tokens] on device
    positions_t: torch.Tensor  # [num_tokens] on device
    slot_mapping: torch.Tensor  # [num_tokens] on device
    block_table: torch.Tensor  # [num_reqs, max_blocks] on device
    query_start_loc_t: torch.Tensor  # [num_reqs + 1] on device
    seq_lens_t: torch.Tensor  # [num_reqs] on device
    sample_mask: np.ndarray = field(default=None)  # [num_reqs] bool: this step yields a token
    graph_size: GraphShape | None = None  # device tensors are padded to this captured shape's requests and tokens


class InputBatch:
    """Rows of per-request state: token ids, block table and counts, as arrays indexed by row.

    A step's requests are looked up once per change of the batch: while the scheduler sends
    the same requests in the same order (decode steps), their states and rows are reused, and
    every count of every request is updated by one numpy operation.
    """

    def __init__(
        self, max_num_reqs: int, max_model_len: int, block_size: int, device: torch.device, max_num_tokens: int
    ):
        self.block_size = block_size
        self.device = device
        self.max_model_len = max_model_len
        self.max_blocks = table_width(max_model_len, block_size, TABLE_WIDTH_MULTIPLE)
        self.width_multiple = 1  # of a step's compact table; the attention backend's block_table_width_multiple
        self.buffers = StepBuffers(max_num_reqs, max(max_num_tokens, max_num_reqs), self.max_blocks, device)
        self.token_ids = np.zeros((max_num_reqs, max_model_len), dtype=np.int64)
        self.block_table = np.zeros((max_num_reqs, self.max_blocks), dtype=np.int32)
        self.num_blocks = np.zeros(max_num_reqs, dtype=np.int64)
        self.num_computed = np.zeros(max_num_reqs, dtype=np.int64)
        self.num_tokens = np.zeros(max_num_reqs, dtype=np.int64)  # prompt + outputs, including a token still on the device
        self.num_known = np.zeros(max_num_reqs, dtype=np.int64)  # prompt + outputs the host has (num_tokens - num_known <= 2)
        self.pending_index = np.full(max_num_reqs, -1, dtype=np.int64)  # row of the newest token in step pending_step's sampled ids
        self.pending_step = np.zeros(max_num_reqs, dtype=np.int64)
        # Bumped when a row is freed: the tokens of a step in flight for its old request are dropped.
        self.generation = np.zeros(max_num_reqs, dtype=np.int64)
        self.free_rows = list(range(max_num_reqs - 1, -1, -1))
        # A step of one token each (a decode step): its query starts and scheduled counts, read-only.
        self._decode_query_start_loc = np.arange(max_num_reqs + 1, dtype=np.int32)
        self._decode_num_scheduled = np.ones(max_num_reqs, dtype=np.int64)
        self._decode_query_start_loc.flags.writeable = self._decode_num_scheduled.flags.writeable = False
        self.requests: dict[str, CachedRequestState] = {}
        self._lookup_key: tuple[int, list[str]] | None = None  # (requests' version, ids) of the last lookup
        self._lookup_value: tuple[list[CachedRequestState], np.ndarray, bool] = ([], np.zeros(0, dtype=np.int64), True)
        self._version = 0  # bumped whenever a request is added or dropped
        # Tokens of the latest launched step, on the device: the next step may be launched
        # before the host has them and then reads each request's newest token from here.
        self.last_sampled: torch.Tensor | None = None
        self.last_step = 0  # steps that sampled so far (numbers pending_step)

    def lookup(self, req_ids: list[str]) -> tuple[list[CachedRequestState], np.ndarray, bool]:
        """The states and rows of ``req_ids``, and whether all of them are plain greedy; the same
        ids as the last lookup reuse its answer."""
        key = self._lookup_key
        if key is not None and key[0] == self._version and key[1] == req_ids:
            return self._lookup_value
        states = [self.requests[req_id] for req_id in req_ids]
        rows = np.fromiter((s.row for s in states), dtype=np.int64, count=len(states))
        self._lookup_key = (self._version, req_ids)
        self._lookup_value = (states, rows, all(s.plain_greedy for s in states))
        return self._lookup_value

    def update_states(self, so: SchedulerOutput) -> None:
        """Apply the scheduler's changes: drop finished, add new, extend cached."""
        for req_id in so.finished_req_ids:
            state = self.requests.pop(req_id, None)
            if state is not None:
                self.free_rows.append(state.row)
                self.generation[state.row] += 1
                self._version += 1
        for new in so.scheduled_new_reqs:
            row = self.free_rows.pop()
            tokens = new.prompt_token_ids + new.output_token_ids
            self.token_ids[row, : len(tokens)] = tokens
            self.block_table[row, : len(new.block_ids)] = new.block_ids
            self.num_blocks[row] = len(new.block_ids)
            self.num_computed[row] = new.num_computed_tokens
            self.num_tokens[row] = self.num_known[row] = len(tokens)
            self.requests[new.req_id] = CachedRequestState(
                new.req_id, row, new.prompt_token_ids, new.sampling_params, is_plain_greedy(new.sampling_params)
            )
            self._version += 1
        cached = so.scheduled_cached_reqs
        if cached.req_ids:
            self.num_computed[self.lookup(cached.req_ids)[1]] = cached.num_computed_tokens
        for req_id, block_ids in cached.new_block_ids.items():
            row = self.requests[req_id].row
            start = int(self.num_blocks[row])
            self.block_table[row, start : start + len(block_ids)] = block_ids
            self.num_blocks[row] = start + len(block_ids)
        for req_id, drafts in so.scheduled_spec_decode_tokens.items():
            # Speculative decoding: the drafts follow the known tokens in the request's row, so
            # prepare() feeds them as inputs (a later step overwrites the rejected ones).
            row = self.requests[req_id].row
            start = int(self.num_tokens[row])
            self.token_ids[row, start : start + len(drafts)] = drafts

    def output_token_ids(self, state: CachedRequestState) -> list[int]:
        """The request's output ids the host has."""
        return self.token_ids[state.row, len(state.prompt_token_ids) : self.num_known[state.row]].tolist()

    def prepare(self, so: SchedulerOutput, graph_shape: Callable[[int, int, int], GraphShape | None] | None = None) -> StepInputs:
        """Flatten the step into the persistent buffers and copy them to the device.

        ``graph_shape(num_reqs, num_tokens, max_query_len)`` names the captured graph to pad
        to (None: run eagerly on exactly the step's tokens).
        """
        req_ids = list(so.num_scheduled_tokens)
        states, rows, plain_greedy = self.lookup(req_ids)
        num_reqs = len(states)
        num_computed = self.num_computed[rows]
        num_all = self.num_tokens[rows]  # incl. on-device
        num_known = self.num_known[rows]
        num_tokens = so.total_num_scheduled_tokens
        if num_tokens == num_reqs and max(so.num_scheduled_tokens.values(), default=0) == 1:
            # One token each (a decode step): token t belongs to request t.
            num_scheduled = self._decode_num_scheduled[:num_reqs]
            query_start_loc = self._decode_query_start_loc[: num_reqs + 1]
            positions, token_req_rows, token_known, token_all = num_computed, rows, num_known, num_all
        else:
            num_scheduled = np.fromiter(so.num_scheduled_tokens.values(), dtype=np.int64, count=num_reqs)
            query_start_loc = np.zeros(num_reqs + 1, dtype=np.int32)
            np.cumsum(num_scheduled, out=query_start_loc[1:])
            # positions[t] = num_computed[r] + (t - query_start[r]) for token t of request r
            token_rows = np.repeat(np.arange(num_reqs), num_scheduled)
            positions = np.arange(num_tokens, dtype=np.int64) - query_start_loc[:-1][token_rows] + num_computed[token_rows]
            token_req_rows, token_known, token_all = rows[token_rows], num_known[token_rows], num_all[token_rows]
        seq_lens = (num_computed + num_scheduled).astype(np.int32)
        padded = graph_shape(num_reqs, num_tokens, int(num_scheduled.max())) if graph_shape is not None and num_reqs else None
        b = self.buffers
        b.fence.wait()
        reqs_out, tokens_out = (padded.num_reqs, padded.num_tokens) if padded else (num_reqs, num_tokens)
        # Padding: tokens with no request (slot -1: not cached), requests with no queries.
        b.input_ids.np[:num_tokens] = self.token_ids[token_req_rows, positions]
        b.input_ids.np[num_tokens:tokens_out] = 0
        forward = self._forward_pending(token_req_rows, positions, token_known, token_all)
        b.positions.np[:num_tokens] = positions
        b.positions.np[num_tokens:tokens_out] = 0
        block_numbers = self.block_table[token_req_rows, positions // self.block_size]
        b.slot_mapping.np[:num_tokens] = block_numbers.astype(np.int64) * self.block_size + positions % self.block_size
        b.slot_mapping.np[num_tokens:tokens_out] = -1
        b.query_start_loc.np[: num_reqs + 1] = query_start_loc
        b.query_start_loc.np[num_reqs + 1 : reqs_out + 1] = num_tokens
        b.seq_lens.np[:num_reqs] = seq_lens
        b.seq_lens.np[num_reqs:reqs_out] = 0
        width = table_width(int(seq_lens.max()), self.block_size, self.width_multiple) if num_reqs else 0
        b.block_table_flat.np[: num_reqs * width].reshape(num_reqs, width)[:] = self.block_table[rows, :width]
        input_ids = b.input_ids.upload(tokens_out)
        if forward is not None:  # newest tokens still on the device: copy them in place
            dst, src = forward
            input_ids[dst] = self.last_sampled[src]
        inputs = StepInputs(
            states=states,
            req_ids=req_ids,
            rows=rows,
            plain_greedy=plain_greedy,
            num_scheduled=num_scheduled,
            num_computed=num_computed,
            num_tokens=num_all,
            num_known=num_known,
            query_start_loc=query_start_loc,
            seq_lens=seq_lens,
            positions=positions,
            input_ids=input_ids,
            positions_t=b.positions.upload(tokens_out),
            slot_mapping=b.slot_mapping.upload(tokens_out),
            block_table=b.upload_block_table(num_reqs, width, reqs_out if padded else None),
            query_start_loc_t=b.query_start_loc.upload(reqs_out + 1),
            seq_lens_t=b.seq_lens.upload(reqs_out),
            sample_mask=seq_lens >= num_all,
            graph_size=padded,
        )
        b.fence.record()
        return inputs

    def _forward_pending(self, token_req_rows: np.ndarray, positions: np.ndarray, token_known: np.ndarray, token_all: np.ndarray):
        """Device indices (input slot, row of ``last_sampled``) of tokens the host does not have yet;
        per token: its request's row, position, and the request's known and all token counts.

        Positions at or past ``num_tokens`` are speculative drafts, already in the host row.
        """
        missing = np.nonzero((positions >= token_known) & (positions < token_all))[0]
        if len(missing) == 0:
            return None
        missing_rows = token_req_rows[missing]
        src = self.pending_index[missing_rows]
        assert (self.pending_step[missing_rows] == self.last_step).all() and (
            positions[missing] == self.num_known[missing_rows]
        ).all(), "a step needs tokens that are neither on the host nor sampled by the previous step"
        b = self.buffers
        b.forward_dst.np[: len(missing)] = missing
        b.forward_src.np[: len(missing)] = src
        return b.forward_dst.upload(len(missing)), b.forward_src.upload(len(missing))

    def sampled_on_device(self, rows: np.ndarray, token_ids: torch.Tensor) -> None:
        """A launched step sampled ``token_ids`` [n] (on the device) for the requests in ``rows`` [n]."""
        self.last_sampled = token_ids
        self.last_step += 1
        self.pending_index[rows] = np.arange(len(rows))
        self.pending_step[rows] = self.last_step
        self.num_tokens[rows] += 1

    def receive_token_lists(self, states: list[CachedRequestState], token_lists: list[list[int]]) -> None:
        """A step emitted ``token_lists[i]`` (one or more tokens, known on the host) for ``states[i]``
        (speculative decoding: the accepted drafts and one token of the target's)."""
        for state, tokens in zip(states, token_lists):
            row = state.row
            start = int(self.num_known[row])
            end = min(start + len(tokens), self.max_model_len)
            self.token_ids[row, start:end] = tokens[: end - start]
            self.num_known[row] = self.num_tokens[row] = start + len(tokens)

    def receive_tokens(self, rows: np.ndarray, generations: np.ndarray, token_ids: np.ndarray) -> None:
        """The host now has the tokens a step sampled for ``rows`` (whose ``generation`` was
        ``generations`` then); rows freed since are skipped."""
        live = self.generation[rows] == generations
        if not live.all():  # finished or preempted while the step ran: its row may be reused
            rows, token_ids = rows[live], token_ids[live]
        known = self.num_known[rows]
        fits = known < self.max_model_len
        self.token_ids[rows[fits], known[fits]] = token_ids[fits]
        self.num_known[rows] = known + 1
