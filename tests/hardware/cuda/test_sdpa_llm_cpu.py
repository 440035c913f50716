"""The ``sdpa`` backend inside the engine on the CPU: greedy tokens identical to transformers.

Gemma 3 covers both of the backend's masks (sliding and full layers); chunked prefill
and prefix caching make prefill chunks read cached context through the block table.
Kept small: the GPU parity test covers every architecture.
"""

from __future__ import annotations

import pytest

from runtime import LLM, SamplingParams

from cuda_tiny import build_untokenized_model, check_logprobs_close, check_outputs_equal, make_prompts, reference_outputs

NUM_NEW_TOKENS = 10
SETTINGS = {
    "default": dict(),
    "chunked_prefill_prefix_caching": dict(max_num_batched_tokens=8, enable_prefix_caching=True, block_size=4),
}


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    path = build_untokenized_model("gemma3", tmp_path_factory.mktemp("gemma3"))
    prompts = make_prompts()[2:7]  # a long distinct prompt, and prompts sharing a prefix
    return "gemma3", path, prompts, reference_outputs(path, prompts, NUM_NEW_TOKENS)


@pytest.mark.parametrize("setting", list(SETTINGS))
def test_sdpa_greedy_matches_transformers(reference, setting):
    arch, path, prompts, expected = reference
    llm = LLM(path, platform="cpu", attention_backend="sdpa", dtype="float32", skip_tokenizer_init=True,
              **SETTINGS[setting])
    params = SamplingParams(temperature=0.0, max_tokens=NUM_NEW_TOKENS, ignore_eos=True, logprobs=5, detokenize=False)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    label = f"{arch}/sdpa/{setting}"
    check_outputs_equal([e[0] for e in expected], [o.outputs[0].token_ids for o in outputs], label)
    for (_, ref_steps), out in zip(expected, outputs):
        check_logprobs_close(ref_steps, out.outputs[0].logprobs, atol=2e-3, label=label)
