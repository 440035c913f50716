"""The decode-graph path of the model runner, on the CPU: padding and persistent buffers.

A test platform "captures" a graph by keeping the step function and "replays" it by
calling it again, so everything but the recording itself runs: steps pad to the next
captured batch size, every input comes from the persistent buffers the capture saw,
and the Triton backend (under the interpreter) skips padded requests and tokens. The
engine's greedy tokens must still be transformers' tokens. The real CUDA-graph run of
the same checks is in test_cuda_llm_parity.py (marked gpu).
"""

from __future__ import annotations

import os
from collections import Counter

import pluggy
import pytest

from runtime import LLM, SamplingParams
from runtime import plugins
from runtime_cpu.platform import CpuPlatform

from runtime.testing.models import build_untokenized_model
from runtime.testing.reference import check_logprobs_close, check_outputs_equal, make_prompts, reference_outputs

# The Triton backend runs here on CPU tensors, which only the interpreter can do; where
# Triton compiles for a GPU, test_cuda_llm_parity.py runs the same checks with real graphs.
pytestmark = pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") != "1", reason="needs Triton's interpreter (CPU tensors); GPU: test_cuda_llm_parity.py"
)

hookimpl = pluggy.HookimplMarker("runtime")
SIZES = [1, 2, 4, 8]
NUM_NEW_TOKENS = 9


class ReplayingCpuPlatform(CpuPlatform):
    """The CPU platform with a pretend graph capture that records which sizes replay."""

    name = "cpu-replay"
    priority = -1
    supports_graphs = True
    compiles_graphs = False  # records graphs (capture_graph) instead of the CPU platform's compiled code

    def __init__(self):
        self.captured: list[int] = []
        self.replayed: Counter[int] = Counter()

    def capture_graph(self, fn, pool):
        size = len(self.captured)
        self.captured.append(size)

        def replay():
            self.replayed[size] += 1
            return fn()

        return replay


class ReplayPlugin:
    def __init__(self, platform: ReplayingCpuPlatform):
        self.platform = platform

    @hookimpl
    def register_platforms(self, register):
        register(self.platform)

    @hookimpl
    def register_attention_backends(self, register):
        from runtime_kernels.attention_backend import TritonAttentionBackend

        register("triton-replay", TritonAttentionBackend, platforms=["cpu-replay"])


@pytest.fixture
def replay_platform():
    saved = plugins._manager
    manager = plugins.PluginManager(["cpu", "cuda", "spec_decode"])
    platform = ReplayingCpuPlatform()
    manager.register(ReplayPlugin(platform), "replay", "0.0", "runtime-plugin-replay-test")
    plugins.reset_plugin_manager(manager)
    yield platform
    plugins.reset_plugin_manager(saved)


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    path = build_untokenized_model("qwen3", tmp_path_factory.mktemp("qwen3"))
    prompts = make_prompts()  # 8 prompts, 3 of them sharing a prefix
    return path, prompts, reference_outputs(path, prompts, NUM_NEW_TOKENS)


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_padded_decode_replays_match_transformers(reference, replay_platform, async_scheduling):
    """With async scheduling the replays also read each request's newest token from the
    previous step's sampled ids (copied on the device into the graph's input buffer)."""
    path, prompts, expected = reference
    llm = LLM(path, platform="cpu-replay", attention_backend="triton-replay", dtype="float32", skip_tokenizer_init=True,
              cuda_graph_sizes=SIZES, max_num_seqs=8, block_size=4, async_scheduling=async_scheduling)
    assert len(replay_platform.captured) == len(SIZES)
    # Different lengths: the decode batch shrinks 8 -> 1, so most steps pad (7 -> 8, 5 -> 8, 3 -> 4, ...).
    lengths = [NUM_NEW_TOKENS - i for i in range(len(prompts))]
    params = [
        SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True, logprobs=5, detokenize=False) for n in lengths
    ]
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    check_outputs_equal([e[0][:n] for e, n in zip(expected, lengths)], [o.outputs[0].token_ids for o in outputs], "replay")
    for (_, ref_steps), out, n in zip(expected, outputs, lengths):
        check_logprobs_close(ref_steps[:n], out.outputs[0].logprobs, atol=2e-3, label="replay")
    # Captured largest first: index 0 is size 8. Every decode step replayed, at several sizes.
    assert len(replay_platform.replayed) >= 3, replay_platform.replayed
    assert sum(replay_platform.replayed.values()) >= NUM_NEW_TOKENS - 1
    if async_scheduling:
        assert llm.llm_engine.engine_core.num_steps_ahead >= NUM_NEW_TOKENS - 2


