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


@dataclass(slots=True)
class CachedRequestState:
    req_id: str
    row: int
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    sampling_params: SamplingParams
    num_blocks: int
    num_computed_tokens: int
    num_tokens: int = 0  # prompt + outputs, including a token sampled but still on the device
    num_known: int = 0  # prompt + outputs whose ids the host has (num_tokens - num_known <= 2)
    pending_index: int = -1  # row of this request's newest token in the sampled ids of step ``pending_step``
    pending_step: int = 0
    plain_greedy: bool = False  # sampling needs only the argmax (runtime.sample.metadata.is_plain_greedy)

    @property
    def wants_prompt_logprobs(self) -> bool:
        return self.sampling_params.prompt_logprobs is not None and not self.output_token_ids


@dataclass(slots=True)
class StepInputs:
    """A step's flat batch, on the host (numpy) and on the device (torch)."""

    states: list[CachedRequestState]
    num_scheduled: np.ndarray  # [num_reqs]
    num_computed: np.ndarray  # [num_reqs] before this step
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
    def __init__(
        self, max_num_reqs: int, max_model_len: int, block_size: int, device: torch.device, max_num_tokens: int
    ):
        self.block_size = block_size
        self.device = device
        self.max_model_len = max_model_len
        self.max_blocks = -(-max_model_len // block_size)
        self.buffers = StepBuffers(max_num_reqs, max(max_num_tokens, max_num_reqs), self.max_blocks, device)
        self.token_ids = np.zeros((max_num_reqs, max_model_len), dtype=np.int64)
        self.block_table = np.zeros((max_num_reqs, self.max_blocks), dtype=np.int32)
        self.free_rows = list(range(max_num_reqs - 1, -1, -1))
        self.requests: dict[str, CachedRequestState] = {}
        # Tokens of the latest launched step, on the device: the next step may be launched
        # before the host has them and then reads each request's newest token from here.
        self.last_sampled: torch.Tensor | None = None
        self.last_step = 0  # steps that sampled so far (numbers pending_step)

    def update_states(self, so: SchedulerOutput) -> None:
        """Apply the scheduler's changes: drop finished, add new, extend cached."""
        for req_id in so.finished_req_ids:
            state = self.requests.pop(req_id, None)
            if state is not None:
                self.free_rows.append(state.row)
        for new in so.scheduled_new_reqs:
            row = self.free_rows.pop()
            tokens = new.prompt_token_ids + new.output_token_ids
            self.token_ids[row, : len(tokens)] = tokens
            self.block_table[row, : len(new.block_ids)] = new.block_ids
            self.requests[new.req_id] = CachedRequestState(
                new.req_id, row, new.prompt_token_ids, list(new.output_token_ids), new.sampling_params,
                len(new.block_ids), new.num_computed_tokens, len(tokens), len(tokens),
                plain_greedy=is_plain_greedy(new.sampling_params),
            )
        for cached in so.scheduled_cached_reqs:
            state = self.requests[cached.req_id]
            if cached.new_block_ids:
                end = state.num_blocks + len(cached.new_block_ids)
                self.block_table[state.row, state.num_blocks : end] = cached.new_block_ids
                state.num_blocks = end
            state.num_computed_tokens = cached.num_computed_tokens
        for req_id, drafts in so.scheduled_spec_decode_tokens.items():
            # Speculative decoding: the drafts follow the known tokens in the request's row, so
            # prepare() feeds them as inputs (a later step overwrites the rejected ones).
            state = self.requests[req_id]
            self.token_ids[state.row, state.num_tokens : state.num_tokens + len(drafts)] = drafts

    def prepare(self, so: SchedulerOutput, graph_shape: Callable[[int, int, int], GraphShape | None] | None = None) -> StepInputs:
        """Flatten the step into the persistent buffers and copy them to the device.

        ``graph_shape(num_reqs, num_tokens, max_query_len)`` names the captured graph to pad
        to (None: run eagerly on exactly the step's tokens).
        """
        states = [self.requests[req_id] for req_id in so.num_scheduled_tokens]
        num_reqs = len(states)
        num_scheduled = np.fromiter(so.num_scheduled_tokens.values(), dtype=np.int64, count=num_reqs)
        num_computed = np.fromiter((s.num_computed_tokens for s in states), dtype=np.int64, count=num_reqs)
        rows = np.fromiter((s.row for s in states), dtype=np.int64, count=num_reqs)
        num_all = np.fromiter((s.num_tokens for s in states), dtype=np.int64, count=num_reqs)  # incl. on-device
        query_start_loc = np.zeros(num_reqs + 1, dtype=np.int32)
        np.cumsum(num_scheduled, out=query_start_loc[1:])
        num_tokens = int(query_start_loc[-1])
        # positions[t] = num_computed[r] + (t - query_start[r]) for token t of request r
        token_rows = np.repeat(np.arange(num_reqs), num_scheduled)
        positions = np.arange(num_tokens, dtype=np.int64) - query_start_loc[:-1][token_rows] + num_computed[token_rows]
        seq_lens = (num_computed + num_scheduled).astype(np.int32)
        padded = graph_shape(num_reqs, num_tokens, int(num_scheduled.max())) if graph_shape is not None and num_reqs else None
        b = self.buffers
        b.fence.wait()
        reqs_out, tokens_out = (padded.num_reqs, padded.num_tokens) if padded else (num_reqs, num_tokens)
        # Padding: tokens with no request (slot -1: not cached), requests with no queries.
        b.input_ids.np[:num_tokens] = self.token_ids[rows[token_rows], positions]
        b.input_ids.np[num_tokens:tokens_out] = 0
        forward = self._forward_pending(states, token_rows, positions, num_all)
        b.positions.np[:num_tokens] = positions
        b.positions.np[num_tokens:tokens_out] = 0
        block_numbers = self.block_table[rows[token_rows], positions // self.block_size]
        b.slot_mapping.np[:num_tokens] = block_numbers.astype(np.int64) * self.block_size + positions % self.block_size
        b.slot_mapping.np[num_tokens:tokens_out] = -1
        b.query_start_loc.np[: num_reqs + 1] = query_start_loc
        b.query_start_loc.np[num_reqs + 1 : reqs_out + 1] = num_tokens
        b.seq_lens.np[:num_reqs] = seq_lens
        b.seq_lens.np[num_reqs:reqs_out] = 0
        width = int(-(-seq_lens.max() // self.block_size)) if num_reqs else 0
        b.block_table_flat.np[: num_reqs * width].reshape(num_reqs, width)[:] = self.block_table[rows, :width]
        input_ids = b.input_ids.upload(tokens_out)
        if forward is not None:  # newest tokens still on the device: copy them in place
            dst, src = forward
            input_ids[dst] = self.last_sampled[src]
        inputs = StepInputs(
            states=states,
            num_scheduled=num_scheduled,
            num_computed=num_computed,
            query_start_loc=query_start_loc,
            seq_lens=seq_lens,
            positions=positions,
            input_ids=input_ids,
            positions_t=b.positions.upload(tokens_out),
            slot_mapping=b.slot_mapping.upload(tokens_out),
            block_table=b.upload_block_table(num_reqs, width, reqs_out if padded else None),
            query_start_loc_t=b.query_start_loc.upload(reqs_out + 1),
            seq_lens_t=b.seq_lens.upload(reqs_out),
            sample_mask=(num_computed + num_scheduled) >= num_all,
            graph_size=padded,
        )
        b.fence.record()
        return inputs

    def _forward_pending(self, states, token_rows: np.ndarray, positions: np.ndarray, num_all: np.ndarray):
        """Device indices (input slot, row of ``last_sampled``) of tokens the host does not have yet.

        Positions at or past ``num_tokens`` are speculative drafts, already in the host row.
        """
        num_known = np.fromiter((s.num_known for s in states), dtype=np.int64, count=len(states))
        missing = np.nonzero((positions >= num_known[token_rows]) & (positions < num_all[token_rows]))[0]
        if len(missing) == 0:
            return None
        rows = token_rows[missing]
        pending = np.fromiter((s.pending_index for s in states), dtype=np.int64, count=len(states))
        pending_step = np.fromiter((s.pending_step for s in states), dtype=np.int64, count=len(states))
        src = pending[rows]
        assert (pending_step[rows] == self.last_step).all() and (positions[missing] == num_known[rows]).all(), (
            "a step needs tokens that are neither on the host nor sampled by the previous step"
        )
        b = self.buffers
        b.forward_dst.np[: len(missing)] = missing
        b.forward_src.np[: len(missing)] = src
        return b.forward_dst.upload(len(missing)), b.forward_src.upload(len(missing))

    def sampled_on_device(self, states: list[CachedRequestState], token_ids: torch.Tensor) -> None:
        """A launched step sampled ``token_ids`` [n] (on the device) for ``states``."""
        self.last_sampled = token_ids
        self.last_step += 1
        for i, state in enumerate(states):
            state.pending_index = i
            state.num_tokens += 1
            state.pending_step = self.last_step

    def receive_token_lists(self, states: list[CachedRequestState], token_lists: list[list[int]]) -> None:
        """A step emitted ``token_lists[i]`` (one or more tokens, known on the host) for ``states[i]``
        (speculative decoding: the accepted drafts and one token of the target's)."""
        for state, tokens in zip(states, token_lists):
            start = state.num_known
            end = min(start + len(tokens), self.max_model_len)
            self.token_ids[state.row, start:end] = tokens[: end - start]
            state.output_token_ids.extend(tokens)
            state.num_known += len(tokens)
            state.num_tokens = state.num_known

    def receive_tokens(self, states: list[CachedRequestState], token_ids: list[int]) -> None:
        """The host now has the tokens a step sampled; requests dropped since are skipped."""
        for state, token in zip(states, token_ids):
            if self.requests.get(state.req_id) is not state:
                continue  # finished or preempted while the step ran: its row may be reused
            if state.num_known < self.max_model_len:
                self.token_ids[state.row, state.num_known] = token
            state.output_token_ids.append(token)
            state.num_known += 1
