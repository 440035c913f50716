"""The drafts of a draft model and of EAGLE-1, EAGLE-3 and Medusa heads equal an independent reference.

Greedy parity alone cannot see a wrong draft (it is only rejected); here every draft the
worker proposes is recorded (by wrapping the runner's ``propose``) with the request's computed
length at that step, and compared with ``head_reference`` (transformers' Llama modules and
plain torch over the whole sequence) for the same context, random heads in the published
layouts of ``heads.py`` (and a random draft model), float32.
"""

from __future__ import annotations

import gc

import pytest

from runtime import LLM, SamplingParams
from runtime.testing.models import UNTOKENIZED_VOCAB_SIZE, build_untokenized_model

from spec_decode.head_reference import REFERENCES, Target
from spec_decode.heads import build_eagle1_head, build_eagle3_head, build_medusa_head
from spec_decode.engine_runs import generate, repetitive_prompts

K = 3
GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    """(root folder, tiny llama target path, its transformers reference)."""
    root = tmp_path_factory.mktemp("head_reference")
    path = build_untokenized_model("llama", root / "target")
    return root, path, Target(path)


def build_head(method: str, root) -> str:
    if method == "draft_model":  # a model of the target's shape with other weights
        return build_untokenized_model("llama", root / "draft", seed=2)
    if method == "eagle":
        return build_eagle1_head(root / "eagle1", UNTOKENIZED_VOCAB_SIZE, seed=2)
    if method == "eagle3":  # the tiny llama has 2 layers
        return build_eagle3_head(root / "eagle3", UNTOKENIZED_VOCAB_SIZE, [0, 1, 1], UNTOKENIZED_VOCAB_SIZE // 2, seed=2)
    return build_medusa_head(root / "medusa", UNTOKENIZED_VOCAB_SIZE, num_heads=K, seed=2)


def record_drafts(llm: LLM, monkeypatch) -> list[tuple[str, int, list[int]]]:
    """(request id, its computed tokens before the step, the step's drafts) of each drafting step."""
    runner = llm.llm_engine.engine_core.executor.worker.model_runner.spec_runner
    records = []
    propose = runner.propose

    def recording(so, inputs, token_ids):
        drafts = propose(so, inputs, token_ids)
        cached = so.scheduled_cached_reqs
        computed = {r.req_id: r.num_computed_tokens for r in so.scheduled_new_reqs}
        computed.update(zip(cached.req_ids, cached.num_computed_tokens))
        for req_id, tokens in (drafts.token_ids if drafts is not None else {}).items():
            records.append((req_id, computed[req_id], list(tokens)))
        return drafts

    monkeypatch.setattr(runner, "propose", recording)
    return records


@pytest.mark.parametrize("method", ["draft_model", "eagle", "eagle3", "medusa"])
def test_drafts_equal_the_reference(method, target, monkeypatch):
    root, path, reference_target = target
    config = {"method": method, "model": build_head(method, root), "num_speculative_tokens": K}
    llm = LLM(path, dtype="float32", skip_tokenizer_init=True, speculative_config=config)
    records = record_drafts(llm, monkeypatch)
    prompts = repetitive_prompts(UNTOKENIZED_VOCAB_SIZE)[:2]
    outputs = generate(llm, prompts, GREEDY)
    del llm
    gc.collect()
    sequences = {o.request_id: list(o.prompt_token_ids) + list(o.outputs[0].token_ids) for o in outputs}
    reference = REFERENCES[method](reference_target, config["model"])
    assert {r[0] for r in records if len(r[2]) == K} == set(sequences), records  # fewer near max_tokens
    for req_id, num_computed, drafts in records:
        context = sequences[req_id][: num_computed + 1]
        assert drafts == reference.drafts(context, len(drafts)), f"{method}: request {req_id}, {len(context)} tokens"