@pytest.mark.parametrize("proposer", ["ngram", "self_draft"])
def test_verification_steps_replay_their_own_graphs(tmp_path_factory, replay_platform, proposer):
    """Speculative decoding: steps of up to 1 + k tokens per request replay verification graphs
    (padded in requests and tokens; requests with fewer drafts keep their own query lengths),
    plain decode steps the decode graphs, and the greedy tokens stay transformers'. ngram drafts on
    the host (some steps verify, some decode); a draft model of the target's own weights runs in
    the worker before the replay, and all its drafts are accepted."""
    from spec_decode.engine_runs import repetitive_prompts, spec_counts

    from runtime.testing.models import UNTOKENIZED_VOCAB_SIZE

    path = build_untokenized_model("llama", tmp_path_factory.mktemp("llama"))
    prompts = repetitive_prompts(UNTOKENIZED_VOCAB_SIZE)
    expected = reference_outputs(path, prompts, NUM_NEW_TOKENS)
    k = 3
    spec = ({"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_max": 3, "prompt_lookup_min": 1}
            if proposer == "ngram" else {"method": "draft_model", "model": path, "num_speculative_tokens": k})
    llm = LLM(path, platform="cpu-replay", attention_backend="triton-replay", dtype="float32", skip_tokenizer_init=True,
              cuda_graph_sizes=SIZES, max_num_seqs=8, block_size=4, speculative_config=spec)
    graphs = llm.llm_engine.engine_core.executor.worker.model_runner.graphs
    assert graphs.verify_len == 1 + k and graphs.verify_sizes == tuple(SIZES)
    assert len(replay_platform.captured) == 2 * len(SIZES)
    lengths = [NUM_NEW_TOKENS - 2 * i for i in range(len(prompts))]  # the batch shrinks: steps pad
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True, detokenize=False) for n in lengths]
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    check_outputs_equal([e[0][:n] for e, n in zip(expected, lengths)], [o.outputs[0].token_ids for o in outputs], proposer)
    drafted, accepted = spec_counts(llm)
    assert accepted > 0 and sum(graphs.verify_replay_counts.values()) >= 2, (drafted, accepted, graphs.verify_replay_counts)
    assert len(graphs.verify_replay_counts) >= 2  # verification steps at several padded sizes
    if proposer == "self_draft":
        assert accepted == drafted  # the target's own drafts: every one accepted
    else:
        assert sum(graphs.replay_counts.values()) >= 1  # steps without drafts replay the decode graphs


def test_one_request_engine_captures_and_matches(reference, replay_platform):
    """``--max-num-seqs 1`` (a batch-1 latency run): the buffers hold one request, so the
    start-up's mixed-batch warm-up runs the prefill chunk alone (it wrote a second request
    past the buffers and failed to start), and the batch-1 graph replays every decode step."""
    path, prompts, expected = reference
    llm = LLM(path, platform="cpu-replay", attention_backend="triton-replay", dtype="float32", skip_tokenizer_init=True,
              max_num_seqs=1, block_size=4)
    assert len(replay_platform.captured) == 1
    params = SamplingParams(temperature=0.0, max_tokens=NUM_NEW_TOKENS, ignore_eos=True, detokenize=False)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts[:2]], params, use_tqdm=False)
    check_outputs_equal([e[0] for e in expected[:2]], [o.outputs[0].token_ids for o in outputs], "one request")
    assert sum(replay_platform.replayed.values()) == 2 * (NUM_NEW_TOKENS - 1)


def test_enforce_eager_captures_nothing(reference, replay_platform):
    path, prompts, _ = reference
    llm = LLM(path, platform="cpu-replay", attention_backend="triton-replay", dtype="float32", skip_tokenizer_init=True,
              cuda_graph_sizes=SIZES, enforce_eager=True)
    params = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True, detokenize=False)
    llm.generate([{"prompt_token_ids": prompts[0]}], params, use_tqdm=False)
    assert replay_platform.captured == [] and not replay_platform.replayed


def test_graph_sizes_flag_is_validated():
    from runtime.engine_args import EngineArgs
    from runtime.engine_args import graph_sizes

    assert graph_sizes(EngineArgs(model="m", max_num_seqs=20)) == (1, 2, 4, 8, 16, 20)
    assert graph_sizes(EngineArgs(model="m", cuda_graph_sizes=[8, 1, 64], max_num_seqs=32)) == (1, 8)
    assert graph_sizes(EngineArgs(model="m", enforce_eager=True)) == ()
    with pytest.raises(ValueError, match="cuda_graph_sizes"):
        graph_sizes(EngineArgs(model="m", cuda_graph_sizes=[0, 4]))
