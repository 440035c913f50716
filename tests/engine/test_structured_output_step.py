"""Where a step fills its grammar bitmask: after the model runner has queued the forward pass
(so that on a GPU the host fills rows while the device computes), before the logits are masked
and sampled; the bitmask crosses to another process filled; a backend's batched fill is used
where it has one, each grammar's own fill where not."""

from __future__ import annotations

import pickle

import pytest
import torch

import runtime
from runtime import LLM, SamplingParams, StructuredOutputsParams
from runtime.messages import SchedulerOutput
from runtime.structured_output import DeferredBitmask, allocate_token_bitmask, fill_bitmask_batch, resolve_bitmask
from runtime.testing.models import build_tiny_model
from support.token_trie_grammar import TrieBackend, TrieGrammar, choice_spec

SEQUENCES = [[100, 200, 300, 301, 302], [100, 200, 400], [700, 800, 900, 1000]]
PROMPTS = [[101, 2045, 7, 880, 42], [9001, 15, 15, 300], [77, 78, 79, 80, 81, 82, 83]]
EVENTS: list[str] = []


class RecordingGrammar(TrieGrammar):
    def fill_bitmask(self, bitmask, row: int) -> None:
        EVENTS.append("fill")
        super().fill_bitmask(bitmask, row)

    def fork(self) -> "RecordingGrammar":
        return RecordingGrammar(self.sequences, self.eos)


class RecordingBackend(TrieBackend):
    def compile(self, kind, spec: str) -> RecordingGrammar:
        grammar = super().compile(kind, spec)
        return RecordingGrammar(grammar.sequences, grammar.eos)


class BatchRecordingBackend(RecordingBackend):
    def fill_bitmask_batch(self, grammars, bitmask) -> None:
        EVENTS.append("fill_batch")
        for row, grammar in enumerate(grammars):
            grammar.fill_bitmask(bitmask, row)


class RecordingPlugin:
    @staticmethod
    @runtime.hookimpl
    def register_guided_backends(register):
        register("recording", RecordingBackend)
        register("recording_batch", BatchRecordingBackend)


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    return build_tiny_model("llama", tmp_path_factory.mktemp("structured_step_llama"))


@pytest.fixture
def recording(plugin_manager):
    plugin_manager.register(RecordingPlugin, "recording_guided_backends")
    EVENTS.clear()
    return plugin_manager


def record_forward_and_sampling(llm: LLM) -> None:
    """Log the model runner's forward passes and sampler calls into EVENTS, beside the fills."""
    runner = llm.llm_engine.engine_core.executor.worker.model_runner
    model, sampler = runner.model, runner.sampler
    forward = model.forward

    def recorded_forward(*args, **kwargs):
        EVENTS.append("forward")
        return forward(*args, **kwargs)

    class RecordedSampler:
        def __call__(self, *args, **kwargs):
            EVENTS.append("sample")
            return sampler(*args, **kwargs)

    model.forward = recorded_forward
    runner.sampler = RecordedSampler()


@pytest.mark.parametrize("backend", ["recording", "recording_batch"])
@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_the_bitmask_is_filled_after_the_forward_pass_is_queued(recording, model_path, backend, async_scheduling):
    llm = LLM(model_path, dtype="float32", max_model_len=128, guided_decoding_backend=backend,
              async_scheduling=async_scheduling, enforce_eager=True)
    record_forward_and_sampling(llm)
    constraint = StructuredOutputsParams(choice=choice_spec(SEQUENCES))
    params = [SamplingParams(temperature=0.0, max_tokens=8, structured_outputs=constraint),
              SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True),  # a free row beside them
              SamplingParams(temperature=0.0, max_tokens=8, structured_outputs=constraint)]
    outputs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
    for output in outputs[::2]:
        tokens = output.outputs[0].token_ids
        assert (tokens[:-1] if tokens[-1] == 2 else tokens) in SEQUENCES  # SmolLM2's EOS is 2
    steps = collapse_fills(EVENTS)
    assert steps.count("fill") >= 3
    for i, event in enumerate(steps):
        if event == "fill":  # every step with constrained rows: forward pass, their rows' fill, sampling
            assert steps[i - 1] == "forward" and steps[i + 1] == "sample", EVENTS
    if backend == "recording_batch":
        assert "fill_batch" in EVENTS  # the backend's own batched fill, not the per-row fallback


def collapse_fills(events: list[str]) -> list[str]:
    """The events with each run of fills (batched and per row) as one ``fill``."""
    steps: list[str] = []
    for event in events:
        event = "fill" if event.startswith("fill") else event
        if not (event == "fill" and steps and steps[-1] == "fill"):
            steps.append(event)
    return steps


