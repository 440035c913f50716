"""InputBatch keeps each request's counts in row arrays and reuses a step's lookup of its requests:
checked against a plain per-request model over random schedules.

The schedules mix chunked prefills, decodes, new blocks, finishing and preempting requests
(rows freed and reused, under the same id too), and tokens received one step late, as with
async scheduling (a step reads its newest token from the device, and a token of a request
dropped while it was in flight is ignored).
"""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from runtime.messages import CachedRequestData, NewRequestData, SchedulerOutput
from runtime.sampling_params import SamplingParams
from runtime.worker.input_batch import InputBatch

BLOCK = 4
MAX_LEN = 64
MAX_REQS = 6


class Reference:
    """One request as the scheduler sees it: every token sampled so far (the device has them all)."""

    def __init__(self, req_id: str, prompt: list[int]):
        self.req_id = req_id
        self.prompt = prompt
        self.tokens = list(prompt)  # prompt + outputs, including a token still in flight
        self.num_computed = 0
        self.blocks: list[int] = []
        self.is_new = True


def schedule(rng: random.Random, running: list[Reference], finished: set[str], next_block: list[int]) -> SchedulerOutput:
    new, cached, num_scheduled = [], CachedRequestData(), {}
    for ref in running:
        remaining = len(ref.tokens) - ref.num_computed
        num_new = 1 if remaining == 1 else rng.randint(1, remaining)
        needed = -(-(ref.num_computed + num_new) // BLOCK) - len(ref.blocks)
        block_ids = list(range(next_block[0], next_block[0] + needed))
        next_block[0] += needed
        ref.blocks += block_ids
        if ref.is_new:
            outputs = ref.tokens[len(ref.prompt) :]
            new.append(NewRequestData(ref.req_id, ref.prompt, outputs, SamplingParams(), list(ref.blocks), ref.num_computed))
            ref.is_new = False
        else:
            cached.req_ids.append(ref.req_id)
            cached.num_computed_tokens.append(ref.num_computed)
            if block_ids:
                cached.new_block_ids[ref.req_id] = block_ids
        num_scheduled[ref.req_id] = num_new
    # The scheduler lists the running requests first, then the new ones.
    order = cached.req_ids + [n.req_id for n in new]
    num_scheduled = {req_id: num_scheduled[req_id] for req_id in order}
    return SchedulerOutput(new, cached, num_scheduled, sum(num_scheduled.values()), finished_req_ids=set(finished))


def check_inputs(batch: InputBatch, so: SchedulerOutput, refs: dict[str, Reference]):
    inputs = batch.prepare(so)
    positions, input_ids, slots, sample = [], [], [], []
    for i, (req_id, num_new) in enumerate(so.num_scheduled_tokens.items()):
        ref = refs[req_id]
        span = range(ref.num_computed, ref.num_computed + num_new)
        positions += span
        input_ids += ref.tokens[span.start : span.stop]
        slots += [ref.blocks[p // BLOCK] * BLOCK + p % BLOCK for p in span]
        sample.append(span.stop >= len(ref.tokens))
        assert inputs.block_table[i, : len(ref.blocks)].tolist() == ref.blocks
    # The compact table covers the longest request, in whole multiples of the backend's width (a Triton kernel
    # compiles again for a row stride of another class of divisibility).
    if so.num_scheduled_tokens:
        longest = max(len(refs[r].blocks) for r in so.num_scheduled_tokens)
        width = inputs.block_table.shape[1]
        assert width % batch.width_multiple == 0 and inputs.block_table.stride(0) % batch.width_multiple == 0
        assert longest <= width < longest + batch.width_multiple
    assert inputs.positions.tolist() == positions
    assert inputs.input_ids.tolist() == input_ids  # newest tokens forwarded from the device included
    assert inputs.slot_mapping.tolist() == slots
    assert inputs.sample_mask.tolist() == sample
    assert inputs.req_ids == list(so.num_scheduled_tokens)
    return inputs


@pytest.mark.parametrize("seed,width_multiple", [(seed, 1) for seed in range(6)] + [(seed, 16) for seed in range(2)])
def test_row_arrays_match_a_per_request_model(seed, width_multiple):
    rng = random.Random(seed)
    batch = InputBatch(MAX_REQS, MAX_LEN, BLOCK, torch.device("cpu"), max_num_tokens=MAX_REQS * MAX_LEN)
    assert batch.max_blocks == 16  # the full-width table of the decode graphs: 64 / 4 blocks, a multiple of 16
    batch.width_multiple = width_multiple
    refs: dict[str, Reference] = {}
    running: list[Reference] = []
    finished: set[str] = set()
    next_block, next_id = [0], 0
    in_flight = None  # (pending output of the previous step, its requests) when received one step late
    for _ in range(120):
        while len(running) < MAX_REQS and rng.random() < 0.5:
            prompt = [rng.randrange(1, 1000) for _ in range(rng.randint(1, 12))]
            # Ids come back after their request ended, as a client may reuse them.
            req_id = f"r{next_id % 9}" if f"r{next_id % 9}" not in refs else f"x{next_id}"
            next_id += 1
            refs[req_id] = Reference(req_id, prompt)
            running.append(refs[req_id])
        so = schedule(rng, running, finished, next_block)
        finished = set()
        batch.update_states(so)
        inputs = check_inputs(batch, so, refs)
        # Sample on the "device": each sampling request gets a token the host learns later.
        sampling = [refs[r] for r, s in zip(inputs.req_ids, inputs.sample_mask) if s]
        rows = inputs.rows[inputs.sample_mask]
        tokens = torch.tensor([rng.randrange(1, 1000) for _ in sampling], dtype=torch.int64)
        batch.sampled_on_device(rows, tokens)
        generations = batch.generation[rows]
        for ref, num_new in zip((refs[r] for r in so.num_scheduled_tokens), so.num_scheduled_tokens.values()):
            ref.num_computed += num_new
        for ref, token in zip(sampling, tokens.tolist()):
            ref.tokens.append(token)
        if in_flight is not None:  # the previous step's tokens, collected after this step was launched
            batch.receive_tokens(*in_flight)
            in_flight = None
        step = (rows, generations, tokens.numpy())
        if rng.random() < 0.5:
            in_flight = step
        else:
            batch.receive_tokens(*step)
        # End requests (finished, or preempted to resume later with their outputs) with their tokens maybe in flight.
        for ref in list(running):
            if len(ref.tokens) >= MAX_LEN - 2 or rng.random() < 0.08:
                running.remove(ref)
                finished.add(ref.req_id)
                del refs[ref.req_id]
            elif rng.random() < 0.05:
                finished.add(ref.req_id)
                ref.num_computed, ref.blocks, ref.is_new = 0, [], True
        check_rows(batch, refs, pending=in_flight)


def check_rows(batch: InputBatch, refs: dict[str, Reference], pending) -> None:
    """Every live request's row holds its known tokens; at most its token in flight is missing."""
    in_flight_rows = set(pending[0].tolist()) if pending is not None else set()
    for req_id, state in batch.requests.items():
        ref = refs.get(req_id)
        if ref is None or ref.is_new:
            continue  # ended or preempted: the next update_states drops its row
        known = int(batch.num_known[state.row])
        assert int(batch.num_tokens[state.row]) == len(ref.tokens)
        assert known == len(ref.tokens) - (state.row in in_flight_rows)
        assert batch.token_ids[state.row, :known].tolist() == ref.tokens[:known]
        assert batch.output_token_ids(state) == ref.tokens[len(ref.prompt) : known]
        assert int(batch.num_computed[state.row]) <= len(ref.tokens)


def test_lookup_is_reused_only_while_the_requests_stay():
    batch = InputBatch(4, MAX_LEN, BLOCK, torch.device("cpu"), max_num_tokens=64)
    so = SchedulerOutput(
        [NewRequestData(r, [1, 2], [], SamplingParams(), [i], 0) for i, r in enumerate("ab")], CachedRequestData(),
        {"a": 2, "b": 2}, 4,
    )
    batch.update_states(so)
    first = batch.lookup(["a", "b"])
    assert batch.lookup(["a", "b"]) is first  # decode steps: nothing looked up again
    assert batch.lookup(["b", "a"])[1].tolist() == first[1][::-1].tolist() and not first[2]  # not greedy
    batch.update_states(SchedulerOutput([], CachedRequestData(), {}, 0, finished_req_ids={"a"}))
    batch.update_states(SchedulerOutput([NewRequestData("a", [3], [], SamplingParams(), [5], 0)], CachedRequestData(), {"a": 1}, 1))
    states, rows, _ = batch.lookup(["a", "b"])
    assert states[0] is batch.requests["a"] and np.array_equal(rows, [batch.requests["a"].row, batch.requests["b"].row])


def test_tables_of_whole_multiples_of_16_columns_give_the_same_tokens(tmp_path, monkeypatch):
    """The model runner takes the attention backend's ``block_table_width_multiple`` (the Triton backend asks
    for 16): the padded columns, never read past a request's length, change no token."""
    from runtime import LLM, SamplingParams
    from runtime.testing.models import build_untokenized_model
    from runtime_cpu.attention import CPUPagedAttentionBackend

    path = build_untokenized_model("llama", tmp_path / "llama")
    prompts = [{"prompt_token_ids": list(range(3, 3 + n))} for n in (5, 23, 40)]
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)

    def generate():
        llm = LLM(path, dtype="float32", skip_tokenizer_init=True, block_size=4, max_num_batched_tokens=32)
        batch = llm.llm_engine.engine_core.executor.worker.model_runner.input_batch
        tokens = [out.outputs[0].token_ids for out in llm.generate(prompts, params, use_tqdm=False)]
        return batch.width_multiple, batch.max_blocks % 16, tokens

    multiple, remainder, plain = generate()
    assert (multiple, remainder) == (1, 0)
    monkeypatch.setattr(CPUPagedAttentionBackend, "block_table_width_multiple", 16, raising=False)
    multiple, remainder, padded = generate()
    assert (multiple, remainder) == (16, 0)
    assert padded == plain
