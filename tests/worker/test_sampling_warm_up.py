"""Start-up samples once on each path a step takes (argmax-only rows in the lm_head's dtype, greedy rows with
logprobs over float logits, random rows with top-k and top-p), at one row and two, so the platform's kernels
for them compile before the first request; without touching the global random generator."""

from __future__ import annotations

import torch

from runtime import LLM, SamplingParams
from runtime.sample.sampler import Sampler
from runtime.testing.models import build_untokenized_model


def test_start_up_samples_on_every_path(tmp_path, monkeypatch):
    path = build_untokenized_model("llama", tmp_path / "llama")
    seen = []
    real = Sampler.forward

    def spy(self, logits, metadata):
        out = real(self, logits, metadata)
        seen.append((logits.shape[0], logits.dtype, Sampler.argmax_only(metadata), metadata.all_greedy,
                     metadata.max_num_logprobs, out.sampled_token_ids.shape[0]))
        return out

    monkeypatch.setattr(Sampler, "forward", spy)
    llm = LLM(path, dtype="bfloat16", skip_tokenizer_init=True)
    assert seen == [
        (1, torch.bfloat16, True, True, None, 1),  # argmax only, no float32 copy
        (1, torch.float32, False, True, 1, 1),  # greedy with logprobs
        (2, torch.bfloat16, True, True, None, 2),
        (2, torch.float32, False, False, None, 2),  # random rows (top-k, top-p)
    ]
    # The warm-up drew from a generator of its own: the global one is where this process's seed put it.
    torch.manual_seed(5)
    state = torch.get_rng_state()
    llm.llm_engine.engine_core.executor.worker.model_runner.warm_up_sampling()
    assert torch.equal(torch.get_rng_state(), state)
    out = llm.generate([{"prompt_token_ids": [1, 2, 3]}], SamplingParams(temperature=0.0, max_tokens=3), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 3
