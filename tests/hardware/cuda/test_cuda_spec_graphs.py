"""On a GPU: speculative verification steps replayed from CUDA graphs keep transformers' tokens.

Each architecture in float32, with host drafts (ngram) and worker drafts (a draft model of
the target's own weights, so every draft is accepted), in the parity settings that exercise
prefix caching, chunked prefill and preemption; and random EAGLE-1, EAGLE-3 and Medusa heads
(EAGLE-3 reads the target's layers through hooks, so its steps run eagerly). The CPU twin of
these checks, under the Triton interpreter with pretend graphs, is test_decode_graphs_cpu.py.
"""

from __future__ import annotations

import pytest
from spec_decode.engine_runs import repetitive_prompts, spec_counts
from spec_decode.heads import build_eagle1_head, build_eagle3_head, build_medusa_head

from runtime import SamplingParams
from runtime.testing.models import UNTOKENIZED_VOCAB_SIZE, build_untokenized_model
from runtime.testing.reference import check_outputs_equal, reference_outputs

from test_cuda_llm_parity import ARCHS, SETTINGS, cuda_llm

pytestmark = pytest.mark.gpu

NUM_NEW_TOKENS = 24
K = 3


@pytest.fixture(scope="module", params=ARCHS)
def reference(request, tmp_path_factory):
    path = build_untokenized_model(request.param, tmp_path_factory.mktemp(f"spec-{request.param}"))
    prompts = repetitive_prompts(UNTOKENIZED_VOCAB_SIZE)
    return request.param, path, prompts, reference_outputs(path, prompts, NUM_NEW_TOKENS)


@pytest.mark.parametrize("setting", ["default", "prefix_caching", "preemption"])
@pytest.mark.parametrize("proposer", ["ngram", "self_draft"])
def test_verification_graphs_match_transformers(reference, proposer, setting):
    arch, path, prompts, expected = reference
    llm = cuda_llm(path, "triton", True, speculative_config=spec_config(proposer, path), **SETTINGS[setting])
    params = SamplingParams(temperature=0.0, max_tokens=NUM_NEW_TOKENS, ignore_eos=True, detokenize=False)
    for _ in range(2 if setting == "prefix_caching" else 1):
        outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        check_outputs_equal([e[0] for e in expected], [o.outputs[0].token_ids for o in outputs], f"{arch}/{proposer}/{setting}")
    graphs = llm.llm_engine.engine_core.executor.worker.model_runner.graphs
    drafted, accepted = spec_counts(llm)
    assert accepted > 0 and sum(graphs.verify_replay_counts.values()) > 0, (drafted, accepted, graphs.verify_replay_counts)
    if proposer == "self_draft":
        assert accepted == drafted
    if setting == "preemption":
        assert llm.llm_engine.engine_core.scheduler.num_preemptions > 0


@pytest.mark.parametrize("method", ["eagle", "eagle3", "medusa"])
def test_head_proposers_match_transformers(reference, method, tmp_path):
    arch, path, prompts, expected = reference
    if method == "eagle":
        head = build_eagle1_head(tmp_path / "eagle1", UNTOKENIZED_VOCAB_SIZE)
    elif method == "eagle3":
        num_target_layers = 4 if arch == "gemma3" else 2
        layers = [0, num_target_layers // 2, num_target_layers - 1]
        head = build_eagle3_head(tmp_path / "eagle3", UNTOKENIZED_VOCAB_SIZE, layers, UNTOKENIZED_VOCAB_SIZE // 2)
    else:
        head = build_medusa_head(tmp_path / "medusa", UNTOKENIZED_VOCAB_SIZE)
    spec = {"method": method, "model": head, "num_speculative_tokens": K}
    llm = cuda_llm(path, "triton", True, speculative_config=spec, **SETTINGS["preemption"])
    params = SamplingParams(temperature=0.0, max_tokens=NUM_NEW_TOKENS, ignore_eos=True, detokenize=False)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    check_outputs_equal([e[0] for e in expected], [o.outputs[0].token_ids for o in outputs], f"{arch}/{method}")
    graphs = llm.llm_engine.engine_core.executor.worker.model_runner.graphs
    assert spec_counts(llm)[0] > 0, "nothing was drafted"
    if method == "eagle3":
        assert graphs is None  # its hooks would not run inside a replayed graph
    else:
        assert sum(graphs.verify_replay_counts.values()) > 0


def spec_config(proposer: str, path) -> dict:
    if proposer == "ngram":
        return {"method": "ngram", "num_speculative_tokens": K, "prompt_lookup_max": 3, "prompt_lookup_min": 1}
    return {"method": "draft_model", "model": path, "num_speculative_tokens": K}


@pytest.mark.parametrize("proposer", ["ngram", "self_draft"])
def test_seeded_sampling_and_token_limits_equal_no_speculation_in_graphs(reference, proposer):
    """On the GPU's generators and in replayed verification graphs: a seeded request samples each position as it
    would without drafts (so its tokens equal the run without speculation), and allowed_token_ids and logit_bias
    hold in drafted steps as in plain ones."""
    arch, path, prompts, _ = reference
    allowed = sorted({t for p in prompts for t in p})[:12]
    params = [SamplingParams(temperature=0.1, max_tokens=NUM_NEW_TOKENS, ignore_eos=True, seed=5, n=2,
                             detokenize=False),
              SamplingParams(temperature=0.0, max_tokens=NUM_NEW_TOKENS, ignore_eos=True, detokenize=False,
                             allowed_token_ids=allowed, logit_bias={allowed[0]: -100.0})]

    def run(llm):
        return [[[c.token_ids for c in o.outputs] for o in llm.generate(
            [{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)] for sp in params]

    expected = run(cuda_llm(path, "triton", True))
    llm = cuda_llm(path, "triton", True, speculative_config=spec_config(proposer, path))
    got = run(llm)
    assert got == expected, f"{arch}/{proposer}"
    limited = [t for choices in got[1] for tokens in choices for t in tokens]
    assert set(limited) <= set(allowed[1:]), f"{arch}/{proposer}: {sorted(set(limited) - set(allowed[1:]))}"
    graphs = llm.llm_engine.engine_core.executor.worker.model_runner.graphs
    assert spec_counts(llm)[1] > 0 and sum(graphs.verify_replay_counts.values()) > 0