def test_a_deferred_bitmask_fills_once_and_pickles_filled():
    grammars = [TrieGrammar([(5, 6), (5, 9)], 2), TrieGrammar([(7,)], 2)]
    assert grammars[1].accept_tokens([7])
    calls = []

    def fill():
        calls.append(1)
        bitmask = allocate_token_bitmask(len(grammars), 64)
        fill_bitmask_batch(object(), grammars, bitmask)  # no batched fill: each grammar's own row
        return bitmask

    deferred = DeferredBitmask(fill)
    assert not deferred.is_filled and not calls
    output = SchedulerOutput([], [], {"a": 1, "b": 1}, 2, structured_output_request_ids={"a": 0, "b": 1},
                             grammar_bitmask=deferred)
    crossed = pickle.loads(pickle.dumps(output))  # as a multiproc executor sends it to its workers
    assert isinstance(crossed.grammar_bitmask, torch.Tensor) and deferred.is_filled
    assert torch.equal(resolve_bitmask(deferred), crossed.grammar_bitmask) and len(calls) == 1
    assert resolve_bitmask(crossed.grammar_bitmask) is crossed.grammar_bitmask
    allowed = [{t for t in range(64) if crossed.grammar_bitmask[row, t // 32] >> (t % 32) & 1} for row in range(2)]
    assert allowed == [{5}, {2}]


@pytest.mark.parametrize("as_slots", [False, True])
def test_the_runner_masks_each_row_by_its_requests_bitmask_row(as_slots):
    """The scheduler numbers bitmask rows in its own order, the model runner's batch has another
    (and free rows between): each logits row gets its request's bitmask row, free rows none;
    also where the backend gives the rows as slots of its table (copied as a device table would be)."""
    from types import SimpleNamespace

    import numpy as np

    from runtime.sample.bitmask import DeviceMaskTable, apply_token_bitmask
    from runtime.structured_output import SlotBitmask
    from runtime.worker.model_runner import ModelRunner

    vocab = 96
    allowed = {"a": {1, 40}, "b": {2, 95}, "c": {3}}
    bitmask = torch.zeros((3, 3), dtype=torch.int32)
    for row, req_id in enumerate("abc"):
        for token in allowed[req_id]:
            bitmask[row, token // 32] |= 1 << (token % 32)
    table = torch.cat([torch.full((1, 3), 7, dtype=torch.int32), bitmask.flip(0), torch.zeros((4, 3), dtype=torch.int32)])
    slots = lambda: SlotBitmask(table, 4, 1, 0, np.array([3, 2, 1], dtype=np.int32))  # noqa: E731 (rows a, b, c)
    output = SchedulerOutput([], [], {}, 0, structured_output_request_ids={"a": 0, "b": 1, "c": 2},
                             grammar_bitmask=DeferredBitmask(lambda: bitmask, slots))
    states = [SimpleNamespace(req_id=r) for r in ("c", "free", "a", "b")]
    logits = torch.randn(4, vocab)
    original = logits.clone()
    # the op a runner without a fused one keeps
    runner = SimpleNamespace(apply_token_bitmask=apply_token_bitmask,
                             mask_table=DeviceMaskTable("cpu", copy=True) if as_slots else None)
    ModelRunner._apply_grammar_bitmask(runner, output, states, logits)
    assert isinstance(output.grammar_bitmask.value(), SlotBitmask) == as_slots
    for i, state in enumerate(states):
        finite = set(torch.nonzero(torch.isfinite(logits[i])).flatten().tolist())
        assert finite == allowed.get(state.req_id, set(range(vocab)))
    assert torch.equal(logits[1], original[1])


def test_a_platform_fused_bitmask_op_masks_the_logits(recording, model_path):
    """A platform offering ``apply_token_bitmask`` (the CUDA plugin's Triton kernel, here in Triton's
    interpreter) masks the constrained rows with it, beside a free row, in mixed steps and decodes."""
    pytest.importorskip("triton")
    from runtime_cpu.platform import CpuPlatform
    from runtime_kernels.bitmask import apply_token_bitmask

    calls = []

    def fused(logits, bitmask, rows=None):
        calls.append(rows)
        return apply_token_bitmask(logits, bitmask, rows)

    class FusedBitmaskPlatform(CpuPlatform):
        name = "cpu-fused-bitmask"
        priority = -1

        def custom_ops(self):
            return {**super().custom_ops(), "apply_token_bitmask": fused}

    class PlatformPlugin:
        @staticmethod
        @runtime.hookimpl
        def register_platforms(register):
            register(FusedBitmaskPlatform())

    recording.register(PlatformPlugin, "fused_bitmask_platform")
    llm = LLM(model_path, dtype="float32", max_model_len=128, guided_decoding_backend="recording",
              platform="cpu-fused-bitmask", attention_backend="sdpa", enforce_eager=True)
    constraint = StructuredOutputsParams(choice=choice_spec(SEQUENCES))
    # The free row first, so that the rows differ. It runs longer: when the grammar is compiled late (a loaded
    # machine) and the constrained request joins a later step, the free one is still running there (row 0).
    params = [SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True),
              SamplingParams(temperature=0.0, max_tokens=8, structured_outputs=constraint)]
    outputs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS[:2]], params, use_tqdm=False)
    tokens = outputs[1].outputs[0].token_ids
    assert (tokens[:-1] if tokens[-1] == 2 else tokens) in SEQUENCES
    assert calls and calls[0] == [1], calls  # the first step masks the constrained request's logits row only
